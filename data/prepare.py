"""Turn documents into a tokenizer and a packed token stream for training.

    python data/prepare.py                          # generated corpus -> data/default/
    python data/prepare.py --input pubmed.jsonl --name pubmed
    python data/prepare.py --input notes.txt --group_tokens 256 --tokenizer tokenizer.json

Output directory (data/NAME/ or --out_dir):
    tokenizer.json   byte-level BPE (trained here unless --tokenizer is given)
    train.bin        flat uint16/uint32 token ids, for np.memmap
    val.bin          the same for the held-out documents
    val.txt          the held-out documents, one per line (for later analysis)
    meta.json        vocab size, dtype, special token ids, counts, source

Every document is stored as [CLS] tokens [SEP], back to back. The same stream
serves both phases of the method: the causal LM phase predicts the next token
(SEP marks where a document ends), the MLM phase masks tokens in windows.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # "import world" and "import detour" from any working directory
import world  # noqa: E402
from detour import NON_NEGATIVE, RATE, atomic_write, check, fail, load_tokenizer  # noqa: E402  (one error style)
from tasks import read_lines  # noqa: E402

# Registered in this order when we train, so the ids are always 0..4.
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# Byte-level BPE starts from all 256 bytes; the specials come on top.
MIN_VOCAB = len(SPECIAL_TOKENS) + 256
DEFAULT_N_DOCS = 20000  # about 2.6M tokens with the default 8192-token vocabulary
DEFAULT_WORLD_SEED = 1234
RULES = dict(vocab_size=(lambda v: v >= MIN_VOCAB, f">= {MIN_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} specials)"),
             val_fraction=RATE, n_docs=(lambda v: v >= 2, ">= 2 (a train and a val document)"), seed=NON_NEGATIVE,
             world_seed=NON_NEGATIVE, group_tokens=(lambda v: v is None or v > 0, "> 0"))  # checked by main


def clean(text):
    # Collapse all whitespace (newlines included) to single spaces, so every
    # document fits on one line of val.txt and tokenizes the way it is stored.
    return " ".join(text.split())


def read_documents(path, group_tokens=None):
    """Read documents from a .jsonl ({"text": ...} per line) or a text file.

    A text file has one document per line; with group_tokens=N, consecutive
    non-empty lines are joined until a document has about N words, and a
    blank line always ends a document.
    """
    if not os.path.isfile(path):
        fail(f"input file not found: {path} (check the --input path)")
    docs = []
    lines = read_lines(path)  # a file that is not UTF-8 text is a one-line error
    if path.endswith(".jsonl"):
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object")
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                fail(f'{path}:{lineno}: no "text" string field; each line must look like {{"text": "..."}}')
            docs.append(clean(record["text"]))
    elif group_tokens:
        group, n_words = [], 0
        for line in lines:
            words = line.split()
            if words:
                group.append(" ".join(words))
                n_words += len(words)
            if group and (not words or n_words >= group_tokens):
                docs.append(" ".join(group))
                group, n_words = [], 0
        if group:
            docs.append(" ".join(group))
    else:
        docs = [clean(line) for line in lines]
    docs = [d for d in docs if d]
    if not docs:
        fail(f"no documents in {path} (the file is empty or has only blank lines); give a file with text")
    return docs


def train_tokenizer(docs, vocab_size):
    """Train a byte-level BPE tokenizer whose special ids are [PAD]=0 ... [MASK]=4."""
    if vocab_size < MIN_VOCAB:
        fail(f"vocab_size {vocab_size} is too small: byte-level BPE needs at least {MIN_VOCAB} "
             f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens); use e.g. --vocab_size 8192")
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space: a word gets the same tokens at the start of a document
    # as in the middle, which keeps word-level tasks (NER) consistent.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte encodes: no [UNK]s
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer, length=len(docs))
    # No post-processor on purpose: callers add [CLS]/[SEP] themselves.
    return tokenizer


def special_ids(tokenizer):
    """Look up the five special tokens by name; fail if any is missing."""
    ids = {name: tokenizer.token_to_id(name) for name in SPECIAL_TOKENS}
    missing = [name for name, i in ids.items() if i is None]
    if missing:
        fail(f"tokenizer lacks special token(s) {' '.join(missing)}; "
             f"use a tokenizer.json that defines {' '.join(SPECIAL_TOKENS)}")
    return ids


def encode_stream(tokenizer, docs, cls_id, sep_id, dtype=np.uint32, batch_size=1024):
    """Encode docs into one flat array: [CLS] doc0 [SEP] [CLS] doc1 [SEP] ..."""
    parts = []
    for i in range(0, len(docs), batch_size):
        # add_special_tokens=False: a real tokenizer.json (ModernBERT's) has a
        # post-processor that would add a second CLS/SEP pair.
        for enc in tokenizer.encode_batch(docs[i:i + batch_size], add_special_tokens=False):
            parts.append(np.array([cls_id] + enc.ids + [sep_id], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _write_text(path, text):
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def prepare(docs, out_dir, tokenizer_path=None, vocab_size=8192, val_fraction=0.005, seed=42,
            source="documents"):
    """Split docs, get a tokenizer, write the token streams; return the meta dict."""
    docs = [d for d in (clean(d) for d in docs) if d]
    if len(docs) < 2:
        fail(f"need at least 2 documents (one for train, one for val), got {len(docs)}; give more input")
    if not 0 < val_fraction < 1:
        fail(f"val_fraction must be between 0 and 1, got {val_fraction}")

    # Shuffle before the split so val is not just the tail of the file.
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_val = min(len(docs) - 1, max(1, round(len(docs) * val_fraction)))
    val_docs = [docs[i] for i in order[:n_val]]
    train_docs = [docs[i] for i in order[n_val:]]

    tok_out = os.path.join(out_dir, "tokenizer.json")
    if tokenizer_path:
        if not os.path.isfile(tokenizer_path):
            fail(f"tokenizer file not found: {tokenizer_path} (check the --tokenizer path)")
        tokenizer = load_tokenizer(tokenizer_path)
        ids = special_ids(tokenizer)
        data = open(tokenizer_path, "rb").read()
    else:
        # Train on the train split only, so val text stays truly unseen.
        tokenizer = train_tokenizer(train_docs, vocab_size)
        ids = special_ids(tokenizer)
        assert [ids[t] for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
        data = tokenizer.to_str(pretty=True).encode("utf-8")
    os.makedirs(out_dir, exist_ok=True)  # the first write: the input and the tokenizer are known good
    if not tokenizer_path or os.path.abspath(tokenizer_path) != os.path.abspath(tok_out):
        atomic_write(tok_out, lambda f: f.write(data))

    n_vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if n_vocab <= 2 ** 16 else np.uint32
    streams = {}
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        streams[split] = encode_stream(tokenizer, split_docs, ids["[CLS]"], ids["[SEP]"], dtype)
        atomic_write(os.path.join(out_dir, f"{split}.bin"), streams[split].tofile)
    _write_text(os.path.join(out_dir, "val.txt"), "".join(d + "\n" for d in val_docs))

    meta = {
        "vocab_size": n_vocab,
        "dtype": np.dtype(dtype).name,
        "pad_token_id": ids["[PAD]"],
        "unk_token_id": ids["[UNK]"],
        "cls_token_id": ids["[CLS]"],
        "sep_token_id": ids["[SEP]"],
        "mask_token_id": ids["[MASK]"],
        "eos_token_id": ids["[SEP]"],  # SEP ends each document in the stream
        "tokenizer": "tokenizer.json",
        "n_train_tokens": int(streams["train"].size),
        "n_val_tokens": int(streams["val"].size),
        "n_train_docs": len(train_docs),
        "n_val_docs": len(val_docs),
        "source": source,
    }
    # meta.json goes last: if it exists, every file it describes is complete.
    _write_text(os.path.join(out_dir, "meta.json"), json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv=None):
    p = argparse.ArgumentParser(description="Documents -> tokenizer.json, train.bin, val.bin, meta.json")
    p.add_argument("--input", help=".txt (one document per line) or .jsonl ({\"text\": ...} per line); "
                                   "default: generate a corpus with world.py")
    p.add_argument("--group_tokens", type=int, default=None,
                   help="for .txt: join consecutive lines into documents of about N words")
    p.add_argument("--name", default="default", help="output goes to data/NAME/")
    p.add_argument("--out_dir", default=None, help="output directory (overrides --name)")
    p.add_argument("--tokenizer", default=None, help="use this tokenizer.json instead of training one")
    p.add_argument("--vocab_size", type=int, default=8192, help="size of the trained tokenizer")
    p.add_argument("--val_fraction", type=float, default=0.005, help="fraction of documents held out")
    p.add_argument("--seed", type=int, default=42, help="shuffle seed for the train/val split")
    p.add_argument("--n_docs", type=int, default=DEFAULT_N_DOCS, help="generated documents")
    p.add_argument("--world_seed", type=int, default=DEFAULT_WORLD_SEED, help="seed of the generated corpus")
    p.error = lambda message: fail(f"{message}; see python data/prepare.py --help")  # argparse's own: exit 2, 2 lines
    args = p.parse_args(argv)
    check(vars(args), RULES, "data/prepare.py")

    t0 = time.time()
    if args.input:
        docs = read_documents(args.input, args.group_tokens)
        source = args.input
    else:
        docs = world.corpus(args.n_docs, args.world_seed)
        source = f"generated:world.corpus({args.n_docs}, {args.world_seed})"
    out_dir = args.out_dir or os.path.join(HERE, args.name)
    meta = prepare(docs, out_dir, args.tokenizer, args.vocab_size, args.val_fraction, args.seed, source)
    print(f"prepare.py: {meta['n_train_docs']:,} train + {meta['n_val_docs']:,} val docs, "
          f"{meta['n_train_tokens']:,} train + {meta['n_val_tokens']:,} val tokens, "
          f"vocab {meta['vocab_size']:,} ({meta['dtype']}) -> {out_dir} in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
