"""finetune.py's grid: one JSON per (checkpoint, task, seed) cell, resumable, sharded, merged at the end.
The same tiny grid run three ways (one process; --shard 0/2 and 1/2 at once, then --merge; killed midway
and restarted) must give the same results.json, bitwise (CPU, one thread per process)."""
import errno
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

import finetune as ft
from conftest import ROOT
from test_finetune import FAST, make_ckpt, make_task_dir, write

# the fast settings but those that would act on nothing in these grids, which finetune.py refuses: their NER task is
# a probe (no --ner_epochs) and they have fewer than 8 units (no bootstrap)
CLI = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in FAST.items()
       if k not in ("ner_epochs", "bootstrap_samples")]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """Two tiny checkpoints and two tasks (one a probe): 2 x 2 x 2 seeds = 8 cells."""
    root = tmp_path_factory.mktemp("grid")
    a, b = make_ckpt(root / "a", seed=0)[0], make_ckpt(root / "b", seed=1)[0]
    spec = (f"drugs=cls:{make_task_dir(root / 'c', 'cls', n=(16, 8, 8))},"
            f"ents=ner+probe:{make_task_dir(root / 'n', 'ner', n=(16, 8, 8))}")
    return dict(root=root, ckpts=[a, b], spec=spec, argv=["--ckpts", f"{a},{b}", "--tasks", spec, *CLI])


def finetune(argv, out_dir, **kw):
    """finetune.py as its own process (as on a cluster), one thread."""
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "finetune.py"), *argv, "--out_dir", str(out_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, **kw)


def finish(proc):
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out


def cells(out_dir):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(out_dir) for f in fs if f.endswith(".seed0.json")
                  or f.endswith(".seed1.json"))


def test_one_process_shards_and_a_killed_run_give_the_same_results(grid):
    root, argv = grid["root"], grid["argv"]
    ft.main(argv + ["--out_dir", str(root / "one")])  # this process
    want = open(root / "one" / "results.json", "rb").read()
    assert len(cells(root / "one")) == 8

    shards = [finetune(argv + ["--shard", f"{i}/2"], root / "sharded") for i in (0, 1)]  # at once
    logs = [finish(s) for s in shards]
    assert all("shard" in log and " of 8 cells: 4 here" in log for log in logs), logs
    ft.main(argv + ["--merge", "true", "--out_dir", str(root / "sharded")])  # the results were written by either
    assert open(root / "sharded" / "results.json", "rb").read() == want

    run = finetune(argv, root / "killed")
    while len(cells(root / "killed")) < 3 and run.poll() is None:
        time.sleep(0.02)
    run.send_signal(signal.SIGKILL)  # mid-grid, most likely mid-cell: its lock file stays behind
    out, _ = run.communicate(timeout=60)
    assert run.returncode == -signal.SIGKILL and not os.path.exists(root / "killed" / "results.json"), out
    done = len(cells(root / "killed"))
    assert 3 <= done < 8
    log = finish(finetune(argv, root / "killed"))
    assert f"of 8 cells: 8 here, {done} of them done already" in log and log.count(" seed ") == 8 - done, log
    assert open(root / "killed" / "results.json", "rb").read() == want


def test_two_processes_racing_on_one_cell_train_it_once(tmp_path):
    a, _ = make_ckpt(tmp_path / "a")
    argv = ["--ckpts", a, "--tasks", f"drugs=cls:{make_task_dir(tmp_path / 'c', 'cls', n=(16, 8, 8))}",
            *[a for a in CLI if not a.startswith("--probe_")], "--seeds", "1"]  # no probe here
    logs = [finish(p) for p in [finetune(argv, tmp_path / "out") for _ in range(2)]]
    trained = [log for log in logs if "drugs seed 0: dev" in log]
    assert len(trained) == 1, logs  # the other found the cell locked, or finished
    other = logs[1 - logs.index(trained[0])]
    assert "another process is running this cell" in other or "1 of them done already" in other, other
    assert json.load(open(tmp_path / "out" / "results.json"))["scores"][a]["drugs"]["runs"][0]["seed"] == 0


def test_a_cell_held_elsewhere_is_waited_for_and_run_here_when_its_holder_dies(tmp_path, capsys):
    """Two grids sharing cells (the two transplant variants) must both end whole and both report: a cell
    another process holds is taken up again at the end, waiting on its lock; a holder that dies without a
    result leaves the cell to this process."""
    p, a = replace(ft.Protocol(**FAST), out_dir=str(tmp_path / "out"), seeds=1), make_ckpt(tmp_path / "a")[0]
    spec = f"drugs=cls:{make_task_dir(tmp_path / 'c', 'cls', n=(16, 8, 8))}"
    cell = ft.grid_cells(p, ft.arms_of([a]), ft.tasks.parse_tasks(spec, p.tasks_dir))[0]
    os.makedirs(os.path.dirname(cell["file"]))
    holder = open(cell["file"] + ".lock", "a")
    fcntl.flock(holder, fcntl.LOCK_EX)  # another process's claim
    threading.Timer(1.0, holder.close).start()  # ... which dies a second later, leaving no result
    assert ft.run(p, [a], spec) is not None  # waited, ran the cell itself, reported
    out = capsys.readouterr().out
    assert "another process is running this cell; left to it, waited for at the end" in out, out
    assert "drugs seed 0: dev" in out and os.path.exists(cell["file"]), out


