"""The GPU path, as far as a CPU can run it: bf16 autocast and torch.compile against the fp32 and
eager runs, the varlen backend's plumbing against the dense-mask path, the backend decision, one
compile per phase, and bench/gpu_check.py's code at toy sizes.
Each test states its tolerance and why."""
import json
import os
import subprocess
import sys

import pytest
import torch

import detour
from bench import gpu_check
from bench.fixtures import per_document_varlen
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
    ck = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
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
    saved = torch.load(str(tmp_path / "compiled" / "ckpt.pt"), weights_only=True)["model"]
    assert set(saved) == set(want)  # no torch.compile "_orig_mod." prefixes


# ----------------------------------------------------------------------------------------
# The varlen backend (FlashAttention's variable-length kernel: CUDA only), as far as a CPU runs it
# ----------------------------------------------------------------------------------------
def tiny():
    return detour.Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, local_attention=16, pad_token_id=0, unk_token_id=1,
                         cls_token_id=2, sep_token_id=3, mask_token_id=4)


def spans_of(rows, sep=3):
    cu, longest = detour.document_spans(detour.document_ids(torch.tensor(rows), sep))
    return cu.tolist(), longest


def test_document_spans_on_packed_rows():
    """cu_seqlens from [SEP] boundaries and row ends: a [SEP] closes its document, a row end cuts
    one, a row that is one document is one span, and the empty-document cases (a row starting with
    [SEP], two [SEP]s in a row, a row of [SEP]s, a [SEP] as the last token) give spans of one token,
    never an empty span. Offsets index the flattened B x T tokens, int32 as the kernel wants."""
    S = 3
    assert spans_of([[2, 7, S, 2, 8, 9], [9, 9, S, 2, 8, S]]) == ([0, 3, 6, 9, 12], 3)  # cut at the row end
    assert spans_of([[2, 7, 8, 9, 9, 9]]) == ([0, 6], 6)                                 # one document
    assert spans_of([[S, 2, 7, S, S, 8]]) == ([0, 1, 4, 5, 6], 3)       # [SEP] first; [SEP][SEP]
    assert spans_of([[S, S, S]]) == ([0, 1, 2, 3], 1)                   # only [SEP]s: one token each
    assert spans_of([[2, 7, S], [S, 2, 7]]) == ([0, 3, 4, 6], 3)        # [SEP] last, then first
    cu, _ = detour.document_spans(torch.zeros(2, 5, dtype=torch.long))   # doc_mask off: the rows
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 10]
    g = torch.Generator().manual_seed(0)  # random rows: spans tile the tokens, one document each
    idx = torch.randint(2, 8, (3, 40), generator=g)
    doc_ids = detour.document_ids(idx, S)
    cu, longest = detour.document_spans(doc_ids)
    flat = doc_ids.reshape(-1)
    assert cu[0] == 0 and cu[-1] == idx.numel() and (cu.diff() > 0).all() and longest == cu.diff().max()
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert a // 40 == (b - 1) // 40 and (flat[a:b] == flat[a]).all()
        assert b % 40 == 0 or flat[b] != flat[b - 1]


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_path_equals_the_dense_mask_path(monkeypatch, causal):
    """The varlen backend's plumbing (spans, the flattening into one token stream, the window_size
    of each layer kind) with the kernel replaced by the per-document reference above, against the
    sdpa path (dense document mask, block-sparse window) on packed rows with documents cut at the
    row ends: each attention call's output to 1e-6, and the model's loss, logits and every gradient.
    fp32 on both sides, the same pairs summed in another order: measured differences ~1e-7."""
    import torch.nn.attention.varlen as varlen
    monkeypatch.setattr(varlen, "varlen_attn", per_document_varlen)
    c = tiny()
    B, T, H, D = 2, 70, 4, 16
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(5, c.vocab_size, (B, T), generator=g)
    idx[0, [0, 9, 10, 40]], idx[1, [25, T - 1]] = c.sep_token_id, c.sep_token_id
    doc_ids = detour.document_ids(idx, c.sep_token_id)
    spans = detour.document_spans(doc_ids)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    dense = detour.attention_fns(c, B, T, torch.device("cpu"), causal, doc_ids=doc_ids)
    sparse = detour.attention_fns(c, B, T, torch.device("cpu"), causal, backend="varlen", spans=spans)
    for kind in ("full_attention", "sliding_attention"):
        err = (sparse[kind](q, k, v) - dense[kind](q, k, v)).abs().max().item()
        assert err <= 1e-6, (kind, err)
    torch.manual_seed(0)
    m = detour.ModernBERT(c).train()
    targets = torch.where(torch.rand(B, T, generator=g) < 0.5, idx, detour.IGNORE)
    results = {}
    for backend in ("sdpa", "varlen"):
        m.model.attn_backend = backend
        m.zero_grad()
        loss = m(idx, targets, causal=causal, doc_ids=doc_ids, spans=spans)[1]
        loss.backward()
        with torch.no_grad():
            logits = m(idx, causal=causal, doc_ids=doc_ids, spans=spans)[0]
        results[backend] = loss.item(), logits, {n: p.grad.clone() for n, p in m.named_parameters()}
    (ref_loss, ref_logits, ref_grads), (loss, logits, grads) = results["sdpa"], results["varlen"]
    assert abs(loss - ref_loss) <= 1e-6 and (logits - ref_logits).abs().max() <= 1e-5
    for n, gr in ref_grads.items():
        assert torch.allclose(grads[n], gr, atol=1e-6, rtol=1e-5), n


