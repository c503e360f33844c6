"""Task files: reading them (finetune.py's task format, and its --tasks list), and the embedded
default tasks.

A task is a directory with train/dev/test files, read into plain dicts; every example keeps
its file line, so errors point at it:
  ner         CoNLL: `token<TAB or space>tag` per line, blank line between sentences
              (train|dev|devel|test).(tsv|txt|conll|iob)
  the others  JSONL (train|dev|devel|test).jsonl or TSV with a header (see read_tsv)

The default tasks are built from world.py with seeds other than the pretraining corpus's
(1234) and written once as such files:
  ner     drug / disease / dose / gene spans in templated sentences (CoNLL)
  notes   which of the note types a clinical note is (JSONL)
  needle  needle in a haystack, a linear probe: is the query fact (text_a) in the long
          text (text_b)? Accuracy is also reported by position (start/middle/end) and length.
An example whose text occurs verbatim in the pretraining text is dropped (and counted).
Used by finetune.py, which puts data/ and the repository root on the path: it reads and checks
every task before anything trains (read_task), encodes them per tokenizer (encode, encode_words)
and records the files' digest with each result (digest).
"""
import hashlib
import json
import os
import random
import re

from data import world
from detour import IGNORE, atomic_write, fail, read_json

SPLIT_NAMES = {"train": ("train",), "dev": ("dev", "devel"), "test": ("test",)}


# ----------------------------------------------------------------------------------------
# Readers. How each kind's label is read: (from JSON, from a TSV cell, its form for errors);
# a reader returns None for a malformed label. ner has tags, read from CoNLL files.
# ----------------------------------------------------------------------------------------
def _tsv_number(cell):
    try:
        return float(cell)
    except ValueError:
        return None


def _tsv_labels(cell):
    """Comma-separated labels; items written name_0/name_1 (HoC's form) mean absent/present."""
    items = [x.strip() for x in cell.split(",") if x.strip()]
    if items and all(x[-2:] in ("_0", "_1") for x in items):
        items = [x[:-2] for x in items if x.endswith("_1")]
    return items


def _json_class(value):
    return str(value) if isinstance(value, (str, int, bool)) else None


def _json_labels(value):
    if isinstance(value, list) and all(isinstance(x, (str, int)) for x in value):
        return [str(x) for x in value]
    return None


def _json_number(value):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _tsv_cell(cell):
    return cell


LABELS = {
    "cls": (_json_class, _tsv_cell, "a string"),
    "multilabel": (_json_labels, _tsv_labels, "a list of strings"),
    "regression": (_json_number, _tsv_number, "a number"),
}


def find_split(directory, split, exts):
    if os.path.exists(directory) and not os.path.isdir(directory):
        fail(f"task directory {directory} is a file; give the directory that holds the split files")
    if not os.path.isdir(directory):
        fail(f"task directory {directory} not found; check the path in --tasks")
    for name in SPLIT_NAMES[split]:
        for ext in exts:
            p = os.path.join(directory, name + ext)
            if os.path.exists(p):
                return p
    names = ", ".join(n + e for n in SPLIT_NAMES[split] for e in exts)
    fail(f"no {split} split in {directory} (looked for {names})")


