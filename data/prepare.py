"""Turn documents into a tokenizer and a packed token stream for training.

    python data/prepare.py                  # the default pair -> data/world/general/ and bio/
    python data/prepare.py --register bio   # the generated biomedical corpus alone -> data/default/
    python data/prepare.py --register general --name general_world  # generated everyday English
    python data/prepare.py --input pubmed.jsonl --name pubmed
    python data/prepare.py --input notes.txt --group_tokens 256 --tokenizer tokenizer.json
    python data/prepare.py --input pubmed/ --name pubmed --tokenizer tokenizer.json  # shards
    python data/prepare.py --input 'baseline/pubmed25n*.xml.gz' --name pubmed  # NLM's PubMed XML

Without --input, the default (--register pair) writes the setting of the paper in miniature: a
general corpus (everyday English) in data/world/general/ with a tokenizer trained on it, as
ModernBERT's was trained on general text, then the biomedical corpus in data/world/bio/ cut with
that tokenizer: the general encoder θ0 learns on the first, the twins continue it on the second.

Output directory (data/NAME/ or --out_dir; for the pair, its general/ and bio/):
    tokenizer.json    byte-level BPE (trained here unless --tokenizer is given)
    train.bin         flat uint16/uint32 token ids, for np.memmap
    val.bin           the same for the held-out documents
    val.txt           the held-out documents, one per line (for later analysis)
    train_counts.npy  how often each token id occurs in train.bin (detour's unigram baseline)
    meta.json         vocab size, dtype, special token ids, counts, source (for PubMed XML also the
                      articles and books read, those skipped for want of an abstract, the deleted
                      citations, the files without an article); written last

Every document is stored as [CLS] tokens [SEP], back to back. The same stream
serves both phases of the method: the causal LM phase predicts the next token
(SEP marks where a document ends), the MLM phase masks tokens in windows.

The input is read as a stream, twice: pass 1 checks and counts the documents (several files:
a worker process per core) and keeps the tokenizer's training sample, pass 2 tokenizes them in
batches and appends the tokens to temp files in input order; then each split is copied out in
its shuffled order. Memory is a batch, plus about 25 bytes a document for the split (its
permutation, sizes, offsets).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import io
import json
import os
import random
import re
import sys
import time
import xml.etree.ElementTree as ET
import zlib
from array import array
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from itertools import chain, islice, repeat
from multiprocessing import get_all_start_methods, get_context

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
# The repository root, so that detour and data.world import from any working directory.
sys.path.insert(0, os.path.dirname(HERE))
from data import world  # noqa: E402
from detour import atomic_write, check, fail, load_tokenizer  # noqa: E402  (one error style)
from detour import NON_NEGATIVE, POSITIVE, RATE, one_of  # noqa: E402

# Registered in this order when we train, so the ids are always 0..4.
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# Byte-level BPE starts from all 256 bytes; the specials come on top.
MIN_VOCAB = len(SPECIAL_TOKENS) + 256
DEFAULT_N_DOCS = 20000  # about 2.6M tokens with the default 8192-token vocabulary
DEFAULT_WORLD_SEED = 1234
# The default without --input: both registers, the general one first (its tokenizer cuts the bio
# one), each into its own directory under data/world/ (or --out_dir), named by the register.
PAIR = "pair"
PAIR_NAME = "world"
# A trained tokenizer learns from the train documents among the input's first 256 MB of text:
# BPE's merges settle long before that, and its memory grows with the sample. A smaller input is
# used whole.
TOKENIZER_SAMPLE_MB = 256
# The progress bars: MB/s and ETA; off without a tty.
BAR = dict(unit="B", unit_scale=True, dynamic_ncols=True, disable=None, leave=False)
BATCH_DOCS = 2048  # documents per encode_batch call: enough to keep every tokenizer thread busy
# What prepare reads, told by the file's ending, each maybe gzipped (+ ".gz"): a directory given as
# --input contributes these files, and any other file is refused (a .csv, .tsv or .parquet read as
# lines of text gives garbage documents).
FORMATS = {
    ".txt": "(a document per line)",
    ".jsonl": '({"text": ...} per line)',
    ".xml": "(NLM's PubMed XML)",
}
SUFFIXES = tuple(suffix + gz for gz in ("", ".gz") for suffix in FORMATS)
RULES = dict(  # checked by main
    vocab_size=(lambda v: v >= MIN_VOCAB,
                f">= {MIN_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} specials)"),
    val_fraction=RATE,
    n_docs=(lambda v: v >= 2, ">= 2 (a train and a val document)"),
    seed=NON_NEGATIVE,
    world_seed=NON_NEGATIVE,
    group_tokens=(lambda v: v is None or v > 0, "> 0"),
    tokenizer_sample_mb=POSITIVE,
    register=one_of(PAIR, *world.REGISTERS),
)
# When each option acts, in one place: an option given on the command line that does not act in
# this run is refused in one line (check_acting), even at its default value, for the record is
# the truth: a --vocab_size beside --tokenizer would otherwise be dropped in silence while the
# command says it was used. None: it acts in every run. Else (acts(args, kinds), what stops it,
# what it does, the fix); kinds: the FORMATS keys of the input files, or {GENERATED} without
# --input. An option left out of the command is never refused. Every option has an entry (tested).
GENERATED = "the generated corpus"
WITHOUT_INPUT = (lambda args, kinds: not args.input, "--input")
WITHOUT_TOKENIZER = (lambda args, kinds: args.tokenizer is None, "--tokenizer")


def is_pair(args):
    """The default generated pair: no --input, --register pair."""
    return not args.input and args.register == PAIR


ACTS = dict(
    input=None, out_dir=None, val_fraction=None, seed=None,
    tokenizer=(lambda args, kinds: not is_pair(args), "--register pair",
               "the pair's tokenizer is trained on its general corpus",
               "drop --tokenizer, or give --register bio or general"),
    group_tokens=(lambda args, kinds: ".txt" in kinds, "{input}",
                  "it joins the lines of .txt files into documents",
                  "drop --group_tokens, or give .txt input"),
    name=(lambda args, kinds: args.out_dir is None, "--out_dir",
          "it names data/NAME/, the output directory without --out_dir", "drop one of them"),
    vocab_size=(*WITHOUT_TOKENIZER, "it sizes a tokenizer trained here",
                "drop --vocab_size, or drop --tokenizer to train one"),
    tokenizer_sample_mb=(*WITHOUT_TOKENIZER, "it caps the text a tokenizer trained here learns "
                         "from", "drop --tokenizer_sample_mb, or drop --tokenizer to train one"),
    n_docs=(*WITHOUT_INPUT, "it sizes the generated corpus", "drop --n_docs, or drop --input"),
    world_seed=(*WITHOUT_INPUT, "it seeds the generated corpus",
                "drop --world_seed, or drop --input"),
    register=(*WITHOUT_INPUT, "it picks the generated corpus's register",
              "drop --register, or drop --input"),
)


def clean(text):
    # Collapse all whitespace (newlines included) to single spaces, so every
    # document fits on one line of val.txt and tokenizes the way it is stored.
    return " ".join(text.split())


def format_of(path):
    """The FORMATS key of a file's ending (.gz aside), or None."""
    return next((s for s in FORMATS if path.endswith((s, s + ".gz"))), None)


