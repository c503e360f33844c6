"""The study scripts (studies/*.sh) run end to end with a fake `python` and `torchrun` first on PATH: each call is
logged and writes the file the scripts' skip checks look for, so a script's whole command list is checked in a
second, without training anything. The expected commands are the old README's study blocks (git 531479d),
expanded: a study script must reproduce its runs' arguments exactly."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

STUDIES = ["from_scratch", "bio_cpu", "where_it_pays", "why_it_pays", "tiny_mechanism"]

# The stand-in for python and torchrun (a shell script: a study makes hundreds of calls): logs its command line
# (with OMP_NUM_THREADS, which the numbers depend on) and writes what the run would have written that the scripts
# check: <out_dir>/hf/config.json for detour.py,
# data/<name>/meta.json for prepare.py, <out_dir>/results.json and .md for finetune.py, <out_dir>/{cka,drift,
# transplant-*}.json and .md for studies/analysis.py.
# FAKE_FAIL: a run whose out_dir ends so fails (exit 1) without writing anything.
FAKE = r"""#!/bin/bash
prog=${0##*/}
echo "${OMP_NUM_THREADS:+OMP_NUM_THREADS=$OMP_NUM_THREADS }$prog $*" >> "$FAKE_LOG"
if [ "$prog" = torchrun ]; then shift 2; fi   # --standalone --nproc_per_node=1
script=${1:-}; shift || true
phase="" out="" init="" name=default analysis="" layers=""
while [ $# -gt 0 ]; do   # the last one wins, as in the real parsers
  case $1 in --phase) phase=$2;; --out_dir) out=$2;; --init_from) init=$2;; --name) name=$2;;
             --analysis) analysis=$2;; --layers) layers=$2;; esac; shift
