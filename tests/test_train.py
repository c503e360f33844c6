"""Objectives, data order, phases and the training loop, on tiny runs."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import detour
from conftest import ROOT, TINY_DECAY, TINY_INIT, TINY_RUN


def run(argv):
    return detour.main(list(argv))


def log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def cfg_of(**kw):
    from types import SimpleNamespace
    return SimpleNamespace(**{**detour.DEFAULTS, **kw})


CFG = detour.Config(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                    pad_token_id=0, unk_token_id=1, cls_token_id=2, sep_token_id=3, mask_token_id=4)


def test_overrides_both_forms_and_errors():
    ns = dict(phase="clm", seq_len=8, lr=1e-3, flag=False)
    assert detour.apply_overrides(ns, ["--phase", "mlm", "--seq_len=16", "--lr", "2e-4", "--flag=true"])
    assert ns == dict(phase="mlm", seq_len=16, lr=2e-4, flag=True)
    for bad, msg in ((["--nope", "1"], "unknown option --nope"), (["--seq_len", "x"], "expects an integer"),
                     (["--flag", "maybe"], "expects true/false"), (["--seq_len"], "needs a value"),
                     (["seq_len=3"], "unexpected argument")):
        with pytest.raises(SystemExit, match=msg):
            detour.apply_overrides(dict(ns), bad)


def test_clm_targets_are_next_token_within_document():
    buf = torch.tensor([[2, 10, 11, 3, 2, 20, 21, 22, 3]])
    x, y = detour.clm_batch(buf, sep_id=3)
    assert x.tolist() == [[2, 10, 11, 3, 2, 20, 21, 22]]
    assert y.tolist() == [[10, 11, 3, -100, 20, 21, 22, 3]]  # [SEP] predicts nothing


def test_mlm_masking_rules():
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(64):
        row = []
        while len(row) < 257:
            n = int(rng.integers(1, 40))
            row += [2] + list(rng.integers(5, 200, n)) + [3]
        rows.append(row[:257])
    buf = torch.tensor(rows)
    x, y = detour.mlm_batch(buf, 0.30, g, CFG, n_real_vocab=200)
    orig = buf[:, :-1]
    special = torch.isin(orig, torch.tensor(CFG.special_ids))
    chosen = y != detour.IGNORE
    assert not (chosen & special).any()                                  # specials never masked
    assert torch.equal(y[chosen], orig[chosen])                          # targets are the originals
    assert torch.equal(x[~chosen], orig[~chosen])                        # unchosen untouched
    rate = chosen.sum() / (~special).sum()
    assert 0.28 <= rate < 0.33                                           # 30% (+ >= 1 per document)
    as_mask = (x[chosen] == CFG.mask_token_id).float().mean()
    kept = (x[chosen] == orig[chosen]).float().mean()
    assert abs(as_mask - 0.8) < 0.03 and abs(kept - 0.1) < 0.03          # 80/10/10
    rand = x[chosen & (x != CFG.mask_token_id) & (x != orig)]
    assert not torch.isin(rand, torch.tensor(CFG.special_ids)).any() and rand.max() < 200
    doc = detour.document_ids(orig, 3)
    for b in range(8):                                                   # every document predicts something
        for d in doc[b].unique():
            inside = (doc[b] == d) & ~special[b]
            if inside.any():
                assert chosen[b][inside].any()


def test_twins_see_the_same_windows_in_the_same_order(tiny_data):
    _, data = detour.load_data(tiny_data, "train")
    a, b = detour.Windows(data, 64, 42), detour.Windows(data, 64, 42)
    assert torch.equal(a.rows(0, 8), b.rows(0, 8))
    assert torch.equal(a.rows(100, 8), detour.Windows(data, 64, 42).rows(100, 8))   # pure in the index
    assert not torch.equal(a.rows(0, 8), detour.Windows(data, 64, 43).rows(0, 8))  # data seed matters
    ramp = detour.Windows(np.arange(64 * 50 + 1), 64, 42)                           # an epoch covers the stream once
    starts = sorted(int(ramp.rows(i, 1)[0, 0]) // 64 for i in range(ramp.n))
    assert starts == list(range(50)) and ramp.rows(0, 1)[0, 0] != 0
    assert [int(ramp.rows(i, 1)[0, 0]) for i in range(50, 53)] != [int(ramp.rows(i, 1)[0, 0]) for i in range(3)]
    # the twins' batches: same windows, CLM vs MLM views of them
    cfg_c, cfg_m = cfg_of(phase="clm"), cfg_of(phase="mlm")
    buf = a.rows(8, 4)
    xc, _ = detour.make_batch(cfg_c, buf, CFG, 200, 8)
    xm, ym = detour.make_batch(cfg_m, buf, CFG, 200, 8)
    assert detour.PHASES["clm"].causal and not detour.PHASES["mlm"].causal  # the phase's, not the batch's
    assert torch.equal(xc, buf[:, :-1])
    chosen = ym != detour.IGNORE
    assert torch.equal(xm[~chosen], buf[:, :-1][~chosen])


def test_schedules():
    c = cfg_of(phase="clm", learning_rate=1.0, warmup_tokens=100)
    assert detour.lr_at(c, 50, 1000) == 0.5 and detour.lr_at(c, 100, 1000) == 1.0 and detour.lr_at(c, 999, 1000) == 1.0
    d = cfg_of(phase="decay", learning_rate=1.0, min_lr_ratio=0.1)
    assert detour.lr_at(d, 0, 100) == 1.0 and abs(detour.lr_at(d, 100, 100) - 0.1) < 1e-12
    assert abs(detour.lr_at(d, 25, 100) - (0.1 + 0.9 * (1 - math.sqrt(0.25)))) < 1e-12


def test_first_decay_step_runs_at_peak():
    """A 13-step decay: step 1 at the peak (not 0.75x), then 1 - sqrt down towards 10%."""
    d = cfg_of(phase="decay", learning_rate=2e-4, min_lr_ratio=0.1)
    lrs = [detour.lr_at(d, k * 100, 1300, 100) for k in range(13)]
    assert lrs[0] == 2e-4 and all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] > 2e-5
    c = cfg_of(phase="clm", learning_rate=2e-4, warmup_tokens=1000)
    assert detour.lr_at(c, 0, 10**6, 100) == pytest.approx(2e-5)  # warmup: the first step above 0


def test_grad_clip_defaults_to_off():
    assert detour.DEFAULTS["grad_clip"] == 0  # upstream clips nothing; clipping treats the twins unequally


def test_weight_decay_is_decoupled_and_skips_norms():
    m = detour.ModernBERT(CFG)
    opt = detour.make_optimizer(m, cfg_of(weight_decay=1e-5, learning_rate=2e-4))
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.05)
    for name, p in m.named_parameters():
        assert (id(p) in decayed) == ("norm" not in name and p.ndim == 2), name


def test_parse_layers():
    assert detour.parse_layers("0-3,7", 10) == [0, 1, 2, 3, 7] and detour.parse_layers("", 4) == []
    with pytest.raises(SystemExit, match="names layer 9"):
        detour.parse_layers("8-9", 9)


def test_clm_then_decay_end_to_end(tiny_data, tmp_path):
    out = str(tmp_path / "clm")
    run(["--data_dir", tiny_data, "--out_dir", out, "--phase", "clm", "--max_tokens", "8192", *TINY_RUN])
    rows = log(out)
    assert rows[-1]["step"] == 16 and rows[-1]["tokens"] == 8192
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0] - 0.5                      # it learns
    ck = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert ck["phase"] == "clm" and ck["tokens"] == 8192
    assert os.path.exists(os.path.join(out, "hf", "model.safetensors"))
    # decay: 10% of Phase-1 tokens, inherits the shape/lr, keeps Adam moments
    model = run(["--phase", "decay", "--init_from", out, "--progress", "false", "--log_interval", "1"])
    dec = out + "-decay"
    rows = log(dec)
    assert rows[-1]["tokens"] == 1024 and rows[-1]["step"] == 2
    # 1-sqrt from the 3e-3 peak towards 10% of it over int(0.1 x 8192) = 819 tokens, read at each
    # step's start: step 1 at the peak, step 2 after 512 tokens
    assert rows[0]["lr"] == 3e-3 and abs(rows[-1]["lr"] - 3e-3 * (0.1 + 0.9 * (1 - math.sqrt(512 / 819)))) < 1e-12
    dck = torch.load(os.path.join(dec, "ckpt.pt"), weights_only=True)
    assert dck["phase"] == "decay" and dck["phase1_tokens"] == 8192
    assert dck["optimizer"]["state"][0]["step"].item() == ck["optimizer"]["state"][0]["step"].item() + 2
    back = detour.load_hf(os.path.join(dec, "hf"))
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)


def test_decay_needs_a_phase1_checkpoint(tiny_data, tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint"):
        run(["--data_dir", tiny_data, "--phase", "decay", "--init_from", str(tmp_path / "nothing"), *TINY_DECAY])
    with pytest.raises(SystemExit, match="starts from a Phase-1 checkpoint"):
        run(["--data_dir", tiny_data, "--phase", "decay", "--out_dir", str(tmp_path / "x"), *TINY_DECAY])


def test_freeze_layers_keeps_them_fixed(tiny_data, tmp_path):
    out = str(tmp_path / "f")
    init = detour.ModernBERT(detour.Config(**{**detour.asdict(CFG), **detour.PRESETS["tiny"], "layer_types": None}))
    detour.save_hf(init, str(tmp_path / "init"))
    m = run(["--data_dir", tiny_data, "--out_dir", out, "--init_from", str(tmp_path / "init"),
             "--max_tokens", "2048", "--freeze_layers", "0-1", *TINY_INIT])
    before, after = init.state_dict(), m.state_dict()
    for k in before:
        same = torch.equal(before[k], after[k])
        assert same == (k.startswith("model.layers.0.") or k.startswith("model.layers.1.")), k


def test_resume_after_sigterm_is_exact(tiny_data, tmp_path):
    """SIGTERM mid-run -> checkpoint and clean exit; --init_from resume ends bitwise equal."""
    args = ["--data_dir", tiny_data, "--phase", "mlm", "--max_tokens", "12288", *TINY_RUN]
    full = run(args + ["--out_dir", str(tmp_path / "full")])
    out = str(tmp_path / "cut")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "detour.py"), *args, "--out_dir", out],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    import time
    while not (os.path.exists(os.path.join(out, "log.jsonl")) and len(log(out)) >= 3):
        assert p.poll() is None, p.stdout.read()
        time.sleep(0.05)
    p.terminate()
    text = p.communicate(timeout=60)[0]
    assert p.returncode == 0 and "stopped by signal" in text, text
    assert f"Continue with --init_from resume --out_dir {out}" in text, text  # without --autoresume: the way back
    stopped_at = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["step"]
    assert 0 < stopped_at < 24
    resumed = run(["--init_from", "resume", "--out_dir", out, "--phase", "mlm"])
    for k, v in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
    assert [r["loss"] for r in log(out) if "loss" in r][-1] == [r["loss"] for r in log(str(tmp_path / "full")) if "loss" in r][-1]


def test_two_process_ddp_matches_one_process(tiny_data, tmp_path):
    args = ["--data_dir", tiny_data, "--phase", "mlm", "--max_tokens", "4096", *TINY_RUN]
    run(args + ["--out_dir", str(tmp_path / "one")])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    os.path.join(ROOT, "detour.py"), *args, "--out_dir", str(tmp_path / "two")],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    one = [r["loss"] for r in log(str(tmp_path / "one")) if "loss" in r]
    two = [r["loss"] for r in log(str(tmp_path / "two")) if "loss" in r]
    assert len(one) == len(two) == 8
    assert np.allclose(one, two, atol=1e-4), (one, two)


@pytest.mark.parametrize("argv,msg", [
    (["--phase", "nope"], "must be one of clm | mlm | decay"),
    (["--preset", "huge"], "--preset 'huge' must be one of tiny"),
])
def test_bad_input_is_one_clear_line(tiny_data, tmp_path, argv, msg):
    with pytest.raises(SystemExit, match=msg):
        run(["--data_dir", tiny_data, "--out_dir", str(tmp_path / "o"), *TINY_RUN, *argv])


def test_refuses_to_overwrite_another_run(tiny_data, tmp_path):
    out = str(tmp_path / "o")
    run(["--data_dir", tiny_data, "--out_dir", out, "--max_tokens", "1024", *TINY_RUN])
    before = open(os.path.join(out, "ckpt.pt"), "rb").read()
    with pytest.raises(SystemExit, match="exists"):
        run(["--data_dir", tiny_data, "--out_dir", out, "--phase", "mlm", *TINY_RUN])
    assert open(os.path.join(out, "ckpt.pt"), "rb").read() == before


def test_seq_len_above_max_positions_is_refused(tiny_data, tmp_path):
    short = detour.ModernBERT(detour.Config(**{**detour.asdict(CFG), "max_position_embeddings": 32}))
    detour.save_hf(short, str(tmp_path / "short"))
    with pytest.raises(SystemExit, match="exceeds max_position_embeddings 32"):
        run(["--data_dir", tiny_data, "--init_from", str(tmp_path / "short"), "--out_dir", str(tmp_path / "o"), *TINY_INIT])


def test_vocab_mismatch_is_refused(tiny_data, tmp_path):
    small = detour.ModernBERT(detour.Config(**{**detour.asdict(CFG), "vocab_size": 128}))
    detour.save_hf(small, str(tmp_path / "small"))
    with pytest.raises(SystemExit, match="larger than the model"):
        run(["--data_dir", tiny_data, "--init_from", str(tmp_path / "small"), "--out_dir", str(tmp_path / "o"), *TINY_INIT])


def test_freeze_in_phase1_then_decay_and_freeze_in_decay(tiny_data, tmp_path):
    """The paper's interventions: frozen low layers during CLM, then a normal decay; and a
    decay with frozen layers. The AdamW state must carry over either way."""
    out = str(tmp_path / "clm")
    run(["--data_dir", tiny_data, "--out_dir", out, "--max_tokens", "2048", "--freeze_layers", "0", *TINY_RUN])
    assert os.path.exists(os.path.join(out, "init", "model.safetensors"))  # step-0 weights kept
    init = detour.load_hf(os.path.join(out, "init"))
    decayed = run(["--phase", "decay", "--init_from", out, "--decay_tokens", "512", "--progress", "false"])
    assert not torch.equal(decayed.model.layers[0].attn.Wqkv.weight, init.model.layers[0].attn.Wqkv.weight)
    p1 = detour.load_hf(os.path.join(out, "hf"))
    assert torch.equal(p1.model.layers[0].attn.Wqkv.weight, init.model.layers[0].attn.Wqkv.weight)
    frozen = run(["--phase", "decay", "--init_from", out, "--decay_tokens", "512", "--progress", "false",
                  "--freeze_layers", "1", "--out_dir", str(tmp_path / "dec-frozen")])
    assert torch.equal(frozen.model.layers[1].mlp.Wi.weight, p1.model.layers[1].mlp.Wi.weight)