def test_a_filesystem_without_locks_runs_the_cells_unlocked(tmp_path, monkeypatch, capsys):
    def no_locks(*args):
        raise OSError(errno.ENOSYS, "Function not implemented")  # Lustre mounted without flock
    monkeypatch.setattr(ft.fcntl, "flock", no_locks)
    p = replace(ft.Protocol(**FAST), out_dir=str(tmp_path / "out"), seeds=1)
    spec = f"drugs=cls:{make_task_dir(tmp_path / 'c', 'cls', n=(16, 8, 8))}"
    assert ft.run(p, [make_ckpt(tmp_path / "a")[0]], spec) is not None
    assert "cannot be locked on this filesystem; the cell runs unlocked" in capsys.readouterr().out


def test_stale_and_corrupt_cells_are_named_and_rerun(grid, tmp_path, capsys):
    p, spec = replace(ft.Protocol(**FAST), out_dir=str(tmp_path / "out")), grid["spec"]
    ckpts = [make_ckpt(tmp_path / "a", seed=0)[0], make_ckpt(tmp_path / "b", seed=1)[0]]
    first = json.dumps(ft.run(p, ckpts, spec))
    files = cells(tmp_path / "out")
    stamps = {f: os.path.getmtime(f) for f in files}
    write(files[0], '{"identity": {"protocol"')  # torn / corrupt: named, rerun, nothing else lost
    capsys.readouterr()
    assert json.dumps(ft.run(p, ckpts, spec)) == first
    out = capsys.readouterr().out
    assert f"note: {files[0]} not a complete cell result" in out and out.count(" seed ") == 1, out
    assert all(os.path.getmtime(f) == stamps[f] for f in files[1:])
    ft.run(replace(p, epochs=1), ckpts, spec)  # another protocol: every cell stale, told in one line
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "and 7 other cells made with epochs 2 (now 1): not reused" in notes[0], notes
    make_ckpt(ckpts[1], seed=7)  # the same path, other weights: its cells are not reused
    with pytest.raises(SystemExit, match="4 of 8 cells not done"):
        ft.run(replace(p, epochs=1, merge=True), ckpts, spec)
    assert "and 3 other cells made with other checkpoint files" in capsys.readouterr().out


def test_every_task_and_checkpoint_is_checked_before_anything_trains(grid, tmp_path, capsys):
    p = replace(ft.Protocol(**FAST), out_dir=str(tmp_path / "out"))
    ckpts = [make_ckpt(tmp_path / "a", seed=0)[0], make_ckpt(tmp_path / "b", seed=1)[0]]
    bad = make_task_dir(tmp_path / "bad", "ner", n=(16, 8, 8))
    write(os.path.join(bad, "test.tsv"), "\n")  # the second of three tasks: its test file is empty
    with pytest.raises(SystemExit, match="test.tsv is empty"):
        ft.run(p, ckpts, grid["spec"].replace(",", f",bad=ner:{bad},", 1))
    os.remove(os.path.join(ckpts[1], "tokenizer.json"))  # the second checkpoint: broken
    with pytest.raises(SystemExit, match="tokenizer.json not found"):
        ft.run(p, ckpts, grid["spec"])
    assert " seed " not in capsys.readouterr().out and not os.path.exists(tmp_path / "out")  # nothing trained


def test_a_shard_alone_writes_no_results_and_merge_names_the_missing_cells(grid, tmp_path, capsys):
    p = replace(ft.Protocol(**FAST), out_dir=str(tmp_path), seeds=1, shard="1/3")
    ckpts, spec = grid["ckpts"], grid["spec"]
    assert ft.run(p, ckpts, spec) is None  # cell 1 of 4 (a, ents)
    out = capsys.readouterr().out
    assert "shard 1/3 of 4 cells: 1 here" in out and "3 of 4 cells not done" in out and "--merge true" in out
    assert cells(tmp_path) == [os.path.join(tmp_path, "cells", re.sub(r"[^\w-]+", "_", os.path.normpath(ckpts[0])),
                                            "ents.seed0.json")]
    assert not os.path.exists(tmp_path / "results.json")
    with pytest.raises(SystemExit, match=r"3 of 4 cells not done \(.*drugs.seed0.json.*\); run every shard"):
        ft.run(replace(p, merge=True), ckpts, spec)
    assert not os.path.exists(tmp_path / "results.json")


def test_shard_defaults_come_from_a_slurm_array(grid, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "1")  # --array=1-4: the third task
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "4")
    argv = grid["argv"] + ["--out_dir", str(tmp_path), "--seeds", "1", "--device", "cpu"]
    ft.main(argv)
    assert "shard 2/4 of 4 cells: 1 here" in capsys.readouterr().out
    ft.main(argv + ["--shard", "3/4"])  # --shard wins
    assert "shard 3/4 of 4 cells: 1 here" in capsys.readouterr().out
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "5")
    with pytest.raises(SystemExit, match="--shard '4/4' must be i/n with 0 <= i < n"):
        ft.main(argv)
