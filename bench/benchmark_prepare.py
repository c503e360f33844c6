"""data/prepare.py at scale, measured (a benchmark, not a test): throughput against the tokenizer
alone, and peak memory against corpus size.

    python bench/benchmark_prepare.py                        # 250 MB and 1 GB corpora under /tmp
    python bench/benchmark_prepare.py --sizes 50 --bare_sizes 50 --baseline ""   # a quick look
    python bench/benchmark_prepare.py --format xml           # the same corpora as PubMed baseline XML

It builds corpora of gzipped JSONL shards (64 MB of text each, as PubMed dumps come) by repeating
base documents (--source files, else world.corpus) in a fresh shuffled order per repeat; with
--format xml, of gzipped PubMed baseline XML shards instead (pubmed25nNNNN.xml.gz, see
pubmed_article), the reader's path a paper-scale run takes. Then it prints, from one run on one
machine:
  - prepare.py's MB/s (characters of cleaned text over wall time, reading and writing included)
    and peak RSS at each size, and RSS at the largest size over the smallest (flat: <= 1.25x);
  - bare `tokenizer.encode_batch` over the same documents already in memory, in the batches
    prepare uses: the physical limit (target: prepare >= 0.7x of it); and `encode_batch_fast`, the
    call prepare makes (the same ids, no character offsets), the limit of what prepare does;
  - the code before streaming (--baseline, a git revision) on the smallest corpus, as one plain
    .jsonl of the same text (it reads no .gz, no directory, no XML): its peak RSS;
  - detour.py's start-up on each prepared corpus (wall time of a one-step run, and of the same
    run on data/default/ for reference): no scan of train.bin, so flat in corpus size.
Every program runs in its own process; RSS is that process's peak (wait4's ru_maxrss). The
tokenizer is given to prepare.py (trained once here on the base documents), as in the paper's run
with ModernBERT's tokenizer: training one is a separate, capped step (--tokenizer_sample_mb).
"""

import argparse
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from xml.sax.saxutils import escape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a file (python bench/x.py), not imported: the repository root, for detour and bench
    sys.path.insert(0, ROOT)
from data import prepare, world  # noqa: E402

SHARD_MB = 64
# A <PubmedArticle> as NLM's baseline files have it, less most metadata; PMID, title and abstract filled in.
ARTICLE = ('<PubmedArticle><MedlineCitation Status="MEDLINE" Owner="NLM"><PMID Version="1">{pmid}</PMID>'
           '<Article PubModel="Print"><Journal><ISSN IssnType="Electronic">1234-5678</ISSN><Title>Journal of Tests'
           '</Title></Journal><ArticleTitle>{title}</ArticleTitle>{abstract}<AuthorList CompleteYN="Y"><Author '
           'ValidYN="Y"><LastName>Doe</LastName><ForeName>Jane</ForeName><Initials>J</Initials></Author></AuthorList>'
           '</Article><MeshHeadingList><MeshHeading><DescriptorName UI="D006801" MajorTopicYN="N">Humans'
           '</DescriptorName></MeshHeading></MeshHeadingList></MedlineCitation><PubmedData><ArticleIdList><ArticleId '
           'IdType="pubmed">{pmid}</ArticleId></ArticleIdList></PubmedData></PubmedArticle>\n')


def measured(cmd, **kw):
    """(wall seconds, peak RSS in MB, stdout) of one child process, reaped here with wait4 for its
    own rusage; a failure stops the benchmark."""
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **kw)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        sys.exit(f"benchmark_prepare: {' '.join(cmd)} exited {p.returncode}:\n{out[-2000:]}")
    return time.time() - t0, usage.ru_maxrss / 1024, out


def base_documents(sources):
    if sources:
        return list(prepare.Corpus(sources))
    return [d for d in map(prepare.clean, world.corpus(20000, seed=99)) if d]


def jsonl_record(doc, n):
    """(a document's line in a JSONL shard, the document prepare reads from it)."""
    return json.dumps({"text": doc}, ensure_ascii=False) + "\n", doc


