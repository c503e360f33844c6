"""The downstream tasks finetune.py fine-tunes on: their files (its task format and its --tasks
list), their kinds, encoding, batches and metrics, and the embedded default tasks.

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
finetune.py reads and checks every task before anything trains (read_task), encodes each per
tokenizer (encode_task), batches it (train_order, pad_batch), keeps each epoch's predictions as
arrays (kept_gold, KINDS' predict, write_kept), scores them in a scoring (score: the kind's metrics,
seqeval's modes for NER) and records the files' digest with each result (digest).
"""
import hashlib
import json
import math
import os
import random
import re
import zipfile
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from data import world
from detour import IGNORE, atomic_write, fail, make_dirs, read_json

SPLIT_NAMES = {"train": ("train",), "dev": ("dev", "devel"), "test": ("test",)}


# ----------------------------------------------------------------------------------------
# Readers. How each kind's label is read: (from JSON, from a TSV cell, its form for errors);
# a reader returns None for a malformed label. ner has tags, read from CoNLL files.
# ----------------------------------------------------------------------------------------
def _tsv_number(cell):
    try:
        value = float(cell)
    except ValueError:
        return None
    return value if math.isfinite(value) else None  # nan, inf: no score can be computed from them


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
    """A finite number; JSON's NaN and Infinity (which Python's json reads) are refused."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _tsv_cell(cell):
    return cell


LABELS = {
    "cls": (_json_class, _tsv_cell, "a string"),
    "multilabel": (_json_labels, _tsv_labels, "a list of strings"),
    "regression": (_json_number, _tsv_number, "a finite number"),
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
                 f"got {d['label']!r}; fix that line")
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
            fail(f"{where}: label should be {LABELS[kind][2]}, got {cells[lab]!r}; fix that line")
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


def read_task(name, kind, path, frozen=False, max_len=0):
    """Read one task's train/dev/test and check them before any tokenizer or training (finetune.py
    reads every task first): every label must occur in the training split (the label set); NER tags
    must be of a scheme entity_spans reads (tag_scheme). max_len: the task's own (0: --max_len).
    -> dict(name, kind, path, labels, probe, raw={split: (file, examples)}, max_len[, scheme])"""
    if kind not in KINDS:
        fail(f"task {name}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    kind_spec = KINDS[kind]
    raw = {split: read_split(path, split, kind) for split in ("train", "dev", "test")}
    labels = kind_spec.label_set(raw["train"][1])
    known = set(labels)
    what = "tag" if kind_spec.per_token else "label"
    for file, rows in raw.values():
        for ex in rows:
            if kind_spec.per_token:
                found = zip(ex["tags"], ex["lines"])
            else:
                found = [(lab, ex["line"]) for lab in kind_spec.gold(ex["label"])]
            for lab, n in found:
                if lab not in known:
                    fail(f"{file}:{n}: {what} {lab!r} does not occur in the training split")
    if len(labels) < kind_spec.min_labels:
        fail(f"task {name}: the training split has a single label {labels}; nothing to classify")
    task = dict(name=name, kind=kind, path=path, labels=labels, probe=frozen, raw=raw,
                max_len=max_len)
    if kind_spec.per_token:
        task["scheme"] = tag_scheme(raw)
    return task


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



def encode_task(p, task, tokenizer):
    """A read_task result (labels checked), every split encoded by `tokenizer` -> the task dict
    finetune_one takes."""
    kind = KINDS[task["kind"]]
    index = {label: i for i, label in enumerate(task["labels"])}
    p = replace(p, max_len=task["max_len"] or p.max_len)  # the task's own, when it has one

    def encode_example(ex):  # -> (encoded example, truncated)
        if kind.per_token:
            tags = [index[t] for t in ex["tags"]]
            ids, target, mapped, cut = encode_words(p, tokenizer, ex["words"], tags)
            return dict(ids=ids, target=target, mapped=mapped, tags=ex["tags"]), cut
        ids, cut = encode(p, tokenizer, ex["text"], ex["text_b"])
        return dict(ids=ids, y=kind.y(ex["label"], index), groups=ex["groups"]), cut
    splits = {}
    n_trunc = 0
    for split, (file, rows) in task["raw"].items():
        encoded = [encode_example(ex) for ex in rows]
        out = [ex for ex, _ in encoded]
        n_trunc += sum(cut for _, cut in encoded)
        limit = p.max_train if split == "train" else p.max_eval
        if 0 < limit < len(out):  # the same subset for every checkpoint and seed
            out = [out[i] for i in sorted(random.Random(0).sample(range(len(out)), limit))]
        splits[split] = out
    if n_trunc:
        print(f"{task['name']}: {n_trunc} examples truncated to max_len={p.max_len} tokens")
    kept = ("name", "kind", "path", "labels", "probe", "max_len", "scheme")
    return dict({k: task[k] for k in kept if k in task}, **splits)


# ----------------------------------------------------------------------------------------
# Batches of encoded examples: sorted by length within a shuffled group (little padding),
# padded into tensors.
# ----------------------------------------------------------------------------------------
def pad_batch(examples, pad_id, dev):
    """-> (ids, attention mask, targets), each (B, T) on dev, padded with pad_id, 0 and IGNORE."""
    width = max(len(ex["ids"]) for ex in examples)

    def pad(rows, value):
        padded = [r + [value] * (width - len(r)) for r in rows]
        return torch.tensor(padded, dtype=torch.long).to(dev)
    return (pad([ex["ids"] for ex in examples], pad_id),
            pad([[1] * len(ex["ids"]) for ex in examples], 0),
            pad([ex.get("target", []) for ex in examples], IGNORE))



def targets(kind, examples, dev):
    """A batch's training targets: one per labeled word (NER) or per example."""
    if kind.per_token:
        ys = [y for ex in examples for y in ex["target"] if y != IGNORE]
    else:
        ys = [ex["y"] for ex in examples]
    return torch.tensor(ys, dtype=kind.target).to(dev)