def test_attention_backend_decision(monkeypatch, capsys):
    """Decided once at start-up. On a CPU: auto is sdpa without a word; varlen asked for falls back
    to sdpa with one warning line naming what is missing. On CUDA (faked here): varlen when the GPU
    has FlashAttention (sm80+), the run is bf16, the attention has no dropout and torch has the
    varlen module; otherwise sdpa and one line. sdpa is taken as asked, on any device."""
    pick = detour.attention_backend
    assert pick("auto", "cpu", False, 0.0) == "sdpa" and capsys.readouterr().err == ""
    assert pick("sdpa", "cpu", False, 0.0) == "sdpa" and pick("sdpa", "cuda", True, 0.0) == "sdpa"
    assert pick("varlen", "cpu", False, 0.0) == "sdpa"
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: attn_backend=varlen needs a CUDA device, bf16") and line.endswith("using sdpa")
    assert pick("varlen", "cpu", False, 0.0, warn=False) == "sdpa" and capsys.readouterr().err == ""
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    assert pick("auto", "cuda", True, 0.0) == "varlen" and pick("varlen", "cuda:0", True, 0.0) == "varlen"
    assert capsys.readouterr().err == ""
    for args, missing in (((False, 0.0), "bf16"), ((True, 0.1), "attention_dropout 0")):
        assert pick("auto", "cuda", *args) == "sdpa"
        assert capsys.readouterr().err == f"warning: attn_backend=auto needs {missing}; using sdpa\n"
    capability[0] = (7, 5)  # a V100 / T4: no FlashAttention
    assert pick("auto", "cuda", True, 0.0) == "sdpa" and "needs sm80+" in capsys.readouterr().err
    capability[0] = (8, 0)
    monkeypatch.setattr(detour.importlib.util, "find_spec", lambda name: None)  # an older torch
    assert pick("auto", "cuda", True, 0.0) == "sdpa" and "needs torch >= 2.10" in capsys.readouterr().err


def test_varlen_asked_for_on_cpu_warns_once_and_trains_as_sdpa(tiny_data, tmp_path, capsys):
    """--attn_backend varlen where it cannot run: one warning line at start-up (not per step), then
    the sdpa run, bit for bit (the same code runs; tolerance 0)."""
    args = ["--data_dir", tiny_data, "--phase", "clm", "--max_tokens", "1024", *TINY_RUN]
    run(args + ["--attn_backend", "sdpa", "--out_dir", str(tmp_path / "sdpa")])
    capsys.readouterr()
    run(args + ["--attn_backend", "varlen", "--out_dir", str(tmp_path / "varlen")])
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 1 and "attn_backend=varlen needs a CUDA device" in warned[0], warned
    timeless = lambda rows: [{k: v for k, v in r.items() if k != "tok_per_s"} for r in rows]  # noqa: E731
    assert timeless(log(str(tmp_path / "varlen"))) == timeless(log(str(tmp_path / "sdpa")))


