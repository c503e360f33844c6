"""The README's quick start, run as written and timed, then its loss table made from the runs' logs
(not a test). Run it from a fresh clone on an idle machine; it runs the commands of the README's
"Quick start" section (its bash blocks, less the pip lines and the test command), each part of an
`a && b` line timed alone, then prints the wall times and the markdown table the README shows: θ0 on
the biomedical text before continued pretraining, each twin after Phase 1 and after its decay, each
loss next to the unigram cross-entropy of the same targets.

    git clone . /tmp/qs && cd /tmp/qs && python bench/quickstart.py      # about 10 minutes on 2 cores
    python bench/quickstart.py --table_only true                         # the table of the runs there
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: the repository root, for studies.gather
from studies import gather  # noqa: E402  (a run's last validation record, as the studies read it)

SECTION = "## Quick start"
# (row, Phase-1 run, its decay); the table's θ0 row is the CLM twin's step-0 record (score_start)
TWINS = [("CLM detour twin", "out/clm", "out/clm-decay"), ("MLM twin", "out/mlm", "out/mlm-decay")]


def commands(readme):
    """The quick start's commands: every line of the bash blocks of the README's Quick start
    section (up to its first ### heading), less the installs and the test command."""
    text = open(readme, encoding="utf-8").read()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    lines = [line.split("  #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)
             for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("pip ") and "pytest" not in line]


def run_timed(line, env):
    """Each part of an `a && b` line in order, in bash from the repository root -> [(part,
    seconds)]; `export K=V` sets K for the parts after it. A part that fails stops here."""
    times = []
    for part in [p.strip() for p in line.split("&&")]:
        if part.startswith("export "):
            key, _, value = part[len("export "):].partition("=")
            env[key] = value
            continue
        print(f"$ {part}", flush=True)
        start = time.time()
        if subprocess.run(["bash", "-c", part], cwd=ROOT, env=env).returncode:
            sys.exit(f"error: the quick start's `{part}` failed; see its output above")
        times.append((part, time.time() - start))
    return times


def records(run_dir):
    path = os.path.join(ROOT, run_dir, "log.jsonl")
    if not os.path.isfile(path):
        sys.exit(f"error: {path} not found; run the quick start first (python bench/quickstart.py)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def last_eval(run_dir):
    """The run's last validation record (studies/gather.py's), its absence one line."""
    record = gather.last_eval(os.path.join(ROOT, run_dir))
    if record is None:
        sys.exit(f"error: {run_dir} has no validation record; run the quick start first "
                 "(python bench/quickstart.py)")
    return record


def loss_table():
    """The README's table: θ0 on the domain (the CLM twin's step-0 record), then each twin."""
    start = records(TWINS[0][1])[0]
    if "start_val_loss" not in start:
        sys.exit(f"error: {TWINS[0][1]}/log.jsonl has no step-0 record of θ0; it did not start "
                 "from θ0 (--init_from)")
    rows = ["| model | Phase 1, its own objective (unigram) | MLM-15% loss on the biomedical "
            "validation text (unigram) | masked tokens predicted exactly |", "|---|---|---|---|",
            f"| θ0 before continued pretraining (`out/theta0`) | | {start['start_val_loss']:.2f} "
            f"({start['start_val_unigram']:.2f}) | {100 * start['start_val_acc']:.1f}% |"]
    for name, phase1, decay in TWINS:
        if not os.path.isfile(os.path.join(ROOT, phase1, "log.jsonl")):
            continue
        p, d = last_eval(phase1), last_eval(decay)
        objective = "next-token" if phase1.endswith("clm") else "MLM-30%"
        rows.append(f"| {name} (`{phase1}`, `{decay}`) | {p['val_loss']:.2f} {objective} "
                    f"({p['val_unigram']:.2f}) | {d['val_loss']:.2f} ({d['val_unigram']:.2f}) | "
                    f"{100 * d['val_acc']:.1f}% |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table_only", default="false", choices=("true", "false"),
                    help="print the table of the runs already there, run nothing (default: false)")
    args = ap.parse_args()
    if args.table_only == "false":
        env = dict(os.environ)
        times = [t for line in commands(os.path.join(ROOT, "README.md")) for t in run_timed(line, env)]
        print("\nwall times (s):")
        for part, seconds in times:
            print(f"{seconds:7.1f}  {part}")
        print(f"{sum(s for _, s in times):7.1f}  in all")
    print("\n" + loss_table())


if __name__ == "__main__":
    main()
