"""The GPU path, as far as a CPU can run it: bf16 autocast, torch.compile and FlexAttention
against the fp32 / eager / SDPA runs, and tests/gpu_check.py's code at toy sizes.
Each test states its tolerance and why."""
import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import detour
from conftest import ROOT, TINY_RUN


def run(argv):
    return detour.main(list(argv))


def log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def safetensors_dtypes(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


# ----------------------------------------------------------------------------------------
# bf16
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("phase", ["clm", "mlm"])
def test_bf16_training_tracks_fp32_and_saves_fp32(tiny_data, tmp_path, phase):
    """--dtype bfloat16 (autocast on CPU) against --dtype float32: same seed, data and batches.
    Tolerance 2e-3 on each logged train loss (and the validation loss), about 0.04% of the
    ~5.5 loss: bf16 rounds matmul inputs to 8 bits of mantissa (relative 2^-9), and the loss
    averages those errors over the few hundred predicted tokens of a step; measured 2.1e-4
    (clm and mlm) over 4 steps, 1e-5 and 1.1e-4 on the validation loss. The runs must also differ at all, or bf16 was not on.
    The weights stay fp32 under autocast: the checkpoint and the HF export are float32."""
    args = ["--data_dir", tiny_data, "--phase", phase, "--max_tokens", "2048", *TINY_RUN, "--eval_interval", "100"]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        out = str(tmp_path / dtype)
        model = run(args + ["--dtype", dtype, "--out_dir", out])
        runs[dtype] = (log(out), model, out)
    (ref, _, _), (got, model, out) = runs["float32"], runs["bfloat16"]
    assert len(got) == len(ref) == 4
    dev = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, ref))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in got)
    assert 0 < dev <= 2e-3, dev
    assert abs(got[-1]["val_loss"] - ref[-1]["val_loss"]) <= 2e-3
    ck = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert all(t.dtype == torch.float32 for t in ck["model"].values())
    assert all(v.dtype == torch.float32 for s in ck["optimizer"]["state"].values() for k, v in s.items()
               if k != "step")
    assert set(safetensors_dtypes(os.path.join(out, "hf", "model.safetensors")).values()) == {"F32"}
    back = detour.load_hf(os.path.join(out, "hf"))
    for k, v in model.state_dict().items():
        assert back.state_dict()[k].dtype == torch.float32 and torch.equal(back.state_dict()[k], v), k


# ----------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------
def test_compile_matches_eager(tiny_data, tmp_path):
    """--compile true (inductor, C++ kernels on CPU) for 2 CLM steps and the final evaluation,
    against eager. Tolerance 1e-4 on the logged losses (5 decimals) and 1e-5 on the weights:
    fp32 throughout, and inductor's fused kernels only reorder sums (relative ~1e-7), which two
    AdamW steps at lr 3e-3 cannot grow to 1e-5; measured 0 (losses) and 4.8e-8 (weights).
    Cost: one compile of the training and evaluation graphs, 65 s with a cold inductor cache on
    this 2-core machine (busy, one thread), 7 s once inductor's on-disk cache holds them."""
    import shutil
    if not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):  # inductor's CPU backend
        pytest.skip("no C++ compiler: torch.compile (inductor) cannot build CPU kernels here")
    args = ["--data_dir", tiny_data, "--phase", "clm", *TINY_RUN, "--seq_len", "32", "--batch_size", "2",
            "--global_batch_size", "2", "--max_tokens", "128", "--eval_tokens", "64", "--eval_interval", "100",
            "--dtype", "float32"]
    eager = run(args + ["--out_dir", str(tmp_path / "eager")])
    compiled = run(args + ["--compile", "true", "--out_dir", str(tmp_path / "compiled")])
    ref, got = log(str(tmp_path / "eager")), log(str(tmp_path / "compiled"))
    assert len(got) == len(ref) == 2
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-4, (a, b)
    assert abs(got[-1]["val_loss"] - ref[-1]["val_loss"]) <= 1e-4
    want = eager.state_dict()
    for k, v in compiled.state_dict().items():
        assert torch.allclose(v, want[k], atol=1e-5, rtol=0), (k, (v - want[k]).abs().max())
    saved = torch.load(str(tmp_path / "compiled" / "ckpt.pt"), weights_only=False)["model"]
    assert set(saved) == set(want)  # no torch.compile "_orig_mod." prefixes