# ----------------------------------------------------------------------------------------
# One compile: the head at a fixed capacity
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_fixed_capacity_head_gives_todays_loss_and_gradients(causal):
    """ModernBERT.forward with `capacity` (what --compile uses: the supervised positions first, then
    padding slots with IGNORE targets) against the eager path (only the supervised positions): the
    loss to 1e-6 and every gradient to 1e-6 (fp32; the padding rows add exact zeros, but the matmuls
    see other shapes, so sums may round differently); also at capacity = every position."""
    c = tiny()
    torch.manual_seed(0)
    m = detour.ModernBERT(c).train()
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(5, c.vocab_size, (2, 40), generator=g)
    targets = torch.where(torch.rand(2, 40, generator=g) < 0.3, idx, detour.IGNORE)
    n = int((targets != detour.IGNORE).sum())
    results = []
    for capacity in (None, n + 7, 80):
        m.zero_grad()
        loss = m(idx, targets, causal=causal, capacity=capacity)[1]
        loss.backward()
        results.append((loss.item(), {k: p.grad.clone() for k, p in m.named_parameters()}))
    (want, ref), *rest = results
    for got, grads in rest:
        assert abs(got - want) <= 1e-6
        for k, gr in ref.items():
            assert torch.allclose(grads[k], gr, atol=1e-6, rtol=0), k


def test_head_capacity_holds_every_masked_count_and_all_of_clm():
    """detour.head_capacity, the one formula prepare and gpu_check use: every position for CLM
    (rate 1); for MLM 30% of an 8192-token window it covers the largest of 2,000 binomial draws of
    the masked count (above it, a batch would take a second compiled shape) and stays within 15% of
    the mean (8 standard deviations are 13.5% there; a loose bound wastes head work on every step)."""
    for n in (1, 128, 8192, 16384):
        assert detour.head_capacity(n, 1.0) == n
    n, rate = 8192, 0.3
    cap = detour.head_capacity(n, rate)
    torch.manual_seed(0)
    draws = torch.distributions.Binomial(n, torch.full((2000,), rate)).sample()
    assert draws.max().item() <= cap <= 1.15 * rate * n


def test_compile_does_not_recompile_after_the_first_step(tiny_data, tmp_path, monkeypatch):
    """20 MLM steps, then 20 CLM steps, under --compile true: the number of graphs torch._dynamo has
    compiled (its counters) after the first step of each phase stays the same to the last step
    (before the fixed-capacity head, every new count of masked tokens was a new graph, up to the
    recompile limit). Evaluation runs the raw model eager: not counted, and not compiled."""
    import shutil
    if not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        pytest.skip("no C++ compiler: torch.compile (inductor) cannot build CPU kernels here")
    from torch._dynamo.utils import counters
    seen = []
    check = detour.check_finite
    monkeypatch.setattr(detour, "check_finite", lambda cfg, r, step: seen.append(
        (cfg.phase, step, counters["stats"]["unique_graphs"], sum(counters["recompiles"].values()))) or check(cfg, r, step))
    torch._dynamo.reset()
    counters.clear()
    for phase in ("mlm", "clm"):
        run(["--data_dir", tiny_data, "--phase", phase, *TINY_RUN, "--seq_len", "32", "--batch_size", "2",
             "--global_batch_size", "2", "--max_tokens", str(20 * 64), "--eval_interval", "1000", "--eval_tokens", "64",
             "--ckpt_interval", "1000", "--compile", "true", "--out_dir", str(tmp_path / phase)])
    for phase in ("mlm", "clm"):
        rows = [r for r in seen if r[0] == phase]
        assert len(rows) >= 20 and rows[0][1] == 1, rows
        assert all(r[2:] == rows[0][2:] for r in rows), rows
    assert seen[-1][2] >= 2  # a graph per phase at least: the counter counts


# ----------------------------------------------------------------------------------------
# bench/gpu_check.py on a CPU
# ----------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu_check would run for real")
def test_gpu_check_without_cuda_is_one_line_and_exit_0():
    p = subprocess.run([sys.executable, os.path.join("bench", "gpu_check.py")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device"), p.stdout


def test_gpu_check_smoke_on_cpu(tmp_path):
    """All of gpu_check's code at toy sizes on the CPU (--device cpu --smoke): parity with
    transformers, causality, varlen vs sdpa (a skip here: no CUDA), detour.main end to end, speed rows
    with the SDPA kernel probe, the table and the JSON. DDP is skipped there without GPUs, so
    its torchrun comparison runs here on gloo. Compiled speed rows are not run (compile time)."""
    gc = gpu_check
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