def read_lines(path):
    """The lines of a UTF-8 text file (as iterating over it gives them); anything else is a one-line
    error."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readlines()
    except UnicodeDecodeError as e:
        fail(f"{path} is not UTF-8 text (byte {e.object[e.start:e.start + 1]!r}); "
             "convert it (e.g. iconv -t utf-8)")


def read_conll(path):
    """CoNLL file -> [dict(words, tags, lines)]; `-DOCSTART-` lines are skipped."""
    sents = []
    cur = dict(words=[], tags=[], lines=[])
    for n, raw in enumerate(read_lines(path), 1):
        line = raw.strip()
        if not line or line.startswith("-DOCSTART-"):
            if cur["words"]:
                sents.append(cur)
            cur = dict(words=[], tags=[], lines=[])
            continue
        parts = line.split()
        if len(parts) < 2:
            fail(f"{path}:{n}: expected `token<TAB>tag`, got {line[:60]!r}")
        cur["words"].append(parts[0])
        cur["tags"].append(parts[-1])  # the tag is the last column (as conlleval reads it)
        cur["lines"].append(n)
    if cur["words"]:
        sents.append(cur)
    if not sents:
        fail(f"{path} is empty")
    return sents


def read_jsonl(path, kind):
    """JSONL file -> [dict(text, text_b, label, groups, line)]; the label as LABELS[kind] reads
    it."""
    out = []
    for n, raw in enumerate(read_lines(path), 1):
        if not raw.strip():
            continue
        where = f"{path}:{n}"
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as e:
            fail(f"{where}: not valid JSON ({e.msg})")
        if not isinstance(d, dict):
            fail(f"{where}: expected a JSON object")
        if "text" in d:
            text = d["text"]
            text_b = None
        elif "text_a" in d and "text_b" in d:
            text = d["text_a"]
            text_b = d["text_b"]
        else:
            fail(f"{where}: missing field `text` (or `text_a` and `text_b`)")
        if "label" not in d:
            fail(f"{where}: missing field `label`")
        if not isinstance(text, str) or not isinstance(text_b, (str, type(None))):
            fail(f"{where}: text fields must be strings")
        label = LABELS[kind][0](d["label"])
        if label is None:
            fail(f"{where}: label should be {LABELS[kind][2]} for a {kind} task, "
                 f"got {d['label']!r}")
        groups = d.get("group", [])
        out.append(dict(text=text, text_b=text_b, label=label,
                        groups=[groups] if isinstance(groups, str) else list(groups), line=n))
    if not out:
        fail(f"{path} is empty")
    return out


def read_tsv(path, kind):
    """TSV with a header: text in `sentence` or `text` (pairs: `text_a`/`sentence1` and
    `text_b`/`sentence2`), label in `label` or `labels` (multilabel: comma-separated)."""
    rows = [(n, line.rstrip("\n").split("\t"))
            for n, line in enumerate(read_lines(path), 1) if line.strip()]
    if len(rows) < 2:
        fail(f"{path} is empty (a header and at least one row are needed)")
    header = rows[0][1]

    def col(*names):  # the first of these columns in the header, or None
        return next((header.index(x) for x in names if x in header), None)

    t = col("sentence", "text", "text_a", "sentence1")
    tb = col("text_b", "sentence2")
    lab = col("label", "labels", "score")
    if t is None or lab is None:
        fail(f"{path}:1: header needs a `sentence` or `text` column "
             "and a `label` or `labels` column")
    out = []
    for n, cells in rows[1:]:
        where = f"{path}:{n}"
        if len(cells) != len(header):
            fail(f"{where}: {len(cells)} columns, the header has {len(header)}")
        label = LABELS[kind][1](cells[lab])
        if label is None:
            fail(f"{where}: label should be {LABELS[kind][2]}, got {cells[lab]!r}")
        out.append(dict(text=cells[t], text_b=cells[tb] if tb is not None else None,
                        label=label, groups=[], line=n))
    return out


def read_split(directory, split, kind):
    """-> (file, examples): CoNLL for ner (token tags), else JSONL or TSV."""
    if kind not in LABELS:
        path = find_split(directory, split, (".tsv", ".txt", ".conll", ".iob"))
        return path, read_conll(path)
    path = find_split(directory, split, (".jsonl", ".tsv"))
    return path, (read_jsonl(path, kind) if path.endswith(".jsonl") else read_tsv(path, kind))


def read_task(name, kind, path, kinds, frozen=False):
    """Read one task's train/dev/test and check them before any tokenizer or training (finetune.py
    reads every task first): every label must occur in the training split (the label set). `kinds`:
    finetune.py's KINDS. -> dict(name, kind, path, labels, probe, raw={split: (file, examples)})"""
    if kind not in kinds:
        fail(f"task {name}: unknown kind {kind!r} (one of {', '.join(kinds)})")
    K = kinds[kind]
    raw = {split: read_split(path, split, kind) for split in ("train", "dev", "test")}
    labels = K.label_set(raw["train"][1])
    known = set(labels)
    what = "tag" if K.per_token else "label"
    for file, rows in raw.values():
        for ex in rows:
            if K.per_token:
                found = zip(ex["tags"], ex["lines"])
            else:
                found = [(lab, ex["line"]) for lab in K.gold(ex["label"])]
            for lab, n in found:
                if lab not in known:
                    fail(f"{file}:{n}: {what} {lab!r} does not occur in the training split")
    if len(labels) < K.min_labels:
        fail(f"task {name}: the training split has a single label {labels}; nothing to classify")
    return dict(name=name, kind=kind, path=path, labels=labels, probe=frozen, raw=raw)


