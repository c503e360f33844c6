"""Tests for data/world.py (the text generator) and data/prepare.py (tokenize + pack)."""

import gzip
import hashlib
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer, models, processors

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
from data import prepare, world

import detour  # noqa: E402


def valid_bio(tags):
    """Every I-X must continue a B-X or I-X of the same type."""
    prev = "O"
    for tag in tags:
        if tag.startswith("I-") and prev[2:] != tag[2:]:
            return False
        prev = tag
    return True


# --- world.py ---------------------------------------------------------------

def test_corpus_is_deterministic_and_depends_on_seed():
    a = world.corpus(30, seed=7)
    assert a == world.corpus(30, seed=7)
    assert a != world.corpus(30, seed=8)
    assert len(a) == 30 and all(isinstance(d, str) and d for d in a)


def test_documents_have_4_to_14_sentences():
    rng = random.Random(3)
    for genre in ("note", "abstract"):
        for _ in range(100):
            words = world.document(rng, genre).split()
            # Every template ends with a lone "."; values never produce one.
            assert 4 <= words.count(".") <= 14
            assert words[-1] == "."


def test_render_every_template_gives_valid_bio():
    rng = random.Random(0)
    labels = {"O"} | {p + x for p in ("B-", "I-") for x in world.ENTITY_SLOTS.values()}
    for genre, templates in world.TEMPLATES.items():
        for template in templates:
            for _ in range(5):
                words, tags = world.render(template, rng, world._case(rng))
                assert len(words) == len(tags) > 0
                assert set(tags) <= labels, template
                assert valid_bio(tags), (template, list(zip(words, tags)))
                assert all(w and " " not in w for w in words)


def test_render_fill_overrides_and_splits_punctuation():
    rng = random.Random(1)
    words, tags = world.render("The patient received {DRUG} {DOSE}.", rng,
                               {"DRUG": "insulin glargine", "DOSE": "10 IU"})
    assert words == ["The", "patient", "received", "insulin", "glargine", "10", "IU", "."]
    assert tags == ["O", "O", "O", "B-DRUG", "I-DRUG", "B-DOSE", "I-DOSE", "O"]
    # Without fill, values come from the lexicons, and the same slot repeats its value.
    words, tags = world.render("{GENE} and {GENE} ( {DISEASE} )", rng)
    assert words[0] == words[2] and words[0] in world.GENES
    assert tags[:3] == ["B-GENE", "O", "B-GENE"]


def test_sentence_genres():
    rng = random.Random(2)
    for genre in ("note", "abstract", None):
        words, tags = world.sentence(rng, genre)
        assert len(words) == len(tags) and valid_bio(tags)
    with pytest.raises(ValueError):
        world.sentence(rng, "tweet")


def test_note_type_is_never_written():
    assert 4 <= len(world.NOTE_TYPES) <= 6
    rng = random.Random(4)
    for note_type in world.NOTE_TYPES:
        for _ in range(100):
            text, got = world.note(rng, note_type)
            assert got == note_type
            assert note_type not in text.lower()
    text, got = world.note(rng)
    assert got in world.NOTE_TYPES


# The general register (world.corpus(..., register="general")): everyday English, made as the bio text is. The
# digests pin the bytes: the bio corpus's as they were before the general register existed, the general one's as
# first written, so that either changing shows here.
BIO_DIGEST = "e5faff3e00059c020fd314aee5594ab6386eba49cd6c9c65901c4b07d6a494c1"  # corpus(500, 1234)
GENERAL_DIGEST = "ad62c9f0f0320532749985985839aefadef6836b097c91c2babfb8a53f1615c1"  # corpus(200, 7, "general")


def corpus_digest(*args):
    return hashlib.sha256("\n".join(world.corpus(*args)).encode()).hexdigest()


def test_general_register_is_a_pure_function_of_its_seed():
    code = ("import hashlib, sys; sys.path.insert(0, sys.argv[1]); from data import world; "
            "print(hashlib.sha256('\\n'.join(world.corpus(200, 7, 'general')).encode()).hexdigest())")
    # Two processes with different string hashing: no set or dict order leaks into the text.
    runs = [subprocess.run([sys.executable, "-c", code, os.path.dirname(DATA)], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}, timeout=60) for seed in ("1", "2")]
    assert [r.stdout for r in runs] == [GENERAL_DIGEST + "\n"] * 2, [r.stderr for r in runs]
    assert corpus_digest(200, 7, "general") == GENERAL_DIGEST != corpus_digest(200, 8, "general")
    # The bio corpus, world.corpus's default register, is byte for byte what it was.
    assert corpus_digest(500, 1234) == corpus_digest(500, 1234, "bio") == BIO_DIGEST
    with pytest.raises(ValueError, match="unknown register 'news'"):
        world.corpus(2, 1, "news")


def test_general_register_is_everyday_english_not_biomedical():
    general = world.corpus(2000, 3, "general")
    bio = world.corpus(2000, 3)
    words = [{w.lower() for d in docs for w in d.split() if w.isalpha()} for docs in (general, bio)]
    shared = words[0] & words[1]
    # A different register: English's function words are shared, little else (13% of the general words here).
    assert {"the", "and", "of", "in", "to", "was", "we", "with"} <= shared
    assert 0.02 < len(shared) / len(words[0]) < 0.3
    assert not words[0] & {term.lower() for term in world.DRUGS + world.GENES if term.isalpha()}
    assert not words[0] & {"patients", "mg", "disease", "treatment", "clinical", "study"}
    assert len(general) == 2000 and all(isinstance(d, str) and d for d in general)
    rng = random.Random(5)
    for genre in world.GENERAL_GENRES:
        for _ in range(100):
            tokens = world.general_document(rng, genre).split()
            ends = sum(tokens.count(p) for p in (".", "!", "?"))  # every template ends with one, alone
            assert 4 <= ends <= 14 and tokens[-1] in (".", "!", "?")
    with pytest.raises(ValueError):
        world.general_document(rng, "tweet")
    for template in [t for pool in world.GENERAL_TEMPLATES.values() for t in pool]:  # every slot has a value
        tokens, tags = world.render(template, rng, world._general_case(rng))
        assert tokens and set(tags) == {"O"} and all(w and " " not in w and "{" not in w for w in tokens), template


# --- prepare.py -------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A prepared tiny generated corpus, shared by the tests below."""
    out = tmp_path_factory.mktemp("tiny")
    meta = prepare.prepare(world.corpus(200, seed=5), str(out), vocab_size=512,
                           val_fraction=0.05, source="test")
    return out, meta


