"""One command judges an ablation of detour.py (issue 51): the detour twin (CLM, then its decay)
against the MLM twin (MLM, then its decay), both continued from θ0, a small general-English
encoder standing in for ModernBERT-base, on biomedical text; R pretraining replicates per twin,
fine-tuned on the default tasks. The report gives D (the detour twin minus the MLM twin in average
test score), its 95% interval, the sign-flip p, the detectable difference and the verdict by the
project's rule: a gain if the interval lies above 0, a deficit if below, else cannot tell.

    python studies/ablation.py                  # R = 5 at the default sizes (about 30 minutes)
    python studies/ablation.py --replicates 2   # rougher and faster

Every twin runs the working tree's detour.py, so an edit of it is what the command tests. Resumable
as every study: the two corpora and θ0 are built once; a finished run is skipped while the detour.py
it ran (its out_dir/detour.py) and its configuration (its out_dir/run.json) are what this command
runs now and what it started from is older than it; otherwise it runs again (--overwrite true). A
fine-tuning cell that is done is not run again (finetune.py's rule). Everything goes under
--out_dir (default out/ablation): the corpora in data/, the runs, the grid in ft/, each run's
output in logs/, wall times in times.txt, the report in ablation.md and ablation.json.
"""

import argparse
import concurrent.futures
import hashlib
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a file (python studies/x.py): the repository root, for its modules
    sys.path.insert(0, ROOT)
from data import tasks  # noqa: E402  (what a --tasks spec is: its kinds, the epochs each trains)
from detour import atomic_write, fail, make_dirs  # noqa: E402  (one-line errors, atomic writes)
from studies import gather  # noqa: E402  (the last validation record of each run: the loss table)

DETOUR = "detour.py"  # the working tree's: every command runs from the repository root
# θ0 as the studies on real text make it (studies/common.sh T0): MLM at batch 32 x 128, peak lr
# 1e-3, then its decay; two threads, as it runs alone.
THETA0 = dict(seq_len=128, batch_size=32, global_batch_size=32, learning_rate=1e-3,
              warmup_tokens=100_000, eval_interval=200, eval_tokens=65_536, ckpt_interval=500,
              progress=False)
THETA0_THREADS = 2
# The twins from θ0 (studies/common.sh TW): fresh AdamW, 8 x 128 tokens a step, peak lr 5e-4 after
# a 20-step warmup; their decay is detour.py's. One thread each, two side by side.
TWIN = dict(seq_len=128, batch_size=8, global_batch_size=8, learning_rate=5e-4,
            warmup_tokens=20_480, eval_interval=250, eval_tokens=65_536, progress=False)
SIDE_BY_SIDE = 2
N_DOCS = 20_000  # documents of each generated corpus
REAL_TEXT = dict(group_tokens=200, val_fraction=0.02)  # real text, cut as studies/common.sh does
FINETUNE_LR = 5e-4  # the studies' (finetune.py's CPU default): small encoders barely move at 5e-5
ARMS = ("clm", "mlm")  # the detour twin first: D = first arm - second arm
REPLACES = ("overwrite",)  # given only to replace an earlier run: not a part of what ran
FIRST_SEED = 16  # replicate k: --seed 16 + k, --data_seed 41 + k (studies/common.sh R1..R5)
FIRST_DATA_SEED = 41
SAY = threading.Lock()  # two runs side by side print whole lines


@dataclass(frozen=True)
class Run:
    """One detour.py run of the study: its name (its out_dir's), its options, its threads."""
    name: str
    args: dict    # --key value; out_dir among them
    threads: int
    after: tuple  # the files it starts from: it is stale when one is newer than its run.json
    code: bool    # its saved detour.py must be the working tree's (θ0, built once: not)


def say(line):
    with SAY:
        print(line, flush=True)