def input_files(paths, out_dir=None):
    """The files behind --input, in order: each file as given, a directory's SUFFIXES files sorted
    by path, a glob pattern's matches sorted by path (a quoted 'pubmed/pubmed25n*.xml.gz' works as
    the shell's expansion would). Never a file this run writes (see own_outputs), and no file
    twice (see distinct)."""
    own = own_outputs(out_dir)
    return distinct([(f, path) for path in paths for f in files_behind(path, own)])


def own_outputs(out_dir):
    """The real paths of the files a run into out_dir writes. Of them only val.txt ends like an
    input, and a directory walk would take a previous run's val.txt for a shard when --out_dir is
    in (or is) the --input directory: its held-out documents would come back as input, a second
    run would differ from the first, and val text would leak into train. Walks and patterns skip
    these files; naming one is refused (files_behind)."""
    if out_dir is None:
        return set()
    return {os.path.realpath(os.path.join(out_dir, name)) for name in OUTPUTS}


def files_behind(path, own):
    """The input files of one --input argument (see input_files); own: own_outputs."""
    if not os.path.exists(path) and glob.has_magic(path):
        found = sorted(glob.glob(path))
        if not found:
            fail(f"--input pattern {path} matches no file; check the directory and the pattern")
        # A pattern lists files as a directory does: this run's own outputs are not among them.
        kept = [match for match in found if os.path.realpath(match) not in own]
        if not kept:
            fail(f"--input pattern {path} matches only files this run writes ({', '.join(found)}); "
                 "give another pattern or another --out_dir")
        return [f for match in kept for f in files_behind(match, own)]
    if os.path.isdir(path):
        return directory_files(path, own)
    if not os.path.isfile(path):
        fail(f"input file not found: {path}; check the --input path")
    if os.path.realpath(path) in own:
        fail(f"--input {path} is a file this run writes (--out_dir's "
             f"{os.path.basename(os.path.realpath(path))}); give another --out_dir, "
             "or move the file out of it")
    if not format_of(path):
        formats = ", ".join(f"{s} {what}" for s, what in FORMATS.items())
        fail(f"cannot read {path}: prepare reads {formats}, each maybe gzipped (.gz), "
             "by the file's ending; convert it to one of them")
    return [path]