def pubmed_article(doc, n):
    """(the n-th document as a <PubmedArticle>, the document prepare makes of it: "" for none). Its first sentence is
    the ArticleTitle, the rest the AbstractText: in every 4th article two sections with a Label, in every 3rd the first
    word of each in <i>; every 50th article has no abstract (prepare skips it)."""
    cut = doc.find(" . ") + 1 or len(doc)
    title, abstract = doc[:cut + 1], doc[cut + 2:] if n % 50 else ""
    mid = abstract.find(" . ", len(abstract) // 2) + 1 if n % 4 == 1 else 0
    sections = [("BACKGROUND", abstract[:mid + 1]), ("METHODS", abstract[mid + 2:])] if mid else [(None, abstract)]
    sections = [(label, body) for label, body in sections if body]
    markup = lambda body: "<i>{}</i>{}{}".format(*map(escape, body.partition(" "))) if n % 3 == 0 else escape(body)
    xml = "".join("<AbstractText{}>{}</AbstractText>".format(f' Label="{label}"' if label else "", markup(body))
                  for label, body in sections)
    text = " ".join([title] + [f"{label}: {body}" if label else body for label, body in sections])
    return (ARTICLE.format(pmid=n + 1, title=escape(title), abstract=xml and f"<Abstract>{xml}</Abstract>"),
            text if sections else "")


# --format: a shard's file name, its first and last lines, a document's record in it.
FORMATS = {
    "jsonl": ("shard_{:05d}.jsonl.gz", "", "", jsonl_record),
    "xml": ("pubmed25n{:04d}.xml.gz", '<?xml version="1.0" encoding="utf-8"?>\n<PubmedArticleSet>\n<DeleteCitation>'
            '<PMID Version="1">1</PMID></DeleteCitation>\n', "</PubmedArticleSet>\n", pubmed_article),
}


def build_corpus(directory, docs, mb, plain=None, fmt="jsonl", shard_mb=SHARD_MB):
    """Shards of about `shard_mb` MB of text in `fmt` (FORMATS; gzip level 1) until `mb` MB of the text prepare
    reads; also one plain .jsonl of that text at `plain` (for the code before streaming, which reads no .gz, no
    XML and no directory)."""
    os.makedirs(directory, exist_ok=True)
    name, head, tail, record = FORMATS[fmt]
    target, chars, shard, rep, n = mb * 10 ** 6, 0, None, 0, 0
    whole = open(plain, "w", encoding="utf-8") if plain else None
    while chars < target:
        order = list(range(len(docs)))
        random.Random(rep).shuffle(order)
        rep += 1
        for i in order:
            if shard is None or shard_chars >= shard_mb * 10 ** 6:
                if shard:
                    shard.write(tail)
                    shard.close()
                shard = gzip.open(os.path.join(directory, name.format(len(os.listdir(directory)))),
                                  "wt", encoding="utf-8", compresslevel=1)
                shard.write(head)
                shard_chars = 0
            line, doc = record(docs[i], n)
            n += 1
            shard.write(line)
            if whole and doc:
                whole.write(jsonl_record(doc, n)[0])
            shard_chars += len(doc)
            chars += len(doc)
            if chars >= target:
                break
    shard.write(tail)
    shard.close()
    if whole:
        whole.close()


def bare(corpus_dir, tokenizer_path):
    """Child mode: the documents in memory first, then only the tokenizer, timed: encode_batch (the
    issue's reference) and encode_batch_fast (what prepare calls: no character offsets); prints JSON."""
    tok = prepare.load_tokenizer(tokenizer_path)
    t0 = time.time()
    docs = list(prepare.Corpus([corpus_dir]))  # read, gunzip, parse, clean: one core
    seconds = {"parse": time.time() - t0}
    for name in ("encode_batch", "encode_batch_fast"):
        encode, t0 = getattr(tok, name), time.time()
        for i in range(0, len(docs), prepare.BATCH_DOCS):
            encode(docs[i:i + prepare.BATCH_DOCS], add_special_tokens=False)
        seconds[name] = time.time() - t0
    print(json.dumps(dict(seconds=seconds, chars=sum(map(len, docs)))))


def baseline_code(rev, directory):
    """data/prepare.py and what it imports, as of git revision `rev`, in `directory`."""
    for path in ("detour.py", "data/prepare.py", "data/world.py", "data/tasks.py"):
        os.makedirs(os.path.join(directory, os.path.dirname(path)), exist_ok=True)
        body = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], capture_output=True, check=True).stdout
        open(os.path.join(directory, path), "wb").write(body)
    return os.path.join(directory, "data", "prepare.py")