def text_of(value):
    """A value as detour.py's command line reads it back (run.json holds the typed value)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def options(args):
    return [word for key, value in args.items() for word in (f"--{key}", text_of(value))]


def replicate_seeds(k):
    return dict(seed=FIRST_SEED + k, data_seed=FIRST_DATA_SEED + k)


# ---- Whether a run is done: finished, with the code and configuration this command runs. ----
def same_bytes(a, b):
    with open(a, "rb") as f:
        first = f.read()
    with open(b, "rb") as f:
        return first == f.read()


def why_stale(run):
    """Why `run` must run (again), or None when its finished run stands."""
    out = run.args["out_dir"]
    record = os.path.join(out, "run.json")
    if not os.path.isfile(os.path.join(out, "hf", "config.json")):  # the last thing a run writes
        return "not finished" if os.path.exists(record) else "not run yet"
    try:
        with open(record, "rb") as f:
            ran = json.loads(f.read())
    except (OSError, ValueError):
        return f"{record} is unreadable"
    changed = [f"{key} {ran.get(key)!r} -> {value!r}" for key, value in run.args.items()
               if key not in REPLACES and ran.get(key) != value]
    if changed:
        return "its configuration changed: " + ", ".join(changed)
    saved = os.path.join(out, "detour.py")
    if run.code and not (os.path.isfile(saved) and same_bytes(saved, DETOUR)):
        return "detour.py changed"
    started = os.stat(record).st_mtime_ns
    newer = [p for p in run.after if not os.path.exists(p) or os.stat(p).st_mtime_ns > started]
    if newer:
        return f"{newer[0]} is newer than it"
    return None


# ---- Running: each command's output in logs/<name>.log, its wall time in times.txt. ----
def last_line(path):
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else "no output"


def execute(out, name, command, threads):
    """Run `command` from the repository root -> None, or what failed in one line."""
    log = os.path.join(out, "logs", f"{name}.log")
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.time()
    with open(log, "w") as f:
        code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if code:
        return f"{name} failed (exit {code}): {last_line(log)}; its output: {log}"
    seconds = round(time.time() - start)
    with open(os.path.join(out, "times.txt"), "a") as f:
        f.write(f"{seconds} s  {name}: {shlex.join(command)}\n")
    say(f"{name}: done in {seconds} s")
    return None


def run_chain(out, chain, stop):
    """Each run of `chain` in turn (a Phase 1, then its decay), those that stand skipped -> None,
    or what failed; nothing starts once `stop` is set (a run beside it failed)."""
    for run in chain:
        why = why_stale(run)
        if why is None:
            say(f"{run.name}: done, skipped")
            continue
        if stop.is_set():
            return None
        say(f"{run.name}: runs ({why})")
        command = [sys.executable, DETOUR, *options(run.args)]
        if os.path.exists(os.path.join(run.args["out_dir"], "ckpt.pt")):  # an earlier run's
            command += ["--overwrite", "true"]
        if failed := execute(out, run.name, command, run.threads):
            stop.set()
            return failed
    return None


def side_by_side(jobs):
    """jobs(stop) -> None or an error, SIDE_BY_SIDE at a time; once one fails no other starts,
    those running finish, and the first failure is the study's one line."""
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(SIDE_BY_SIDE) as pool:
        errors = list(pool.map(lambda job: job(stop), jobs))
    if failed := [e for e in errors if e]:
        fail(failed[0])


# ---- The data: a general corpus and its tokenizer; the biomedical corpus cut with it. ----
def corpus_of(out, register):
    return os.path.join(out, "data", register)


def prepare(out, register, args, after):
    """data/prepare.py into <out>/data/<register>, unless its meta.json is there from the same
    command (<register>.json beside it) and newer than what it starts from (`after`)."""
    done = os.path.join(out, "data", f"{register}.json")  # written once the corpus is whole
    command = [sys.executable, "data/prepare.py", *options(args)]
    made = None
    if os.path.isfile(done) and os.path.isfile(os.path.join(args["out_dir"], "meta.json")):
        with open(done, "rb") as f:
            made = json.loads(f.read()).get("command")
    started = os.stat(done).st_mtime_ns if made else 0
    if made == command[1:] and all(os.stat(p).st_mtime_ns < started for p in after):
        return say(f"data/{register}: done, skipped")
    say(f"data/{register}: runs")
    if failed := execute(out, f"prepare-{register}", command, None):
        fail(failed)
    record = json.dumps(dict(command=command[1:]), indent=1) + "\n"
    atomic_write(done, lambda f: f.write(record.encode()))


def source(a, register):
    """data/prepare.py's options for one corpus: generated (data/world.py, a.n_docs documents),
    or real text (--general, --bio) cut as the studies on real text cut it (studies/common.sh
    prepare_data: documents of about 200 words, 2% held out)."""
    if not a.general:
        return dict(register=register, n_docs=a.n_docs or N_DOCS)
    return dict(input=getattr(a, register), **REAL_TEXT)


def build_data(a, out):
    """The general corpus (its tokenizer trained on it: ModernBERT's is general), then the
    biomedical one tokenized with it."""
    general = corpus_of(out, "general")
    prepare(out, "general", dict(**source(a, "general"), out_dir=general), ())
    tokenizer = os.path.join(general, "tokenizer.json")
    bio = dict(**source(a, "bio"), tokenizer=tokenizer, out_dir=corpus_of(out, "bio"))
    prepare(out, "bio", bio, (os.path.join(out, "data", "general.json"),))