def distinct(named):
    """The files of [(file, the --input argument it came from)], or the one-line error naming a
    file that is among them twice, however it was named (two spellings of a path, a symlink, a
    directory and a file in it, two overlapping patterns). Refused rather than read once: a file
    named twice is a slip in the command, and reading it twice puts its documents in train and val
    both; dropping the repeat in silence would leave meta.json's source naming a file twice that
    the run read once, and would hide the slip (the path meant may be another file)."""
    first = {}
    for f, arg in named:
        real = os.path.realpath(f)
        how = f if f == arg else f"{f} in {arg}"
        if real in first:
            fail(f"--input names the file {real} twice ({first[real]}, and {how}); give each "
                 "file once (a directory includes the files under it)")
        first[real] = how
    return [f for f, _ in named]


def directory_files(path, own=frozenset()):
    """A directory's SUFFIXES files, sorted by path, all of one format; none of `own` (a run's own
    outputs, see own_outputs)."""
    found = sorted(f for d, _, names in os.walk(path) for f in (os.path.join(d, n) for n in names)
                   if f.endswith(SUFFIXES) and os.path.realpath(f) not in own)
    if not found:
        fail(f"no {' / '.join(SUFFIXES)} files in the directory {path}; "
             "give a directory of shards or a file")
    # One format a directory: a README.txt next to PubMed's .xml.gz files is not a shard.
    kinds = {}
    for f in found:
        kinds.setdefault(format_of(f), f)
    if len(kinds) > 1:
        fail(f"the directory {path} mixes {' and '.join(kinds)} files "
             f"({', '.join(kinds.values())}); "
             "give the files of one format as --input, or move the others out")
    return found


def parse(lines, path, group_tokens):
    """Yield the cleaned documents of one file's lines: a .jsonl ({"text": ...} per line), or text
    with one document per line; with group_tokens=N, consecutive non-empty lines are joined until
    a document has about N words, and a blank line always ends a document."""
    if path.endswith((".jsonl", ".jsonl.gz")):
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{path}:{lineno}: not valid JSON ({e.msg}); "
                     "each line must be one JSON object")
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                fail(f'{path}:{lineno}: no "text" string field; '
                     'each line must look like {"text": "..."}')
            yield clean(record["text"])
    elif group_tokens:
        group = []
        n_words = 0
        for line in lines:
            words = line.split()
            if words:
                group.append(" ".join(words))
                n_words += len(words)
            if group and (not words or n_words >= group_tokens):
                yield " ".join(group)
                group = []
                n_words = 0
        if group:
            yield " ".join(group)
    else:
        yield from map(clean, lines)


class Corpus:
    """The documents of the input files (text, JSONL or PubMed XML, each maybe gzipped), read as a
    stream every time it is iterated; empty documents are dropped, and a text or JSONL file without
    any is an error (a PubMed file without a usable article is skipped and counted: an update file
    may hold only deletions). `bar`, when set, advances by the bytes read from disk; `counts` holds,
    in the last read, the PubMed articles and books read, those `skipped` (no abstract), the deleted
    citations and the XML files without an article. out_dir: the run's, whose outputs are never
    input (see input_files)."""

    COUNTS = ("articles", "books", "skipped", "deleted", "files_without_articles")

    def __init__(self, paths, group_tokens=None, out_dir=None):
        self.files = input_files(paths, out_dir)
        self.group_tokens = group_tokens
        self.bar = None
        self.counts = dict.fromkeys(self.COUNTS, 0)

    @property
    def skipped(self):
        return self.counts["skipped"]

    def size(self):
        return sum(os.path.getsize(f) for f in self.files)

    def __iter__(self):
        self.counts = dict.fromkeys(self.counts, 0)
        for path in self.files:
            is_xml = format_of(path) == ".xml"
            n_docs = 0
            for n_docs, doc in enumerate(self._read(path, is_xml), 1):
                yield doc
            if not n_docs and is_xml:
                self.counts["files_without_articles"] += 1
            elif not n_docs:
                fail(f"no documents in {path} (the file is empty or has only blank lines); "
                     "give a file with text")

    def _read(self, path, is_xml):
        """The non-empty documents of one file; a file that cannot be read is one line naming it."""
        try:
            raw = open(path, "rb")
        except OSError as e:  # unreadable, or gone since the files were listed
            fail(f"cannot read {path} ({e.strerror}); check the --input path and its permissions")
        with raw:
            data = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
            try:
                if is_xml:
                    docs = self._progress(self.pubmed(data, path), raw)
                else:
                    lines = self._progress(io.TextIOWrapper(data, encoding="utf-8"), raw)
                    docs = parse(lines, path, self.group_tokens)
                yield from filter(None, docs)
            except UnicodeDecodeError as e:
                fail(f"{path} is not UTF-8 text (byte {e.object[e.start:e.start + 1]!r}); "
                     "convert it (e.g. iconv -t utf-8)")
            except (EOFError, gzip.BadGzipFile, zlib.error) as e:
                fail(f"{path} is a truncated or corrupt gzip file ({e}); "
                     "download or compress it again")
            except ET.ParseError as e:
                # its line in the XML (after gunzip); str(e) ends with the position
                fail(f"{path}:{e.position[0]}: not well-formed XML ({str(e).split(':')[0]}); "
                     "download the file again")

    def pubmed(self, data, path):
        """Yield the documents of NLM's PubMed XML (the baseline's and updates' pubmed*.xml.gz):
        each PubmedArticle's and PubmedBookArticle's (a Bookshelf record's) text, see
        pubmed_document; one without an abstract is skipped and counted. A DeleteCitation (PMIDs
        taken out of PubMed) is counted, not read. A stream: iterparse builds the tree a read
        (16 KB) at a time and every child of the root is cleared once read, so memory holds a
        read's articles, whatever the file's size (a baseline file: up to 30,000 articles)."""
        events = ET.iterparse(data, events=("start", "end"))
        _, root = next(events)
        if root.tag != "PubmedArticleSet":
            fail(f"{path} is not PubMed XML (its root is <{root.tag}>, not <PubmedArticleSet>); "
                 "give NLM's files")
        depth = 1
        for event, elem in events:
            depth += 1 if event == "start" else -1
            if event == "end" and depth == 1:  # a child of the root, complete
                if elem.tag in ("PubmedArticle", "PubmedBookArticle"):
                    doc = pubmed_document(elem)
                    self.counts["articles" if elem.tag == "PubmedArticle" else "books"] += 1
                    self.counts["skipped"] += not doc
                    yield doc
                elif elem.tag == "DeleteCitation":
                    self.counts["deleted"] += len(elem.findall("PMID"))
                root.clear()

    def _progress(self, lines, raw, every=4096):
        if self.bar is None:
            yield from lines
            return
        done = raw.tell()
        for i, line in enumerate(lines):
            yield line
            if i % every == every - 1:
                self.bar.update(raw.tell() - done)
                done = raw.tell()
        self.bar.update(raw.tell() - done)