# ----------------------------------------------------------------------------------------
# FlexAttention
# ----------------------------------------------------------------------------------------
def reference_mask(B, T, causal, window, attention_mask, doc_ids):
    """The attention rule restated here, independently of detour: True = query i sees key j."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    ok = torch.ones(B, T, T, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= (i - j).abs() <= window
    if doc_ids is not None:
        ok &= doc_ids[:, :, None] == doc_ids[:, None, :]
    if attention_mask is not None:
        ok &= attention_mask[:, None, :].bool()
    return (ok | (i == j))[:, None]


@pytest.mark.parametrize("causal", [False, True])
def test_flex_block_mask_across_tiles_matches_sdpa(causal):
    """flex_attention (eager, forward: CPU has no flex backward) under detour's BlockMask against
    SDPA under the rule restated above, at T = 300: three 128-token tiles, the last one ragged,
    the real local window (64 each side), packed documents and padding, and the broadcast mask
    (no per-row masks). Tolerance 1e-5: fp32, the same keys, sums in another order; measured 7e-7.
    The local and causal masks must also skip tiles (that is what flex buys)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    B, H, T, D, window = 2, 2, 300, 16, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    sep = torch.rand(B, T, generator=g) < 0.02
    doc_ids = torch.cumsum(sep.long(), 1) - sep.long()
    am = torch.ones(B, T, dtype=torch.long)
    am[1, T - 70:] = 0
    for masks in ((None, None), (am, doc_ids)):
        for w in (None, window):
            want = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=reference_mask(B, T, causal, w, *masks))
            bm = detour.flex_block_mask(B, T, "cpu", causal, w, *masks)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # eager flex_attention: the unfused reference path
                got = flex.flex_attention(q, k, v, block_mask=bm)
            err = (got - want).abs().max().item()
            assert err <= 1e-5, (causal, w, masks[0] is not None, err)
            tiles = bm.kv_num_blocks + (0 if bm.full_kv_num_blocks is None else bm.full_kv_num_blocks)
            assert tiles.shape[-1] == 3 and (tiles <= 3).all()  # 3 x 3 tiles of 128 at T = 300
            if causal or w is not None:  # (BlockMask.sparsity() miscounts a ragged last tile: not used)
                assert (tiles.sum(-1) < 9).all(), (causal, w, tiles)


def test_flex_on_cpu_falls_back_to_sdpa_in_training(tiny_data, tmp_path):
    """Where flex cannot run (CPU: no flex backward), attn_backend=flex warns and runs SDPA:
    the same outputs and gradients, bit for bit (tolerance 0: the same code runs), with
    causal attention and documents in training mode, and the same losses through detour.main."""
    c = detour.Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, local_attention=16, pad_token_id=0, unk_token_id=1,
                      cls_token_id=2, sep_token_id=3, mask_token_id=4)
    torch.manual_seed(0)
    m = detour.ModernBERT(c).train()
    idx = torch.randint(5, c.vocab_size, (2, 50), generator=torch.Generator().manual_seed(1))
    idx[:, 20] = c.sep_token_id
    doc_ids = detour.document_ids(idx, c.sep_token_id)
    targets = torch.roll(idx, -1, 1)
    results = {}
    for backend in ("sdpa", "flex"):
        m.model.attn_backend = backend
        m.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, loss = m(idx, targets, causal=True, doc_ids=doc_ids)
            loss.backward()
        results[backend] = (loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()},
                            [str(w.message) for w in caught])
    assert not results["sdpa"][2] and any("using sdpa" in w for w in results["flex"][2])
    assert results["flex"][0] == results["sdpa"][0]
    for n, g in results["sdpa"][1].items():
        assert torch.equal(results["flex"][1][n], g), n
    args = ["--data_dir", tiny_data, "--phase", "clm", "--max_tokens", "1024", *TINY_RUN]
    run(args + ["--out_dir", str(tmp_path / "sdpa")])
    with pytest.warns(UserWarning, match="using sdpa"):
        run(args + ["--attn_backend", "flex", "--out_dir", str(tmp_path / "flex")])
    timeless = lambda rows: [{k: v for k, v in r.items() if k != "tok_per_s"} for r in rows]  # noqa: E731
    assert timeless(log(str(tmp_path / "flex"))) == timeless(log(str(tmp_path / "sdpa")))


# ----------------------------------------------------------------------------------------
# tests/gpu_check.py on a CPU
# ----------------------------------------------------------------------------------------
def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "tests", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu_check would run for real")
def test_gpu_check_without_cuda_is_one_line_and_exit_0():
    p = subprocess.run([sys.executable, os.path.join("tests", "gpu_check.py")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device"), p.stdout


def test_gpu_check_smoke_on_cpu(tmp_path):
    """All of gpu_check's code at toy sizes on the CPU (--device cpu --smoke): parity with
    transformers, causality, flex vs sdpa (a fallback here), detour.main end to end, speed rows
    with the SDPA kernel probe, the table and the JSON. DDP is skipped there without GPUs, so
    its torchrun comparison runs here on gloo. Compiled speed rows are not run (compile time)."""
    gc = load_gpu_check()
    assert not [n for n in dir(gc) if n.startswith("test")]  # nothing pytest could collect
    out = tmp_path / "gpu_check.json"
    assert gc.main(["--device", "cpu", "--smoke", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    rows = summary["rows"]
    assert summary["ok"] and not [r for r in rows if r["status"] == "FAIL"]
    checks = {r["check"] for r in rows if r["status"] == "ok"}
    assert checks == {"parity", "backends", "speed"}
    assert sum(r["check"] == "parity" for r in rows) == 6      # fp32, bf16, 4 causality rows
    speed = [r for r in rows if r.get("tok_s")]
    assert {(r["phase"], r["T"]) for r in speed} == {(p, T) for p in ("mlm", "clm") for T in (64, 128)}
    assert all(r["hf_tok_s"] > 0 and r["mfu"] is None and r["peak_gib"] is None for r in speed)
    kernels = [r for r in rows if "sdpa_ran" in r]
    assert len(kernels) == 2 and all(r["sdpa_ran"]["global"] and r["sdpa_ran"]["local"] for r in kernels)
    assert all(r["sdpa_can"]["math"] for r in kernels)
    report = gc.Report()
    gc.check_ddp(report, "cpu", str(tmp_path / "ddp"), dtypes=("float32",), preset="tiny", seq_len=64)
    (row,) = report.rows
    assert row["status"] == "ok" and len(row["one"]) == 8, row
