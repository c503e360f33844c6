"""One command for the first minutes on a GPU: is detour's GPU path right, and how fast is it?

    python bench/gpu_check.py                      # everything, about 8 minutes on one H100/H200
    python bench/gpu_check.py --quick              # about 3 minutes: T = 8192 only, no compiled rows
    python bench/gpu_check.py --budget 300 --out out/gpu_check.json
    python bench/gpu_check.py --device cpu --smoke # the same code at toy sizes on a CPU (what the tests run)

A script, not a test: pytest collects test_*.py only, and nothing here is named test_*.
Without CUDA (and without --device cpu) it prints one line and exits 0. On a GPU it runs, in order:
  1 parity    detour's ModernBERT against transformers' ModernBertForMaskedLM (sdpa), same weights
              (save_hf -> from_pretrained), padded batch, bidirectional (HF has no causal mode):
              fp32 with TF32 off to 1e-4, bf16 autocast to a relative bound; then the causal
              flag's causality check (future tokens never move earlier outputs under causal=True,
              and do move them under causal=False), fp32 and bf16, with and without documents.
  2 backends  attn_backend varlen (FlashAttention's variable-length kernel on document spans)
              against sdpa (dense document mask) on packed documents cut at row ends, with
              padding, causal and bidirectional: logits and every parameter's gradient, within the
              bf16 bound; an error or a fallback fails loudly. Then detour.main end to end on this
              device (bf16, --compile true, --attn_backend varlen, no warning allowed) against the
              same run eager with sdpa, and the compiled run's recompiles.
  3 speed     training steps (fwd + bwd + fused AdamW) of the base preset in bf16 at 1024, 4096,
              8192 tokens, CLM and MLM, varlen and sdpa, eager and compiled: tokens/s, MFU on the
              allowed pairs (detour.model_flops with the batch's document lengths over
              device_peak_flops), peak memory (reset per row), CLM/MLM step time, against HF's
              ModernBertForMaskedLM (sdpa) on the same batch; which SDPA kernel the global and
              local layers ran with the document mask.
  4 ddp       with 2+ GPUs: torchrun on 2 GPUs gives the loss curve of 1 GPU with the same global
              batch (NCCL), fp32 and bf16. One GPU: a printed skip.
It prints one summary table and writes it as JSON (--out). Exit status 1 if a check fails. A
speed row fails only if it errors or its loss is not finite; the targets (base, T = 8192, the
default backend compiled: MLM >= 350K tokens/s and MFU >= 40% on one H100/H200, CLM step time /
MLM step time <= 1.1) are reported, and fail the run with --strict.
"""
import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import contextlib
import io
import time
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a file (python bench/x.py), not imported: the repository root, for detour and bench
    sys.path.insert(0, ROOT)
import detour  # noqa: E402
from bench.fixtures import write_tiny_data  # noqa: E402

IGNORE = -100  # no-loss target: detour's and transformers' convention
SPECIAL = dict(pad_token_id=0, unk_token_id=1, cls_token_id=2, sep_token_id=3, mask_token_id=4)
# Tolerances, and why.
FP32_PARITY = 1e-4   # max |logit difference| on real tokens, fp32, TF32 off: as the CPU tests
BF16_REL = 2e-2      # bf16 keeps 8 bits of mantissa (2^-8 = 0.4% per rounding); a few layers of
                     # roundings in two different orders stay within 2% of the largest value
CAUSAL_LEAK = 1e-5   # causal=True: earlier outputs must not move (float noise at most)
CAUSAL_SEEN = 1e-4   # causal=False: future tokens must move them by more than this (as the CPU test)
DDP_ATOL = {"float32": 1e-3, "bfloat16": 2e-2}  # logged loss, 1 vs 2 GPUs: fp32 differs only in
# reduction order (NCCL ring vs one GPU's sum, atomics in attention backward); bf16 roundings amplify it
TARGET_TOK_S, TARGET_MFU = 350_000, 0.40


class Report:
    """Rows of the summary table; status: ok | FAIL | skip | info | miss (target missed)."""

    def __init__(self):
        self.rows = []

    def add(self, check, case, status, value=None, bound=None, detail="", **extra):
        row = dict(check=check, case=case, status=status, value=value, bound=bound, detail=detail, **extra)
        self.rows.append(row)
        shown = "" if value is None else f" {fmt(value)}" + ("" if bound is None else f" (bound {fmt(bound)})")
        print(f"[{check}] {case}: {status}{shown} {detail}".rstrip(), flush=True)
        return row

    def failed(self, strict=False):
        return [r for r in self.rows if r["status"] == "FAIL" or (strict and r["status"] == "miss")]


def fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextmanager
def tf32_off():
    """fp32 matmuls in full precision (no TF32) for the fp32 parity; restored after."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def dynamo_graphs():
    """How many graphs torch._dynamo has compiled in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def bf16(device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def rel_err(a, b, keep=None):
    """max |a - b| / max |b| (on the positions `keep`, a boolean (B, T) mask, when given)."""
    a, b = a.float(), b.float()
    if keep is not None:
        a, b = a[keep], b[keep]
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def abs_err(a, b, keep):
    return (a.float() - b.float())[keep].abs().max().item()


# ----------------------------------------------------------------------------------------
# Models and batches
# ----------------------------------------------------------------------------------------
def check_config(device, smoke):
    """A small config for the numerical checks: head_dim 64 and the real 128-token local window
    on a GPU; the CPU tests' tiny one with --smoke."""
    if smoke:
        return detour.Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                             num_attention_heads=4, local_attention=16, max_position_embeddings=512, **SPECIAL)
    return detour.Config(vocab_size=1024, hidden_size=256, intermediate_size=384, num_hidden_layers=6,
                         num_attention_heads=4, local_attention=128, max_position_embeddings=2048, **SPECIAL)


def hf_copy(model):
    """transformers' ModernBertForMaskedLM (sdpa) with the weights of `model` (via save_hf)."""
    import transformers
    with tempfile.TemporaryDirectory() as d:
        detour.save_hf(model, d)
        return transformers.AutoModelForMaskedLM.from_pretrained(d, attn_implementation="sdpa")


def random_model(config, seed=0):
    """A ModernBERT whose norms and decoder bias are perturbed, so that every parameter matters."""
    torch.manual_seed(seed)
    m = detour.ModernBERT(config)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n or "bias" in n:
                p.add_(0.1 * torch.randn_like(p))
    return m