def element_text(elem):
    """An element's text, inline markup included, cleaned; "" for no element."""
    return clean("".join(elem.itertext())) if elem is not None else ""


def pubmed_document(record):
    """A PubmedArticle's title and abstract (Abstract's AbstractText elements, in order) as one
    document, or "" if it has no abstract text; a PubmedBookArticle's book title, chapter title (a
    whole book has none) and abstract, the same way. Inline markup (<i>, <sup>, <b>, ...) stays as
    its text (itertext); OtherAbstract (a translation) is left out. A structured abstract keeps its
    section labels as text, "METHODS: ...", as PubMed shows it: without them the sections run
    together into prose the authors did not write ("UNLABELLED" is no label)."""
    article = "BookDocument" if record.tag == "PubmedBookArticle" else "MedlineCitation/Article"
    abstract = []
    for section in record.iterfind(f"{article}/Abstract/AbstractText"):
        label = section.get("Label")
        body = element_text(section)
        if body:
            abstract.append(f"{label}: {body}" if label and label != "UNLABELLED" else body)
    titles = [element_text(record.find(f"{article}/{title}"))
              for title in ("Book/BookTitle", "ArticleTitle")]
    return clean(" ".join(titles + abstract)) if abstract else ""


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
    # BPE counts words, so the documents' order does not change the result (tested).
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


