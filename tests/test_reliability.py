"""What happens when things go wrong: preemption, kills, crashes mid-write, NaN, bad input,
a DDP rank dying. Each promise of docs/reliability.md is here."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import detour
from conftest import ROOT, TINY_DECAY, TINY_INIT, TINY_RUN


def log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def start(args, env=None):
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
           "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(p, out, step):
    while not (os.path.exists(os.path.join(out, "log.jsonl")) and any(r["step"] >= step for r in log(out))):
        assert p.poll() is None, p.stdout.read()
        time.sleep(0.05)


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_run_resumes_bitwise(tiny_data, tmp_path, sig):
    """SIGINT: checkpoint and clean exit. SIGKILL: nothing runs, the periodic checkpoint is
    what is left. Either way --init_from resume reaches the uninterrupted run's weights."""
    args = ["--data_dir", tiny_data, "--phase", "clm", "--max_tokens", "10240", "--ckpt_interval", "3", *TINY_RUN]
    full = detour.main(args + ["--out_dir", str(tmp_path / "full")])
    out = str(tmp_path / "cut")
    p = start([sys.executable, "detour.py", *args, "--out_dir", out])
    wait_for_step(p, out, 7)
    p.send_signal(sig)
    text = p.communicate(timeout=60)[0]
    if sig == signal.SIGINT:
        assert p.returncode == 0 and "stopped by signal" in text, text
    else:
        assert p.returncode == -signal.SIGKILL
    step = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["step"]
    assert 0 < step < 20
    resumed = detour.main(["--init_from", "resume", "--out_dir", out, "--phase", "clm"])
    assert same_weights(resumed, full)
    steps = [r["step"] for r in log(out) if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 20  # no duplicated records after the kill


def test_decay_resume_is_exact(tiny_data, tmp_path):
    p1 = str(tmp_path / "clm")
    detour.main(["--data_dir", tiny_data, "--phase", "clm", "--max_tokens", "8192", "--out_dir", p1, *TINY_RUN])
    full = detour.main(["--phase", "decay", "--init_from", p1, "--decay_tokens", "4096",
                        "--out_dir", str(tmp_path / "full"), *TINY_DECAY])
    out = str(tmp_path / "cut")
    p = start([sys.executable, "detour.py", "--phase", "decay", "--init_from", p1, "--decay_tokens", "4096",
               "--out_dir", out, *TINY_DECAY])
    wait_for_step(p, out, 2)
    p.send_signal(signal.SIGTERM)
    assert "stopped by signal" in p.communicate(timeout=60)[0]
    resumed = detour.main(["--init_from", "resume", "--out_dir", out, "--phase", "decay"])
    assert same_weights(resumed, full)


def test_crash_while_writing_keeps_the_previous_checkpoint(tiny_data, tmp_path, monkeypatch):
    out = str(tmp_path / "o")
    args = ["--data_dir", tiny_data, "--out_dir", out, "--max_tokens", "2048", *TINY_RUN]
    detour.main(args)
    path = os.path.join(out, "ckpt.pt")
    before = open(path, "rb").read()

    def dying_save(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        detour.main(["--init_from", "resume", "--out_dir", out, "--max_tokens", "4096", "--phase", "clm"])
    assert open(path, "rb").read() == before
    assert torch.load(path, weights_only=True)["step"] == 4


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny_data, tmp_path):
    out = str(tmp_path / "o")
    with pytest.raises(SystemExit, match=r"loss is (nan|inf) at step \d+.*lower --learning_rate"):
        detour.main(["--data_dir", tiny_data, "--out_dir", out, "--max_tokens", "65536", *TINY_RUN,
                     "--learning_rate", "1e30", "--warmup_tokens", "1", "--grad_clip", "0", "--ckpt_interval", "1"])
    ck = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())


def test_torchrun_restarts_a_dead_rank_and_resumes(tiny_data, tmp_path):
    """A worker killed mid-run: torchrun --max-restarts restarts the group, which resumes from
    the last checkpoint and ends where an uninterrupted run ends."""
    args = ["--data_dir", tiny_data, "--phase", "mlm", "--max_tokens", "10240", "--ckpt_interval", "3", *TINY_RUN]
    full = detour.main(args + ["--out_dir", str(tmp_path / "full")])
    out = str(tmp_path / "ddp")
    p = start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--max-restarts=1", "detour.py", *args, "--out_dir", out])
    wait_for_step(p, out, 7)
    workers = []  # torchrun's worker processes: their command line is detour.py's own
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"detour.py" in cmd and out.encode() in cmd and b"torch.distributed.run" not in cmd:
            workers.append(int(pid))
    assert len(workers) == 2, workers
    os.kill(max(workers), signal.SIGKILL)
    text = p.communicate(timeout=240)[0]
    assert p.returncode == 0, text
    back = detour.load_hf(os.path.join(out, "hf"))
    sa, sb = back.state_dict(), full.state_dict()
    assert all(torch.allclose(sa[k], sb[k], atol=1e-5) for k in sa)
    assert abs(log(out)[-1]["val_loss"] - log(str(tmp_path / "full"))[-1]["val_loss"]) < 1e-4