# ---- The runs: θ0 once, then R replicates of both twins from it. ----
def finished(out, name):
    return os.path.join(out, name, "hf", "config.json")


def theta0_chain(a, out):
    """θ0: MLM on the general corpus from scratch, then its decay; built once (not rerun for an
    edit of detour.py: it is the fixed encoder the ablation continues, as ModernBERT-base is)."""
    mlm = os.path.join(out, "theta0-mlm")
    args = dict(phase="mlm", init_from="scratch", preset=a.preset,
                data_dir=corpus_of(out, "general"), max_tokens=a.theta0_tokens, **THETA0,
                out_dir=mlm)
    decay = dict(phase="decay", init_from=mlm, progress=False, out_dir=mlm + "-decay")
    general = os.path.join(out, "data", "general.json")
    return [Run("theta0-mlm", args, THETA0_THREADS, (general,), code=False),
            Run("theta0-mlm-decay", decay, THETA0_THREADS, (finished(out, "theta0-mlm"),),
                code=False)]


def twin_chain(a, out, arm, k):
    """Replicate k of one twin: Phase 1 `arm` from θ0's export on the biomedical corpus, then its
    decay, each by the working tree's detour.py."""
    name = f"{arm}-r{k}"
    theta0 = os.path.join(out, "theta0-mlm-decay", "hf")
    args = dict(phase=arm, data_dir=corpus_of(out, "bio"), init_from=theta0, **TWIN,
                max_tokens=a.tokens, **replicate_seeds(k), out_dir=os.path.join(out, name))
    decay = dict(phase="decay", init_from=args["out_dir"], progress=False,
                 out_dir=args["out_dir"] + "-decay")
    starts = (finished(out, "theta0-mlm-decay"), os.path.join(out, "data", "bio.json"))
    return [Run(name, args, 1, starts, code=True),
            Run(name + "-decay", decay, 1, (finished(out, name),), code=True)]


def chain_job(out, chain):
    return lambda stop: run_chain(out, chain, stop)


def twin_chains(a, out):
    return [twin_chain(a, out, arm, k) for k in range(1, a.replicates + 1) for arm in ARMS]


def pretrain(a, out):
    """θ0 alone, then the 2R twin chains two at a time (replicate k's twins side by side)."""
    if failed := run_chain(out, theta0_chain(a, out), threading.Event()):
        fail(failed)
    side_by_side([chain_job(out, chain) for chain in twin_chains(a, out)])


# ---- Fine-tuning: the CLM replicates as one arm, the MLM replicates as the other. ----
def epochs_options(a, spec, tasks_dir):
    """--epochs and --ner_epochs for finetune.py where a task trains for them (a probe trains for
    probe_epochs); either given to this command where no task does is refused."""
    acting = {tasks.KINDS[task[1]].epochs for task in tasks.parse_tasks(spec, tasks_dir)
              if not task[3]}  # (name, kind, path, probe, max_len)
    words = []
    for key in ("epochs", "ner_epochs"):
        if key in acting:
            words += [f"--{key}", str(getattr(a, key) or FINETUNE_EPOCHS[key])]
        elif getattr(a, key) is not None:
            fail(f"--{key} does not act: no task of --tasks {spec} trains for {key} (a probe "
                 "trains for finetune.py's probe_epochs); drop it")
    return words


def finetune_command(a, out):
    """finetune.py's command for the grid in <out>/ft, checked before anything runs."""
    arms = ",".join("+".join(os.path.join(out, f"{arm}-r{k}-decay")
                             for k in range(1, a.replicates + 1)) for arm in ARMS)
    command = [sys.executable, "finetune.py", "--ckpts", arms, "--tasks", a.tasks,
               "--out_dir", os.path.join(out, "ft"), "--seeds", str(a.seeds),
               "--learning_rate", str(FINETUNE_LR), "--max_train", str(a.max_train),
               "--max_eval", str(a.max_eval), "--progress", "false"]
    tasks_dir = os.path.join(out, "tasks")
    if "default" in [s.strip() for s in a.tasks.split(",")]:  # the options of the default tasks
        command += ["--tasks_dir", tasks_dir, "--pretrain_dir", corpus_of(out, "bio")]
    return command + epochs_options(a, a.tasks, tasks_dir)