def get_tokenizer(tokenizer_path, train_sample, vocab_size):
    """The given tokenizer.json, or one trained on train_sample -> (tokenizer, special ids, file
    bytes)."""
    if tokenizer_path:
        if os.path.isdir(tokenizer_path):
            fail(f"--tokenizer {tokenizer_path} is a directory; give the tokenizer.json file in it")
        if not os.path.isfile(tokenizer_path):
            fail(f"tokenizer file not found: {tokenizer_path}; check the --tokenizer path")
        tokenizer = load_tokenizer(tokenizer_path)
        with open(tokenizer_path, "rb") as f:
            return tokenizer, special_ids(tokenizer), f.read()
    tokenizer = train_tokenizer(train_sample, vocab_size)
    ids = special_ids(tokenizer)
    assert [ids[t] for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return tokenizer, ids, tokenizer.to_str(pretty=True).encode("utf-8")


def count_documents(path, group_tokens):
    """(documents, characters) of one input file: pass 1's work in a worker process."""
    n_docs = n_chars = 0
    for doc in Corpus([path], group_tokens):
        n_docs += 1
        n_chars += len(doc)
    return n_docs, n_chars


def first_documents(docs, sample_chars):
    """[(index, doc)] from the start of docs while fewer than sample_chars characters are taken."""
    sample = []
    n_chars = 0
    for i, doc in enumerate(docs) if sample_chars else ():
        sample.append((i, doc))
        n_chars += len(doc)
        if n_chars >= sample_chars:
            break
    return sample


def survey(docs, sample_chars):
    """Pass 1: read every document once (so bad input fails before anything is written) ->
    (documents, characters, first_documents(docs, sample_chars)). Several input files are counted
    in worker processes, one per core, while this process reads the sample: the tokenizer is idle
    in this pass, and one parsing core would leave the others idle too."""
    if not (isinstance(docs, Corpus) and len(docs.files) > 1 and os.cpu_count() > 1
            and "fork" in get_all_start_methods()):
        n_docs = n_chars = 0
        sample = []
        for n_docs, doc in enumerate(docs, 1):
            if n_chars < sample_chars:  # as first_documents, in the same read
                sample.append((n_docs - 1, doc))
            n_chars += len(doc)
        return n_docs, n_chars, sample
    n_workers = min(len(docs.files), os.cpu_count())
    workers = ProcessPoolExecutor(n_workers, mp_context=get_context("fork"))
    try:  # results in input order: the first bad file fails first, as in one serial read
        counts = workers.map(count_documents, docs.files, repeat(docs.group_tokens))
        sample = first_documents(Corpus(docs.files, docs.group_tokens), sample_chars)
        n_docs = n_chars = 0
        for path, (n, chars) in zip(docs.files, counts):
            n_docs += n
            n_chars += chars
            if docs.bar is not None:
                docs.bar.update(os.path.getsize(path))
        return n_docs, n_chars, sample
    finally:
        workers.shutdown(cancel_futures=True)


def split_order(n_docs, val_fraction, seed):
    """The documents' order after a seeded shuffle, and how many of its first ones are val: val is a
    random sample, not the tail of the input. random.shuffle on a list of 4-byte ids, not of
    Python ints (40 bytes each): the same permutation in a tenth of the memory."""
    order = array("I", range(n_docs))
    random.Random(seed).shuffle(order)
    n_val = min(n_docs - 1, max(1, round(n_docs * val_fraction)))
    return np.frombuffer(order, dtype=np.uint32), n_val


def encoded_batches(tokenizer, docs, cls_id, sep_id, dtype):
    """Yield (documents, token counts, [CLS] doc [SEP] ... tokens) batch by batch, in input order.
    The tokenizer's threads encode one batch while this thread reads and cleans the next."""
    def encode(batch):
        # add_special_tokens=False: a real tokenizer.json (ModernBERT's) has a
        # post-processor that would add a second CLS/SEP pair.
        # encode_batch_fast: the same ids without character offsets, which nothing here reads.
        encodings = tokenizer.encode_batch_fast(batch, add_special_tokens=False)
        lengths = np.fromiter(map(len, encodings), np.int64, len(encodings)) + 2
        ends = np.cumsum(lengths)
        starts = ends - lengths
        # Whole-array writes, not a Python loop over every token.
        tokens = np.empty(int(ends[-1]), dtype)
        tokens[starts] = cls_id
        tokens[ends - 1] = sep_id
        edge = np.zeros(int(ends[-1]), bool)
        edge[starts] = edge[ends - 1] = True
        ids = chain.from_iterable(e.ids for e in encodings)
        tokens[~edge] = np.fromiter(ids, dtype, len(tokens) - 2 * len(batch))
        return batch, lengths, tokens

    docs = iter(docs)
    with ThreadPoolExecutor(1) as pool:
        pending = deque()
        while batch := list(islice(docs, BATCH_DOCS)):
            pending.append(pool.submit(encode, batch))
            if len(pending) > 1:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


class Spool:
    """Records (a document's tokens or text) appended to a temp file in input order, then copied
    into the final file's temp in the split's shuffled order."""

    def __init__(self, path):
        self.path = path
        self.file = open(path, "wb")
        self.sizes = []

    def add(self, data, sizes):
        self.file.write(data)
        self.sizes.append(np.asarray(sizes, dtype=np.uint32))  # a document's bytes: < 4 GB

    def copy_in_order(self, ranks, dst, chunk=1 << 16):
        """Write record ranks[0], ranks[1], ... to dst (fsynced), then delete the spool."""
        self.file.close()
        sizes = np.concatenate(self.sizes) if self.sizes else np.zeros(0, np.uint32)
        self.sizes = [sizes]
        starts = np.cumsum(sizes, dtype=np.uint64) - sizes
        with open(self.path, "rb") as src, open(dst, "wb") as out:
            for i in range(0, len(ranks), chunk):
                pick = ranks[i:i + chunk]
                places = zip(sizes[pick].tolist(), starts[pick].tolist())
                out.write(b"".join(os.pread(src.fileno(), n, at) for n, at in places))
            out.flush()
            os.fsync(out.fileno())
        os.remove(self.path)


def temp_path(out_dir, name, kind="tmp"):
    """Where `name` is written before its rename: hidden, and named after this process (as
    atomic_write)."""
    return os.path.join(out_dir, f".{name}.{kind}{os.getpid()}")


OUTPUTS = ("tokenizer.json", "train.bin", "val.bin", "val.txt", "train_counts.npy", "meta.json")
TEMP_NAME = re.compile(r"\.(%s)\.(tmp|spool|new)\d+(\.tmp\d+)?"
                       % "|".join(map(re.escape, OUTPUTS)))


def remove_temp_files(out_dir):
    for name in os.listdir(out_dir):
        if TEMP_NAME.fullmatch(name):
            os.remove(os.path.join(out_dir, name))


def write_splits(tokenizer, ids, dtype, docs, order, n_val, out_dir, bar):
    """Pass 2: tokenize, spool each split in input order, count the train tokens, then write
    train.bin, val.bin and val.txt in the split's order under temp names -> (temp names, stats)."""
    is_val = np.zeros(len(order), dtype=bool)
    is_val[order[:n_val]] = True
    spools = {name: Spool(temp_path(out_dir, name, "spool"))
              for name in ("train.bin", "val.bin", "val.txt")}
    counts = np.zeros(tokenizer.get_vocab_size(), np.int64)
    itemsize = np.dtype(dtype).itemsize
    n = 0
    batches = encoded_batches(tokenizer, docs, ids["[CLS]"], ids["[SEP]"], dtype)
    for batch, lengths, tokens in batches:
        val = is_val[n:n + len(batch)]
        n += len(batch)
        in_val = np.repeat(val, lengths)
        train = tokens[~in_val]
        spools["train.bin"].add(train.tobytes(), lengths[~val] * itemsize)
        # longer than counts if an id is >= the vocab size
        batch_counts = np.bincount(train, minlength=len(counts))
        counts = np.pad(counts, (0, len(batch_counts) - len(counts))) + batch_counts
        if val.any():
            spools["val.bin"].add(tokens[in_val].tobytes(), lengths[val] * itemsize)
            text = [(d + "\n").encode("utf-8") for d, v in zip(batch, val) if v]
            spools["val.txt"].add(b"".join(text), list(map(len, text)))
        bar.update(sum(map(len, batch)))
    bar.close()
    written = {}
    splits = (("train.bin", ~is_val, order[n_val:]),
              ("val.bin", is_val, order[:n_val]),
              ("val.txt", is_val, order[:n_val]))
    for name, member, part in splits:
        # A document's place in its spool: how many of its split come before it in the input
        # (4-byte counts: part picks members only, so the count is >= 1 there).
        written[name] = temp_path(out_dir, name)
        spools[name].copy_in_order(np.cumsum(member, dtype=np.uint32)[part] - 1, written[name])
    sizes = {split: int(spools[f"{split}.bin"].sizes[0].sum(dtype=np.uint64)) // itemsize
             for split in ("train", "val")}
    return written, counts, sizes


def prepare(docs, out_dir, tokenizer_path=None, vocab_size=8192, val_fraction=0.005, seed=42,
            source="documents", tokenizer_sample_mb=TOKENIZER_SAMPLE_MB):
    """Split docs (a list of strings or a Corpus), get a tokenizer, write the token streams; return
    the meta dict."""
    check_out_dir(out_dir)
    if isinstance(docs, (list, tuple)):  # already in memory: clean once here
        docs = [d for d in map(clean, docs) if d]
    sample_chars = 0 if tokenizer_path else int(tokenizer_sample_mb * 10 ** 6)
    n_docs, n_chars, sample = read_input(docs, sample_chars)
    if not 0 < val_fraction < 1:
        fail(f"val_fraction must be between 0 and 1, got {val_fraction}")
    order, n_val = split_order(n_docs, val_fraction, seed)
    val_ids = set(order[:n_val].tolist()) if sample else set()
    # Train on the train split only, so val text stays truly unseen.
    train_sample = [d for i, d in sample if i not in val_ids]
    tokenizer, ids, data = get_tokenizer(tokenizer_path, train_sample, vocab_size)
    del sample, val_ids, train_sample
    n_vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if n_vocab <= 2 ** 16 else np.uint32
    bar = tqdm(total=n_chars, desc="prepare: tokenizing", **BAR)
    with writing(out_dir):
        # The first write: the input and the tokenizer are known good.
        os.makedirs(out_dir, exist_ok=True)
        remove_temp_files(out_dir)  # a rerun starts clean: an interrupted run's temp files go
        try:
            splits = write_splits(tokenizer, ids, dtype, docs, order, n_val, out_dir, bar)
            written, counts, n_tokens = splits
            stage(out_dir, written, "train_counts.npy", lambda f: np.save(f, counts))
            tok_out = os.path.join(out_dir, "tokenizer.json")
            if not tokenizer_path or os.path.abspath(tokenizer_path) != os.path.abspath(tok_out):
                stage(out_dir, written, "tokenizer.json", lambda f: f.write(data))
            meta = metadata(ids, n_vocab, dtype, n_tokens, n_docs, n_val, n_chars, counts, source)
            meta.update(counted(docs))
            commit(out_dir, written, json.dumps(meta, indent=2) + "\n")
        finally:
            bar.close()  # before an error's one line
            remove_temp_files(out_dir)  # what a failure left behind; a finished run left nothing
    return meta


def check_out_dir(out_dir):
    """Fail before pass 1 on an --out_dir that cannot be a directory: a file, or a path under
    one."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        fail(f"--out_dir {out_dir} is a file; give a directory (it is created if missing)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.isdir(parent):  # the root is a directory: this ends
        if os.path.exists(parent):
            fail(f"--out_dir {out_dir} is under {parent}, which is a file; "
                 "give a directory path (it is created if missing)")
        parent = os.path.dirname(parent)


@contextmanager
def writing(out_dir):
    """An OSError while out_dir is written (a read-only directory, a full disk) is the one-line
    error naming it; what was there stays, as after any failure (see commit)."""
    try:
        yield
    except OSError as e:
        fail(f"cannot write to {out_dir} ({e.strerror}: {e.filename or out_dir}); "
             "give an --out_dir you can write to, with room for the dataset")


def read_input(docs, sample_chars):
    """Pass 1 (survey), with its progress bar, and its verdict: at least 2 documents."""
    if isinstance(docs, Corpus):
        docs.bar = tqdm(total=docs.size(), desc="prepare: reading", **BAR)
    try:
        n_docs, n_chars, sample = survey(docs, sample_chars)
    finally:  # cleared, also before an error's one line
        if isinstance(docs, Corpus):
            docs.bar = docs.bar.close()  # pass 2 has its own bar
    if n_docs == 0 and isinstance(docs, Corpus):  # only PubMed files can be without documents
        fail(f"no PubmedArticle or PubmedBookArticle with an abstract in the {len(docs.files)} "
             "input file(s); give PubMed XML with abstracts")
    if n_docs < 2:
        fail(f"need at least 2 documents (one for train, one for val), got {n_docs}; "
             "give more input")
    return n_docs, n_chars, sample


def metadata(ids, n_vocab, dtype, n_tokens, n_docs, n_val, n_chars, counts, source):
    """meta.json, but for PubMed XML's counts (see counted)."""
    return {
        "vocab_size": n_vocab,
        "dtype": np.dtype(dtype).name,
        "pad_token_id": ids["[PAD]"],
        "unk_token_id": ids["[UNK]"],
        "cls_token_id": ids["[CLS]"],
        "sep_token_id": ids["[SEP]"],
        "mask_token_id": ids["[MASK]"],
        "eos_token_id": ids["[SEP]"],  # SEP ends each document in the stream
        "tokenizer": "tokenizer.json",
        "n_train_tokens": n_tokens["train"],
        "n_val_tokens": n_tokens["val"],
        "n_train_docs": n_docs - n_val,
        "n_val_docs": n_val,
        "source": source,
        "n_chars": n_chars,  # of cleaned text, read by the tokenizer
        "train_counts": "train_counts.npy",  # detour.py's unigram baseline and vocabulary check
        "max_train_token_id": int(np.flatnonzero(counts)[-1]),
    }


def counted(docs):
    """For PubMed XML input, meta.json's counts of pass 2's read; else nothing."""
    if not (isinstance(docs, Corpus) and any(format_of(f) == ".xml" for f in docs.files)):
        return {}
    return dict(n_articles=docs.counts["articles"], n_books=docs.counts["books"],
                n_articles_without_abstract=docs.skipped,  # articles and books not made documents
                n_deleted_citations=docs.counts["deleted"],
                n_files_without_articles=docs.counts["files_without_articles"])


def stage(out_dir, written, name, write_fn):
    """Write `name` under a temp name (atomic_write: complete or absent) for commit() to rename."""
    written[name] = temp_path(out_dir, name, "new")
    atomic_write(written[name], write_fn)


def commit(out_dir, written, meta_text):
    """Put the finished files in place. meta.json goes first (a crash among the renames leaves no
    meta.json, so detour.py loads nothing half-replaced) and comes back last: if it exists, every
    file it describes is complete and of the same run."""
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta_path):
        os.remove(meta_path)
    for name, tmp in written.items():
        os.replace(tmp, os.path.join(out_dir, name))
    atomic_write(meta_path, lambda f: f.write(meta_text.encode("utf-8")))


