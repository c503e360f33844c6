"""Tests for data/world.py (the text generator) and data/prepare.py (tokenize + pack)."""

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
sys.path.insert(0, DATA)
import prepare  # noqa: E402
import world  # noqa: E402


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
    assert run.stderr.strip().splitlines() == [f"error: input file not found: {tmp_path / 'missing.jsonl'} (check the --input path)"]
