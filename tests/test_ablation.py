"""studies/ablation.py end to end at a tiny size, in a copy of the repository (its detour.py is the working tree's
that the study tests): R = 2, the tiny preset, ten steps a run, one fine-tuning seed on 16 examples a task. The
report holds D, its interval, the sign-flip p and the verdict; a second run reruns nothing; an edit of detour.py
reruns every twin and nothing else; a changed flag makes the runs it changes stale. Bad input is one line."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

FILES = ["detour.py", "finetune.py", "data/prepare.py", "data/tasks.py", "data/world.py", "studies/ablation.py",
         "studies/gather.py"]
TINY = ["--replicates", "2", "--n_docs", "600", "--theta0_tokens", "40960", "--tokens", "10240", "--seeds", "1",
        "--epochs", "1", "--ner_epochs", "1", "--max_train", "16", "--max_eval", "16"]
TWINS = [f"{arm}-r{k}{suffix}" for arm in ("clm", "mlm") for k in (1, 2) for suffix in ("", "-decay")]
THETA0 = ["theta0-mlm", "theta0-mlm-decay"]


@pytest.fixture
def repo(tmp_path):
    """The files the study runs, copied: a working tree of its own to edit."""
    for name in FILES:
        os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    return tmp_path


def study(repo, *args):
    """python studies/ablation.py in the copy -> (the completed process, its lines)."""
    p = subprocess.run([sys.executable, str(repo / "studies" / "ablation.py"), *args], cwd=repo,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return p, p.stdout.splitlines()


def status(lines, name):
    """What the study said of one step: 'skipped' or the reason it ran."""
    said = [line.split(": ", 1)[1] for line in lines if line.startswith(name + ": ") and "done in" not in line]
    assert len(said) == 1, (name, said)
    return said[0]


def mtimes(out):
    return {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in
            [f"{r}/run.json" for r in THETA0 + TWINS] + ["times.txt"]}


def check_report(out):
    """The report's D, interval, p and verdict are finetune.py's results.json read by the project's rule."""
    record = json.loads((out / "ablation.json").read_text())
    results = json.loads((out / "ft" / "results.json").read_text())
    lo, hi = record["ci95"]
    assert record["d"] == pytest.approx(100 * results["difference"]["average"])
    assert [lo, hi] == pytest.approx([100 * x for x in results["ci95"]["average"]]) and lo <= record["d"] <= hi
    assert record["verdict"] == ("gain" if lo > 0 else "deficit" if hi < 0 else "cannot tell")
    assert float(record["p_text"]) >= 0.5 ** record["units"] > 0    # never 0: at least the floor
    text = (out / "ablation.md").read_text()
    assert f"**{record['verdict']}**: D = {record['d']:+.1f} [{lo:+.1f}, {hi:+.1f}] points" in text
    assert f"sign-flip p = {record['p_text']}" in text and "detectable difference" in text
    if record["verdict"] == "cannot tell":
        assert "This run cannot tell whether the detour twin is better or worse" in text
    assert "ft/results.md" in text and "| difference (first − second arm) [95% CI] |" in text
    return record


def report_now(repo, monkeypatch):
    """The study's last step alone, in the copy."""
    sys.path.insert(0, ROOT)
    from studies import ablation
    monkeypatch.chdir(repo)
    ablation.write_report(ablation.arguments().parse_args(TINY), "out/ablation")


def test_ablation_end_to_end_resumes_and_reruns_what_changed(repo, monkeypatch):
    out = repo / "out" / "ablation"
    p, first = study(repo, *TINY)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert all(status(first, r).startswith("runs (not run yet)") for r in THETA0 + TWINS)
    check_report(out)
    # Run again: everything stands, nothing trains, no run's record is written again.
    before = mtimes(out)
    p, second = study(repo, *TINY)
    assert p.returncode == 0, p.stderr[-2000:]
    assert all(status(second, r) == "done, skipped" for r in ["data/general", "data/bio"] + THETA0 + TWINS)
    assert status(second, "ft").startswith("every cell done, skipped") and mtimes(out) == before
    # An ablation: the decay masks 20%, not 15%. Every twin runs again by the edited file; the data and θ0 stand.
    source = (repo / "detour.py").read_text()
    assert source.count("\ndecay_mlm_rate = 0.15 ") == 1
    (repo / "detour.py").write_text(source.replace("\ndecay_mlm_rate = 0.15 ", "\ndecay_mlm_rate = 0.20 "))
    with pytest.raises(SystemExit, match="clm-r1, clm-r1-decay, .* no longer stand"):  # no report of another file
        report_now(repo, monkeypatch)
    p, third = study(repo, *TINY)
    assert p.returncode == 0, p.stderr[-2000:]
    assert all(status(third, r) == "done, skipped" for r in ["data/general", "data/bio"] + THETA0)
    assert all(status(third, r) == "runs (detour.py changed)" for r in TWINS)
    assert status(third, "ft") == "runs"                   # new decays: new cells
    assert json.loads((out / "clm-r1-decay" / "run.json").read_text())["decay_mlm_rate"] == 0.2
    assert json.loads((out / "theta0-mlm-decay" / "run.json").read_text())["decay_mlm_rate"] == 0.15
    check_report(out)