def arguments():
    """The command line; every option's help names its default, and when it acts (ACTS)."""
    p = argparse.ArgumentParser(
        description="Documents -> tokenizer.json, train.bin, val.bin, meta.json")
    p.add_argument("--input", nargs="+", action="extend",
                   help=".txt (one document per line), .jsonl ({\"text\": ...} per line) or "
                        "NLM's PubMed .xml (a PubmedArticle's title and abstract per document, "
                        "a PubmedBookArticle's book and chapter titles and abstract), each maybe "
                        ".gz; several files, a directory of one format's files (shards), or a "
                        "quoted glob pattern (default: none, generate a corpus with world.py)")
    p.add_argument("--group_tokens", type=int, default=None,
                   help="for .txt: join consecutive lines into documents of about N words "
                        "(default: none, a line each)")
    p.add_argument("--name", default=None,
                   help=f"output goes to data/NAME/, without --out_dir (default: {PAIR_NAME} for "
                        "the pair, else default)")
    p.add_argument("--out_dir", default=None,
                   help="output directory, instead of data/NAME/; the pair writes its general/ "
                        "and bio/ in it (default: none)")
    p.add_argument("--tokenizer", default=None,
                   help="use this tokenizer.json (default: none, train one of --vocab_size on the "
                        "input)")
    p.add_argument("--vocab_size", type=int, default=8192,
                   help="size of the tokenizer trained here, without --tokenizer "
                        "(default: %(default)s)")
    p.add_argument("--tokenizer_sample_mb", type=float, default=TOKENIZER_SAMPLE_MB,
                   help="a trained tokenizer learns from the train documents among the input's "
                        "first N MB (default: %(default)s)")
    p.add_argument("--val_fraction", type=float, default=0.005,
                   help="fraction of documents held out (default: %(default)s)")
    p.add_argument("--seed", type=int, default=42,
                   help="shuffle seed for the train/val split (default: %(default)s)")
    p.add_argument("--n_docs", type=int, default=DEFAULT_N_DOCS,
                   help="generated documents, without --input (default: %(default)s)")
    p.add_argument("--world_seed", type=int, default=DEFAULT_WORLD_SEED,
                   help="seed of the generated corpus, without --input (default: %(default)s)")
    p.add_argument("--register", default=PAIR,
                   help="register of the generated corpus, without --input: bio (clinical notes "
                        "and PubMed-style abstracts), general (everyday English: stories, local "
                        "news, letters), or pair: general into NAME/general/ with its tokenizer, "
                        "then bio into NAME/bio/ cut with it (default: %(default)s)")
    p.error = usage_error
    return p