def digest(paths):
    """One SHA-256 of the files' bytes, read in 1 MiB blocks (memory flat in their size): a task's
    or a checkpoint's identity, which finetune.py's cells record."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------
# Encoding for finetune.py (p: its Protocol): the specials around the text's tokens; NER labels
# the first sub-token of each word and ignores the rest, so a word is predicted once, from its first
# piece.
# ----------------------------------------------------------------------------------------
def encode(p, tokenizer, text, text_b=None):
    """A text, or a pair, as [CLS] a [SEP] (b [SEP]) in p.max_len tokens -> (ids, truncated). We
    add the specials ourselves: a tokenizer's post-processor may or may not, and
    finetune.load_encoder checked that its [CLS]/[SEP] ids are the model's."""
    cls = tokenizer.token_to_id("[CLS]")
    sep = tokenizer.token_to_id("[SEP]")
    a = tokenizer.encode(text, add_special_tokens=False).ids
    if text_b is None:
        return [cls] + a[:p.max_len - 2] + [sep], len(a) > p.max_len - 2
    b = tokenizer.encode(text_b, add_special_tokens=False).ids
    room = p.max_len - 3
    truncated = len(a) + len(b) > room
    a = a[:room]              # the haystack (b) is cut first: the query (a) must survive
    return [cls] + a + [sep] + b[:room - len(a)] + [sep], truncated


def encode_words(p, tokenizer, words, tag_ids):
    """Words joined by spaces, tokenized as running text (as in pretraining); each word's first
    sub-token gets its tag, every other token IGNORE. -> (ids, target, mapped, truncated); mapped[w]
    is False for a word with no token of its own (cut by max_len, or swallowed by a previous
    word's)."""
    text = " ".join(words)
    enc = tokenizer.encode(text, add_special_tokens=False)
    ids = enc.ids[:p.max_len - 2]
    char_tok = [-1] * len(text)          # the first token that covers each character
    for t, (s, e) in enumerate(enc.offsets[:p.max_len - 2]):
        for ch in range(s, e):
            if char_tok[ch] < 0:
                char_tok[ch] = t
    target = [IGNORE] * len(ids)
    mapped = []
    last = -1  # the token of the last word mapped
    start = 0  # the word's first character in text
    for word, tag in zip(words, tag_ids):
        t = next((char_tok[ch] for ch in range(start, start + len(word)) if char_tok[ch] >= 0), -1)
        start += len(word) + 1
        mapped.append(t > last)
        if t > last:
            target[t] = tag
            last = t
    cls = tokenizer.token_to_id("[CLS]")
    sep = tokenizer.token_to_id("[SEP]")
    truncated = len(enc.ids) > p.max_len - 2
    return [cls] + ids + [sep], [IGNORE] + target + [IGNORE], mapped, truncated



# ----------------------------------------------------------------------------------------
# The default tasks.
# ----------------------------------------------------------------------------------------
# finetune.py's `default` task: name=kind:path under the directory build_default_tasks writes
SPEC = "ner=ner:{d}/ner,notes=cls:{d}/notes,needle=cls+probe:{d}/needle"