def startup(data_dir, out_dir):
    """Wall time of a one-step detour.py run (imports, model, data, one step, checkpoint)."""
    cmd = [sys.executable, os.path.join(ROOT, "detour.py"), "--data_dir", data_dir, "--out_dir", out_dir,
           "--overwrite", "true", "--init_from", "scratch", "--preset", "tiny", "--seq_len", "128", "--batch_size", "2",
           "--global_batch_size", "2", "--max_tokens", "256", "--progress", "false", "--eval_interval", "1000000",
           "--warmup_tokens", "0"]
    t0 = time.time()
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.time() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="250,1000", help="corpus sizes in MB of text")
    p.add_argument("--bare_sizes", default="250", help="sizes at which bare encode_batch is timed too")
    p.add_argument("--format", choices=FORMATS, default="jsonl", help="the shards: gzipped JSONL or PubMed XML")
    p.add_argument("--shard_mb", type=int, default=SHARD_MB, help="MB of text a shard (>= --sizes: one file)")
    p.add_argument("--source", nargs="*", default=[], help="base text files (default: world.corpus documents)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: trained here on the base text)")
    p.add_argument("--baseline", default="4fd3d0f", help="git revision of the code before streaming; '' skips it")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "benchmark_prepare"))
    p.add_argument("--keep", action="store_true", help="keep the corpora and outputs under --dir")
    args = p.parse_args()
    sizes, bare_sizes = [int(s) for s in args.sizes.split(",")], {int(s) for s in args.bare_sizes.split(",") if s}
    os.makedirs(args.dir, exist_ok=True)
    docs = base_documents(args.source)
    tag = "" if (args.format, args.shard_mb) == ("jsonl", SHARD_MB) else f"_{args.format}_{args.shard_mb}"
    tok = args.tokenizer or os.path.join(args.dir, "tokenizer.json")
    if not args.tokenizer:
        prepare.train_tokenizer(docs[:20000], 8192).save(tok)
    print(f"benchmark_prepare: {os.cpu_count()} CPUs, base {len(docs):,} documents "
          f"({sum(map(len, docs)) / 1e6:.1f} MB, {'given' if args.source else 'world.corpus'}), tokenizer {tok}"
          + ("" if not tag else f"; {args.format} shards of {args.shard_mb} MB of text"))
    rows, rss = [], {}
    for mb in sizes:
        corpus = os.path.join(args.dir, f"corpus_{mb}{tag}")
        plain = corpus + ".jsonl"
        want_plain = args.baseline and mb == min(sizes)
        if not os.path.isdir(corpus):
            build_corpus(corpus, docs, mb, plain if want_plain else None, args.format, args.shard_mb)
        out = os.path.join(args.dir, f"out_{mb}")
        wall, rss[mb], text = measured([sys.executable, os.path.join(ROOT, "data", "prepare.py"), "--input", corpus,
                                        "--out_dir", out, "--tokenizer", tok])
        meta = json.load(open(os.path.join(out, "meta.json")))
        rate = meta["n_chars"] / 1e6 / wall
        row = dict(mb=mb, chars=meta["n_chars"], docs=meta["n_train_docs"] + meta["n_val_docs"], tokens=meta["n_train_tokens"] +
                   meta["n_val_tokens"], wall=wall, rate=rate, rss=rss[mb])
        if mb in bare_sizes:
            _, _, out_bare = measured([sys.executable, __file__, "--bare_child", corpus, tok])
            b = json.loads(out_bare)
            assert b["chars"] == meta["n_chars"], (b, meta["n_chars"])
            row["bare"], row["fast"], row["parse"] = (b["chars"] / 1e6 / b["seconds"][k]
                                                      for k in ("encode_batch", "encode_batch_fast", "parse"))
        row["startup"] = startup(out, os.path.join(args.dir, "run"))
        rows.append(row)
        print(f"  {mb:>5} MB: {row['docs']:,} docs, {row['tokens']:,} tokens, prepare {wall:.0f} s = "
              f"{rate:.2f} MB/s, peak RSS {rss[mb]:,.0f} MB" + (f", bare encode_batch {row['bare']:.2f} MB/s, "
                                                                 f"encode_batch_fast {row['fast']:.2f} MB/s"
                                                                 if "bare" in row else ""), flush=True)
        if mb != max(sizes) and not args.keep:  # disk: one prepared corpus at a time
            shutil.rmtree(out)
    old = None
    if args.baseline:
        code = baseline_code(args.baseline, os.path.join(args.dir, "baseline"))
        mb = min(sizes)
        wall, old, _ = measured([sys.executable, code, "--input", os.path.join(args.dir, f"corpus_{mb}{tag}.jsonl"),
                                 "--out_dir", os.path.join(args.dir, "out_baseline"), "--tokenizer", tok])
        print(f"  code before streaming ({args.baseline}) at {mb} MB: {wall:.0f} s, peak RSS {old:,.0f} MB")
    default_start = startup(os.path.join(ROOT, "data", "default"), os.path.join(args.dir, "run")) \
        if os.path.exists(os.path.join(ROOT, "data", "default", "meta.json")) else None
    report(rows, rss, old, default_start, args.baseline)
    if not args.keep:
        shutil.rmtree(args.dir)