def usage_error(message):
    """argparse's error, as the one line of every other (argparse's own: exit 2, two lines)."""
    fail(f"{message}; see python data/prepare.py --help")


def given_options(argv):
    """The options on the command line (argv, else sys.argv's), whatever their values: the same
    parser with every default suppressed, so that only what was typed is in its namespace."""
    parser = arguments()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def check_acting(args, given, kinds):
    """The one-line error for the first option given that does not act in this run (see ACTS)."""
    for key in sorted(given):
        rule = ACTS[key]
        if rule is not None and not rule[0](args, kinds):
            _, stop, does, fix = rule
            input_kind = " and ".join(sorted(kinds)) + " input"
            input_kind = GENERATED if kinds == {GENERATED} else input_kind
            fail(f"--{key} does not act with {stop.format(input=input_kind)} ({does}); {fix}")


def main(argv=None):
    args = arguments().parse_args(argv)
    check(vars(args), RULES, "data/prepare.py")
    name = args.name or (PAIR_NAME if is_pair(args) else "default")
    out_dir = args.out_dir or os.path.join(HERE, name)
    t0 = time.time()
    # The input files are listed (not read) before the check: --group_tokens acts on their kinds.
    docs = Corpus(args.input, args.group_tokens, out_dir) if args.input else None
    kinds = {format_of(f) for f in docs.files} if docs else {GENERATED}
    check_acting(args, given_options(argv), kinds)
    if is_pair(args):  # the general corpus and its tokenizer, then the bio corpus cut with it
        check_out_dir(out_dir)
        general = os.path.join(out_dir, "general")
        generated(args, "general", general, None)
        return generated(args, "bio", os.path.join(out_dir, "bio"),
                         os.path.join(general, "tokenizer.json"))
    if docs:
        source = " ".join(args.input)
        meta = prepare(docs, out_dir, args.tokenizer, args.vocab_size, args.val_fraction,
                       args.seed, source, args.tokenizer_sample_mb)
        return print(summary(meta, out_dir, time.time() - t0))
    return generated(args, args.register, out_dir, args.tokenizer)


