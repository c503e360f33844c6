"""The researcher's path: autoresume, the SLURM scripts (requeue after SIGTERM) and a multi-node
rendezvous on one machine, the complete HF export, one error line under torchrun, the W&B tracker."""
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import detour
from conftest import ROOT, TINY_DECAY, TINY_RUN, without
from test_reliability import log, start, wait_for_step

ARGS = ["--phase", "clm", "--max_tokens", "10240", "--ckpt_interval", "3", *TINY_RUN]  # 20 steps


def losses(out):
    return [r["loss"] for r in log(out) if "loss" in r]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- 2. autoresume ----

def test_autoresume_continues_starts_finishes_and_refuses(tiny_data, tmp_path, capsys):
    args = ["--data_dir", tiny_data, *ARGS, "--autoresume", "true"]
    full = detour.main(["--data_dir", tiny_data, *ARGS, "--out_dir", str(tmp_path / "full")])
    out = str(tmp_path / "auto")
    # A first attempt dies before its first checkpoint (kill -9 at step 2): its records must not stay.
    p = start([sys.executable, "detour.py", *args, "--out_dir", out, "--ckpt_interval", "100"])
    wait_for_step(p, out, 2)
    p.kill()
    p.wait()
    assert not os.path.exists(os.path.join(out, "ckpt.pt")) and log(out)
    # Rerun: no checkpoint, so it starts; stopped by SIGINT at step >= 7, it checkpoints.
    p = start([sys.executable, "detour.py", *args, "--out_dir", out])
    wait_for_step(p, out, 7)
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=60) == 0
    step = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["step"]
    assert 7 <= step < 20
    steps = [r["step"] for r in log(out) if "loss" in r]
    assert steps == list(range(1, len(steps) + 1))  # the dead attempt's steps 1, 2 are gone, none twice
    # The same command again continues it, bitwise as --init_from resume does ...
    capsys.readouterr()
    resumed = detour.main([*args, "--out_dir", out])
    assert f"detour: autoresume: continuing {out}/ckpt.pt from step {step}" in capsys.readouterr().out
    assert all(torch.equal(v, full.state_dict()[k]) for k, v in resumed.state_dict().items())
    assert losses(out) == losses(str(tmp_path / "full"))
    # ... and once more: finished, said once, nothing run (exit 0 from the command line).
    r = subprocess.run([sys.executable, "detour.py", *args, "--out_dir", out], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == f"detour: {out} is finished (step 20, 10,240 tokens); nothing to do\n"
    # Another phase or configuration: one line naming what differs, nothing written.
    before = open(os.path.join(out, "log.jsonl")).read()
    for extra, match in ((["--phase", "mlm"], f"--autoresume: {out}/ckpt.pt was run with another configuration "
                                              "(phase 'clm' there, 'mlm' here)"),
                         (["--learning_rate", "1e-3", "--seed", "3"],
                          f"--autoresume: {out}/ckpt.pt was run with another configuration (seed 17 there, 3 here; "
                          "learning_rate 0.003 there, 0.001 here); rerun it with its settings, or give another --out_dir")):
        r = subprocess.run([sys.executable, "detour.py", *args, "--out_dir", out, *extra], cwd=ROOT, capture_output=True,
                           text=True)
        assert r.returncode == 1 and r.stderr.startswith(f"error: {match}") and r.stderr.count("\n") == 1, r.stderr
    assert open(os.path.join(out, "log.jsonl")).read() == before


def test_autoresume_continues_a_decay_run(tiny_data, tmp_path):
    """decay derives its configuration and budget from its Phase 1: the comparison and the finished check use both."""
    p1 = str(tmp_path / "clm")
    detour.main(["--data_dir", tiny_data, *ARGS, "--max_tokens", "8192", "--out_dir", p1])
    decay = ["--phase", "decay", "--init_from", p1, "--decay_tokens", "10240", *TINY_DECAY, "--ckpt_interval", "3"]
    full = detour.main(decay + ["--out_dir", str(tmp_path / "full")])
    out = str(tmp_path / "auto")
    p = start([sys.executable, "detour.py", *decay, "--out_dir", out, "--autoresume", "true"])
    wait_for_step(p, out, 7)
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=60) == 0 and torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["step"] < 20
    resumed = detour.main(decay + ["--out_dir", out, "--autoresume", "true"])
    assert all(torch.equal(v, full.state_dict()[k]) for k, v in resumed.state_dict().items())
    assert detour.main(decay + ["--out_dir", out, "--autoresume", "true"]) is None  # finished