def padded_batch(c, B, T, seed):
    """Random tokens, with padding at the end of rows 1 and 2: (idx, attention_mask) on CPU."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(5, c.vocab_size, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    if B >= 3:
        am[1, T - T // 5:] = 0
        am[2, T - 1:] = 0
    idx[am == 0] = c.pad_token_id
    return idx, am


def packed_rows(c, B, T, seed, min_doc=50, max_doc=1000):
    """B rows of T + 1 tokens of packed documents ([CLS] random tokens [SEP] ...), on CPU."""
    g = np.random.default_rng(seed)
    rows = []
    for _ in range(B):
        row = []
        while len(row) < T + 1:
            row += [c.cls_token_id, *g.integers(5, c.vocab_size, int(g.integers(min_doc, max_doc))), c.sep_token_id]
        rows.append(row[:T + 1])
    return torch.tensor(rows)


def training_batch(c, buf, phase, seed):
    """(inputs, targets) as detour trains: CLM next-token targets except after [SEP]; MLM 30% of
    the non-special tokens chosen (80% [MASK], 10% random, 10% kept), loss there only."""
    if phase == "clm":
        x, y = buf[:, :-1], buf[:, 1:].clone()
        y[x == c.sep_token_id] = IGNORE
        return x, y
    g = torch.Generator().manual_seed(seed)
    x = buf[:, :-1].clone()
    chosen = (torch.rand(x.shape, generator=g) < 0.30) & ~torch.isin(x, torch.tensor(c.special_ids))
    y = torch.where(chosen, x, IGNORE)
    action = torch.rand(x.shape, generator=g)
    x[chosen & (action < 0.8)] = c.mask_token_id
    rand = chosen & (action >= 0.8) & (action < 0.9)
    x[rand] = torch.randint(5, c.vocab_size, (int(rand.sum()),), generator=g)
    return x, y


# ----------------------------------------------------------------------------------------
# 1. Parity with transformers, and causality
# ----------------------------------------------------------------------------------------
def check_parity(report, device, smoke=False):
    c = check_config(device, smoke)
    ours = random_model(c)
    hf = hf_copy(ours).to(device).eval()
    ours = ours.to(device).eval()
    B, T = 3, (40 if smoke else 300)  # 300: more than two local windows, not a multiple of 128
    idx, am = (t.to(device) for t in padded_batch(c, B, T, seed=1))
    keep = am.bool()  # pad positions' outputs are unspecified: real tokens only
    with torch.no_grad():
        with tf32_off():
            want = hf(input_ids=idx, attention_mask=am).logits.float()
            got = ours(idx, attention_mask=am)[0].float()
        e = abs_err(got, want, keep)
        report.add("parity", f"fp32 TF32 off, bidirectional, padding, T={T}: max |logit diff|",
                   "ok" if e <= FP32_PARITY else "FAIL", e, FP32_PARITY)
        with bf16(device):
            hf_b = hf(input_ids=idx, attention_mask=am).logits.float()
            ours_b = ours(idx, attention_mask=am)[0].float()
        e, e_hf = rel_err(ours_b, want, keep), rel_err(hf_b, want, keep)
        report.add("parity", "bf16 autocast vs HF fp32: max |diff| / max |logit|",
                   "ok" if e <= BF16_REL else "FAIL", e, BF16_REL,
                   f"(HF's own bf16: {e_hf:.3g}; ours vs HF both bf16: {rel_err(ours_b, hf_b, keep):.3g})")
    del hf
    check_causality(report, device, ours, c, T)
    del ours
    free(device)


def check_causality(report, device, model, c, T):
    """causal=True: replacing the tokens after t leaves outputs at <= t unchanged; causal=False:
    it changes them. Without documents the global layers take SDPA's is_causal path (on CUDA a
    flash kernel); with documents a dense mask (another kernel): both are checked."""
    idx, _ = padded_batch(c, 1, T, seed=2)
    idx = idx.to(device)
    doc = torch.zeros_like(idx)
    doc[:, T // 2:] = 1  # two documents; no [SEP] needed, doc_ids are given
    g = torch.Generator().manual_seed(3)
    for dtype in ("float32", "bfloat16"):
        for doc_ids in (None, doc):
            leak, seen = 0.0, float("inf")
            with torch.no_grad(), tf32_off(), (bf16(device) if dtype == "bfloat16" else nullcontext()):
                for t in (0, 10, T // 2 - 1, T // 2 + 5, T - 2):
                    changed = idx.clone()
                    changed[0, t + 1:] = torch.randint(5, c.vocab_size, (T - t - 1,), generator=g).to(device)
                    a, b = model(idx, causal=True, doc_ids=doc_ids)[0], model(changed, causal=True, doc_ids=doc_ids)[0]
                    leak = max(leak, (a[0, :t + 1].float() - b[0, :t + 1].float()).abs().max().item())
                    if doc_ids is None or t >= T // 2:  # (a first-document token cannot see the second)
                        a, b = (model(idx, doc_ids=doc_ids)[0], model(changed, doc_ids=doc_ids)[0])
                        seen = min(seen, (a[0, :t + 1].float() - b[0, :t + 1].float()).abs().max().item())
            case = f"causal flag, {dtype}, {'documents' if doc_ids is not None else 'no documents'}"
            ok = leak <= CAUSAL_LEAK and seen > CAUSAL_SEEN
            report.add("parity", case + ": past moved by", "ok" if ok else "FAIL", leak, CAUSAL_LEAK,
                       f"(bidirectional: moved by >= {seen:.3g}, must be > {CAUSAL_SEEN})")


# ----------------------------------------------------------------------------------------
# 2. Backends: varlen vs sdpa, and detour.main end to end on this device
# ----------------------------------------------------------------------------------------
def forward_backward(model, backend, idx, am, doc, causal, weight, device):
    """Logits and every parameter's gradient of sum(logits * weight) with one backend, in bf16. varlen
    gets the spans of the documents and of the padding (document_spans on doc_ids x 2 + padding)."""
    model.model.attn_backend = backend
    model.zero_grad(set_to_none=True)
    cu, longest = detour.document_spans((doc * 2 + (am == 0)).cpu())
    with bf16(device):
        logits = model(idx, attention_mask=am, causal=causal, doc_ids=doc, spans=(cu.to(device), longest))[0]
    (logits.float() * weight).sum().backward()
    return logits.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


def check_backends(report, device, smoke=False):
    if device.type != "cuda":
        report.add("backends", "varlen vs sdpa", "skip", detail="the varlen kernel needs CUDA; "
                   "tests/test_gpu_path.py checks its plumbing on the CPU against a per-document reference")
        return
    c = check_config(device, smoke)
    model = random_model(c).to(device).eval()  # eval: no dropout (none configured anyway)
    B, T = 2, (96 if smoke else 1024)
    buf = packed_rows(c, B, T, seed=4, min_doc=T // 8, max_doc=T // 2)
    idx = buf[:, :-1].to(device)
    doc = detour.document_ids(idx, c.sep_token_id)
    am = torch.ones_like(idx)
    am[1, T - T // 4:] = 0  # padding at the end of row 1
    keep = am.bool()
    weight = torch.randn(B, T, c.vocab_size, generator=torch.Generator().manual_seed(5)).to(device) * keep[..., None]
    for causal in (False, True):
        case = f"varlen vs sdpa, {'causal' if causal else 'bidirectional'}, documents + padding, T={T}"
        try:
            ref, ref_grads = forward_backward(model, "sdpa", idx, am, doc, causal, weight, device)
            got, grads = forward_backward(model, "varlen", idx, am, doc, causal, weight, device)
        except Exception as e:  # the kernel must run here: an error is a failure, loudly
            traceback.print_exc()
            report.add("backends", case, "FAIL", detail=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        e = rel_err(got, ref, keep)
        eg = max(((grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in ref_grads.items())
        report.add("backends", case + ": logits max rel diff", "ok" if max(e, eg) <= BF16_REL else "FAIL", e,
                   BF16_REL, f"(grads: max over params of |g_varlen - g_sdpa| / |g_sdpa| = {eg:.3g})")
    model.model.attn_backend = "sdpa"
    del model
    free(device)


def logged_losses(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def check_training_run(report, device, workdir, compile_=True):
    """detour.main on this device, one process: bf16, --compile, --attn_backend varlen (the GPU
    training path: autocast, fused AdamW, compile, the varlen kernel, prefetch, eval, checkpoint,
    HF export) against the same run eager with sdpa; then the export loads back. On CUDA the
    varlen run must not fall back (no warning line) and must not recompile after its first step."""
    data = write_tiny_data(os.path.join(workdir, "data"))
    base = ["--data_dir", data, "--phase", "clm", "--init_from", "scratch", "--preset", "tiny", "--seq_len", "256", "--batch_size", "4",
            "--global_batch_size", "8", "--max_tokens", str(6 * 8 * 256), "--learning_rate", "1e-3",
            "--warmup_tokens", "2048", "--progress", "false", "--log_interval", "1", "--eval_interval", "1000",
            "--eval_tokens", "2048", "--device", str(device), "--dtype", "bfloat16"]
    fast = ["--compile", str(compile_).lower(), "--attn_backend", "varlen"]
    runs = {}
    for name, extra in (("eager sdpa", ["--compile", "false", "--attn_backend", "sdpa"]), ("fast", fast)):
        out = os.path.join(workdir, name.replace(" ", "_"))
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        err, graphs = io.StringIO(), []
        step_hook = detour.check_finite  # called once per logged step: the compiled graphs so far
        detour.check_finite = lambda cfg, run, step: graphs.append(dynamo_graphs()) or step_hook(cfg, run, step)
        t0 = time.time()
        try:
            with contextlib.redirect_stderr(err):
                detour.main(base + extra + ["--out_dir", out])
        finally:  # detour.main takes SIGINT/SIGTERM for its checkpoints: give Ctrl-C back
            detour.check_finite = step_hook
            for sig, h in handlers.items():
                signal.signal(sig, h)
        sys.stderr.write(err.getvalue())
        runs[name] = (logged_losses(out), time.time() - t0, "using sdpa" in err.getvalue(), graphs)
    (ref, t_ref, _, _), (got, t_got, fell_back, graphs) = runs["eager sdpa"], runs["fast"]
    e = max(abs(a - b) for a, b in zip(got, ref)) / max(abs(b) for b in ref)
    case = f"detour.main clm bf16 {'compile+' if compile_ else ''}varlen vs eager sdpa, {len(ref)} steps: loss max rel diff"
    bad = len(got) != len(ref) or not all(map(math.isfinite, got)) or e > BF16_REL
    recompiled = graphs and graphs[-1] != graphs[0]
    if device.type == "cuda" and (fell_back or recompiled):
        bad, note = True, " varlen fell back to sdpa on CUDA" if fell_back else f" recompiled: graphs {graphs}"
    else:
        note = " [varlen fell back to sdpa: no CUDA]" if fell_back else ""
    back = detour.load_hf(os.path.join(workdir, "fast", "hf"))
    fp32 = all(p.dtype == torch.float32 for p in back.state_dict().values() if p.is_floating_point())
    report.add("backends", case, "FAIL" if bad or not fp32 else "ok", e, BF16_REL,
               f"({t_got:.0f} s vs {t_ref:.0f} s; HF export fp32 and loads: {fp32}){note}")


# ----------------------------------------------------------------------------------------
# 3. Speed
# ----------------------------------------------------------------------------------------
def sdpa_kernels(model, x, doc, causal, device, T):
    """Which SDPA kernel the layers ran with the document mask, read from the profiler's aten
    op names (global layers: queries of length T; local: blocks of local_attention // 2), and
    which kernels can run this model at all (torch.nn.attention.sdpa_kernel, one at a time)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile
    ran = {"global": Counter(), "local": Counter()}
    with torch.no_grad(), bf16(device):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            model(x, causal=causal, doc_ids=doc)
        for ev in prof.events():
            if ev.name.startswith("aten::_scaled_dot_product"):
                kind = "global" if ev.input_shapes and len(ev.input_shapes[0]) == 4 and ev.input_shapes[0][2] == T \
                    else "local"
                ran[kind][ev.name.replace("aten::_scaled_dot_product_", "")] += 1
        can = {}
        for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
            try:
                with sdpa_kernel(b), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model(x, causal=causal, doc_ids=doc)
                sync(device)
                can[b.name.lower()] = True
            except Exception:  # "No available kernel", or a kernel this build lacks
                can[b.name.lower()] = False
    return {k: dict(v) for k, v in ran.items()}, can


def time_steps(step, device, warmup, steps):
    """(first step seconds, median step seconds, peak bytes, step bytes, last loss): warm-up steps
    untimed apart from the first (compilation), then `steps` timed steps, torch.cuda.synchronize
    around every timer; peak memory reset just before the timed steps."""
    first = None
    for i in range(warmup):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        first = first if first is not None else time.perf_counter() - t0
    peak = base = None
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times, loss = [], None
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        loss = step()
        sync(device)
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    return first, float(np.median(times)), peak, None if peak is None else peak - base, loss.item()


def head_capacity(phase, n):
    """The compiled head's fixed slots for n tokens, as detour.prepare sets them, at this phase's rate
    (training_batch masks MLM at 30%)."""
    return detour.head_capacity(n, 1.0 if phase == "clm" else 0.3)


def check_speed(report, device, preset="base", lengths=(1024, 4096, 8192), tokens=16384, phases=("mlm", "clm"),
                modes=("eager", "compiled"), steps=5, warmup=2, deadline=float("inf"), hf_rows=True,
                backends=("varlen", "sdpa")):
    import transformers
    config = detour.Config(vocab_size=50368, max_position_embeddings=max(8192, max(lengths)), **SPECIAL,
                           **detour.PRESETS[preset])  # the real ModernBERT vocabulary: the head weighs its weight
    torch.manual_seed(0)
    ours = detour.ModernBERT(config)
    hf = hf_copy(ours).to(device).train() if hf_rows else None
    ours = ours.to(device).train()
    opt_cfg = SimpleNamespace(learning_rate=2e-4, weight_decay=1e-5, beta1=0.9, beta2=0.98, eps=1e-6)
    opt = detour.make_optimizer(ours, opt_cfg, fused=device.type == "cuda")  # fused AdamW on CUDA, as trained
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=2e-4, fused=device.type == "cuda" or None) if hf else None
    peak_flops = detour.device_peak_flops(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report.add("speed", f"{preset} preset, {ours.num_params() / 1e6:.1f}M params, {where}", "info",
               detail=f"bf16 peak {peak_flops / 1e12:.0f} TFLOP/s" if peak_flops else "no bf16 peak known: no MFU")
    # Which SDPA kernel the layers run with the document mask on (eager model, longest length).
    T = max(lengths)
    for phase in phases:
        x, _ = training_batch(config, packed_rows(config, max(1, tokens // T), T, seed=T), phase, seed=T)
        doc = detour.document_ids(x, config.sep_token_id)
        try:
            ran, can = sdpa_kernels(ours, x.to(device), doc.to(device), phase == "clm", device, T)
            report.add("speed", f"sdpa kernels, {phase} T={T}, document mask", "info",
                       detail=f"ran: global {ran['global']}, local {ran['local']}; can run: "
                              + ", ".join(k for k, v in can.items() if v), sdpa_ran=ran, sdpa_can=can)
        except Exception as e:
            traceback.print_exc()
            report.add("speed", f"sdpa kernels, {phase} T={T}", "FAIL", detail=f"{type(e).__name__}: {e}"[:200])
    runners = {"eager": ours}
    if "compiled" in modes:
        limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        setattr(torch._dynamo.config, limit, 64)  # a graph per (T, phase, backend) row
        runners["compiled"] = torch.compile(ours)  # as detour.setup compiles: dynamic=None
    # Longest first: the target length is measured before the budget runs out; per length and
    # phase, HF, then ours eager, then ours compiled, on the same batch.
    for T in sorted(lengths, reverse=True):
        for phase in phases:
            B = max(1, tokens // T)
            x, y = training_batch(config, packed_rows(config, B, T, seed=T), phase, seed=T)
            doc = detour.document_ids(x, config.sep_token_id)
            cu, longest = detour.document_spans(doc)
            n_pred = int((y != IGNORE).sum())
            capacity = head_capacity(phase, B * T)
            x, y, doc, spans = x.to(device), y.to(device), doc.to(device), (cu.to(device), longest)
            causal = phase == "clm"
            flops = detour.model_flops(config, cu.diff().tolist(), causal, n_pred)  # allowed pairs only

            def hf_step():
                with bf16(device):
                    loss = hf(input_ids=x, labels=y).loss
                loss.backward()
                hf_opt.step()
                hf_opt.zero_grad(set_to_none=True)
                return loss.detach()

            hf_res = None
            if hf is not None and deadline - time.time() > 30:
                try:
                    hf_res = time_steps(hf_step, device, warmup, steps)
                except Exception as e:  # e.g. out of memory: HF's figure is missing, ours still runs
                    traceback.print_exc()
                    report.add("speed", f"{phase} T={T} HF", "FAIL", detail=f"{type(e).__name__}: {str(e)[:200]}")
                    hf_opt.zero_grad(set_to_none=True)
                    free(device)
            for mode, backend in [(m, b) for b in backends for m in modes]:
                case = f"{phase} T={T} {backend} {mode}"
                left = deadline - time.time()
                if left < (100 if mode == "compiled" else 20):
                    report.add("speed", case, "skip", detail=f"budget: {max(left, 0):.0f} s left")
                    continue
                runner, compiled = runners[mode], mode == "compiled"

                def ours_step():  # as detour.train: varlen gets spans, compiled the fixed head capacity
                    ours.model.attn_backend = backend
                    with bf16(device):
                        _, loss = runner(x, y, causal=causal, doc_ids=None if backend == "varlen" else doc,
                                         spans=spans if backend == "varlen" else None,
                                         capacity=capacity if compiled else None)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    return loss.detach()

                try:
                    graphs = dynamo_graphs()
                    first, dt, peak, grow, loss = time_steps(ours_step, device, warmup, steps)
                    graphs = dynamo_graphs() - graphs
                except Exception as e:  # e.g. out of memory: this row fails, the others still run
                    traceback.print_exc()
                    report.add("speed", case, "FAIL", detail=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    opt.zero_grad(set_to_none=True)
                    free(device)
                    continue
                tok_s = B * T / dt
                mfu = flops / dt / peak_flops if peak_flops else None
                row = dict(phase=phase, T=T, batch=B, mode=mode, backend=backend, tok_s=round(tok_s), mfu=mfu,
                           graphs=graphs if compiled else None,
                           first_step_s=round(first, 2), step_s=dt, loss=loss,
                           peak_gib=None if peak is None else peak / 2**30, step_gib=None if grow is None else grow / 2**30)
                parts = [f"MFU {mfu:.1%}"] if mfu is not None else []
                if peak is not None:
                    parts.append(f"peak {peak / 2**30:.1f} GiB (step {grow / 2**30:.1f})")
                detail = ", ".join(parts)
                if hf_res is not None:
                    _, hdt, hpeak, hgrow, hloss = hf_res
                    row.update(hf_tok_s=round(B * T / hdt), hf_peak_gib=None if hpeak is None else hpeak / 2**30,
                               hf_step_gib=None if hgrow is None else hgrow / 2**30, speedup_vs_hf=hdt / dt)
                    detail += ("; " if detail else "") + f"HF {B * T / hdt:,.0f} tok/s (ours {hdt / dt:.2f}x)"
                    if hgrow is not None:
                        detail += f", HF step {hgrow / 2**30:.1f} GiB"
                detail += f"; first step {first:.1f} s" + (f", {graphs} graph(s) compiled" if compiled else "")
                status = "ok" if math.isfinite(loss) else "FAIL"
                bound = None
                if (T == 8192 and preset == "base" and phase == "mlm" and mode == modes[-1] and status == "ok"
                        and backend == backends[0] and device.type == "cuda"):  # the targets: MLM at 8192, default
                    bound = f">= {TARGET_TOK_S:,} tok/s, MFU >= {TARGET_MFU:.0%}"
                    if tok_s < TARGET_TOK_S or (mfu or 0) < TARGET_MFU:
                        status = "miss"
                report.add("speed", case + ": tok/s", status, tok_s, bound, detail, **row)
    clm_over_mlm(report, device, preset)
    del ours, hf, opt, hf_opt
    if "compiled" in modes:
        torch._dynamo.reset()
    free(device)


def clm_over_mlm(report, device, preset):
    """CLM step time / MLM step time per (T, backend, mode) from the speed rows; the target (base, 8192,
    the default backend): <= 1.1, the detour must not cost much more per step than MLM."""
    rows = {(r["phase"], r["T"], r["backend"], r["mode"]): r for r in report.rows if r.get("tok_s")}
    for (phase, T, backend, mode), r in sorted(rows.items()):
        if phase != "clm" or ("mlm", T, backend, mode) not in rows:
            continue
        ratio = r["step_s"] / rows[("mlm", T, backend, mode)]["step_s"]
        target = T == 8192 and preset == "base" and backend == "varlen" and device.type == "cuda"
        report.add("speed", f"CLM / MLM step time, T={T} {backend} {mode}", "miss" if target and ratio > 1.1 else
                   "info", ratio, 1.1 if target else None)


# ----------------------------------------------------------------------------------------
# 4. DDP
# ----------------------------------------------------------------------------------------
def check_ddp(report, device_type, workdir, nproc=2, dtypes=("float32", "bfloat16"), preset="small", seq_len=256):
    """torchrun with 1 and with `nproc` processes, the same global batch: the same loss curve."""
    data = write_tiny_data(os.path.join(workdir, "data"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    steps, per_rank = 8, 8
    for dtype in dtypes:
        args = ["--data_dir", data, "--phase", "mlm", "--init_from", "scratch", "--preset", preset, "--seq_len", str(seq_len),
                "--batch_size", str(per_rank), "--global_batch_size", str(per_rank * nproc),
                "--max_tokens", str(steps * per_rank * nproc * seq_len), "--learning_rate", "1e-3",
                "--warmup_tokens", str(2 * per_rank * nproc * seq_len), "--progress", "false", "--log_interval", "1",
                "--eval_interval", "4", "--eval_tokens", str(4 * nproc * seq_len), "--device", device_type,
                "--dtype", dtype]
        curves = {}
        try:
            for n in (1, nproc):
                out = os.path.join(workdir, f"ddp_{dtype}_{n}")
                p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    f"--nproc_per_node={n}", os.path.join(ROOT, "detour.py"), *args, "--out_dir", out],
                                   cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
                if p.returncode:
                    raise RuntimeError(f"torchrun --nproc_per_node={n} exited {p.returncode}: "
                                       + (p.stderr.strip().splitlines() or ["?"])[-1][:300])
                curves[n] = logged_losses(out)
        except Exception as e:
            report.add("ddp", f"{nproc} vs 1 process, {dtype}", "FAIL", detail=f"{type(e).__name__}: {e}")
            continue
        one, many = curves[1], curves[nproc]
        e = max(abs(a - b) for a, b in zip(one, many)) if len(one) == len(many) == steps else float("inf")
        report.add("ddp", f"{nproc} vs 1 {device_type} process{'es' * (nproc > 1)}, {dtype}, {steps} steps: "
                          "max |loss diff|", "ok" if e <= DDP_ATOL[dtype] else "FAIL", e, DDP_ATOL[dtype],
                   one=one, many=many)


# ----------------------------------------------------------------------------------------
def print_table(report):
    cols = ("check", "case", "status", "value", "bound / target", "detail")
    cells = [(r["check"], r["case"], r["status"], "" if r["value"] is None else fmt(r["value"]),
              "" if r["bound"] is None else fmt(r["bound"]), r["detail"]) for r in report.rows]
    widths = [max(len(str(c[i])) for c in [cols] + cells) for i in range(5)]
    line = lambda c: "  ".join(f"{str(v):<{w}}" for v, w in zip(c[:5], widths)) + "  " + str(c[5])  # noqa: E731
    print("\n" + line(cols))
    print("-" * (sum(widths) + 10 + len(cols[5])))
    for c in cells:
        print(line(c))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/gpu_check.json", help="the summary as JSON")
    p.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu (cpu: with --smoke, toy sizes)")
    p.add_argument("--quick", action="store_true", help="speed at T = 8192 only, eager only, 3 steps; DDP fp32 only")
    p.add_argument("--budget", type=float, default=480, help="seconds for the whole run: speed rows that would "
                   "overrun it are skipped (printed), leaving time for DDP")
    p.add_argument("--lengths", default="1024,4096,8192")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per speed step (batch = tokens // T)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per speed row (median)")
    p.add_argument("--checks", default="parity,backends,speed,ddp")
    p.add_argument("--strict", action="store_true", help="a missed speed target fails the run")
    p.add_argument("--smoke", action="store_true", help="toy sizes (tiny preset, short sequences): a code check")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}); nothing checked, run it on a GPU machine")
        return 0
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # "cuda" -> "cuda:N": set_device and the memory stats need an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    t_start = time.time()
    deadline = t_start + args.budget
    checks = set(args.checks.split(","))
    n_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    ddp_reserve = 120 if "ddp" in checks and n_gpus >= 2 else 0
    report = Report()
    import transformers
    print(f"gpu_check: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, "
          f"{n_gpus} GPU(s), torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"transformers {transformers.__version__}", flush=True)
    lengths = [8192] if args.quick else [int(t) for t in args.lengths.split(",")]
    speed = dict(preset="base", lengths=lengths, tokens=args.tokens, steps=3 if args.quick else args.steps,
                 modes=("eager",) if args.quick else ("eager", "compiled"))
    if device.type != "cuda":  # varlen needs CUDA
        speed.update(backends=("sdpa",))
    if args.smoke:
        speed.update(preset="tiny", lengths=[64, 128], tokens=256, steps=1, warmup=1, modes=("eager",))
    with tempfile.TemporaryDirectory() as work:
        steps = [("parity", lambda: check_parity(report, device, args.smoke)),
                 ("backends", lambda: check_backends(report, device, args.smoke)),
                 ("backends", lambda: check_training_run(report, device, os.path.join(work, "train"),
                                                          compile_=device.type == "cuda")),
                 ("speed", lambda: check_speed(report, device, deadline=deadline - ddp_reserve, **speed)),
                 ("ddp", lambda: check_ddp(report, "cuda", os.path.join(work, "ddp"),
                                           dtypes=("float32",) if args.quick else ("float32", "bfloat16"))
                  if n_gpus >= 2 else report.add("ddp", "2 GPUs vs 1", "skip",
                                                 detail=f"{n_gpus} GPU(s) here: DDP needs 2 or more"))]
        for name, run in steps:
            if name not in checks:
                continue
            try:
                run()
            except (Exception, SystemExit) as e:  # a crashed check (or detour's fail()) fails; the others run
                traceback.print_exc()
                report.add(name, "crashed", "FAIL", detail=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                free(device)
    failed = report.failed(args.strict)
    print_table(report)
    summary = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", gpus=n_gpus,
                   torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
                   args=vars(args), wall_s=round(time.time() - t_start, 1), ok=not failed, rows=report.rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"\ngpu_check: {len(failed)} failed of {len(report.rows)} rows, {summary['wall_s']:.0f} s; wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