def length_batches(examples, batch_size, order=None):
    """`order` (default: all examples) sorted by length, cut into batches of indices: little
    padding (a CPU saver)."""
    order = range(len(examples)) if order is None else order
    order = sorted(order, key=lambda i: len(examples[i]["ids"]))
    return [order[s:s + batch_size] for s in range(0, len(order), batch_size)]



def train_order(examples, rng, batch_size, group=8):
    """One epoch of shuffled training batches. Like HF's group_by_length: every `group` batches'
    worth of shuffled examples is cut into length_batches; the batches are then shuffled again."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    batches = [b for s in range(0, len(order), group * batch_size)
               for b in length_batches(examples, batch_size, order[s:s + group * batch_size])]
    rng.shuffle(batches)
    return batches


def pos_weights(p, train, n_out, dev):
    """--pos_weight for the multilabel BCE: none, auto (n_neg/n_pos per label) or a number."""
    if p.pos_weight == "none":
        return None
    if p.pos_weight == "auto":
        y = torch.tensor([ex["y"] for ex in train])
        return ((len(y) - y.sum(0)) / y.sum(0).clamp(min=1)).to(dev)
    return torch.full((n_out,), float(p.pos_weight)).to(dev)


# ----------------------------------------------------------------------------------------
# Scoring: each kind's metrics, written out so that their definitions are visible
# (tests/test_scoring.py checks them against seqeval, scikit-learn and scipy).
# ----------------------------------------------------------------------------------------
def _f1(tp, fp, fn):
    return float(2 * tp / (2 * tp + fp + fn)) if tp else 0.0


def weighted(f1s, support):
    """F1s averaged with weights support (gold counts), as scikit-learn's weighted average; 0 when
    nothing is in gold (its zero_division 0)."""
    support = np.asarray(support, float)
    return float(np.dot(f1s, support) / support.sum()) if support.sum() else 0.0


def cls_metrics(gold, pred):
    """Accuracy, and macro and weighted F1 over the labels in gold or prediction (sklearn's)."""
    gold = np.asarray(gold)
    pred = np.asarray(pred)
    classes = np.union1d(gold, pred)
    f1s = [_f1(np.sum((pred == c) & (gold == c)), np.sum((pred == c) & (gold != c)),
               np.sum((pred != c) & (gold == c))) for c in classes]
    return dict(macro_f1=float(np.mean(f1s)), accuracy=float(np.mean(gold == pred)),
                weighted_f1=weighted(f1s, [np.sum(gold == c) for c in classes]))


def multilabel_metrics(gold, pred):
    """gold, pred (N, L) 0/1: micro F1 pools all decisions; macro F1 averages labels (one never
    seen: 0, as sklearn); weighted F1 weighs each label by its gold count."""
    gold = np.asarray(gold, bool)
    pred = np.asarray(pred, bool)
    tp = (pred & gold).sum(0)
    fp = (pred & ~gold).sum(0)
    fn = (~pred & gold).sum(0)
    f1s = [_f1(*c) for c in zip(tp, fp, fn)]
    return dict(micro_f1=_f1(tp.sum(), fp.sum(), fn.sum()), macro_f1=float(np.mean(f1s)),
                weighted_f1=weighted(f1s, gold.sum(0)))


def finite(*arrays):
    return all(bool(np.isfinite(np.asarray(a, float)).all()) for a in arrays)


def pearson(x, y):
    """Pearson's r; nan when a value is not finite (no score hides it); 0.0 when one side is
    constant (no linear relation to find; scipy says nan): a run stays comparable with others."""
    if not finite(x, y):
        return float("nan")
    x = np.asarray(x, float) - np.mean(x)
    y = np.asarray(y, float) - np.mean(y)
    denom = math.sqrt(float((x * x).sum() * (y * y).sum()))
    return float((x * y).sum() / denom) if denom > 0 else 0.0


def ranks(x):
    """Ranks 1..n, ties get the average of their ranks (as Spearman needs): (first + last
    position + 1) / 2."""
    s = np.sort(np.asarray(x, float))
    return (np.searchsorted(s, x, "left") + np.searchsorted(s, x, "right") + 1) / 2


def regression_metrics(gold, pred):
    """Pearson, Spearman (Pearson of the ranks) and MSE; all nan when a value is not finite."""
    if not finite(gold, pred):
        return dict.fromkeys(("pearson", "spearman", "mse"), float("nan"))
    return dict(pearson=pearson(gold, pred), spearman=pearson(ranks(gold), ranks(pred)),
                mse=float(np.mean((np.asarray(gold) - np.asarray(pred)) ** 2)))


# Entities of a sentence's tags, as seqeval finds them, in its two modes. A tag is O or a prefix,
# "-" and a type: IOB2 (BIO) has B- (begins an entity) and I- (inside it); IOBES adds E- (ends it)
# and S- (a one-word entity).
SCHEMES = {"IOB2": "BI", "IOBES": "BIES"}
TAG = re.compile(r"O|[BIES]-.+")


def entity_spans(tags):
    """seqeval's default mode (conlleval's rules) -> [(type, first, last)]. An entity ends after E-
    or S-, and before B-, S-, O or a tag of another type; one begins at B-, S-, a type change, or an
    I- or E- that continues nothing (after O, E- or S-); the sentence end closes the last one."""
    spans = []
    prev = "O"
    prev_type = ""
    start = 0
    for i, tag in enumerate(list(tags) + ["O"]):
        prefix = tag[0]
        typ = tag[2:]
        other_type = prev_type != typ
        if prev in "ES" or (prev in "BI" and prefix in "BSO") or (prev != "O" and other_type):
            spans.append((prev_type, start, i - 1))
        if prefix in "BS" or (prev in "ESO" and prefix in "EI") or (prefix != "O" and other_type):
            start = i
        prev = prefix
        prev_type = typ
    return spans


def strict_spans(tags, scheme):
    """seqeval's strict mode: only the entities `scheme` allows -> [(type, first, last)]. IOB2: B-
    then any I- of its type; IOBES: S- alone, or B-, any I-, then E-, all of one type. Anything else
    (an I- after O, a B- never closed by E-) is no entity."""
    spans = []
    i = 0
    while i < len(tags):
        prefix = tags[i][0]
        typ = tags[i][2:]
        j = i + 1
        while prefix == "B" and j < len(tags) and tags[j] == "I-" + typ:
            j += 1
        closed = prefix == "B" and j < len(tags) and tags[j] == "E-" + typ
        if prefix == "S" or (prefix == "B" and scheme == "IOB2"):
            spans.append((typ, i, j - 1))
        elif closed and scheme == "IOBES":
            spans.append((typ, i, j))
            j += 1
        i = j
    return spans


def sentence_spans(tags, mode, scheme):
    return entity_spans(tags) if mode == "default" else strict_spans(tags, scheme)


def entity_f1(gold_seqs, pred_seqs, mode="default", scheme="IOB2"):
    """Entity-level exact match (type and boundaries), micro over all sentences -> (p, r, f1);
    entities found by seqeval's `mode` (default | strict, which needs the tags' scheme)."""
    def entities(seqs):
        return {(s,) + e for s, tags in enumerate(seqs) for e in sentence_spans(tags, mode, scheme)}
    gold = entities(gold_seqs)
    pred = entities(pred_seqs)
    tp = len(gold & pred)
    precision = tp / len(pred) if pred else 0.0
    recall = tp / len(gold) if gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def tag_scheme(raw):
    """A NER task's splits -> its scheme: IOBES if a tag is E- or S-, else IOB2. A tag of no scheme
    here (BILOU's U- and L-, a type without a prefix) is an error naming its line."""
    scheme = "IOB2"
    for file, rows in raw.values():
        for ex in rows:
            for tag, n in zip(ex["tags"], ex["lines"]):
                if not TAG.fullmatch(tag):
                    fail(f"{file}:{n}: tag {tag!r} is neither O nor B-, I-, E- or S- and a type "
                         "(the IOB2 and IOBES schemes); convert the tags (BILOU: U- is S-, L- is "
                         "E-)")
                if tag[0] in "ES":
                    scheme = "IOBES"
    return scheme


def check_strict(task):
    """Strict scoring drops what the scheme does not allow, in gold too: a dev or test
    sentence whose gold tags hold such a sequence is an error (its entities would vanish)."""
    for split in ("dev", "test"):
        file, rows = task["raw"][split]
        for ex in rows:
            if entity_spans(ex["tags"]) != strict_spans(ex["tags"], task["scheme"]):
                fail(f"{file}:{ex['lines'][0]}: this sentence's gold tags are not valid "
                     f"{task['scheme']} (an I- or E- that continues no entity, a B- never "
                     "closed); strict scoring would drop them: fix the tags, or score with "
                     "--ner_mode default")


def group_accuracy(groups, gold, pred):
    """Accuracy per group tag (the needle's [position, length]), by slot, then first appearance."""
    slots = range(max(len(g) for g in groups))
    names = dict.fromkeys(g[k] for k in slots for g in groups if len(g) > k)
    return {name: float(np.mean([gold[i] == pred[i] for i, g in enumerate(groups) if name in g]))
            for name in names}


# ----------------------------------------------------------------------------------------
# Predictions as finetune.py keeps them (each epoch's, per cell, in a compact file), so that a
# finished grid is scored again, in another scoring, without training: a split's gold and each
# epoch's predictions as arrays. Class ids (cls), 0/1 rows (multilabel), values (regression), a
# tag id per word (ner; -1: a word without a token of its own, cut or swallowed, read as O).
# ----------------------------------------------------------------------------------------
def cls_predict(examples, out):
    return np.array([int(z.argmax()) for z in out])


def multilabel_predict(examples, out):
    return np.array([(z > 0).numpy() for z in out]).reshape(len(out), -1)


def regression_predict(examples, out):
    return np.array([float(z[0]) for z in out])


def ner_predict(examples, out):
    ids = []
    for ex, z in zip(examples, out):
        it = iter(z.argmax(-1).tolist())
        ids += [next(it) if m else -1 for m in ex["mapped"]]
    return np.array(ids, np.int32)


def kept_gold(task, split):
    """A split's gold in the kept form, with what scoring needs besides: the words per sentence
    (ner), the examples' groups (cls, padded with "")."""
    examples = task[split]
    if KINDS[task["kind"]].per_token:
        index = {tag: i for i, tag in enumerate(task["labels"])}
        return dict(gold=np.array([index[t] for ex in examples for t in ex["tags"]], np.int32),
                    lengths=np.array([len(ex["tags"]) for ex in examples], np.int32))
    kept = dict(gold=np.array([ex["y"] for ex in examples]))
    if any(ex["groups"] for ex in examples):
        width = max(len(ex["groups"]) for ex in examples)
        kept["groups"] = np.array([ex["groups"] + [""] * (width - len(ex["groups"]))
                                   for ex in examples])
    return kept


def write_kept(path, kept):
    """A run's kept predictions (dict(labels, dev, test)) as one compressed .npz, no pickle: labels,
    then <split>.<array>; atomic."""
    flat = dict(labels=np.array(kept["labels"], dtype=str))
    for split in ("dev", "test"):
        flat.update({f"{split}.{name}": array for name, array in kept[split].items()})
    atomic_write(path, lambda f: np.savez_compressed(f, **flat))


def read_kept(path, fix):
    """write_kept's file -> dict(labels, dev, test); FileNotFoundError when it is not there; a file
    that cannot be read or lacks a split: one line, `fix` said."""
    try:
        with np.load(path, allow_pickle=False) as z:
            flat = {name: z[name] for name in z.files}
    except FileNotFoundError:
        raise  # the caller says what its absence means
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        fail(f"{path} is unreadable ({type(e).__name__}); {fix}")
    kept = dict(labels=[str(x) for x in flat.pop("labels", [])], dev={}, test={})
    for key, array in flat.items():
        split, _, name = key.partition(".")
        kept.setdefault(split, {})[name] = array
    if not all({"gold", "pred"} <= set(kept[split]) for split in ("dev", "test")):
        fail(f"{path} lacks dev or test predictions; {fix}")
    return kept


def cls_scores(split, pred, labels, scoring):
    metrics = cls_metrics(split["gold"], pred)
    if "groups" in split:
        groups = [[g for g in row if g] for row in split["groups"].tolist()]
        metrics["groups"] = group_accuracy(groups, split["gold"], pred)
    return metrics


def multilabel_scores(split, pred, labels, scoring):
    return multilabel_metrics(split["gold"], pred)


def regression_scores(split, pred, labels, scoring):
    return regression_metrics(split["gold"], pred)


def ner_scores(split, pred, labels, scoring):
    """Entity F1 of the sentences' tags, in scoring's mode and scheme."""
    cuts = np.cumsum(split["lengths"])[:-1]
    gold = [[labels[i] for i in s] for s in np.split(split["gold"], cuts)]
    tags = [[labels[i] if i >= 0 else "O" for i in s] for s in np.split(pred, cuts)]
    precision, recall, f1 = entity_f1(gold, tags, scoring["ner_mode"], scoring["scheme"])
    return dict(f1=f1, precision=precision, recall=recall)


def score(kind, kept, scoring):
    """A run's kept predictions (labels, and per split gold and each epoch's predictions) ->
    dict(dev, test, epoch): the first epoch with the best dev score of scoring's main metric (the
    English paper's load_best_model_at_end), its dev and test metrics, that metric also as main."""
    def metrics(split, epoch):
        pred = kept[split]["pred"][epoch]
        found = KINDS[kind].metrics(kept[split], pred, kept["labels"], scoring)
        return dict(found, main=found[scoring["main"]])
    dev = [metrics("dev", epoch) for epoch in range(len(kept["dev"]["pred"]))]
    best = max(range(len(dev)), key=lambda epoch: (dev[epoch]["main"], -epoch))
    return dict(dev=dev[best], test=metrics("test", best), epoch=best + 1)


# ----------------------------------------------------------------------------------------
# The task kinds: what differs between them, in one table; every code path is shared.
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    main: str                 # the main metric: picks the epoch on dev, reported on test
    selectable: tuple         # the metrics finetune.py's --selection may make main (higher: better)
    predict: object           # (examples, logits per example) -> predictions (kept form)
    metrics: object           # (kept split, its predictions, label set, scoring) -> metrics
    loss: object              # (float logits, targets, pos_weight) -> loss
    target: torch.dtype       # of the training targets
    epochs: str               # the Protocol field that counts its epochs
    label_set: object         # training examples -> the sorted label set; [] = a single output
    per_token: bool = False   # CoNLL files; a prediction per word (its first sub-token)
    gold: object = None       # a label -> the label names it needs in the label set
    y: object = None          # (label, index of the label set) -> the training target
    min_labels: int = 0       # fewer in the training split is an error
    weighted: bool = False    # the loss takes --pos_weight
    one_output: bool = False  # a single output (regression), else one per label


def cross_entropy(z, y, pos_weight):
    return F.cross_entropy(z, y)


def multi_hot(label, index):
    return [1.0 if name in label else 0.0 for name in index]


KINDS = {
    "cls": Kind(
        main="macro_f1", selectable=("macro_f1", "weighted_f1", "accuracy"), predict=cls_predict,
        metrics=cls_scores, loss=cross_entropy, target=torch.long, epochs="epochs",
        label_set=lambda rows: sorted({ex["label"] for ex in rows}), gold=lambda label: [label],
        y=lambda label, index: index[label], min_labels=2),
    "multilabel": Kind(
        main="micro_f1", selectable=("micro_f1", "macro_f1", "weighted_f1"),
        predict=multilabel_predict, metrics=multilabel_scores, target=torch.float,
        epochs="epochs", weighted=True,
        loss=lambda z, y, pw: F.binary_cross_entropy_with_logits(z, y, pos_weight=pw),
        label_set=lambda rows: sorted({x for ex in rows for x in ex["label"]}),
        gold=lambda label: label, y=multi_hot),
    "regression": Kind(
        main="pearson", selectable=("pearson", "spearman"), predict=regression_predict,
        metrics=regression_scores, target=torch.float, epochs="epochs", one_output=True,
        label_set=lambda rows: [], loss=lambda z, y, pw: F.mse_loss(z[:, 0], y),
        gold=lambda label: [], y=lambda label, index: label),
    "ner": Kind(
        main="f1", selectable=("f1",), predict=ner_predict, metrics=ner_scores,
        loss=cross_entropy, target=torch.long, epochs="ner_epochs",
        label_set=lambda rows: sorted({t for s in rows for t in s["tags"]}), per_token=True),
}


# ----------------------------------------------------------------------------------------
# The default tasks.
# ----------------------------------------------------------------------------------------
# finetune.py's `default` task: name=kind:path under the directory build_default_tasks writes
SPEC = "ner=ner:{d}/ner,notes=cls:{d}/notes,needle=cls+probe:{d}/needle"


def parse_tasks(spec, tasks_dir):
    """finetune.py's --tasks, `name=kind[+probe]:path[@max_len],...` with kind one of KINDS (and
    `default`: SPEC, the tasks in tasks_dir) -> [(name, kind, path, probe, max_len)]; max_len 0: the
    task has none of its own (--max_len applies)."""
    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        if item == "default":
            out += parse_tasks(SPEC.format(d=tasks_dir), tasks_dir)
            continue
        name, eq, rest = item.partition("=")
        kind, colon, path = rest.partition(":")
        if not (eq and colon and name and path):
            fail(f"bad task {item!r}; write name=kind:path (kind: {', '.join(KINDS)}), "
                 "or `default`")
        kind, _, mode = kind.partition("+")
        if kind not in KINDS or mode not in ("", "probe"):
            fail(f"task {name}: unknown kind {rest.split(':')[0]!r} "
                 f"(one of {', '.join(KINDS)}, optionally +probe)")
        if name == "average" or name in [t[0] for t in out]:
            fail(f"task name {name!r} is used twice or reserved; give every task its own name")
        own = re.fullmatch(r"(.+)@(\d+)", path)  # a length of its own: path@4096
        if own and int(own.group(2)) < 3:
            fail(f"task {name}: max length @{own.group(2)} must be >= 3 ([CLS] a [SEP] b [SEP]); "
                 "give a longer one")
        path = own.group(1) if own else path
        out.append((name, kind, path, mode == "probe", int(own.group(2)) if own else 0))
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
        make_dirs(os.path.join(directory, name))  # a file in the way: one line, no traceback
        atomic_write(os.path.join(directory, name, file), lambda f: f.write(text.encode("utf-8")))
    print(f"default tasks: {seen['dropped']} drawn examples dropped, "
          "seen verbatim in pretraining text")
    return directory
