"""What a run continues, decided once (detour.resolve), and the copy of detour.py a run saves:
- the saved out_dir/detour.py runs by itself, away from this repository: a CLM phase, its decay,
  the HF export;
- the optimizer runs with the configuration it records, for a decay and for a resume (the state
  loaded from a checkpoint brings the checkpoint's betas and eps with its moments);
- a decay from an unfinished Phase 1 is refused unless --early_decay says it is meant;
- every phase's budget below one optimizer step is refused, the decay's too;
- the configuration is frozen once resolved; torchrun's variables half set are one line."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import detour
from conftest import TINY_RUN
from data import prepare

ARGS = ["--phase", "clm", "--max_tokens", "4096", "--ckpt_interval", "2", *TINY_RUN]  # 8 steps


def fails(argv):
    """The one error line of detour.main(argv)."""
    with pytest.raises(SystemExit) as e:
        detour.main(argv)
    line = str(e.value.code)
    assert line.startswith("error: ") and "\n" not in line, line
    return line


def test_the_saved_copy_runs_alone(tmp_path):
    """out_dir/detour.py, copied alone into an empty directory (no data/ package, no repository on
    the path) beside a dataset data/prepare.py wrote (with its tokenizer), runs a short CLM phase,
    a decay, and writes the HF export of each, tokenizer files included."""
    data = str(tmp_path / "data")
    prepare.main(["--register", "bio", "--n_docs", "200", "--vocab_size", "512", "--val_fraction", "0.05", "--out_dir", data])
    first = str(tmp_path / "first")
    detour.main(["--data_dir", data, *ARGS, "--max_tokens", "1024", "--out_dir", first])
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(os.path.join(first, "detour.py"), alone / "detour.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for argv in (["--data_dir", data, *TINY_RUN, "--max_tokens", "2048", "--phase", "clm", "--out_dir", "clm"],
                 ["--phase", "decay", "--init_from", "clm", "--decay_tokens", "512", "--progress", "false"]):
        r = subprocess.run([sys.executable, "-I", "detour.py", *argv], cwd=alone, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    for out in ("clm", "clm-decay"):
        exported = sorted(os.listdir(alone / out / "hf"))
        assert exported == ["config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
                            "tokenizer_config.json"], exported
    model = detour.load_hf(str(alone / "clm-decay" / "hf"))
    saved = torch.load(alone / "clm-decay" / "ckpt.pt", weights_only=True)["model"]
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def groups_match(optimizer, cfg):
    want = [(cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay / cfg.learning_rate]
    decayed, plain = optimizer.param_groups
    assert [tuple(decayed["betas"]), decayed["eps"], decayed["weight_decay"]] == want
    assert [tuple(plain["betas"]), plain["eps"], plain["weight_decay"]] == [*want[:2], 0.0]


def test_the_optimizer_runs_with_the_configuration_it_records(tiny_data, tmp_path, monkeypatch):
    """A decay and a resume load AdamW's state (the moments are kept) and then take every
    hyperparameter from their own configuration: the optimizer that steps is the record's."""
    p1 = str(tmp_path / "clm")
    detour.main(["--data_dir", tiny_data, *ARGS, "--out_dir", p1])
    seen = []
    real_setup = detour.setup

    def spy(cfg, ckpt):
        run = real_setup(cfg, ckpt)
        seen.append((cfg, run.optimizer))
        return run

    monkeypatch.setattr(detour, "setup", spy)
    detour.main(["--phase", "decay", "--init_from", p1, "--beta2", "0.9", "--eps", "1e-8",
                 "--weight_decay", "2e-5", "--decay_tokens", "1024"])
    cfg, optimizer = seen[-1]
    assert (cfg.beta2, cfg.eps, cfg.weight_decay) == (0.9, 1e-8, 2e-5)
    groups_match(optimizer, cfg)
    record = torch.load(os.path.join(p1 + "-decay", "ckpt.pt"), weights_only=True)
    assert (record["config"]["beta2"], record["config"]["eps"]) == (0.9, 1e-8)
    assert record["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.9)
    # a resume of a stopped run with another eps: its groups say the new one
    monkeypatch.setattr(detour.StopRequest, "requested", lambda stop: True)  # stop after step 1
    stopped = str(tmp_path / "stopped")
    detour.main(["--data_dir", tiny_data, *ARGS, "--out_dir", stopped])
    monkeypatch.undo()
    monkeypatch.setattr(detour, "setup", spy)
    detour.main(["--init_from", "resume", "--out_dir", stopped, "--eps", "1e-7"])
    cfg, optimizer = seen[-1]
    assert cfg.eps == 1e-7 and cfg.init_from == "resume"
    groups_match(optimizer, cfg)


def test_a_decay_from_an_unfinished_phase_1_is_refused_unless_meant(tiny_data, tmp_path,
                                                                    monkeypatch):
    calls = []
    monkeypatch.setattr(detour.StopRequest, "requested", lambda stop: calls.append(1) or len(calls) >= 3)
    p1 = str(tmp_path / "clm")
    detour.main(["--data_dir", tiny_data, *ARGS, "--out_dir", p1])  # stopped at step 3 of 8
    monkeypatch.undo()
    line = fails(["--phase", "decay", "--init_from", p1, "--decay_tokens", "512"])
    assert f"{p1} stopped at step 3 of the 8 its Phase 1 planned" in line and "--early_decay true" in line
    assert not os.path.exists(p1 + "-decay")
    detour.main(["--phase", "decay", "--init_from", p1, "--decay_tokens", "512", "--early_decay", "true"])
    assert torch.load(os.path.join(p1 + "-decay", "ckpt.pt"), weights_only=True)["step"] == 1


def test_every_phase_budget_below_one_step_is_refused(tiny_data, tmp_path):
    """One optimizer step is global_batch_size x seq_len = 8 x 64 = 512 tokens here."""
    p1 = str(tmp_path / "clm")
    line = fails(["--data_dir", tiny_data, *ARGS, "--max_tokens", "100", "--out_dir", p1])
    assert "--max_tokens 100 is less than one optimizer step" in line
    detour.main(["--data_dir", tiny_data, *ARGS, "--max_tokens", "1024", "--out_dir", p1])
    line = fails(["--phase", "decay", "--init_from", p1, "--decay_tokens", "100"])
    assert "--decay_tokens 100 is less than one optimizer step" in line and "8 x 64 = 512" in line
    line = fails(["--phase", "decay", "--init_from", p1])  # 10% of 1,024 tokens
    assert "the decay's budget, --decay_ratio 0.1 x 1024 = 102, is less than one" in line
    assert "raise --decay_ratio" in line and not os.path.exists(p1 + "-decay")


def test_the_configuration_is_frozen_once_resolved(tiny_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default out_dir, out/<phase>, is relative
    cfg, ckpt = detour.resolve(["--data_dir", tiny_data, *ARGS, "--out_dir", str(tmp_path / "a")])
    assert ckpt is None and cfg.out_dir == str(tmp_path / "a") and vars(cfg)["phase"] == "clm"
    with pytest.raises(AttributeError):
        cfg.out_dir = "elsewhere"
    default = detour.resolve(["--data_dir", tiny_data, *ARGS, "--phase", "mlm"])[0]
    assert default.out_dir == os.path.join("out", "mlm")


def test_torchrun_variables_half_set_are_one_line(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    line = fails(["--data_dir", tiny_data, *ARGS, "--out_dir", str(tmp_path / "a")])
    assert "RANK and WORLD_SIZE are set but LOCAL_RANK, MASTER_ADDR, MASTER_PORT not" in line