# ---- bad input: one line naming the problem and the fix, non-zero exit, nothing overwritten ----

def cli(*args):
    r = subprocess.run([sys.executable, "detour.py", *args], cwd=ROOT, capture_output=True, text=True)
    return r.returncode, r.stderr.strip()


def test_cli_errors_are_one_line_and_nonzero(tiny_data):
    for args, msg in ((["--max_tokenz", "5"], "unknown option --max_tokenz"),
                      (["--seq_len", "long"], "--seq_len expects an integer"),
                      (["--phase", "sft"], "--phase 'sft' must be one of clm | mlm | decay")):
        rc, err = cli("--data_dir", tiny_data, *args)
        assert rc != 0 and msg in err and "\n" not in err, err


def test_missing_and_empty_train_bin(tiny_data, tmp_path):
    os.remove(os.path.join(tiny_data, "train.bin"))
    with pytest.raises(SystemExit, match=f"train.bin not found; run `python data/prepare.py --input FILES --out_dir {tiny_data}`"):
        detour.main(["--data_dir", tiny_data, "--out_dir", str(tmp_path / "o"), *TINY_RUN])
    open(os.path.join(tiny_data, "train.bin"), "wb").close()
    with pytest.raises(SystemExit, match="train.bin is empty"):
        detour.main(["--data_dir", tiny_data, "--out_dir", str(tmp_path / "o"), *TINY_RUN])


def test_token_out_of_range(tiny_data, tmp_path):
    data = np.fromfile(os.path.join(tiny_data, "train.bin"), dtype=np.uint16)
    data[100] = 300  # meta says vocab 256
    data.tofile(os.path.join(tiny_data, "train.bin"))
    with pytest.raises(SystemExit, match="token id 300 .* outside the vocabulary"):
        detour.main(["--data_dir", tiny_data, "--out_dir", str(tmp_path / "o"), *TINY_RUN])


def test_meta_vocab_larger_than_model(tiny_data, tmp_path):
    c = detour.Config(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, pad_token_id=0, unk_token_id=1, cls_token_id=2,
                      sep_token_id=3, mask_token_id=4)
    detour.save_hf(detour.ModernBERT(c), str(tmp_path / "m"))
    with pytest.raises(SystemExit, match=r"data vocab \(256\) is larger than the model's \(128\)"):
        detour.main(["--data_dir", tiny_data, "--init_from", str(tmp_path / "m"), "--out_dir", str(tmp_path / "o"), *TINY_INIT])


def test_corrupt_or_truncated_safetensors_and_foreign_config(tmp_path):
    c = detour.Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, pad_token_id=0, unk_token_id=1, cls_token_id=2,
                      sep_token_id=3, mask_token_id=4)
    d = str(tmp_path / "m")
    detour.save_hf(detour.ModernBERT(c), d)
    st = os.path.join(d, "model.safetensors")
    blob = open(st, "rb").read()
    open(st, "wb").write(blob[:-100])
    with pytest.raises(SystemExit, match="truncated or corrupt"):
        detour.load_hf(d)
    open(st, "wb").write(b"\xff" * 64)
    with pytest.raises(SystemExit, match="not a safetensors file"):
        detour.load_hf(d)
    open(st, "wb").write(blob)
    cfg = json.load(open(os.path.join(d, "config.json")))
    json.dump({**cfg, "model_type": "bert"}, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(SystemExit, match="model_type='bert', not 'modernbert'"):
        detour.load_hf(d)


def test_out_dir_of_another_phase_is_refused_unless_overwrite(tiny_data, tmp_path):
    out = str(tmp_path / "o")
    detour.main(["--data_dir", tiny_data, "--out_dir", out, "--max_tokens", "1024", *TINY_RUN])
    before = open(os.path.join(out, "ckpt.pt"), "rb").read()
    with pytest.raises(SystemExit, match=r"exists \(phase clm\).*--overwrite true"):
        detour.main(["--data_dir", tiny_data, "--out_dir", out, "--phase", "mlm", *TINY_RUN])
    assert open(os.path.join(out, "ckpt.pt"), "rb").read() == before
    detour.main(["--data_dir", tiny_data, "--out_dir", out, "--phase", "mlm", "--max_tokens", "1024",
                 "--overwrite", "true", *TINY_RUN])
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["phase"] == "mlm"