def finetune(out, command):
    """The grid, unless every cell is done (finetune.py --merge true then writes the report):
    two processes on the same cells, side by side, each ending with the report."""
    merged = subprocess.run(command + ["--merge", "true"], capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    if merged.returncode == 0:
        return say("ft: every cell done, skipped (its report written again)")
    say("ft: runs")

    def process(i):
        return lambda stop: None if stop.is_set() else execute(out, f"ft-{i}", command, 1)
    side_by_side([process(i) for i in range(SIDE_BY_SIDE)])


# ---- The report: the verdict, every run's last validation record, finetune.py's table. ----
def verdict(lo, hi):
    """The project's rule, fixed before any score: the side of 0 the whole interval lies on."""
    if lo > 0:
        return "gain"
    if hi < 0:
        return "deficit"
    return "cannot tell"


def p_text(p, units):
    """A one-sided p as text, never 0: at least the test's floor (1/2^n, or its Monte Carlo's)."""
    floor = 0.5 ** units if units <= 20 else 1 / (1 + 2 ** 20)
    p = max(p, floor)
    return f"{p:.2g}" if p < 0.01 else f"{p:.3f}"


def comparison(results_path):
    """D and its statistics, in points, from the results.json finetune.py wrote."""
    with open(results_path, "rb") as f:
        res = json.loads(f.read())
    try:
        units = len(res["units"])
        ci = [100 * x for x in res["ci95"]["average"]]
        return dict(d=100 * res["difference"]["average"], ci95=ci, verdict=verdict(*ci),
                    p_sign_flip=res["p_sign_flip"], p_text=p_text(res["p_sign_flip"], units),
                    floor=p_text(0.0, units), units=units, tasks=[t["name"] for t in res["tasks"]],
                    detectable=100 * res["detectable_difference"])
    except (KeyError, TypeError, IndexError) as e:
        fail(f"{results_path} lacks {e} (finetune.py's report changed?); update "
             "studies/ablation.py's comparison() to read it")


READING = {
    "gain": "The detour twin is ahead: the whole interval lies above 0.",
    "deficit": "The detour twin is behind: the whole interval lies below 0.",
    "cannot tell": "This run cannot tell whether the detour twin is better or worse: the "
                   "interval holds 0. A true difference below the detectable one would often go "
                   "unseen; more replicates (--replicates) or tasks narrow the interval.",
}


def verdict_lines(c, replicates):
    return ["## Verdict", "",
            f"**{c['verdict']}**: D = {c['d']:+.1f} [{c['ci95'][0]:+.1f}, {c['ci95'][1]:+.1f}] "
            f"points, the detour twin minus the MLM twin in average test score over "
            f"{len(c['tasks'])} tasks ({', '.join(c['tasks'])}), with its 95% t interval over the "
            f"{c['units']} (task × replicate) units ({replicates} replicates per twin); "
            f"sign-flip p = {c['p_text']} (one-sided, the detour twin better; its floor "
            f"{c['floor']}); detectable difference {c['detectable']:.1f} points (80% power, "
            "one-sided 5%).", "", READING[c["verdict"]], ""]


def setting_lines(a, out, digest):
    general = f"the generated general corpus ({a.n_docs or N_DOCS:,} documents)"
    bio = "the generated biomedical corpus"
    if a.general:
        general = f"the general text {a.general}"
        bio = f"the biomedical text {a.bio}"
    return [f"detour.py: the working tree's, sha256 {digest} (every twin ran it). θ0: the "
            f"`{a.preset}` preset, MLM on {a.theta0_tokens:,} tokens of {general}, then its "
            f"decay ({out}/theta0-mlm-decay, built once). Twins: {a.tokens:,} Phase-1 tokens "
            f"from θ0's export on {bio}, cut with the general tokenizer, then the decay; "
            f"replicate k: --seed {FIRST_SEED}+k --data_seed {FIRST_DATA_SEED}+k. Fine-tuning: "
            f"--tasks {a.tasks}, {a.seeds} fine-tuning seed(s), lr {FINETUNE_LR:g} ({out}/ft).", ""]


def write_report(a, out):
    """<out>/ablation.md (also printed) and ablation.json, once every twin still stands: the
    report names the detour.py they all ran."""
    moved = [run.name for chain in twin_chains(a, out) for run in chain if why_stale(run)]
    if moved:
        fail(f"{', '.join(moved)} no longer stand (detour.py changed while the study ran?); run "
             "the same command again")
    with open(DETOUR, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    c = comparison(os.path.join(out, "ft", "results.json"))
    runs = [os.path.join(out, "theta0-mlm-decay")]
    runs += [os.path.join(out, f"{arm}-r{k}{suffix}") for arm in ARMS
             for k in range(1, a.replicates + 1) for suffix in ("", "-decay")]
    body = gather.report(TITLE, runs, [os.path.join(out, "ft", "results.md")])
    title, rest = body.split("\n", 1)
    text = "\n".join([title, ""] + setting_lines(a, out, digest) + verdict_lines(c, a.replicates))
    text += rest
    record = dict(c, detour_sha256=digest, replicates=a.replicates, settings=vars(a))
    atomic_write(os.path.join(out, "ablation.md"), lambda f: f.write(text.encode("utf-8")))
    atomic_write(os.path.join(out, "ablation.json"),
                 lambda f: f.write((json.dumps(record, indent=1) + "\n").encode()))
    print("\n" + text + f"\nwritten to {out}/ablation.md and ablation.json")


TITLE = "Ablation: the detour twin against the MLM twin (studies/ablation.py)"


# ---- The command line. ----
FINETUNE_EPOCHS = dict(epochs=3, ner_epochs=3)  # finetune.py's CPU default; given where a task acts


def at_least(low):
    def number(text):
        value = int(text)
        if value < low:
            raise ValueError
        return value
    number.__name__ = f"integer >= {low}"  # argparse's message names the type
    return number


def arguments():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--out_dir", default="out/ablation",
                   help="everything the study writes; a relative path (here and in --tasks) is "
                        "from the repository root, where it runs (default: %(default)s)")
    p.add_argument("--replicates", type=at_least(2), default=5,
                   help="pretraining replicates per twin, R >= 2 (default: %(default)s)")
    p.add_argument("--tasks", default="default",
                   help="finetune.py's --tasks: name=kind:path,... or default (default: "
                        "%(default)s)")
    p.add_argument("--preset", default="tiny", choices=("tiny", "small", "medium"),
                   help="θ0's shape, and so the twins' (default: %(default)s)")
    p.add_argument("--n_docs", type=at_least(2), default=None,
                   help=f"documents of each generated corpus, without --general (default: "
                        f"{N_DOCS})")
    p.add_argument("--general", default="",
                   help="real general-English text in place of the generated corpus (a .txt, "
                        "one paragraph a line: docs/data.md's general_en_combined.txt), with "
                        "--bio (default: none)")
    p.add_argument("--bio", default="",
                   help="real biomedical text in place of the generated corpus (a .txt: "
                        "docs/data.md's corpus.txt), with --general (default: none)")
    p.add_argument("--theta0_tokens", type=at_least(1), default=4_096_000,
                   help="θ0's MLM tokens on the general corpus (default: %(default)s)")
    p.add_argument("--tokens", type=at_least(1), default=1_024_000,
                   help="each twin's Phase-1 tokens on the biomedical corpus (default: "
                        "%(default)s)")
    p.add_argument("--seeds", type=at_least(1), default=3,
                   help="fine-tuning seeds per checkpoint and task (default: %(default)s)")
    for key, kinds in (("epochs", "cls, multilabel, regression"), ("ner_epochs", "ner")):
        p.add_argument(f"--{key}", type=at_least(1), default=None,
                       help=f"fine-tuning epochs of the {kinds} tasks (default: "
                            f"{FINETUNE_EPOCHS[key]})")
    for key, what in (("max_train", "training"), ("max_eval", "dev and test")):
        p.add_argument(f"--{key}", type=at_least(0), default=0,
                       help=f"{what} examples per task, a fixed subset; 0 = all (default: 0)")
    p.error = usage_error
    return p


def usage_error(message):
    """argparse's error as the one line of every other (argparse's own: exit 2, two lines)."""
    fail(f"{message}; see python studies/ablation.py --help")


def main(argv=None):
    a = arguments().parse_args(argv)
    if bool(a.general) != bool(a.bio):
        fail("--general and --bio go together (the general corpus makes the tokenizer the "
             "biomedical one is cut with); give both, or neither for the generated corpora")
    if a.general and a.n_docs is not None:
        fail("--n_docs does not act with --general and --bio (real text); drop it")
    os.chdir(ROOT)  # every path as the other studies name it: from the repository root
    out = os.path.normpath(a.out_dir)
    command = finetune_command(a, out)  # its --tasks and epochs checked before anything runs
    make_dirs(os.path.join(out, "logs"))
    build_data(a, out)
    pretrain(a, out)
    finetune(out, command)
    write_report(a, out)


if __name__ == "__main__":
    main()