def parse_tasks(spec, tasks_dir, kinds):
    """finetune.py's --tasks, `name=kind[+probe]:path,...` with kind one of `kinds` (and `default`:
    SPEC, the tasks in tasks_dir) -> [(name, kind, path, probe)]."""
    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        if item == "default":
            out += parse_tasks(SPEC.format(d=tasks_dir), tasks_dir, kinds)
            continue
        name, eq, rest = item.partition("=")
        kind, colon, path = rest.partition(":")
        if not (eq and colon and name and path):
            fail(f"bad task {item!r}; write name=kind:path (kind: {', '.join(kinds)}), "
                 "or `default`")
        kind, _, mode = kind.partition("+")
        if kind not in kinds or mode not in ("", "probe"):
            fail(f"task {name}: unknown kind {rest.split(':')[0]!r} "
                 f"(one of {', '.join(kinds)}, optionally +probe)")
        if name == "average" or name in [t[0] for t in out]:
            fail(f"task name {name!r} is used twice or reserved; give every task its own name")
        out.append((name, kind, path, mode == "probe"))
    if not out:
        fail("no tasks given")
    return out


def pretraining_text(pretrain_dir):
    """Text the encoders were pretrained on, to drop default-task examples that occur in it
    verbatim: <pretrain_dir>/val.txt, plus all the documents when meta.json's source says they
    were generated by world.corpus(n_docs, seed). '' when pretrain_dir is absent."""
    parts = []
    val = os.path.join(pretrain_dir, "val.txt")
    if os.path.exists(val):
        parts.append("".join(read_lines(val)))
    meta_path = os.path.join(pretrain_dir, "meta.json")
    if os.path.exists(meta_path):
        meta = read_json(meta_path, fix="re-run data/prepare.py or point --pretrain_dir elsewhere")
        made = re.fullmatch(r"generated:world\.corpus\((\d+), (\d+)\)", str(meta.get("source", "")))
        if made:
            parts += world.corpus(int(made.group(1)), int(made.group(2)))
    return "\n".join(parts)


def _sizes(text, name):
    try:
        sizes = [int(x) for x in text.split(",")]
        assert len(sizes) == 3 and min(sizes) > 0
    except (ValueError, AssertionError):
        fail(f"--{name} expects three positive counts train,dev,test; got {text!r}")
    return dict(zip(("train", "dev", "test"), sizes))


def _unique(make, n, seen):
    """n examples from make() whose text is new: not in pretraining, not in another split."""
    out = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 50 * n + 1000:
            fail(f"could not draw {n} default-task examples unseen in pretraining; "
                 "lower the task sizes")
        ex, text = make()
        if text in seen["pretrain"]:
            seen["dropped"] += 1
        elif text not in seen["set"]:
            seen["set"].add(text)
            out.append(ex)
    return out