done
w() { mkdir -p "$(dirname "$1")" && echo "# $2" > "$1"; }
case $script in
  detour.py)
    if [ -z "$out" ]; then if [ "$phase" = decay ]; then out=${init%/}-decay; else out=out/$phase; fi; fi
    if [ -n "${FAKE_FAIL:-}" ] && [[ $out == *"$FAKE_FAIL" ]]; then exit 1; fi
    w "$out/hf/config.json" ;;
  data/prepare.py) w "${out:-data/$name}/meta.json" ;;
  finetune.py|studies/analysis.py)
    case $analysis in cka|drift) n=$analysis;; transplant) n=transplant-${layers//,/_};; *) n=results;; esac
    w "${out:-out/finetune}/$n.json" "$n"; w "${out:-out/finetune}/$n.md" "$n" ;;
esac
"""


@pytest.fixture
def tree(tmp_path):
    """A stand-in repository (the study scripts only; they cd to its root), the fakes, dummy corpora."""
    repo, fakes = tmp_path / "repo", tmp_path / "bin"
    (repo / "studies").mkdir(parents=True)
    for name in os.listdir(os.path.join(ROOT, "studies")):
        if name.endswith(".sh"):
            shutil.copy(os.path.join(ROOT, "studies", name), repo / "studies" / name)
    fakes.mkdir()
    for prog in ("python", "torchrun"):
        (fakes / prog).write_text(FAKE)
        (fakes / prog).chmod(0o755)
    ncbi = tmp_path / "bio" / "ner" / "NCBI-disease-IOB"
    ncbi.mkdir(parents=True)
    (ncbi / "test.tsv").write_text("Aspirin\tO\nhelps\tO\n\nIt\tO\nworks\tO\n\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OUT", "FAKE_FAIL")}
    env.update(PATH=f"{fakes}{os.pathsep}{env['PATH']}", GENERAL=str(tmp_path / "general.txt"),
               BIO=str(tmp_path / "bio"), FAKE_LOG=str(tmp_path / "log.txt"))
    return repo, env, tmp_path / "log.txt"


def run(tree, study, **env):
    """Run studies/<study>.sh in the stand-in tree -> (the completed process, the command lines it logged)."""
    repo, base, log = tree
    if log.exists():
        log.unlink()
    p = subprocess.run(["bash", str(repo / "studies" / f"{study}.sh")], cwd=repo, env={**base, **env},
                       capture_output=True, text=True, timeout=60)
    lines = log.read_text().splitlines() if log.exists() else []
    return p, [" ".join(line.split()) for line in lines]  # sh -c splits words: compare them, not the spaces


def training(lines):
    return [c for c in lines if any(s in c for s in ("detour.py", "prepare.py", "finetune.py"))]


# ---- the old README's variables, copied from its blocks (GENERAL and BIO: the test's dummies) ----
def readme(tmp):
    g, b = str(tmp / "general.txt"), str(tmp / "bio")
    n = b + "/ner"
    v = dict(G=g, B=b, N=n)
    v["T0"] = ("--data_dir data/general --preset small --seq_len 128 --batch_size 32 --global_batch_size 32 "
               "--learning_rate 1e-3 --warmup_tokens 100000 --eval_interval 200 --eval_tokens 65536 "
               "--ckpt_interval 500 --progress false")
    v["TW"] = ("--data_dir data/bio --init_from out/bio/theta0-mlm-decay/hf --seq_len 128 --batch_size 8 "
               "--global_batch_size 8 --learning_rate 5e-4 --warmup_tokens 20480 --max_tokens 1024000 "
               "--eval_interval 250 --eval_tokens 65536 --progress false")
    v["TT"] = v["TW"].replace("theta0-mlm-decay", "tiny-theta0-mlm-decay")
    v["TMW"] = v["TW"].replace("theta0-mlm-decay", "medium-theta0-mlm-decay")
    v["R"] = {k: f"--seed {16 + k} --data_seed {41 + k}" for k in range(1, 6)}
    v["P"] = "OMP_NUM_THREADS=1 python detour.py"
    v["TASKS"] = (f"bc5cdr_chem=ner:{n}/BC5CDR-chem-IOB,bc5cdr_disease=ner:{n}/BC5CDR-disease-IOB,"
                  f"ncbi_disease=ner:{n}/NCBI-disease-IOB,bc2gm=ner:{n}/BC2GM-IOB")
    v["TASKS8"] = (v["TASKS"] + f",linnaeus=ner:{n}/linnaeus-IOB,bionlp13cg=ner:{n}/BioNLP13CG-IOB,"
                   f"gad=cls:{b}/cls/GAD,hoc=multilabel:{b}/cls/HoC")
    v["F"] = (f"OMP_NUM_THREADS=1 python finetune.py --tasks {v['TASKS']} --seeds 3 --ner_epochs 4 "
              "--learning_rate 5e-4 --max_train 1000 --max_eval 500 --progress false")
    v["F8"] = (f"OMP_NUM_THREADS=1 python finetune.py --tasks {v['TASKS8']} --seeds 3 --ner_epochs 4 --epochs 4 "
               "--learning_rate 5e-4 --max_train 1000 --max_eval 500 --progress false")
    return v


OW = " --overwrite true"  # the scripts add it so a stopped run restarts; detour.py leaves it out of the run's config


def arms(stem, reps, suffix="decay"):
    return (f"{'+'.join(f'out/bio/{stem}clm-r{k}-{suffix}' for k in reps)},"
            f"{'+'.join(f'out/bio/{stem}mlm-r{k}-{suffix}' for k in reps)}")


def chain(v, phase, flags, name, out="out/bio", p=None):
    p = p or v["P"]
    return [f"{p} --phase {phase} {flags} --out_dir {out}/{name}{OW}",
            f"{p} --phase decay --init_from {out}/{name}{OW}"]


def theta0(v, preset):
    prefix = "" if preset == "small" else preset + "-"
    t0 = v["T0"].replace("small", preset)
    return [f"OMP_NUM_THREADS=2 python detour.py --phase mlm {t0} --max_tokens 8000000 "
            f"--out_dir out/bio/{prefix}theta0-mlm{OW}",
            f"OMP_NUM_THREADS=2 python detour.py --phase decay --init_from out/bio/{prefix}theta0-mlm{OW}"]


def data_cmds(v):
    return [f"python data/prepare.py --input {v['G']} --name general --group_tokens 200 --val_fraction 0.02",
            f"python data/prepare.py --input {v['B']}/corpus.txt --name bio --group_tokens 200 --val_fraction 0.02 "
            "--tokenizer data/general/tokenizer.json"]


def cka(stem, name):
    return (f"python studies/analysis.py --analysis cka --ckpts out/bio/{stem}clm-r1-decay,out/bio/{stem}mlm-r1-decay,"
            f"out/bio/{stem}mlm-r2-decay --texts out/bio/ncbi_test.txt --out_dir out/bio/{name}")


def expected(study, v):
    """The key commands of each study, as its old README block ran them."""
    P, TW, TT, R, F8 = v["P"], v["TW"], v["TT"], v["R"], v["F8"]
    if study == "from_scratch":
        tr = "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=1 detour.py"
        ft = "OMP_NUM_THREADS=1 python finetune.py"
        an = "OMP_NUM_THREADS=1 python studies/analysis.py"
        o = "out/from-scratch"
        # detour.py's defaults when the study was made (the default is now θ0 continued): pinned
        start = "--data_dir data/default --batch_size 4 --global_batch_size 4 --learning_rate 2e-3 --max_tokens 1000000"
        old = f"--init_from scratch --preset small {start}"
        pd = " --pretrain_dir data/default"  # the default tasks drop data/default's text
        return (["python data/prepare.py --register bio"]
                + chain(v, "clm", old, "clm", o, tr) + chain(v, "mlm", old, "mlm", o, tr)
                + chain(v, "clm", f"{old} --seed 18 --data_seed 43", "clm-r2", o, tr)
                + chain(v, "mlm", f"{old} --seed 18 --data_seed 43", "mlm-r2", o, tr)
                + chain(v, "mlm", f"{start} --init_from {o}/mlm/init --seed 18", "mlm-s18", o, tr)
                + chain(v, "clm", f"{old} --freeze_layers 0-1", "clm-freeze-low", o, tr)
                + chain(v, "clm", f"{old} --freeze_layers 2-3", "clm-freeze-mid", o, tr)
                + [f"{tr} --phase decay --init_from {o}/clm --freeze_layers 0-1 --out_dir {o}/clm-decay-freeze-low{OW}"]
                + [f"{tr} --phase decay --init_from {o}/{a} --decay_ratio {r} --out_dir {o}/{a}-decay-{r}{OW}"
                   for r in ("0.025", "0.1", "0.2", "0.5") for a in ("clm", "mlm")]
                + [f"{ft} --ckpts {o}/clm-decay+{o}/clm-r2-decay,{o}/mlm-decay+{o}/mlm-r2-decay --out_dir {o}/finetune{pd}",
                   f"{an} --analysis cka --ckpts {o}/clm-decay,{o}/mlm-decay,{o}/mlm-s18-decay "
                   f"--out_dir {o}/analysis/cka-s18{pd}",
                   f"{an} --analysis drift --ckpts {o}/clm,{o}/mlm/init --out_dir {o}/analysis/drift-clm",
                   f"{an} --analysis drift --ckpts {o}/mlm,{o}/mlm/init --out_dir {o}/analysis/drift-mlm",
                   f"{ft} --ckpts {o}/clm-decay,{o}/clm-freeze-low-decay,{o}/clm-freeze-mid-decay,"
                   f"{o}/clm-decay-freeze-low,{o}/mlm-decay --out_dir {o}/finetune/freeze{pd}"]
                + [f"{an} --analysis transplant --ckpts {o}/clm-decay,{o}/mlm-decay --layers {g} "
                   f"--out_dir {o}/analysis/clm-into-mlm{pd}" for g in ("0-1", "2-3", "4-5", "attn", "mlp")]
                + [f"{ft} --ckpts {o}/clm-decay-{r},{o}/mlm-decay-{r} --out_dir {o}/finetune/decay-{r}{pd}"
                   for r in ("0.025", "0.1", "0.2", "0.5")])
    if study == "bio_cpu":
        F = v["F"]
        return (data_cmds(v) + theta0(v, "small")
                + [c for k in (1, 2, 3) for a in ("clm", "mlm") for c in chain(v, a, f"{TW} {R[k]}", f"{a}-r{k}")]
                + chain(v, "clm", f"{TW} {R[1]} --freeze_layers 0-1", "clm-freeze-low")
                + chain(v, "clm", f"{TW} {R[1]} --freeze_layers 2-3", "clm-freeze-mid")
                + [f"{P} --phase decay --init_from out/bio/{a}-r1 --decay_ratio 0.5 "
                   f"--out_dir out/bio/{a}-r1-decay50{OW}" for a in ("clm", "mlm")]
                + [f"{F} --ckpts {arms('', (1, 2, 3))} --out_dir out/bio/ft-twins",
                   f"{F} --ckpts out/bio/theta0-mlm-decay --out_dir out/bio/ft-theta0",
                   f"{F} --ckpts out/bio/clm-freeze-mid-decay,out/bio/clm-freeze-low-decay --out_dir out/bio/ft-freeze",
                   f"{F} --ckpts out/bio/clm-r1-decay50,out/bio/mlm-r1-decay50 --out_dir out/bio/ft-decay50",
                   cka("", "cka")]
                + [f"python studies/analysis.py --analysis drift --ckpts out/bio/{a}-r1-decay,out/bio/theta0-mlm-decay "
                   f"--out_dir out/bio/drift-{a}" for a in ("clm", "mlm")])
    if study == "where_it_pays":
        return (data_cmds(v) + theta0(v, "small") + theta0(v, "tiny")
                + [c for k in (1, 2, 3) for a in ("clm", "mlm") for c in
                   chain(v, a, f"{TW} {R[k]}", f"{a}-r{k}")
                   + chain(v, a, f"{TW} {R[k]} --max_tokens 256000", f"s250-{a}-r{k}")
                   + chain(v, a, f"{TW} {R[k]} --max_tokens 4096000 --eval_interval 1000", f"s4000-{a}-r{k}")
                   + chain(v, a, f"{TT} {R[k]}", f"t1000-{a}-r{k}")]
                + [f"{F8} --ckpts {arms(pt, (1, 2, 3))} --out_dir out/bio/ft8-{g}"
                   for pt, g in (("", "s1000"), ("s250-", "s250"), ("s4000-", "s4000"), ("t1000-", "t1000"))]
                + [f"{F8} --ckpts out/bio/theta0-mlm-decay,out/bio/tiny-theta0-mlm-decay --out_dir out/bio/ft8-theta0",
                   cka("", "cka"), cka("s250-", "cka-s250"), cka("s4000-", "cka-s4000"), cka("t1000-", "cka-t1000"),
                   "python studies/study_curve.py --out_dir out/bio",
                   f"{v['F8'].replace(v['TASKS8'], v['TASKS'])} --ckpts {arms('', (1, 2, 3))} "
                   "--out_dir out/bio/ft8-s1000-ner4 --merge true"])
    if study == "why_it_pays":
        probes = F8.replace("finetune.py", "studies/analysis.py").replace(" --ner_epochs 4 --epochs 4 --learning_rate 5e-4", "")
        TP = f"{probes} --analysis transplant --ckpts {arms('t1000-', (1, 2, 3))} --out_dir out/bio/tp-t1000"
        fz = lambda L: ("+".join(f"out/bio/t1000-clm-freeze{L}-r{k}-decay" for k in (1, 2, 3)) + ","
                        + arms("t1000-", (1, 2, 3)).split(",")[1])
        return (theta0(v, "tiny") + theta0(v, "small") + theta0(v, "medium")
                + [c for L in (0, 1, 2) for k in (1, 2, 3)
                   for c in chain(v, "clm", f"{TT} {R[k]} --freeze_layers {L}", f"t1000-clm-freeze{L}-r{k}")]
                + [c for k in (4, 5) for a in ("clm", "mlm")
                   for c in chain(v, a, f"{TT} {R[k]}", f"t1000-{a}-r{k}") + chain(v, a, f"{TW} {R[k]}", f"{a}-r{k}")]
                + [c for k in (1, 2, 3) for a in ("clm", "mlm")
                   for c in chain(v, a, f"{v['TMW']} {R[k]}", f"m1000-{a}-r{k}")]
                + [f"{F8} --ckpts {fz(L)} --out_dir out/bio/ft8-t1000-freeze{L}" for L in (0, 1, 2)]
                + [f"{TP} --layers 0", f"{TP} --layers embeddings,0",
                   f"{F8} --ckpts {arms('t1000-', range(1, 6))} --out_dir out/bio/ft8-t1000-r5",
                   f"{F8} --ckpts {arms('', range(1, 6))} --out_dir out/bio/ft8-s1000-r5",
                   f"{F8} --ckpts {arms('m1000-', (1, 2, 3))} --out_dir out/bio/ft8-m1000",
                   cka("m1000-", "cka-m1000"),
                   "python studies/study_curve.py --out_dir out/bio",
                   "python studies/study_figure.py --out_dir out/bio --png out/bio/study.png"])
    if study == "tiny_mechanism":
        return (theta0(v, "tiny")
                + [c for k in range(1, 6) for a in ("clm", "mlm")
                   for c in chain(v, a, f"{TT} {R[k]}", f"t1000-{a}-r{k}")]
                + [f"{P} --phase decay --init_from out/bio/t1000-{a}-r{k} --decay_ratio {r} "
                   f"--out_dir out/bio/t1000-{a}-r{k}-decay{L}{OW}"
                   for k in range(1, 6) for a in ("clm", "mlm") for L, r in (("2.5", "0.025"), ("100", "1.0"))]
                + [c for k in range(1, 6) for L in (0, 1, 2)
                   for c in chain(v, "clm", f"{TT} {R[k]} --freeze_layers {L}", f"t1000-clm-freeze{L}-r{k}")]
                + [f"{F8} --ckpts {arms('t1000-', range(1, 6), 'decay100')} --out_dir out/bio/ft8-t1000-decay100",
                   "python studies/tiny_mechanism.py --out_dir out/bio --png out/bio/tiny-mechanism.png"])


@pytest.mark.parametrize("study", STUDIES)
def test_study_script(tree, study):
    p, first = run(tree, study)
    assert p.returncode == 0, p.stderr[-3000:]
    missing = [c for c in (" ".join(e.split()) for e in expected(study, readme(tree[0].parent))) if c not in first]
    assert not missing, "\n".join(["not run as the README ran it:"] + missing[:5])
    # every run and analysis once, each grid by at most two processes
    assert all(first.count(c) <= 2 for c in first if "finetune.py" in c or "analysis.py" in c)
    assert all(first.count(c) == 1 for c in first if "detour.py" in c or "prepare.py" in c)
    # run again: everything is done, so nothing trains
    p, second = run(tree, study)
    assert p.returncode == 0, p.stderr[-3000:]
    assert training(second) == []
    times = (tree[0] / ("out/from-scratch" if study == "from_scratch" else "out/bio") / "times.txt").read_text()
    assert "detour.py" in times


def test_study_needs_corpora_only_on_real_text(tree):
    p, lines = run(tree, "bio_cpu", BIO="")
    assert p.returncode != 0 and "set BIO" in p.stderr and lines == []
    p, lines = run(tree, "from_scratch", GENERAL="", BIO="")
    assert p.returncode == 0 and lines


def test_failed_run_stops_the_study(tree):
    """A run that fails beside another stops the script before any grid (a bare `wait` would hide it, and the grid
    would then skip the missing checkpoint); the run again resumes."""
    p, lines = run(tree, "bio_cpu", FAKE_FAIL="mlm-r2")
    assert p.returncode != 0 and not [c for c in lines if "finetune.py" in c]
    p, lines = run(tree, "bio_cpu")
    assert p.returncode == 0 and [c for c in lines if "out/bio/mlm-r2 " in c + " "] and "ft-twins" in " ".join(lines)
    assert not [c for c in lines if "theta0-mlm --overwrite" in c]  # done before the stop: not rerun


def test_scripts_parse():
    for name in sorted(os.listdir(os.path.join(ROOT, "studies"))):
        if name.endswith(".sh"):
            subprocess.run(["bash", "-n", os.path.join(ROOT, "studies", name)], check=True)


def test_gather(tmp_path):
    """The report of the studies without a report script: losses from log.jsonl, then the reports as written."""
    run_dir = tmp_path / "clm"
    run_dir.mkdir()
    (run_dir / "log.jsonl").write_text('{"step": 1, "loss": 5}\n{"step": 2, "val_loss": 3.0, "val_unigram": 6.25, '
                                       '"val_acc": 0.45}\n')
    (tmp_path / "results.md").write_text("| a | b |\n")
    out = tmp_path / "r.md"
    subprocess.run([sys.executable, os.path.join(ROOT, "studies", "gather.py"), str(out), "T", "--runs", str(run_dir),
                    str(tmp_path / "mlm"), "--reports", str(tmp_path / "results.md"), str(tmp_path / "cka.md")],
                   check=True, capture_output=True)
    text = out.read_text()
    assert f"| {run_dir} | 2 | 3.00 | 6.25 | 3.25 | 45.0% |" in text and "| a | b |" in text
    assert f"- {tmp_path / 'mlm'}/log.jsonl" in text and f"- {tmp_path / 'cka.md'}" in text