def load(out, split, meta):
    return np.fromfile(out / f"{split}.bin", dtype=meta["dtype"])


def doc_spans(stream, cls_id, sep_id):
    """(start, end) of each document's tokens between its CLS and SEP."""
    cls = np.flatnonzero(stream == cls_id)
    sep = np.flatnonzero(stream == sep_id)
    assert len(cls) == len(sep)
    return list(zip(cls + 1, sep))


def test_prepare_writes_consistent_files(tiny):
    out, meta = tiny
    assert json.loads((out / "meta.json").read_text()) == meta
    assert meta["dtype"] == "uint16" and meta["vocab_size"] <= 512
    ids = [meta[k] for k in ("pad_token_id", "unk_token_id", "cls_token_id", "sep_token_id", "mask_token_id")]
    assert ids == [0, 1, 2, 3, 4] and meta["eos_token_id"] == meta["sep_token_id"]
    assert meta["n_train_docs"] + meta["n_val_docs"] == 200 and meta["n_val_docs"] == 10
    assert not [p for p in os.listdir(out) if ".tmp" in p]  # no leftovers from atomic writes
    for split in ("train", "val"):
        stream = load(out, split, meta)
        assert (out / f"{split}.bin").stat().st_size == meta[f"n_{split}_tokens"] * 2
        assert stream.size == meta[f"n_{split}_tokens"]
        # [CLS] doc [SEP] [CLS] doc [SEP] ...: starts with CLS, ends with SEP, alternates.
        assert stream[0] == 2 and stream[-1] == 3
        marks = stream[(stream == 2) | (stream == 3)]
        assert (marks[0::2] == 2).all() and (marks[1::2] == 3).all()
        assert len(marks) == 2 * meta[f"n_{split}_docs"]
        assert stream.max() < meta["vocab_size"]


def test_val_documents_round_trip(tiny):
    out, meta = tiny
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    lines = (out / "val.txt").read_text().splitlines()
    stream = load(out, "val", meta)
    spans = doc_spans(stream, meta["cls_token_id"], meta["sep_token_id"])
    assert len(lines) == len(spans) == meta["n_val_docs"]
    for line, (a, b) in zip(lines, spans):
        assert tok.decode(stream[a:b].tolist()).strip() == line
    # add_prefix_space: a word has the same tokens at the start and in the middle.
    assert tok.encode("metformin").ids == tok.encode("take metformin").ids[-len(tok.encode("metformin").ids):]


def test_given_tokenizer_with_post_processor_adds_no_extra_specials(tiny, tmp_path):
    out, meta = tiny
    # Real tokenizers (ModernBERT's) add [CLS]/[SEP] in a post-processor; the
    # stream must still hold exactly one pair per document.
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    path = tmp_path / "real.json"
    tok.save(str(path))
    got = prepare.prepare(["one small doc", "and another doc", "a third"], str(tmp_path / "o"),
                          tokenizer_path=str(path), val_fraction=0.34)
    stream = load(tmp_path / "o", "train", got)
    assert (stream == 2).sum() == got["n_train_docs"] == 2
    assert (tmp_path / "o" / "tokenizer.json").exists()


def test_tokenizer_without_special_tokens_fails(tmp_path):
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    path = tmp_path / "bad.json"
    tok.save(str(path))
    with pytest.raises(SystemExit, match=r"lacks special token.*\[CLS\]"):
        prepare.prepare(["a a", "a"], str(tmp_path / "o"), tokenizer_path=str(path))


def test_vocab_too_small_fails(tmp_path):
    with pytest.raises(SystemExit, match="vocab_size 100 is too small"):
        prepare.prepare(["a b", "c d"], str(tmp_path), vocab_size=100)


def test_read_txt_lines_and_groups(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("a b c\nd e\n\nf g h i\nj\n")
    assert list(prepare.Corpus([str(path)])) == ["a b c", "d e", "f g h i", "j"]
    # Groups close at >= 4 words or at a blank line.
    assert list(prepare.Corpus([str(path)], group_tokens=4)) == ["a b c d e", "f g h i", "j"]
    assert list(prepare.Corpus([str(path)], group_tokens=100)) == ["a b c d e", "f g h i j"]


def test_read_jsonl_and_bad_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "first  doc\\nline two"}\n\n{"text": "second", "id": 3}\n')
    assert list(prepare.Corpus([str(path)])) == ["first doc line two", "second"]
    path.write_text('{"text": "ok"}\n{not json}\n')
    with pytest.raises(SystemExit, match=re.escape(f"{path}:2: not valid JSON")):
        list(prepare.Corpus([str(path)]))
    path.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(SystemExit, match=re.escape(f'{path}:2: no "text"')):
        list(prepare.Corpus([str(path)]))


def test_missing_and_empty_input(tmp_path):
    with pytest.raises(SystemExit, match="input file not found"):
        prepare.Corpus([str(tmp_path / "nope.txt")])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(SystemExit, match="no documents in"):
        list(prepare.Corpus([str(empty)]))


