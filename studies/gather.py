"""One study's report from the files its runs wrote (not a test): the last validation record of each
pretraining run (its loss, the unigram cross-entropy of the same targets, accuracy), then each report
(results.md, cka.md, drift.md, ...) as it stands. For the studies without a report script of their own
(studies/from_scratch.sh, studies/bio_cpu.sh); a file not there yet is listed as missing, not guessed.

    python studies/gather.py OUT.md "Title" --runs out/clm out/clm-decay --reports out/finetune/results.md
"""

import argparse
import json
import os


def last_eval(run_dir):
    """The last log.jsonl record with a validation loss, or None (no run, or no evaluation yet)."""
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.isfile(path):
        return None
    evals = [r for r in map(json.loads, filter(str.strip, open(path))) if "val_loss" in r]
    return evals[-1] if evals else None


def report(title, runs, reports):
    lines, missing = [f"# {title}", ""], []
    if runs:
        lines += ["## Pretraining: the last validation record of each run (log.jsonl)", "",
                  "| run | step | loss (its phase's objective) | unigram | below unigram | accuracy |",
                  "|---|---|---|---|---|---|"]
        for run in runs:
            r = last_eval(run)
            if r is None:
                missing.append(os.path.join(run, "log.jsonl"))
                continue
            acc = f"{100 * r['val_acc']:.1f}%" if r.get("val_acc") is not None else ""
            lines.append(f"| {run} | {r['step']} | {r['val_loss']:.2f} | "
                         f"{r['val_unigram']:.2f} | {r['val_unigram'] - r['val_loss']:.2f} | {acc} |")
        lines.append("")
    for path in reports:
        if not os.path.isfile(path):
            missing.append(path)
            continue
        lines += [f"## {path}", "", open(path, encoding="utf-8").read().rstrip(), ""]
    if missing:
        lines += ["## Missing (not run yet, or stopped)", ""] + [f"- {m}" for m in missing] + [""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the report, a markdown file")
    ap.add_argument("title")
    ap.add_argument("--runs", nargs="*", default=[], help="pretraining run directories (each with log.jsonl)")
    ap.add_argument("--reports", nargs="*", default=[], help="markdown reports, in the order to show them")
    args = ap.parse_args()
    text = report(args.title, args.runs, args.reports)
    with open(args.out + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(args.out + ".tmp", args.out)
    print(text + f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