# ---- 3 and 4. SLURM: requeue after SIGTERM, and two torchrun agents meeting at 127.0.0.1 ----

FAKE_SCONTROL = """#!/bin/bash
# scontrol, as far as pretrain.sbatch uses it: every node of the job is this machine.
case "$1 $2" in
  "show hostnames") for ((i = 0; i < ${SLURM_NNODES:-1}; i++)); do echo 127.0.0.1; done ;;
  "requeue "*) echo "scontrol $*" >> "$FAKE_SLURM_LOG" ;;
  *) echo "fake scontrol: $*" >&2; exit 2 ;;
esac
"""
FAKE_SRUN = """#!/bin/bash
# srun, as pretrain.sbatch uses it: one task per node (--ntasks-per-node=1), all here; SIGTERM forwarded to the tasks.
echo "srun $*" >> "$FAKE_SLURM_LOG"
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < ${SLURM_NNODES:-1}; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!); done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
for p in "${pids[@]}"; do
  while wait "$p"; s=$?; kill -0 "$p" 2>/dev/null; do :; done
  [ "$s" -ne 0 ] && status=$s
done
exit $status
"""


def fake_slurm(tmp_path, nodes):
    """A bin directory with fake scontrol and srun first on PATH, and a SLURM job's environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"),
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": str(nodes), "GPUS": "1"}


def sbatch(tmp_path, tiny_data, out, nodes=2):
    env = {**fake_slurm(tmp_path, nodes), "PHASE": "clm", "OUT_DIR": out, "PORT": str(free_port()),
           "ARGS": " ".join(["--data_dir", tiny_data, "--device", "cpu", *ARGS[2:]])}
    return start(["bash", "studies/slurm/pretrain.sbatch"], env)


def test_pretrain_sbatch_sigterm_requeue_then_rerun_reaches_the_same_loss(tiny_data, tmp_path):
    full = str(tmp_path / "full")
    p = sbatch(tmp_path, tiny_data, full)
    text = p.communicate(timeout=240)[0]
    assert p.returncode == 0, text
    assert "rendezvous 127.0.0.1:" in text and "detour: phase=clm" in text and "ranks=2" in text
    out = str(tmp_path / "cut")
    p = sbatch(tmp_path, tiny_data, out)
    wait_for_step(p, out, 7)
    p.send_signal(signal.SIGUSR1)  # what #SBATCH --signal=B:USR1@300 sends the batch shell
    text = p.communicate(timeout=120)[0]
    assert p.returncode == 0, text
    assert "SIGTERM to the training processes, then requeue 4242" in text and "stopped by signal 15" in text, text
    assert "Continue with the same command" in text, text  # --autoresume: the requeued job's rerun, no flag to add
    assert open(tmp_path / "slurm.log").read().splitlines()[-1] == "scontrol requeue 4242"
    step = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["step"]
    assert 7 <= step < 20
    p = sbatch(tmp_path, tiny_data, out)  # the requeued job: the same script from the top
    text = p.communicate(timeout=240)[0]
    assert p.returncode == 0 and f"autoresume: continuing {out}/ckpt.pt from step {step}" in text, text
    assert losses(out)[-1] == losses(full)[-1] and len(losses(out)) == len(losses(full)) == 20
    p = sbatch(tmp_path, tiny_data, out)  # requeued once more after it ended: nothing to do
    text = p.communicate(timeout=120)[0]
    assert p.returncode == 0 and "is finished (step 20" in text, text


def test_two_torchrun_agents_give_the_curve_of_one_process(tiny_data, tmp_path):
    """--nnodes 2 on one machine: two agents, one gloo CPU rank each, c10d rendezvous on 127.0.0.1 at a free port."""
    args = ["--data_dir", tiny_data, *ARGS, "--max_tokens", "4096", "--device", "cpu"]
    detour.main(args + ["--out_dir", str(tmp_path / "one")])
    port, out = free_port(), str(tmp_path / "two")
    agents = [start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                     "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t39",
                     "detour.py", *args, "--out_dir", out]) for _ in range(2)]
    texts = [a.communicate(timeout=240)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], texts
    assert "ranks=2" in "".join(texts)
    one, two = losses(str(tmp_path / "one")), losses(out)
    assert len(one) == len(two) == 8 and np.allclose(one, two, atol=1e-4), (one, two)


# ---- 5. the HF export: every field of ModernBERT's released config.json ----

RELEASED = dict(attention_bias=False, attention_dropout=0.0, classifier_activation="gelu", classifier_bias=False,
                classifier_dropout=0.0, classifier_pooling="mean", decoder_bias=True, deterministic_flash_attn=False,
                embedding_dropout=0.0, global_attn_every_n_layers=3, global_rope_theta=160000.0,
                gradient_checkpointing=False, hidden_activation="gelu", initializer_cutoff_factor=2.0,
                initializer_range=0.02, layer_norm_eps=1e-05, local_attention=128, local_rope_theta=10000.0,
                max_position_embeddings=8192, mlp_bias=False, mlp_dropout=0.0, model_type="modernbert", norm_bias=False,
                norm_eps=1e-05, position_embedding_type="absolute", reference_compile=True, sparse_pred_ignore_index=-100,
                sparse_prediction=False)  # NOTES.md: answerdotai/ModernBERT-base's config.json (transformers 4.48)


def test_hf_export_has_the_released_fields_and_keeps_a_sources(tiny_data, tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification
    tiny = ["--data_dir", tiny_data, *ARGS, "--max_tokens", "1024"]
    detour.main(tiny + ["--out_dir", str(tmp_path / "a")])
    hf = tmp_path / "a" / "hf"
    exported = json.loads((hf / "config.json").read_text())
    assert {k: exported.get(k) for k in RELEASED} == RELEASED
    assert AutoConfig.from_pretrained(hf).classifier_pooling == "mean"
    clf = AutoModelForSequenceClassification.from_pretrained(hf, num_labels=3)
    assert clf(torch.tensor([[2, 40, 41, 3]])).logits.shape == (1, 3)
    # A source with classifier_pooling "cls" (and a field detour has no use for): a run from it, and the decay
    # after that run (its checkpoint carries them), export them as they came.
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes())
    (src / "config.json").write_text(json.dumps({**exported, "classifier_pooling": "cls", "id2label": {"0": "x"}}))
    detour.main(without(tiny, "--preset") + ["--init_from", str(src), "--out_dir", str(tmp_path / "b")])
    detour.main(["--phase", "decay", "--init_from", str(tmp_path / "b"), "--decay_tokens", "512"])
    for out in ("b", "b-decay"):
        back = json.loads((tmp_path / out / "hf" / "config.json").read_text())
        assert back["classifier_pooling"] == "cls" and back["id2label"] == {"0": "x"}
        assert AutoConfig.from_pretrained(tmp_path / out / "hf").classifier_pooling == "cls"


# ---- 6 and 7. one error line under torchrun; the bad-input sweep's two misses ----

@pytest.mark.parametrize("extra,match", [
    (["--max_tokens", "100"], "--max_tokens 100 is less than one optimizer step, global_batch_size x seq_len = "
                              "8 x 64 = 512 tokens; raise --max_tokens or lower those"),
    (["--freeze_layers", "2-1"], "--freeze_layers range '2-1' is empty (its end is below its start); write it "
                                 "low-high, e.g. 1-2"),
])
def test_an_error_under_torchrun_is_one_line_from_rank_0(tiny_data, tmp_path, extra, match):
    """The error is checked before dist starts (max_tokens) or after (freeze_layers): either way one line, rank 0's,
    the last before torchrun's report (its WARNING that stops the other worker, then ChildFailedError), exit 1."""
    p = start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "detour.py",
               "--data_dir", tiny_data, *ARGS, "--out_dir", str(tmp_path / "out"), *extra])
    text = p.communicate(timeout=120)[0]
    lines = [line for line in text.splitlines() if not line.startswith("W")]  # torchrun's OMP_NUM_THREADS warning
    assert p.returncode == 1 and [line for line in lines if "error:" in line] == [f"error: {match}"], text
    report = text.index("ChildFailedError")
    assert text.rindex("error: ", 0, report) == text.index("error: ") and "rank      : 0" in text[text.index("Root Cause"):]
    assert not os.path.exists(tmp_path / "out" / "ckpt.pt")
    # The same in one process, from main: one line, exit 1 (tested in test_errors' style).
    r = subprocess.run([sys.executable, "detour.py", "--data_dir", tiny_data, *ARGS, "--out_dir", str(tmp_path / "one"),
                        *extra], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr == f"error: {match}\n"


# ---- 8. Weights & Biases, offline ----

def test_wandb_gets_every_log_record_in_offline_mode(tiny_data, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")  # tests/requirements.txt installs it
    monkeypatch.setenv("WANDB_MODE", "offline")  # a real run, written to out_dir/wandb, no network
    monkeypatch.setenv("WANDB_SILENT", "true")
    inits, logged, real_init = [], [], wandb.init

    def init(**kw):  # the real wandb.init, its run's log calls recorded on the way
        inits.append(kw)
        run = real_init(**kw)
        real_log = run.log
        run.log = lambda data, step=None: (logged.append((dict(data), step)), real_log(data, step=step))
        return run

    monkeypatch.setattr(wandb, "init", init)
    out = str(tmp_path / "w")
    detour.main(["--data_dir", tiny_data, *ARGS, "--max_tokens", "2048", "--out_dir", out, "--wandb_log", "true",
                 "--wandb_project", "t39"])
    wandb.finish()
    assert logged == [(r, r["step"]) for r in log(out)] and len(logged) == 4
    assert inits[0]["project"] == "t39" and inits[0]["name"] == out and inits[0]["config"]["max_tokens"] == 2048
    runs = [d for d in os.listdir(os.path.join(out, "wandb")) if d.startswith("offline-run-")]
    assert len(runs) == 1 and any(f.endswith(".wandb") for f in os.listdir(os.path.join(out, "wandb", runs[0])))


def test_wandb_run_survives_a_requeue_and_the_decay_starts_its_own(tiny_data, tmp_path, monkeypatch):
    """A stopped run continued by --autoresume logs into the same W&B run (its id saved in the checkpoint), as does
    --init_from resume; the decay, a run of its own, starts a new one."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    inits, real_init, real_stop = [], wandb.init, detour.StopRequest.requested
    monkeypatch.setattr(wandb, "init", lambda **kw: (inits.append(kw), real_init(**kw))[1])
    calls = []  # the loop asks once per step: a SIGTERM at step 5
    monkeypatch.setattr(detour.StopRequest, "requested", lambda stop: calls.append(1) is None and len(calls) >= 5)
    out, cmd = str(tmp_path / "w"), ["--data_dir", tiny_data, *ARGS, "--out_dir", str(tmp_path / "w"), "--wandb_log",
                                     "true", "--autoresume", "true"]
    detour.main(cmd)
    wandb.finish()
    stopped = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    first = stopped["config"]["wandb_run_id"]
    assert inits[0]["id"] == first and first and stopped["step"] < 20  # the id is chosen when the run is resolved
    monkeypatch.setattr(detour.StopRequest, "requested", real_stop)
    detour.main(cmd)  # the requeued job's same command
    wandb.finish()
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert ckpt["step"] == 20 and inits[1]["id"] == first and ckpt["config"]["wandb_run_id"] == first
    detour.main(["--phase", "decay", "--init_from", out, "--wandb_log", "true"])
    wandb.finish()
    assert inits[2]["id"] not in (None, first) and inits[2]["name"] == out + "-decay"
    decay = torch.load(os.path.join(out + "-decay", "ckpt.pt"), weights_only=True)["config"]["wandb_run_id"]
    assert decay and decay != first
    runs = sorted(d for d in os.listdir(os.path.join(out, "wandb")) if d.startswith("offline-run-"))
    assert len(runs) == 2 and all(r.split("-")[3] == first for r in runs), runs  # two attempts, one W&B run id


def test_wandb_missing_is_one_line(tiny_data, tmp_path):
    """Without the package (hidden by sys.modules["wandb"] = None): one line naming pip install wandb, nothing written."""
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['wandb'] = None; import detour; "
                        "detour.main(sys.argv[1:])", "--data_dir", tiny_data, *ARGS, "--out_dir", str(tmp_path / "o"),
                        "--wandb_log", "true"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("error: --wandb_log true needs the wandb package; pip install wandb")
    assert not os.path.exists(tmp_path / "o")