def needle_example(rng, length, position, present):
    """The needle-in-a-haystack probe: query (text_a) = a templated fact about a patient;
    haystack (text_b) = `length` words of world documents with a fact about that patient
    inserted at the start, middle or end. The fact is the query (present) or differs from
    it only in its slot values, the drug and dose (absent)."""
    template = "Patient {ID} was prescribed {DRUG} {DOSE} ."
    pid = str(rng.randint(1000, 9999))
    drug = rng.choice(world.DRUGS)
    dose = rng.choice(world.DOSES)
    query, _ = world.render(template, rng, {"ID": pid, "DRUG": drug, "DOSE": dose})
    if not present:
        drug = rng.choice([d for d in world.DRUGS if d != drug])
        dose = rng.choice(world.DOSES)
    fact, _ = world.render(template, rng, {"ID": pid, "DRUG": drug, "DOSE": dose})
    filler = []
    while len(filler) < length:
        filler += world.document(rng).split()
    # end the filler on a sentence boundary so the fact is never spliced into a sentence
    ends = [i + 1 for i, w in enumerate(filler[:length]) if w == "."]
    filler = filler[:ends[-1] if ends else length]
    if position == "start":
        at = 0
    elif position == "end":
        at = len(filler)
    else:  # middle: the sentence boundary nearest the middle
        ends = [i + 1 for i, w in enumerate(filler) if w == "."]
        at = min(ends or [len(filler) // 2], key=lambda i: abs(i - len(filler) // 2))
    haystack = filler[:at] + fact + filler[at:]
    return dict(text_a=" ".join(query), text_b=" ".join(haystack),
                label="present" if present else "absent", group=[position, f"{length} words"])


def split_files(rng, split, seen, task_seed, ner_sizes, notes_sizes, needle_per_cell,
                needle_lengths, needle_positions):
    """One split of the three tasks -> {(task, file name): text}; `seen` tracks used texts."""
    def ner_one():
        words, tags = world.sentence(rng)
        return (words, tags), " ".join(words)
    sents = _unique(ner_one, _sizes(ner_sizes, "ner_sizes")[split], seen)
    sentences = ("\n".join(f"{w}\t{t}" for w, t in zip(words, tags)) for words, tags in sents)
    conll = "\n\n".join(sentences)
    written = {("ner", split + ".tsv"): conll + "\n"}

    def note_one():
        text, note_type = world.note(rng)
        return dict(text=text, label=note_type), text
    notes = _unique(note_one, _sizes(notes_sizes, "notes_sizes")[split], seen)
    written[("notes", split + ".jsonl")] = "".join(json.dumps(ex) + "\n" for ex in notes)

    needles = []
    for length in [int(x) for x in needle_lengths.split(",")]:
        for position in needle_positions.split(","):
            n = _sizes(needle_per_cell, "needle_per_cell")[split]
            for i in range(n):  # balanced: half present, half absent (training shuffles)
                needles.append(needle_example(rng, length, position, present=i % 2 == 0))
    written[("needle", split + ".jsonl")] = "".join(json.dumps(ex) + "\n" for ex in needles)
    return written


def build_default_tasks(p):
    """Write the default tasks (ner, notes, needle) under p.tasks_dir unless they are there already
    with the same recipe (spec.json), or p.rebuild_tasks; p: finetune.py's Protocol. Returns the
    directory."""
    directory = p.tasks_dir
    pretrain_dir = p.pretrain_dir
    meta_path = os.path.join(pretrain_dir, "meta.json")
    pretrain = None
    if os.path.exists(meta_path):
        fix = "re-run data/prepare.py or point --pretrain_dir elsewhere"
        pretrain = read_json(meta_path, fix=fix).get("source")
    recipe = {k: getattr(p, k) for k in ("task_seed", "ner_sizes", "notes_sizes", "needle_per_cell",
                                         "needle_lengths", "needle_positions")}
    # A new pretraining corpus means new overlaps to drop.
    spec = dict(version=1, **recipe, pretrain_dir=os.path.abspath(pretrain_dir),
                pretrain_source=pretrain)
    spec_path = os.path.join(directory, "spec.json")
    if not p.rebuild_tasks and os.path.exists(spec_path):
        if read_json(spec_path, fix="delete it or pass --rebuild_tasks true") == spec:
            return directory
    print(f"building the default tasks in {directory} (seed {p.task_seed})")
    seen = dict(set=set(), pretrain=pretraining_text(pretrain_dir), dropped=0)
    written = {}
    for split_i, split in enumerate(("train", "dev", "test")):
        # One stream per split: test never shifts with train sizes.
        rng = random.Random(p.task_seed * 10 + split_i)
        written.update(split_files(rng, split, seen, **recipe))
    # Last: its presence means the rest is there.
    written[("", "spec.json")] = json.dumps(spec, indent=1)
    for (name, file), text in written.items():
        os.makedirs(os.path.join(directory, name), exist_ok=True)
        atomic_write(os.path.join(directory, name, file), lambda f: f.write(text.encode("utf-8")))
    print(f"default tasks: {seen['dropped']} drawn examples dropped, "
          "seen verbatim in pretraining text")
    return directory