def report(rows, rss, old, default_start, baseline):
    print()
    print("| corpus | documents | tokens | prepare wall | prepare MB/s | bare encode_batch MB/s | prepare / bare "
          "| bare encode_batch_fast MB/s | prepare / fast | peak RSS | detour start-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bare = [f"{r[k]:.2f} | {r['rate'] / r[k]:.2f}x" if k in r else "- | -" for k in ("bare", "fast")]
        print(f"| {r['mb']:,} MB | {r['docs']:,} | {r['tokens']:,} | {r['wall']:.0f} s | {r['rate']:.2f} | {bare[0]} "
              f"| {bare[1]} | {r['rss']:,.0f} MB | {r['startup']:.1f} s |")
    lo, hi = min(rss), max(rss)
    if hi != lo:
        print(f"RSS at {hi:,} MB / RSS at {lo:,} MB: {rss[hi] / rss[lo]:.2f}x (target <= 1.25x)")
    if old:
        print(f"code before streaming ({baseline}) at {lo:,} MB: peak RSS {old:,.0f} MB ({old / rss[lo]:.1f}x this code's)")
    if default_start:
        print(f"detour start-up on data/default/ (2.6M tokens), the same one-step run: {default_start:.1f} s")
    projection(rows)


def projection(rows, tokens=10e9):
    """Wall time for `tokens` at the measured rates: on this machine's cores as measured, and on 32
    cores if the tokenizer scales with cores and so does pass 1 (one worker process per shard, given
    at least as many shards as cores), while pass 2's parsing stays on one core (pass 2 runs at the
    slower of the tokenizer and the parsing that feeds it)."""
    r = next((r for r in rows if "bare" in r), None)
    if r is None:
        return
    mb = tokens * r["chars"] / r["tokens"] / 1e6
    cores = os.cpu_count()
    print(f"{tokens / 1e9:.0f}B tokens = {mb / 1e3:,.0f} GB of this text ({r['chars'] / r['tokens']:.2f} characters "
          f"a token); parsing on one core {r['parse']:.1f} MB/s")
    print(f"  {cores} cores (measured): {mb / r['rate'] / 3600:.1f} h")
    for n in (32,):
        pass2 = mb / min(r["fast"] * n / cores, r["parse"])
        print(f"  {n} cores (encode_batch_fast x {n / cores:.0f}, pass 1 on {n} cores, pass 2 parsing on one): "
              f"{(mb / (r['parse'] * n) + pass2) / 3600:.1f} h")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--bare_child":
        bare(sys.argv[2], sys.argv[3])
    else:
        main()