def test_a_changed_flag_makes_the_runs_it_changes_stale(repo, monkeypatch):
    """why_stale, run by run, with a finished run's files: another Phase-1 budget reruns that Phase 1 (its decay
    follows once it is newer), an edit of detour.py leaves θ0 standing."""
    sys.path.insert(0, ROOT)
    from studies import ablation
    monkeypatch.chdir(repo)
    out = "out/ablation"
    a = ablation.arguments().parse_args(TINY)
    phase1, decay = ablation.twin_chain(a, out, "clm", 1)
    for run in (phase1, decay):
        os.makedirs(os.path.join(run.args["out_dir"], "hf"))
        (repo / run.args["out_dir"] / "hf" / "config.json").write_text("{}")
        (repo / run.args["out_dir"] / "run.json").write_text(json.dumps(dict(run.args, overwrite=True)))
        shutil.copy(repo / "detour.py", repo / run.args["out_dir"] / "detour.py")
    for name in ("theta0-mlm-decay/hf/config.json", "data/bio.json"):
        os.makedirs(os.path.dirname(os.path.join(out, name)), exist_ok=True)
        (repo / out / name).write_text("{}")
    os.utime(repo / out / "data" / "bio.json", ns=(1, 1))
    os.utime(repo / out / "theta0-mlm-decay" / "hf" / "config.json", ns=(1, 1))
    assert ablation.why_stale(phase1) is None and ablation.why_stale(decay) is None
    longer = ablation.arguments().parse_args(TINY + ["--tokens", "20480"])
    assert ablation.why_stale(ablation.twin_chain(longer, out, "clm", 1)[0]) == (
        "its configuration changed: max_tokens 10240 -> 20480")
    assert ablation.why_stale(ablation.twin_chain(a, out, "clm", 2)[0]) == "not run yet"
    os.utime(repo / out / "clm-r1" / "hf" / "config.json")   # Phase 1 ran again
    os.utime(repo / out / "clm-r1-decay" / "run.json", ns=(2, 2))
    assert ablation.why_stale(decay) == f"{out}/clm-r1/hf/config.json is newer than it"
    (repo / "detour.py").write_text((repo / "detour.py").read_text() + "# an edit\n")
    assert ablation.why_stale(phase1) == "detour.py changed"
    theta0 = ablation.theta0_chain(a, out)[1]
    os.makedirs(repo / out / "theta0-mlm" / "hf")
    (repo / out / "theta0-mlm" / "hf" / "config.json").write_text("{}")
    os.utime(repo / out / "theta0-mlm" / "hf" / "config.json", ns=(1, 1))
    (repo / out / "theta0-mlm-decay" / "run.json").write_text(json.dumps(theta0.args))
    assert ablation.why_stale(theta0) is None                # θ0 is built once, whatever detour.py says now


@pytest.mark.parametrize("args,line", [
    (["--replicates", "1"], "error: argument --replicates: invalid integer >= 2 value: '1'; "
                            "see python studies/ablation.py --help"),
    (["--tasks", "ner=ner:x", "--epochs", "2"], "error: --epochs does not act: no task of --tasks ner=ner:x trains "
                                                "for epochs (a probe trains for finetune.py's probe_epochs); drop it"),
    (["--tasks", "ner=nerd:x"], "error: task ner: unknown kind 'nerd' (one of "),   # data/tasks.py's line
    (["--general", "g.txt"], "error: --general and --bio go together"),
    (["--general", "g.txt", "--bio", "b.txt", "--n_docs", "50"], "error: --n_docs does not act with --general and "
                                                                  "--bio (real text); drop it"),
])
def test_bad_input_is_one_line_before_anything_runs(repo, args, line):
    p, lines = study(repo, *args)
    assert p.returncode == 1 and p.stderr.startswith(line) and p.stderr.count("\n") == 1 and lines == []
    assert not (repo / "out").exists()


def test_a_failed_run_stops_the_study_in_one_line(repo):
    """Too few documents for a validation window: θ0 fails, its own error and log named, nothing after it runs."""
    p, lines = study(repo, *TINY, "--n_docs", "200")
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stderr.startswith("error: theta0-mlm failed (exit 1): error: ") and "logs/theta0-mlm.log" in p.stderr
    assert not (repo / "out" / "ablation" / "clm-r1").exists()


def test_real_text_is_cut_as_the_studies_on_real_text_cut_it():
    """--general and --bio: data/prepare.py on those files as studies/common.sh prepare_data runs it (documents of
    about 200 words, 2% held out); without them the generated corpora of --n_docs documents."""
    sys.path.insert(0, ROOT)
    from studies import ablation
    a = ablation.arguments().parse_args(["--general", "g.txt", "--bio", "b.txt"])
    assert ablation.source(a, "general") == dict(input="g.txt", group_tokens=200, val_fraction=0.02)
    assert ablation.source(a, "bio") == dict(input="b.txt", group_tokens=200, val_fraction=0.02)
    a = ablation.arguments().parse_args([])
    assert ablation.source(a, "bio") == dict(register="bio", n_docs=20_000)