def generated(args, register, out_dir, tokenizer):
    """The generated corpus of one register (data/world.py) into out_dir."""
    t0 = time.time()
    docs = world.corpus(args.n_docs, args.world_seed, register)
    # The call that made them; the bio register is world.corpus's default.
    named = "" if register == "bio" else f", register={register!r}"
    source = f"generated:world.corpus({args.n_docs}, {args.world_seed}{named})"
    meta = prepare(docs, out_dir, tokenizer, args.vocab_size, args.val_fraction, args.seed,
                   source, args.tokenizer_sample_mb)
    print(summary(meta, out_dir, time.time() - t0))


def summary(meta, out_dir, seconds):
    """The line a finished run prints."""
    line = (f"prepare.py: {meta['n_train_docs']:,} train + {meta['n_val_docs']:,} val docs, "
            f"{meta['n_train_tokens']:,} train + {meta['n_val_tokens']:,} val tokens, "
            f"vocab {meta['vocab_size']:,} ({meta['dtype']}) -> {out_dir} "
            f"in {seconds:.1f} s, {meta['n_chars'] / 1e6 / seconds:.2f} MB/s")
    if "n_articles" in meta:
        line += (f"; PubMed XML: {meta['n_articles']:,} articles and {meta['n_books']:,} books "
                 f"read, {meta['n_articles_without_abstract']:,} without an abstract skipped, "
                 f"{meta['n_deleted_citations']:,} deleted citations, "
                 f"{meta['n_files_without_articles']:,} files without an article skipped")
    return line


if __name__ == "__main__":
    main()