def test_cli(tmp_path):
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(world.corpus(60, seed=9)) + "\n")
    script = os.path.join(DATA, "prepare.py")
    # Run from another directory: the script must find world.py by itself.
    run = subprocess.run([sys.executable, script, "--input", str(src), f"--out_dir={tmp_path / 'out'}",
                          "--vocab_size", "400", "--val_fraction", "0.1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["source"] == str(src) and meta["n_val_docs"] == 6 and meta["n_train_docs"] == 54
    assert "prepare.py:" in run.stdout

    run = subprocess.run([sys.executable, script, "--input", str(tmp_path / "missing.jsonl"),
                          "--out_dir", str(tmp_path / "o2")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines() == [f"error: input file not found: {tmp_path / 'missing.jsonl'}; check the --input path"]


# --- prepare.py at scale: streaming, shards, byte identity, failures --------

# The meta.json fields prepare.py wrote before it streamed (4fd3d0f), and the digests of that
# code's outputs on digest_inputs (tokenizer.json, train.bin, val.bin, val.txt, those fields):
# the streaming rewrite must reproduce them byte for byte, so every table in the README stays valid.
OLD_META = ["vocab_size", "dtype", "pad_token_id", "unk_token_id", "cls_token_id", "sep_token_id", "mask_token_id",
            "eos_token_id", "tokenizer", "n_train_tokens", "n_val_tokens", "n_train_docs", "n_val_docs"]
DIGESTS = {"list": "d03a06944ce26f423cf26f38f4644986ce3c996e906f440f4674b0415f9556ba",
           "jsonl": "4dc0b0cb1e64eb5fa7cef62064eae1af8901d87fe2344892fdb4d59f6b6cce4e",
           "txt": "8abd373a7bd03ef82d3fb372af448bbe70bedf939b45bf10ff8eb9543b32773b",
           "lines": "f0112eede41ea9025a6721b795625acf2d66f13d17c7f7915f9b8b4dd2abbc04"}


def digest_inputs(directory):
    """The byte-identity corpus: world documents with the quirks real files have (runs of
    whitespace, tabs, non-ASCII, a no-break space, a whitespace-only document, a blank line, CRLF)."""
    docs = world.corpus(300, seed=11)
    docs[3] = "  tabs\tand\n newlines  " + docs[3]
    docs[7] = "caf\u00e9 na\u00efve \u2014 10 \u00b5g/kg\u00a0dose, " + docs[7]
    docs.insert(10, "   ")
    jsonl = os.path.join(directory, "docs.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" + ("\n" if i == 50 else "") for i, d in enumerate(docs)))
    txt = os.path.join(directory, "notes.txt")
    with open(txt, "w", encoding="utf-8", newline="\r\n") as f:
        for d in docs:
            words = d.split()
            f.write("".join(" ".join(words[i:i + 7]) + "\n" for i in range(0, len(words), 7)) + "\n")
    return docs, jsonl, txt


def digest(out):
    meta = json.loads((out / "meta.json").read_text())
    h = hashlib.sha256()
    for name in ("tokenizer.json", "train.bin", "val.bin", "val.txt"):
        h.update((out / name).read_bytes())
    h.update(json.dumps({k: meta[k] for k in OLD_META}).encode())
    return h.hexdigest()


@pytest.fixture(scope="module")
def digested(tmp_path_factory):
    """The four digest runs: a list in memory, a .jsonl, a .txt grouped, a .txt one document per line."""
    d = tmp_path_factory.mktemp("digest")
    docs, jsonl, txt = digest_inputs(str(d))
    prepare.prepare(docs, str(d / "list"), vocab_size=400, val_fraction=0.05, seed=1, source="test")
    prepare.main(["--input", jsonl, "--out_dir", str(d / "jsonl"), "--vocab_size", "400", "--val_fraction", "0.05"])
    tok = str(d / "jsonl" / "tokenizer.json")
    prepare.main(["--input", txt, "--out_dir", str(d / "txt"), "--group_tokens", "20", "--val_fraction", "0.1",
                  "--seed", "3", "--tokenizer", tok])
    prepare.main(["--input", txt, "--out_dir", str(d / "lines"), "--val_fraction", "0.02", "--tokenizer", tok])
    return d, jsonl, txt


@pytest.mark.parametrize("run", sorted(DIGESTS))
def test_outputs_are_byte_identical_to_the_code_before_streaming(digested, run):
    assert digest(digested[0] / run) == DIGESTS[run]


def test_gzipped_shards_in_a_directory_give_the_same_outputs(digested, tmp_path):
    d, jsonl, _ = digested
    lines = open(jsonl, "rb").read().splitlines(keepends=True)
    shards = tmp_path / "shards"
    (shards / "b").mkdir(parents=True)
    for i, (name, part) in enumerate((("a.jsonl.gz", lines[:90]), ("b/c.jsonl", lines[90:200]),
                                      ("b/d.jsonl.gz", lines[200:]))):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(shards / name, "wb") as f:
            f.writelines(part)
    (shards / "README.md").write_text("not a shard: ignored\n")
    prepare.main(["--input", str(shards), "--out_dir", str(tmp_path / "dir"), "--vocab_size", "400",
                  "--val_fraction", "0.05"])
    prepare.main(["--input", str(shards / "a.jsonl.gz"), str(shards / "b"), "--out_dir", str(tmp_path / "files"),
                  "--vocab_size", "400", "--val_fraction", "0.05"])
    for out in ("dir", "files"):
        for name in ("tokenizer.json", "train.bin", "val.bin", "val.txt", "train_counts.npy"):
            assert (tmp_path / out / name).read_bytes() == (d / "jsonl" / name).read_bytes(), (out, name)
    assert json.loads((tmp_path / "files" / "meta.json").read_text())["source"] == f"{shards / 'a.jsonl.gz'} {shards / 'b'}"


def test_counts_are_stored_and_detour_reads_them(digested):
    out = digested[0] / "txt"
    meta = json.loads((out / "meta.json").read_text())
    train = np.fromfile(out / "train.bin", dtype=meta["dtype"])
    counts = np.load(out / meta["train_counts"])
    assert len(counts) == meta["vocab_size"] and (counts == np.bincount(train, minlength=len(counts))).all()
    assert meta["max_train_token_id"] == train.max()
    assert meta["n_chars"] == sum(len(d) for d in prepare.Corpus([digested[2]], group_tokens=20))
    # detour: the stored counts (trimmed after the largest id), or a scan for data prepared without them.
    stored = detour.train_counts(str(out), meta, None)
    old = detour.train_counts(str(out), {k: meta[k] for k in OLD_META}, np.memmap(out / "train.bin", meta["dtype"]))
    assert len(stored) == train.max() + 1 and (stored == old).all()


def test_tokenizer_learns_from_a_capped_sample_of_the_train_split(digested, tmp_path):
    d, jsonl, _ = digested
    docs = list(prepare.Corpus([jsonl]))
    prepare.main(["--input", jsonl, "--out_dir", str(tmp_path), "--vocab_size", "400", "--val_fraction", "0.05",
                  "--tokenizer_sample_mb", "0.02"])
    order, n_val = prepare.split_order(len(docs), 0.05, 42)
    val, sample, chars = set(order[:n_val].tolist()), [], 0
    for i, doc in enumerate(docs):  # the train documents among the first 20,000 characters
        if chars < 20000:
            sample += [doc] if i not in val else []
        chars += len(doc)
    assert 0 < len(sample) < len(docs) - n_val
    assert (tmp_path / "tokenizer.json").read_text() == prepare.train_tokenizer(sample, 400).to_str(pretty=True)
    # The tokens do not depend on the cap beyond the tokenizer: same split, same documents.
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert [meta[k] for k in ("n_train_docs", "n_val_docs")] == [len(docs) - n_val, n_val]
    assert (tmp_path / "val.txt").read_bytes() == (d / "jsonl" / "val.txt").read_bytes()


def test_shuffled_order_is_random_shuffle_of_a_list():
    for n in (2, 7, 1000):
        ids = list(range(n))
        random.Random(5).shuffle(ids)
        order, n_val = prepare.split_order(n, 0.1, 5)
        assert order.tolist() == ids and n_val == min(n - 1, max(1, round(n * 0.1)))


def one_line_error(argv, match):
    with pytest.raises(SystemExit) as e:
        prepare.main(argv)
    line = str(e.value.code)
    assert line.startswith("error: ") and "\n" not in line and "; " in line and re.search(match, line), line


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    good = tmp_path / "good.jsonl.gz"
    with gzip.open(good, "wt") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in world.corpus(40, seed=1)))
    body = good.read_bytes()
    (tmp_path / "truncated.jsonl.gz").write_bytes(body[:len(body) // 2])
    with gzip.open(tmp_path / "bad.jsonl.gz", "wt") as f:
        f.write('{"text": "fine"}\n{"text": "fine"}\n{"text": broken}\n')
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.csv").write_text("a,b\n")
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "1.jsonl.gz").write_bytes(body)
    with gzip.open(tmp_path / "shards" / "2.jsonl.gz", "wt") as f:
        f.write("\n \n")
    (tmp_path / "a_file").write_text("x")
    out = tmp_path / "out"
    cases = [
        (["--input", str(tmp_path / "bad.jsonl.gz")], re.escape(f"{tmp_path / 'bad.jsonl.gz'}:3: not valid JSON")),
        (["--input", str(good), str(tmp_path / "truncated.jsonl.gz")], "truncated.jsonl.gz is a truncated or corrupt gzip"),
        (["--input", str(tmp_path / "shards")], re.escape(f"no documents in {tmp_path / 'shards' / '2.jsonl.gz'}")),
        (["--input", str(tmp_path / "empty")], "no .txt / .jsonl / .xml / .txt.gz / .jsonl.gz / .xml.gz files in the dir"),
        (["--input", str(good), "--out_dir", str(tmp_path / "a_file")], "a_file is a file; give a directory"),
        (["--input", str(good), "--tokenizer", str(tmp_path / "empty")], "empty is a directory; give the tokenizer.json"),
    ]
    for argv, match in cases:
        one_line_error(["--out_dir", str(out), *argv], match)
    assert not out.exists() and (tmp_path / "a_file").read_text() == "x"


def test_a_run_killed_before_meta_json_leaves_nothing_detour_loads(digested, tmp_path, monkeypatch):
    _, jsonl, _ = digested
    out = tmp_path / "out"
    argv = ["--input", jsonl, "--out_dir", str(out), "--vocab_size", "400", "--val_fraction", "0.05"]
    prepare.main(argv)
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    (out / ".train.bin.spool999999").write_bytes(b"left by a killed run")

    def killed(*args):
        raise KeyboardInterrupt  # as a Ctrl-C while the spools are copied out

    monkeypatch.setattr(prepare.Spool, "copy_in_order", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare.main(argv + ["--seed", "7"])
    # Killed before the renames: the previous dataset is whole, and no temp file is left.
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    monkeypatch.undo()
    renamed = []

    def replace_then_die(src, dst):  # os.replace, killed after the first final name is in place
        if renamed:
            raise KeyboardInterrupt
        if not os.path.basename(dst).startswith("."):
            renamed.append(dst)
        os.rename(src, dst)

    monkeypatch.setattr(prepare.os, "replace", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare.main(argv + ["--seed", "7"])
    monkeypatch.undo()
    assert not (out / "meta.json").exists() and not [f for f in os.listdir(out) if f.startswith(".")]
    hint = f"meta.json not found; run `python data/prepare.py --input FILES --out_dir {out}`"  # builds that directory
    with pytest.raises(SystemExit, match=re.escape(hint)):
        detour.load_data(str(out), "train")
    prepare.main(argv)  # a rerun starts clean and writes the same dataset
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before



@pytest.mark.parametrize("failure", ["read-only", "full disk", "unreadable input"])
def test_a_failed_write_is_one_line_and_leaves_the_dataset(digested, tmp_path, monkeypatch, failure):
    """An OSError of the file system (a read-only --out_dir, a full disk, an input file this user may
    not read) is the one-line error naming the path; the dataset already there stays as it was."""
    _, jsonl, _ = digested
    out = tmp_path / "out"
    argv = ["--input", jsonl, "--out_dir", str(out), "--vocab_size", "400", "--val_fraction", "0.05"]
    prepare.main(argv)
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}

    def refused(path, mode="r", *args, **kwargs):  # open() as root cannot be refused by a chmod
        if failure == "read-only" and "w" in mode:
            raise PermissionError(13, "Permission denied", path)
        if failure == "unreadable input" and path == jsonl:
            raise PermissionError(13, "Permission denied", path)
        return open(path, mode, *args, **kwargs)

    def full(self, data, sizes):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prepare, "open", refused, raising=False)
    if failure == "full disk":
        monkeypatch.setattr(prepare.Spool, "add", full)
    with pytest.raises(SystemExit) as e:
        prepare.main(argv + ["--seed", "7"])
    line = str(e.value.code)
    want = {"read-only": f"cannot write to {out} (Permission denied: {out}/.train.bin.spool",
            "full disk": f"cannot write to {out} (No space left on device: {out}); give an --out_dir",
            "unreadable input": f"cannot read {jsonl} (Permission denied); check the --input path"}[failure]
    assert line.startswith("error: ") and "\n" not in line and want in line, line
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before  # no temp file left either

# --- PubMed XML, and formats prepare does not read ---------------------------

# NLM's PubMed XML as the baseline files hold it: a structured abstract (labels, copyright, a translation in
# OtherAbstract), inline markup, an article without an abstract, a DeleteCitation, a Bookshelf record.
PUBMED = """<?xml version="1.0" encoding="utf-8"?>
<!DOCTYPE PubmedArticleSet PUBLIC "-//NLM//DTD PubMedArticle, 1st January 2025//EN" "https://dtd.nlm.nih.gov/ncbi/pubmed/out/pubmed_250101.dtd">
<PubmedArticleSet>
<PubmedArticle>
  <MedlineCitation Status="MEDLINE" Owner="NLM">
    <PMID Version="1">101</PMID>
    <Article PubModel="Print">
      <Journal><Title>Journal of Tests</Title></Journal>
      <ArticleTitle>Metformin in type 2 diabetes.</ArticleTitle>
      <Abstract>
        <AbstractText Label="BACKGROUND" NlmCategory="BACKGROUND">Metformin is first-line.</AbstractText>
        <AbstractText Label="METHODS" NlmCategory="METHODS">We   randomized
          120 patients.</AbstractText>
        <AbstractText Label="UNLABELLED" NlmCategory="UNASSIGNED">Funded by nobody.</AbstractText>
        <AbstractText/>
        <CopyrightInformation>Copyright 2024 The Authors.</CopyrightInformation>
      </Abstract>
    </Article>
    <OtherAbstract Type="Publisher" Language="ger"><AbstractText>Eine Zusammenfassung.</AbstractText></OtherAbstract>
  </MedlineCitation>
  <PubmedData><ArticleIdList><ArticleId IdType="pubmed">101</ArticleId></ArticleIdList></PubmedData>
</PubmedArticle>
<PubmedArticle>
  <MedlineCitation Status="MEDLINE" Owner="NLM">
    <PMID Version="1">102</PMID>
    <Article PubModel="Electronic">
      <ArticleTitle>Role of <i>BRCA1</i> in calcium signalling.</ArticleTitle>
      <Abstract><AbstractText>Ca<sup>2+</sup> levels rose 10<sup>3</sup>-fold in <i>E. coli</i> &amp; <b>yeast</b>.</AbstractText></Abstract>
    </Article>
  </MedlineCitation>
</PubmedArticle>
<PubmedArticle>
  <MedlineCitation Status="MEDLINE" Owner="NLM">
    <PMID Version="1">103</PMID>
    <Article PubModel="Print"><ArticleTitle>A letter without an abstract.</ArticleTitle></Article>
  </MedlineCitation>
</PubmedArticle>
<DeleteCitation>
  <PMID Version="1">104</PMID>
  <PMID Version="1">105</PMID>
</DeleteCitation>
<PubmedBookArticle>
  <BookDocument><PMID Version="1">106</PMID><Abstract><AbstractText>A book chapter.</AbstractText></Abstract></BookDocument>
</PubmedBookArticle>
<PubmedArticle>
  <MedlineCitation Status="MEDLINE" Owner="NLM">
    <PMID Version="1">107</PMID>
    <Article PubModel="Print">
      <ArticleTitle>Aspirin after stroke.</ArticleTitle>
      <Abstract><AbstractText>Aspirin lowered the risk of a second stroke.</AbstractText></Abstract>
    </Article>
  </MedlineCitation>
</PubmedArticle>
</PubmedArticleSet>
"""
PUBMED_DOCS = ["Metformin in type 2 diabetes. BACKGROUND: Metformin is first-line. METHODS: We randomized 120 patients. "
               "Funded by nobody.",
               "Role of BRCA1 in calcium signalling. Ca2+ levels rose 103-fold in E. coli & yeast.",
               "A book chapter.",  # PMID 106, a Bookshelf record without titles: its abstract alone
               "Aspirin after stroke. Aspirin lowered the risk of a second stroke."]


def test_pubmed_xml_gives_title_and_abstract_per_article(tmp_path, monkeypatch):
    xml = tmp_path / "pubmed25n0001.xml"
    xml.write_text(PUBMED, encoding="utf-8")
    with gzip.open(tmp_path / "pubmed25n0002.xml.gz", "wt", encoding="utf-8") as f:
        f.write(PUBMED)
    for path in (xml, tmp_path / "pubmed25n0002.xml.gz"):
        corpus = prepare.Corpus([str(path)])
        assert list(corpus) == PUBMED_DOCS and corpus.skipped == 1  # PMID 103: no abstract
        assert corpus.counts == dict(articles=4, books=1, skipped=1, deleted=2, files_without_articles=0)
    # Streamed: iterparse builds the tree a chunk (16 KB) at a time, and each article is cleared off the root once
    # read, so the root holds a chunk's articles at most, not the file's (3,000 here; PubMed's files: 30,000).
    start = PUBMED.index("<PubmedArticle>")
    article = PUBMED[start:PUBMED.index("<PubmedArticle>", start + 1)]
    (tmp_path / "big.xml").write_text("<PubmedArticleSet>" + article * 3000 + "</PubmedArticleSet>")
    held, iterparse = [], prepare.ET.iterparse

    def recording(*args, **kw):
        for event, elem in iterparse(*args, **kw):
            root = held[0][0] if held else elem
            held.append((root, len(root)))
            yield event, elem

    monkeypatch.setattr(prepare.ET, "iterparse", recording)
    assert sum(1 for _ in prepare.Corpus([str(tmp_path / "big.xml")])) == 3000
    monkeypatch.undo()
    assert 0 < max(n for _, n in held) < 300
    # End to end, twice the file: the skipped count reaches meta.json and the summary line.
    out = tmp_path / "out"
    prepare.main(["--input", str(xml), str(tmp_path / "pubmed25n0002.xml.gz"), "--out_dir", str(out),
                  "--vocab_size", "300", "--val_fraction", "0.2"])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["n_articles_without_abstract"] == 2 and meta["n_train_docs"] + meta["n_val_docs"] == 8
    assert (meta["n_articles"], meta["n_books"], meta["n_deleted_citations"], meta["n_files_without_articles"]) == (8, 2, 4, 0)
    val = (out / "val.txt").read_text().splitlines()
    assert len(val) == meta["n_val_docs"] == 2 and set(val) <= set(PUBMED_DOCS)
    script = os.path.join(DATA, "prepare.py")
    run = subprocess.run([sys.executable, script, "--input", str(xml), "--out_dir", str(tmp_path / "cli"),
                          "--vocab_size", "300"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and ("; PubMed XML: 4 articles and 1 books read, 1 without an abstract skipped, "
                                    "2 deleted citations, 0 files without an article skipped") in run.stdout, run.stderr
    # Text and JSONL inputs keep their meta.json as it was: no PubMed field.
    (tmp_path / "docs.txt").write_text("\n".join(PUBMED_DOCS) + "\n")
    prepare.main(["--input", str(tmp_path / "docs.txt"), "--out_dir", str(tmp_path / "txt"), "--vocab_size", "300"])
    assert "n_articles_without_abstract" not in json.loads((tmp_path / "txt" / "meta.json").read_text())


# A Bookshelf file as PubMed ships it: a chapter (BookTitle, then the chapter's ArticleTitle, a structured abstract),
# a whole book (no chapter title), a book without an abstract.
BOOKS = """<?xml version="1.0" encoding="utf-8"?>
<PubmedArticleSet>
<PubmedBookArticle>
  <BookDocument>
    <PMID Version="1">20301295</PMID>
    <Book>
      <Publisher><PublisherName>University of Washington, Seattle</PublisherName></Publisher>
      <BookTitle book="gene">GeneReviews<sup>&#174;</sup></BookTitle>
      <PubDate><Year>1993</Year></PubDate>
    </Book>
    <LocationLabel Type="chapter">Cystic Fibrosis</LocationLabel>
    <ArticleTitle book="gene" part="cf">Cystic   Fibrosis</ArticleTitle>
    <Language>eng</Language>
    <Abstract>
      <AbstractText Label="CLINICAL CHARACTERISTICS">CF affects the <i>lungs</i>.</AbstractText>
      <AbstractText Label="DIAGNOSIS/TESTING">Sweat chloride is raised.</AbstractText>
    </Abstract>
  </BookDocument>
  <PubmedBookData><History/></PubmedBookData>
</PubmedBookArticle>
<PubmedBookArticle>
  <BookDocument>
    <PMID Version="1">21000001</PMID>
    <Book><BookTitle book="nap">Dietary Reference Intakes</BookTitle></Book>
    <Abstract><AbstractText>Intakes for vitamins.</AbstractText></Abstract>
  </BookDocument>
</PubmedBookArticle>
<PubmedBookArticle>
  <BookDocument><PMID Version="1">21000002</PMID><Book><BookTitle>An index</BookTitle></Book></BookDocument>
</PubmedBookArticle>
</PubmedArticleSet>
"""
BOOK_DOCS = ["GeneReviews® Cystic Fibrosis CLINICAL CHARACTERISTICS: CF affects the lungs. DIAGNOSIS/TESTING: Sweat "
             "chloride is raised.", "Dietary Reference Intakes Intakes for vitamins."]


def test_pubmed_books_globs_and_files_without_articles(tmp_path):
    """A book-only file is read (book title, chapter title, abstract); a quoted glob is expanded and sorted; a file of
    deletions only is skipped and counted; a pattern that matches nothing is one line."""
    base = tmp_path / "baseline"
    base.mkdir()
    (base / "pubmed25n0003.xml").write_text(BOOKS)
    with gzip.open(base / "pubmed25n0001.xml.gz", "wt", encoding="utf-8") as f:
        f.write(PUBMED)
    (base / "pubmed25n0002.xml.gz").write_bytes(gzip.compress(
        b"<PubmedArticleSet><DeleteCitation><PMID>1</PMID><PMID>2</PMID></DeleteCitation></PubmedArticleSet>"))
    (base / "notes.txt").write_text("not matched by the pattern\n")
    corpus = prepare.Corpus([str(base / "pubmed25n*.xml*")])
    assert corpus.files == [str(base / f"pubmed25n000{i}.xml{gz}") for i, gz in ((1, ".gz"), (2, ".gz"), (3, ""))]
    assert list(corpus) == PUBMED_DOCS + BOOK_DOCS
    assert corpus.counts == dict(articles=4, books=4, skipped=2, deleted=4, files_without_articles=1)
    # The command line, with the pattern quoted as a user types it (no shell expands it here).
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, os.path.join(DATA, "prepare.py"), "--input", str(base / "pubmed25n*.xml*"),
                          "--out_dir", str(out), "--vocab_size", "300"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert ("; PubMed XML: 4 articles and 4 books read, 2 without an abstract skipped, 4 deleted citations, "
            "1 files without an article skipped") in run.stdout
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["n_train_docs"] + meta["n_val_docs"], meta["n_books"], meta["n_files_without_articles"]) == (6, 4, 1)
    one_line_error(["--input", str(base / "pubmed24n*.xml.gz"), "--out_dir", str(tmp_path / "none")],
                   re.escape(f"--input pattern {base / 'pubmed24n*.xml.gz'} matches no file; check the directory"))
    assert not (tmp_path / "none").exists()


def test_benchmark_builds_pubmed_xml_that_prepare_reads_as_its_text(tmp_path):
    """bench/benchmark_prepare.py --format xml (built here, not timed): shards that take the reader's real paths
    (labelled sections, inline <i>, articles without abstract, DeleteCitation), read back as exactly the text the
    builder counts toward a corpus's size."""
    from bench import benchmark_prepare
    docs = [d for d in map(prepare.clean, world.corpus(300, seed=5)) if d]
    benchmark_prepare.build_corpus(str(tmp_path / "xml"), docs, 0.3, str(tmp_path / "plain.jsonl"), "xml", 0.1)
    shards = sorted(os.listdir(tmp_path / "xml"))
    assert len(shards) >= 3 and shards[0] == "pubmed25n0000.xml.gz"
    body = gzip.open(tmp_path / "xml" / shards[0], "rt").read()
    assert all(s in body for s in ('Label="BACKGROUND"', "<i>", "<DeleteCitation>"))
    corpus = prepare.Corpus([str(tmp_path / "xml")])
    text = list(corpus)
    assert text == list(prepare.Corpus([str(tmp_path / "plain.jsonl")])) and corpus.skipped > 0
    assert 0.3e6 <= sum(map(len, text)) < 0.3e6 + max(map(len, docs))


def test_bad_pubmed_xml_is_one_line_and_leaves_the_dataset(tmp_path):
    good = tmp_path / "good.xml"
    good.write_text(PUBMED, encoding="utf-8")
    out = tmp_path / "out"
    prepare.main(["--input", str(good), "--out_dir", str(out), "--vocab_size", "300"])
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    lines = PUBMED.splitlines(keepends=True)
    broken = next(i for i, line in enumerate(lines) if "Aspirin after stroke" in line)
    (tmp_path / "malformed.xml").write_text("".join(lines[:broken]) + "      <ArticleTitle>Aspirin</Title>\n"
                                            + "".join(lines[broken + 1:]))
    body = gzip.compress(PUBMED.encode())
    (tmp_path / "truncated.xml.gz").write_bytes(body[:len(body) // 2])
    (tmp_path / "other.xml").write_text('<?xml version="1.0"?><html><p>not PubMed</p></html>')
    (tmp_path / "deleted.xml").write_text("<PubmedArticleSet><DeleteCitation><PMID>1</PMID></DeleteCitation>"
                                          "</PubmedArticleSet>")
    (tmp_path / "latin1.xml").write_bytes(b"<PubmedArticleSet>caf\xe9</PubmedArticleSet>")
    cases = [
        ("malformed.xml", re.escape(f"{tmp_path / 'malformed.xml'}:{broken + 1}: not well-formed XML (mismatched tag)")),
        ("truncated.xml.gz", "truncated.xml.gz is a truncated or corrupt gzip file"),
        ("other.xml", re.escape("other.xml is not PubMed XML (its root is <html>, not <PubmedArticleSet>)")),
        ("latin1.xml", re.escape(f"{tmp_path / 'latin1.xml'}:1: not well-formed XML (not well-formed (invalid token))")),
    ]
    for name, match in cases:
        one_line_error(["--input", str(good), str(tmp_path / name), "--out_dir", str(out), "--seed", "7"], match)
    # A file of deletions only is skipped (see the glob test); an input without any document is an error.
    one_line_error(["--input", str(tmp_path / "deleted.xml"), "--out_dir", str(out)],
                   re.escape("no PubmedArticle or PubmedBookArticle with an abstract in the 1 input file(s)"))
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before  # the dataset as it was, no temp files


def test_inputs_of_other_formats_are_refused(tmp_path):
    formats = re.escape('prepare reads .txt (a document per line), .jsonl ({"text": ...} per line), .xml (NLM\'s '
                        'PubMed XML), each maybe gzipped (.gz), by the file\'s ending; convert it')
    for name in ("notes.csv", "table.tsv", "corpus.parquet", "abstracts.json", "corpus", "pubmed.xml.zip"):
        (tmp_path / name).write_text("text,label\nsome words,1\n")
        one_line_error(["--input", str(tmp_path / name), "--out_dir", str(tmp_path / "out")],
                       re.escape(f"cannot read {tmp_path / name}: ") + formats)
    # A directory contributes its files of one format: a README.txt among PubMed's files is not a shard.
    (tmp_path / "baseline").mkdir()
    (tmp_path / "baseline" / "pubmed25n0001.xml.gz").write_bytes(gzip.compress(PUBMED.encode()))
    (tmp_path / "baseline" / "pubmed25n0001.xml.gz.md5").write_text("0123\n")  # not a SUFFIXES file: ignored
    (tmp_path / "baseline" / "README.txt").write_text("PubMed baseline files\n")
    one_line_error(["--input", str(tmp_path / "baseline"), "--out_dir", str(tmp_path / "out")],
                   re.escape(f"the directory {tmp_path / 'baseline'} mixes .txt and .xml files "
                             f"({tmp_path / 'baseline' / 'README.txt'}, {tmp_path / 'baseline' / 'pubmed25n0001.xml.gz'})"))
    assert not (tmp_path / "out").exists()
    os.remove(tmp_path / "baseline" / "README.txt")
    assert list(prepare.Corpus([str(tmp_path / "baseline")])) == PUBMED_DOCS


def test_help_names_every_default():
    run = subprocess.run([sys.executable, os.path.join(DATA, "prepare.py"), "--help"], capture_output=True, text=True,
                         timeout=60)
    text = " ".join(run.stdout.split())  # argparse wraps at the terminal's width
    assert run.returncode == 0 and text.startswith("usage: prepare.py"), run.stderr
    for action in prepare.arguments()._actions[1:]:  # after -h
        assert "(default: " in action.help, action.dest
        if action.default is not None:
            assert f"(default: {action.default})" in text, action.dest


# --- every option acts where it is given; no input is read twice ------------

def test_every_option_says_when_it_acts():
    """ACTS is the one place that says when each option acts: a new option without an entry fails here."""
    options = {action.dest for action in prepare.arguments()._actions} - {"help"}
    assert set(prepare.ACTS) == options


@pytest.mark.parametrize("argv,message", [
    (["--input", "{d}/docs.jsonl", "--group_tokens", "20"], "--group_tokens does not act with .jsonl input (it joins "
     "the lines of .txt files into documents); drop --group_tokens, or give .txt input"),
    (["--input", "{d}/pubmed.xml", "--group_tokens", "20"], "--group_tokens does not act with .xml input"),
    (["--input", "{d}/docs.jsonl", "{d}/pubmed.xml", "--group_tokens", "20"],
     "--group_tokens does not act with .jsonl and .xml input"),
    (["--group_tokens", "20"], "--group_tokens does not act with the generated corpus (it joins"),
    (["--input", "{d}/docs.jsonl", "--n_docs", "50"], "--n_docs does not act with --input (it sizes the generated "
     "corpus); drop --n_docs, or drop --input"),
    (["--input", "{d}/docs.jsonl", "--world_seed", "3"], "--world_seed does not act with --input"),
    # at its default value, in the --key=value form: given is given
    (["--register", "bio", "--tokenizer", "{d}/tok.json", f"--vocab_size={8192}"], "--vocab_size does not act with --tokenizer (it sizes a "
     "tokenizer trained here); drop --vocab_size, or drop --tokenizer to train one"),
    (["--input", "{d}/docs.jsonl", "--tokenizer", "{d}/tok.json", "--tokenizer_sample", "1"],  # argparse's prefix
     "--tokenizer_sample_mb does not act with --tokenizer"),
    (["--name", "pubmed"], "--name does not act with --out_dir (it names data/NAME/, the output directory without "
     "--out_dir); drop one of them"),
    (["--input", "{d}/docs.jsonl", "--register", "general"], "--register does not act with --input (it picks the "
     "generated corpus's register); drop --register, or drop --input"),
])
def test_an_option_given_that_does_not_act_is_refused(tmp_path, argv, message):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in world.corpus(20, seed=2)))
    (tmp_path / "pubmed.xml").write_text(PUBMED)
    out = tmp_path / "out"
    one_line_error([a.format(d=tmp_path) for a in argv] + ["--out_dir", str(out)], re.escape(message))
    assert not out.exists()  # refused before anything is read or written


def test_options_that_act_are_taken_and_the_refusal_is_one_line_on_the_command_line(tmp_path):
    docs = world.corpus(40, seed=4)
    (tmp_path / "a.txt").write_text("\n".join(docs[:20]) + "\n")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[20:]))
    # --group_tokens acts on the .txt among the inputs; --vocab_size and --tokenizer_sample_mb on a trained tokenizer.
    prepare.main(["--input", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--group_tokens", "100000",
                  "--vocab_size", "300", "--tokenizer_sample_mb", "1", "--out_dir", str(tmp_path / "out")])
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["n_train_docs"] + meta["n_val_docs"] == 1 + 20 and meta["vocab_size"] <= 300
    run = subprocess.run([sys.executable, os.path.join(DATA, "prepare.py"), "--input", str(tmp_path / "b.jsonl"),
                          "--n_docs", "50", "--out_dir", str(tmp_path / "cli")], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1 and run.stdout == "" and not (tmp_path / "cli").exists()
    assert run.stderr.splitlines() == ["error: --n_docs does not act with --input (it sizes the generated corpus); "
                                       "drop --n_docs, or drop --input"]


def outputs(out):
    return {f: (out / f).read_bytes() for f in sorted(os.listdir(out)) if (out / f).is_file()}


def test_a_run_never_reads_its_own_output(tmp_path):
    """With --out_dir in (or equal to) the --input directory, a run's val.txt is not input to the next: both runs read
    the same documents and write the same bytes. Named as --input, it is refused; a pattern skips it."""
    argv = ["--vocab_size", "300", "--val_fraction", "0.1"]
    for layout in ("inside", "same"):
        corpus = tmp_path / layout
        corpus.mkdir()
        (corpus / "a.txt").write_text("\n".join(world.corpus(60, seed=6)) + "\n")
        out = corpus / "prepared" if layout == "inside" else corpus
        runs = []
        for _ in range(2):
            prepare.main(["--input", str(corpus), "--out_dir", str(out), *argv])
            runs.append(outputs(out))
        assert runs[0] == runs[1]
        assert json.loads(runs[1]["meta.json"])["n_train_docs"] == 54  # the 60 documents of a.txt, no more
    prepare.main(["--input", str(corpus / "*.txt"), "--out_dir", str(corpus), *argv])  # matches a.txt and val.txt
    before = outputs(corpus)
    assert json.loads(before.pop("meta.json"))["n_train_docs"] == 54  # its source names the pattern
    assert before == {f: b for f, b in runs[1].items() if f != "meta.json"}
    one_line_error(["--input", str(corpus / "val.txt"), "--out_dir", str(corpus), *argv],
                   re.escape(f"--input {corpus / 'val.txt'} is a file this run writes (--out_dir's val.txt); give "
                             "another --out_dir, or move the file out of it"))
    one_line_error(["--input", str(corpus / "v*.txt"), "--out_dir", str(corpus), *argv],
                   re.escape(f"--input pattern {corpus / 'v*.txt'} matches only files this run writes"))
    assert {f: b for f, b in outputs(corpus).items() if f != "meta.json"} == before
    # Another --out_dir: that val.txt is a file like any other.
    prepare.main(["--input", str(corpus / "val.txt"), "--out_dir", str(tmp_path / "again"), *argv])


def test_a_file_named_twice_is_refused(tmp_path, monkeypatch):
    """However a file is named twice (the same path, two spellings, a symlink, a directory and a file in it, two
    patterns), one line names it: read twice, its documents would be in train and in val."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(2):
        (shards / f"{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in world.corpus(20, seed=i)))
    os.symlink(shards / "0.jsonl", tmp_path / "link.jsonl")
    monkeypatch.chdir(tmp_path)
    real = str(shards / "0.jsonl")
    cases = [
        ([real, real], f"({real}, and {real})"),
        ([real, "shards/../shards/0.jsonl"], f"({real}, and shards/../shards/0.jsonl)"),
        ([real, "link.jsonl"], f"({real}, and link.jsonl)"),
        (["shards", "shards/0.jsonl"], "(shards/0.jsonl in shards, and shards/0.jsonl)"),
        (["shards/*.jsonl", "shards/0*"], "(shards/0.jsonl in shards/*.jsonl, and shards/0.jsonl in shards/0*)"),
    ]
    out = tmp_path / "out"
    for paths, spelled in cases:
        one_line_error(["--input", *paths, "--out_dir", str(out)],
                       re.escape(f"--input names the file {real} twice {spelled}; give each file once (a directory "
                                 "includes the files under it)"))
    os.symlink(shards / "1.jsonl", shards / "2.jsonl")  # a directory holding a link to one of its files
    one_line_error(["--input", "shards", "--out_dir", str(out)],
                   re.escape("twice (shards/1.jsonl in shards, and shards/2.jsonl in shards)"))
    assert not out.exists()


def test_prepare_writes_the_general_register_on_request(tmp_path):
    """--register general: the generated corpus in everyday English, recorded in meta.json's source as the call that
    made it; the default (bio) run's source stays as it was."""
    prepare.main(["--register", "general", "--n_docs", "300", "--vocab_size", "400", "--out_dir", str(tmp_path / "g")])
    meta = json.loads((tmp_path / "g" / "meta.json").read_text())
    assert meta["source"] == "generated:world.corpus(300, 1234, register='general')"
    docs = [prepare.clean(d) for d in world.corpus(300, 1234, "general")]
    assert set((tmp_path / "g" / "val.txt").read_text().splitlines()) <= set(docs)
    prepare.main(["--register", "bio", "--n_docs", "300", "--vocab_size", "400", "--out_dir", str(tmp_path / "b")])
    assert json.loads((tmp_path / "b" / "meta.json").read_text())["source"] == "generated:world.corpus(300, 1234)"
    one_line_error(["--register", "news", "--out_dir", str(tmp_path / "n")],
                   re.escape("--register 'news' must be one of pair | bio | general"))


def test_the_default_pair_is_the_general_corpus_and_the_bio_corpus_cut_with_its_tokenizer(tmp_path):
    """No --input, no --register: the general corpus with a tokenizer trained on it (as ModernBERT's, on general
    text), then the bio corpus cut with that tokenizer, each what --register writes alone; --name and --out_dir
    name the directory that holds both."""
    out = tmp_path / "pair"
    prepare.main(["--n_docs", "300", "--vocab_size", "400", "--out_dir", str(out)])
    assert sorted(os.listdir(out)) == ["bio", "general"]
    general = json.loads((out / "general" / "meta.json").read_text())
    bio = json.loads((out / "bio" / "meta.json").read_text())
    assert general["source"] == "generated:world.corpus(300, 1234, register='general')"
    assert bio["source"] == "generated:world.corpus(300, 1234)"
    assert (out / "bio" / "tokenizer.json").read_bytes() == (out / "general" / "tokenizer.json").read_bytes()
    # each is byte for byte what its register alone writes (the bio one given the general tokenizer)
    prepare.main(["--register", "general", "--n_docs", "300", "--vocab_size", "400", "--out_dir", str(tmp_path / "g")])
    prepare.main(["--register", "bio", "--n_docs", "300", "--tokenizer", str(out / "general" / "tokenizer.json"),
                  "--out_dir", str(tmp_path / "b")])
    for name, alone in (("general", "g"), ("bio", "b")):
        for f in ("train.bin", "val.bin", "tokenizer.json"):
            assert (out / name / f).read_bytes() == (tmp_path / alone / f).read_bytes(), (name, f)
    # the bio text is cut with a tokenizer that never saw it: more tokens per character than the general text
    assert bio["n_train_tokens"] / bio["n_chars"] > general["n_train_tokens"] / general["n_chars"]
