"""Where a base-preset training step at T = 8192 loses its time, and what each candidate change buys: one
process, one run, every figure from it. A script, not a test (tests/test_gpu_ab.py runs its CPU smoke).

    python bench/gpu_ab.py --budget 360                       # one H100/H200: floors, then the variants in order
    python bench/gpu_ab.py --variants baseline,regional+bf16  # any list; flags join with +
    python bench/gpu_ab.py --cpu_smoke                        # the same code at toy sizes on a CPU, with assertions

Without CUDA (and without --cpu_smoke) it prints one line and exits 0. In order:
  batches   --pool optimizer steps of --step_tokens tokens each, per row: "study" (packed documents of 52-471 tokens,
            mean ~262, as the study's corpus cut at --group_tokens 200: mean 261) and "long" (gpu_check's 52-1001).
            Steps rotate through them, so the timed graph is the one training runs: the varlen spans change every
            batch (the second batch recompiles once, with the spans dynamic), not gpu_check's one static batch.
  floors    what this hardware allows a step, each part timed alone: copy bandwidth; the layer's four matmul shapes,
            forward and both backward products, x the layer count; the head's two at its capacity; varlen_attn
            forward + backward on the real spans, per layer kind x its count; fused AdamW alone. Their sum, and the
            sum with an elementwise estimate (elementwise_values at the copy bandwidth), is the floor of a step.
  variants  each one, flags set in this process (detour.py itself is not changed: the flags patch its functions
            for the variant's duration), each from the same weights (sharpen: attention far from uniform) and a fresh
            AdamW: torch._dynamo.reset(), compile, the first step (compile time; its loss, gradient norm and every
            parameter's gradient checked against the reference of its phase, check_row), warm-up until a whole
            rotation compiles nothing new (past every recompile: "recompiles" counts graphs after the first step), a
            median of --steps steps per row (CUDA events; perf_counter on a CPU), peak memory, graphs, recompiles and
            graph breaks (dynamo's counters), one profiled step summed by kernel class. JSON after every variant;
            --budget skips a variant its estimate (estimate_s) would not fit.
Flags: eager (no compile) | regional (each Layer.forward compiled once for all layers, the head and its loss on their
own) | bf16 (a bf16 residual stream: explicit dtypes; fp32 master weights, softmax, loss, AdamW state) | rope (RoPE
as one expression, no cat, on q and k together) | loss[:chunk] (the loss's gradient in one pass: no index_put, no
padding multiply where no slot can be padding) | micro:N (N rows per forward, same tokens per step) | clm (the CLM
phase). "best" = the fastest mode measured plus, per flag, the value that beat its parent (the same flags without it)
by the most. Each variant is checked against the reference of its phase: the first that runs today's code (no flag
but eager and clm).
Exit status 1 if a variant fails (an error, a check outside its tolerance, or in --cpu_smoke a graph break or more
than one recompile per graph after the first step). The targets (MLM at 8192: >= 35% MFU and >= 430K tokens/s;
CLM/MLM step time <= 1.1; first compiled step <= 20 s) are reported, not enforced.
"""
import argparse
import contextlib
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from collections import Counter
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a file (python bench/x.py), not imported: the repository root, for detour and bench
    sys.path.insert(0, ROOT)
from bench import gpu_check as gc  # noqa: E402  (batches, head capacity and dynamo's graph count, as gpu_check builds them)

detour = gc.detour
IGNORE = detour.IGNORE
DOCS = {"study": (50, 470), "long": (50, 1000)}  # packed_rows' random-token range: + [CLS] and [SEP] per document
FLAG_NAMES = ("eager", "regional", "bf16", "rope", "loss", "micro", "clm")
MODE_FLAGS = ("eager", "regional")  # how the model runs: exclusive; "best" takes the fastest measured
# Correctness bounds on the first step against the reference of its phase, relative: the loss, the gradient norm and
# the largest per-parameter gradient difference (check_row). Every variant but bf16 computes the same sums in another
# order or fusion: bf16 roundings (2^-8) of a few intermediates, averaged over thousands of tokens in the loss, less so
# in a gradient whose terms cancel (head.norm.weight: 1.3e-2 for micro:4 in the smoke). bf16 rounds the residual stream
# itself after every layer: looser (2.3e-2 in the smoke, in the norms' weights). Planted bugs in the smoke (sharpen's
# weights): padding rows left in the loss, 0.81 (loss) and 0.83 (gradients); RoPE's sign lost, 0.76 (gradients; loss
# 3.5e-6, which is why the gradients are compared one parameter at a time).
TOL = {"same": dict(loss=1e-3, grad_norm=1e-2, grads=5e-2), "bf16": dict(loss=1e-2, grad_norm=5e-2, grads=1e-1)}
TARGETS = dict(mfu=0.35, tok_s=430_000, clm_over_mlm=1.1, first_step_s=20.0)
# A variant's time before one of its compile mode ran (a guess; then estimate_s). Compiled: a static first compile
# of the base preset took 80-104 s on an H200, and rotating batches add the dynamic spans' recompile.
PRIOR_S = {"compiled": 200.0, "regional": 90.0, "eager": 40.0}


# ----------------------------------------------------------------------------------------
# The variants, as patches on detour (restored when the variant ends)
# ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def patched(changes):
    """Set (owner, name, value) for the duration, restoring every old value (or its absence) after, also on error."""
    missing = object()
    old = [(owner, name, vars(owner).get(name, missing)) for owner, name, _ in changes]
    try:
        for owner, name, value in changes:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(old):
            delattr(owner, name) if value is missing else setattr(owner, name, value)


def embeddings_bf16(self, idx):
    """Embeddings.forward (bf16 flag): the stream in the autocast dtype from its start. Under autocast the fp32 table's
    rows, and after them every LayerNorm output and residual add, stay fp32; only Linear outputs are bf16."""
    x = self.tok_embeddings(idx)
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    return self.drop(self.norm(x))


def layer_norm_keeps_dtype(self, x):
    """nn.LayerNorm.forward (bf16 flag): outside autocast, which would run it in fp32 and return fp32; the kernel reads
    and writes the input's dtype and keeps its statistics in fp32. The fp32 master weight is cast for the call."""
    with torch.autocast(x.device.type, enabled=False):
        cast = lambda p: None if p is None else p.to(x.dtype)  # noqa: E731
        return F.layer_norm(x, self.normalized_shape, cast(self.weight), cast(self.bias), self.eps)


rope_cos_sin = detour.rope_cos_sin  # today's tables, which rope_tables builds on while detour's name is patched


def rope_tables(theta, head_dim, T, device):
    """detour.rope_cos_sin (rope flag): cos, and sin with the rotate-half sign folded in (-sin on the first half), so
    that RoPE is x * cos + roll(x, half) * sin: roll(x, half) = [x2, x1], and the sign makes it rotate-half's
    [-x2, x1]. (detour's tables repeat their first half, so each half of sin is the same.)"""
    cos, sin = rope_cos_sin(theta, head_dim, T, device)
    return cos, sin * torch.where(torch.arange(head_dim, device=device) < head_dim // 2, -1.0, 1.0)


def attention_rope_qk(self, x, rope, attend):
    """Attention.forward (rope flag): RoPE once on q and k together, a (2, B, H, T, D) view of the projection, one
    upcast and one expression; detour applies it to q and to k apart, each with an upcast and a torch.cat."""
    B, T, _ = x.shape
    qkv = self.Wqkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
    cos, sin = rope
    qk = qkv[:2].float()
    q, k = (qk * cos + qk.roll(self.head_dim // 2, -1) * sin).to(qkv.dtype).unbind(0)
    y = attend(q, k, qkv[2])
    return self.out_drop(self.Wo(y.transpose(1, 2).reshape(B, T, -1)))


def may_have_padding(n):
    """Whether the head's slots may hold padding (target IGNORE): ModernBERT.forward passes the count `n` as a tensor
    exactly when it runs at a fixed capacity (compiled), and as an int when every slot is a supervised position."""
    return torch.is_tensor(n)


LOSS_CHUNK = 1024  # FusedLinearCrossEntropy's rows per chunk (detour's); the loss:N flag sets it


class FusedLinearCrossEntropy(detour.LinearCrossEntropy):
    """detour.LinearCrossEntropy (loss flag) with its gradient formed in one expression per chunk: softmax minus
    one-hot by torch.where against the column index (no index_put), padding rows zeroed in the same expression and only
    when a slot can be padding (detour multiplies by the real-row mask always). The same sums; backward is detour's.
    Rows per chunk: LOSS_CHUNK (a module constant: dynamo cannot read an attribute of an autograd.Function)."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, n):
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)
        grad_b = torch.zeros_like(bias, dtype=torch.float32)
        loss = torch.zeros((), device=h.device)
        cols, padded = torch.arange(weight.size(0), device=h.device), may_have_padding(n)
        for s in range(0, h.size(0), LOSS_CHUNK):
            hc, t = h[s:s + LOSS_CHUNK], targets[s:s + LOSS_CHUNK]
            logits = F.linear(hc, weight, bias).float()  # softmax in fp32, as detour's
            lse = logits.logsumexp(-1)
            nll = lse - logits.gather(1, t.clamp_min(0)[:, None]).squeeze(1)
            p = (logits - lse[:, None]).exp()
            g = torch.where(cols == t[:, None], p - 1, p)  # an IGNORE target (-100) matches no column
            if padded:
                real = t != IGNORE
                nll, g = torch.where(real, nll, 0.0), torch.where(real[:, None], g, 0.0)
            loss += nll.sum()
            grad_b += g.sum(0)
            g = g.to(hc.dtype)  # the products' dtype: under autocast detour's fp32 g is cast to bf16 for them too
            grad_h[s:s + LOSS_CHUNK] = g @ weight
            grad_w += g.t() @ hc
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.n, ctx.w_dtype = n, weight.dtype
        return loss / ctx.n


def head_loss(model, h, targets, capacity):
    """ModernBERT.forward's training tail at a fixed capacity (the supervised positions first, then padding slots),
    as the regional flag compiles it on its own."""
    keep, targets = targets.reshape(-1) != IGNORE, targets.reshape(-1)
    slot = torch.nonzero_static(keep, size=capacity, fill_value=-1).view(-1)
    h, targets = h.reshape(-1, h.size(-1))[slot.clamp(0)], torch.where(slot >= 0, targets[slot.clamp(0)], IGNORE)
    return detour.LinearCrossEntropy.apply(model.head(h), model.decoder.weight, model.decoder.bias, targets,
                                           (slot >= 0).sum())


def regional_changes(backend):
    """Regional compilation: Layer.forward compiled once (dynamo traces one graph per layer structure, here 3: layer 0
    without its attention norm, global, local; the parameters are graph inputs, so every layer reuses them) and the
    head with its loss compiled on its own; embeddings and the final norm run eager between them."""
    head = torch.compile(head_loss, backend=backend)

    def forward(self, idx, targets, causal=False, attention_mask=None, doc_ids=None, spans=None, capacity=None):
        h = self.model(idx, attention_mask=attention_mask, causal=causal, doc_ids=doc_ids, spans=spans)
        return None, head(self, h, targets, capacity)
    return [(detour.Layer, "forward", torch.compile(detour.Layer.forward, backend=backend)),
            (detour.ModernBERT, "forward", forward)]


def variant_changes(S, flags):
    """The patches that make `flags` out of today's detour."""
    changes = []
    if "bf16" in flags:
        changes += [(detour.Embeddings, "forward", embeddings_bf16), (nn.LayerNorm, "forward", layer_norm_keeps_dtype)]
    if "rope" in flags:
        changes += [(detour, "rope_cos_sin", rope_tables), (detour.Attention, "forward", attention_rope_qk)]
    if "loss" in flags:
        changes += [(detour, "LinearCrossEntropy", FusedLinearCrossEntropy),
                    (sys.modules[__name__], "LOSS_CHUNK", flags["loss"] or LOSS_CHUNK)]
    if "regional" in flags:
        changes += regional_changes(S.backend)
    return changes


def parse_variant(spec, step_rows):
    """'regional+loss:4096' -> {'regional': None, 'loss': 4096}; 'baseline' is no flag; 'best' is resolved later."""
    flags = {}
    for token in filter(None, spec.split("+")):
        name, _, value = token.partition(":")
        if name == "baseline":
            continue
        valued = name in ("micro", "loss")  # micro:N needs its N; loss takes an optional :chunk; the rest none
        if (name not in FLAG_NAMES + ("best",) or (name == "micro" and not value) or (value and not valued)
                or (value and not (value.isdigit() and int(value) > 0))):
            raise ValueError(f"variant {spec!r}: {token!r} is not a flag as written: baseline, best, "
                             f"{', '.join(FLAG_NAMES)}; micro:N needs a number N > 0, loss takes an optional "
                             ":chunk > 0, the others no value")
        flags[name] = int(value) if value else None
    if flags.get("micro") and step_rows % flags["micro"]:
        raise ValueError(f"variant {spec!r}: micro:{flags['micro']} does not divide the {step_rows} rows of a step")
    if len([f for f in MODE_FLAGS if f in flags]) > 1:
        raise ValueError(f"variant {spec!r}: eager and regional exclude each other")
    return flags


def variant_name(flags):
    return "+".join(f if v is None else f"{f}:{v}" for f, v in sorted(flags.items())) or "baseline"


def mode_of(flags):
    return next((f for f in MODE_FLAGS if f in flags), "compiled")


def best_flags(rows):
    """The fastest measured way to run today's code (compiled, regional or eager) and, per other flag, the value whose
    variant beat its parent (the same flags without it) by the most: MLM tokens/s on the study row (the target's)."""
    tok_s = lambda r: r["speed"]["study"]["tok_s"]  # noqa: E731
    measured = {frozenset(r["flags"].items()): r for r in rows
                if r.get("speed", {}).get("study") and "clm" not in r["flags"]}
    modes = [r for key, r in measured.items() if all(flag in MODE_FLAGS for flag, _ in key)]
    best = {}
    for key, r in measured.items():
        for flag, value in key:
            parent = measured.get(key - {(flag, value)})
            if flag not in MODE_FLAGS and parent and tok_s(r) / tok_s(parent) > max(1.0, best.get(flag, (0, 1.0))[1]):
                best[flag] = (value, tok_s(r) / tok_s(parent))
    fastest = dict(max(modes, key=tok_s)["flags"]) if modes else {}
    return {**fastest, **{flag: value for flag, (value, _) in best.items()}}


# ----------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------
def batch_pool(S, kind, phase, micro):
    """S.pool optimizer steps of S.step_rows packed rows of `kind`, each split in micro-batches of `micro` rows, built
    on the CPU once and moved to the device. The rows and the masking do not depend on `micro`, and each micro-batch's
    loss is weighted by its share of the step's supervised tokens: every split computes the same loss and gradient."""
    key = (kind, phase, micro)
    if key in S.pools:
        return S.pools[key]
    c, T, steps = S.config, S.T, []
    for s in range(S.pool):
        lo, hi = DOCS[kind]
        buf = gc.packed_rows(c, S.step_rows, T, seed=1000 * s + hi, min_doc=lo, max_doc=hi)
        x, y = gc.training_batch(c, buf, phase, seed=s)
        n_step, batches = int((y != IGNORE).sum()), []
        for r in range(0, S.step_rows, micro):
            xm, ym = x[r:r + micro], y[r:r + micro]
            doc = detour.document_ids(xm, c.sep_token_id)
            (cu, longest), n = detour.document_spans(doc), int((ym != IGNORE).sum())
            cap = gc.head_capacity(phase, ym.numel())
            batches.append(SimpleNamespace(
                x=xm.to(S.device), y=ym.to(S.device), causal=phase == "clm", share=n / n_step,
                doc_ids=None if S.attn == "varlen" else doc.to(S.device),
                spans=(cu.to(S.device), longest) if S.attn == "varlen" else None,
                capacity=cap if n <= cap else ym.numel(),
                flops=detour.model_flops(c, cu.diff().tolist(), phase == "clm", n)))
        steps.append(batches)
    S.pools[key] = steps
    return steps


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------
def sync(S):
    gc.sync(S.device)


def mark(S):
    """A point in time on the device's stream (a recorded CUDA event), or the host clock on a CPU."""
    if S.device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def seconds(a, b):
    return a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a


def median_time(S, fn, reps):
    """Median seconds of fn() over `reps` calls after two untimed ones, each between two marks, one sync at the end."""
    for _ in range(2):
        fn()
    marks = []
    for _ in range(reps):
        a = mark(S)
        fn()
        marks.append((a, mark(S)))
    sync(S)
    return statistics.median(seconds(a, b) for a, b in marks)


def peak_memory_reset(S):
    if S.device.type == "cuda":
        sync(S)
        torch.cuda.reset_peak_memory_stats(S.device)


def peak_gib(S):
    return torch.cuda.max_memory_allocated(S.device) / 2**30 if S.device.type == "cuda" else None


# Kernel classes of a profiled step, by name (case-insensitive, the first match wins): the optimizer's and attention's
# kernels before gemm (fused_adam, flash kernels), gemm before fused (inductor's matmul templates, triton_tem_fused_mm),
# fused (inductor's kernels) before copies (triton_poi_fused__to_copy is a fused kernel). The rest: unfused elementwise.
KERNEL_CLASSES = [("optimizer", r"adam|multi_tensor|foreach"), ("attention", r"flash|fmha|attention|varlen|sdpa"),
                  ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|matmul|(^|[^a-z])(add)?b?mm([^a-z]|$)"),
                  ("fused elementwise", r"triton|cpp_fused"), ("copies", r"copy|memcpy|memset|cat|clone|contiguous")]


def kernel_class(name):
    return next((c for c, pattern in KERNEL_CLASSES if re.search(pattern, name, re.I)), "unfused elementwise")


def profile_step(S, step, batches):
    """One step under torch.profiler: milliseconds per kernel class (GPU kernels' own time; on a CPU, ops' own CPU
    time), and "idle": the step's wall time (marks around it) that no kernel (op) covers."""
    from torch.profiler import ProfilerActivity, profile
    cuda = S.device.type == "cuda"
    sync(S)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        a = mark(S)
        step(batches)
        b = mark(S)
        sync(S)
    wall, ms = seconds(a, b) * 1e3, Counter()
    for e in prof.key_averages():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms[kernel_class(e.key)] += (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3
    ms["idle"] = max(0.0, wall - sum(ms.values()))
    return {k: round(v, 3) for k, v in ms.most_common()}, round(wall, 3)


# ----------------------------------------------------------------------------------------
# Floors: what each part of a step costs alone on this hardware
# ----------------------------------------------------------------------------------------
def elementwise_values(d, inter):
    """Values a step's elementwise passes must move at the least, per token and layer: each of the layer's elementwise
    steps reads its inputs and writes its output once, forward (LayerNorm 2d, RoPE on q and k 4d, two residual adds 3d
    each, the second LayerNorm 2d, GeGLU 3I: 14d + 3I) and about twice that backward. An estimate, not a kernel."""
    return 3 * (14 * d + 3 * inter)


def copy_bandwidth(S):
    """Bytes read + written per second by one device copy of a large buffer (256 MiB on a GPU, 16 MiB on a CPU)."""
    n = (256 if S.device.type == "cuda" else 16) * 2**20
    src, dst = torch.empty(n, dtype=torch.uint8, device=S.device), torch.empty(n, dtype=torch.uint8, device=S.device)
    return 2 * n / median_time(S, lambda: dst.copy_(src), S.reps)


def matmul_floor(S, rows, n_in, n_out):
    """A Linear's three products on `rows` tokens in the compute dtype: forward x W^T, backward dy W and dy^T x."""
    g = torch.Generator(device=S.device).manual_seed(0)
    x, w, dy = (torch.randn(a, b, generator=g, device=S.device, dtype=S.dtype)
                for a, b in ((rows, n_in), (n_out, n_in), (rows, n_out)))
    return median_time(S, lambda: (x @ w.t(), dy @ w, dy.t() @ x), S.reps)


def attention_floor(S, batch):
    """The attention kernels alone, forward + backward, on a micro-batch's real spans (q, k, v as the layers give
    them): per layer kind, times its count. varlen_attn directly where the run uses it; else detour's sdpa path."""
    c, (B, T) = S.config, batch.x.shape
    H, D, half = c.num_attention_heads, c.hidden_size // c.num_attention_heads, c.local_attention // 2
    g = torch.Generator(device=S.device).manual_seed(1)
    q, k, v, dy = (torch.randn(B * T, H, D, generator=g, device=S.device, dtype=S.dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fns = None if S.attn == "varlen" else detour.attention_fns(c, B, T, S.device, batch.causal, doc_ids=batch.doc_ids)
    total = 0.0
    for kind, window in (("full_attention", None), ("sliding_attention", half)):
        def fwd_bwd(kind=kind, window=window):
            if S.attn == "varlen":
                from torch.nn.attention.varlen import varlen_attn  # torch >= 2.10 (S.attn says it is there)
                cu, longest = batch.spans
                y = varlen_attn(q, k, v, cu, cu, longest, longest,
                                window_size=detour.attention_window(batch.causal, window))
            else:
                y = fns[kind](*(t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
            return torch.autograd.grad(y.reshape(B * T, H, D), (q, k, v), dy)
        total += median_time(S, fwd_bwd, S.reps) * c.layer_types.count(kind)
    return total


def adamw_floor(S):
    """detour's AdamW step alone (fused on CUDA, as trained) on the model's parameters with random gradients. It moves
    the weights: every variant starts from S.init_state, so nothing of it reaches them."""
    opt = detour.make_optimizer(S.model, S.opt_cfg, fused=S.device.type == "cuda")
    for p in S.model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    seconds_ = median_time(S, opt.step, S.reps)
    S.model.zero_grad(set_to_none=True)
    return seconds_


def floors(S, phases):
    """The floor of a step per (phase, row): accumulation x (layer matmuls x layers + the head's matmuls at capacity
    + the attention kernels on the row's first micro-batch) + one AdamW step; and that plus the elementwise estimate.
    Matmuls at the baseline micro-batch (S.micro rows)."""
    c, N = S.config, S.micro * S.T
    d, inter, V, L = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_hidden_layers
    bandwidth = copy_bandwidth(S)
    layer = sum(matmul_floor(S, N, a, b) for a, b in ((d, 3 * d), (d, d), (d, 2 * inter), (inter, d))) * L
    elementwise = N * L * elementwise_values(d, inter) * S.dtype.itemsize / bandwidth
    parts = dict(copy_GBps=bandwidth / 1e9, layer_matmuls_s=layer, elementwise_estimate_s=elementwise,
                 adamw_s=adamw_floor(S))
    steps = {}
    for phase in phases:
        cap = gc.head_capacity(phase, N)
        parts[f"head_{phase}_s"] = head = matmul_floor(S, cap, d, d) + matmul_floor(S, cap, d, V)
        for kind in S.rows:
            pool = batch_pool(S, kind, phase, S.micro)
            parts[f"attention_{phase}_{kind}_s"] = attention = attention_floor(S, pool[0][0])
            accum, flops = len(pool[0]), statistics.mean(sum(b.flops for b in step) for step in pool)
            kernels = accum * (layer + head + attention) + parts["adamw_s"]
            with_elementwise = kernels + accum * elementwise
            steps[f"{phase} {kind}"] = dict(kernels_s=kernels, with_elementwise_s=with_elementwise,
                                            tok_s=S.step_rows * S.T / with_elementwise,
                                            mfu=flops / with_elementwise / S.peak if S.peak else None)
    return dict(parts=parts, steps=steps)


# ----------------------------------------------------------------------------------------
# One variant
# ----------------------------------------------------------------------------------------
def make_step(S, runner, fixed_capacity, opt):
    """An optimizer step over one pool entry's micro-batches, as detour.train runs it (the fixed head capacity where
    compiled). Each micro-batch's loss is weighted by its share outside the compiled code (a float argument would be
    a constant there, and a new one a recompile). check=True: also every parameter's gradient, before the update."""
    amp = torch.autocast(S.device.type, dtype=torch.bfloat16) if S.bf16 else contextlib.nullcontext()

    def step(batches, check=False):
        total = torch.zeros((), device=S.device)
        for b in batches:
            with amp:
                loss = runner(b.x, b.y, causal=b.causal, doc_ids=b.doc_ids, spans=b.spans,
                              capacity=b.capacity if fixed_capacity else None)[1]
            (loss * b.share).backward()
            total += loss.detach().float() * b.share
        grads = [p.grad.detach().float().clone() for p in S.model.parameters()] if check else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total, grads
    return step


@contextlib.contextmanager
def compile_log():
    """Dynamo's compiles while inside, as (frame, attempt) from their compile ids ("3/1": frame 3 compiled a second
    time, a recompile), recorded by a start callback: it observes, the backend is the one asked for."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler
    log = []

    def seen(args):
        if args.callback_trigger == CallbackTrigger.DYNAMO and (m := re.search(r"(\d+)/(\d+)", str(args.compile_id))):
            log.append((int(m[1]), int(m[2])))
    callback_handler.register_start_callback(seen)
    try:
        yield log
    finally:
        callback_handler.remove_start_callback(seen)


def recompiles_per_graph(log, n_first):
    """The most compiles after the first step of one frame, per graph that frame compiled in the first step (a frame
    seen first after it: infinite). 1 = each graph recompiled once, as when the spans turn dynamic on the second
    batch; regional compilation has a graph per layer structure in one frame, so per graph, not per frame."""
    first, after = Counter(f for f, _ in log[:n_first]), Counter(f for f, _ in log[n_first:])
    return max((n / first[f] if first[f] else math.inf for f, n in after.items()), default=0.0)


def warm_up(S, step, pools, max_passes=4):
    """Rotate through every row's pool until one whole pass compiles no new graph: past every recompile. -> passes"""
    for passes in range(1, max_passes + 1):
        before = gc.dynamo_graphs()
        for pool in pools:
            for batches in pool:
                step(batches)
        sync(S)
        if gc.dynamo_graphs() == before:
            return passes
    return max_passes


def measure(S, row, step, pools, log):
    """The first step (compile time, loss, gradients), warm-up, the timed steps per row, one profiled step; `log`:
    compile_log's. -> the first step's gradients (for check_row; kept out of the row, which becomes JSON)"""
    from torch._dynamo.utils import counters
    sync(S)
    t0 = time.perf_counter()
    loss, grads = step(pools[S.rows[0]][0], check=True)
    sync(S)
    n_first = len(log)
    row.update(first_step_s=round(time.perf_counter() - t0, 2), graphs=gc.dynamo_graphs(), loss=loss.item(),
               grad_norm=torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
    row["warmup_passes"] = warm_up(S, step, list(pools.values()))
    row["speed"] = {}
    for kind, pool in pools.items():
        peak_memory_reset(S)
        turn = iter(pool * (S.steps + 2))  # rotating: median_time calls step twice untimed, then S.steps times
        dt = median_time(S, lambda: step(next(turn)), S.steps)
        flops = statistics.mean(sum(b.flops for b in batches) for batches in pool)
        row["speed"][kind] = dict(step_s=dt, tok_s=round(S.step_rows * S.T / dt),
                                  mfu=flops / dt / S.peak if S.peak else None, peak_gib=peak_gib(S))
    row["recompiles"] = gc.dynamo_graphs() - row["graphs"]  # graphs compiled after the first step
    row["recompiles_per_graph"] = recompiles_per_graph(log, n_first)
    row["graph_breaks"] = sum(counters["graph_break"].values())
    row["inductor_cache"] = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    row["profile_ms"], row["profile_wall_ms"] = profile_step(S, step, pools[S.rows[0]][0])
    return grads


def run_variant(S, flags):
    """One variant, from today's initial weights and a fresh AdamW: -> (its row, its first step's gradients); status
    FAIL, the error and no gradients if it raised. The patches and dynamo's caches are undone either way."""
    from torch._dynamo.utils import counters
    phase, micro, mode = "clm" if "clm" in flags else "mlm", flags.get("micro") or S.micro, mode_of(flags)
    row = dict(variant=variant_name(flags), flags=flags, mode=mode, phase=phase, micro=micro, status="ok", detail="")
    t0 = time.time()
    S.model.load_state_dict(S.init_state)
    opt = detour.make_optimizer(S.model, S.opt_cfg, fused=S.device.type == "cuda")
    torch._dynamo.reset()
    counters.clear()
    grads = None
    try:
        pools = {kind: batch_pool(S, kind, phase, micro) for kind in S.rows}
        with patched(variant_changes(S, flags)), compile_log() as log:
            runner = torch.compile(S.model, backend=S.backend) if mode == "compiled" else S.model
            grads = measure(S, row, make_step(S, runner, mode != "eager", opt), pools, log)
    except Exception as e:  # out of memory, a kernel or compile error: this row fails, the next runs
        traceback.print_exc()
        row.update(status="FAIL", detail=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
    finally:
        S.model.zero_grad(set_to_none=True)
        del opt
        torch._dynamo.reset()
        gc.free(S.device)
    row["wall_s"] = round(time.time() - t0, 1)
    return row, grads


def check_row(S, row, grads, refs):
    """The first step against the reference of the row's phase, within TOL: the loss, the gradient norm,
    and the largest relative difference of one parameter's gradient, ||g - g_base|| / ||g_base|| (at initialization
    attention is nearly uniform: a wrong RoPE moves the loss by 1e-7 but the projections' gradients by far more).
    In --cpu_smoke also no graph break and at most one recompile per graph (recompiles_per_graph)."""
    if row["status"] != "ok":
        return
    if not set(row["flags"]) - {"clm", "eager"} and row["phase"] not in refs:  # today's code: the reference
        refs[row["phase"]] = row, grads
    (base, base_grads), tol = refs.get(row["phase"], (None, None)), TOL["bf16" if "bf16" in row["flags"] else "same"]
    problems = []
    if base is None:
        row["detail"] += f"no {row['phase']} reference (today's code) ran before: the first step is unchecked. "
    else:
        row["grads_rel"] = max(((g - b).norm() / b.norm().clamp_min(1e-12)).item() for g, b in zip(grads, base_grads))
        for key in ("loss", "grad_norm", "grads"):
            rel = row["grads_rel"] if key == "grads" else abs(row[key] - base[key]) / max(abs(base[key]), 1e-12)
            row[f"{key}_rel"], row[f"{key}_bound"] = rel, tol[key]
            if not rel <= tol[key]:  # (a NaN fails too)
                problems.append(f"{key}: relative difference {rel:.2e} > {tol[key]:g}")
    if S.smoke and row["graph_breaks"]:
        problems.append(f"{row['graph_breaks']} graph break(s)")
    if S.smoke and row["recompiles_per_graph"] > 1:
        problems.append(f"{row['recompiles_per_graph']:g} recompiles per graph after the first step")
    if problems:
        row.update(status="FAIL", detail=row["detail"] + "; ".join(problems))


def estimate_s(S, rows, mode):
    """How long a variant of this compile mode will take: the median of the done ones of its mode (the first one
    compiles cold; later ones find the graphs they share with it in inductor's on-disk cache), else PRIOR_S."""
    done = [r["wall_s"] for r in rows if r["mode"] == mode and r["status"] != "skip"]
    return statistics.median(done) if done else 0.0 if S.smoke else PRIOR_S[mode]


# ----------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------
# On a GPU: today's code eager first (no compile: cheap; docs/paper-recipe.md's command runs it; the reference of the
# checks), in both phases; then regional compilation, whose compile should be the shortest, as the base of the single
# changes, so that most of them fit a short window; the best of them in both phases; then today's whole-model compile
# (two compiles of the base preset: static, then with dynamic spans) and what refines the best. --budget cuts the list
# from its end.
GPU_VARIANTS = ("eager,eager+clm,regional,regional+bf16,regional+rope,regional+loss:4096,regional+micro:4,best,"
                "best+clm,regional+clm,baseline,clm,regional+loss,regional+loss:2048,regional+loss:8192,"
                "regional+micro:8,micro:4")
SMOKE_VARIANTS = "baseline,eager,regional,bf16,rope,loss:64,micro:4,clm,regional+clm,best"
SMOKE = dict(preset="tiny", vocab=512, T=128, step_tokens=512, micro=2, pool=2, steps=2, reps=3, rows="study,long",
             backend="aot_eager", variants=SMOKE_VARIANTS)


def varlen_reference(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, -1), **_):
    """A stand-in for varlen_attn on a CPU (--cpu_smoke), written from its documentation and traceable by dynamo: the
    flat (tokens, H, D) stream as one sequence, key j seen by query i in the same span when i - left <= j <= i + right
    (-1: unbounded); one dense SDPA call. It lets the smoke run the GPU path's plumbing and its dynamic spans."""
    pos = torch.arange(q.size(0), device=q.device)
    doc = torch.bucketize(pos, cu_seq_q[1:].to(pos.dtype), right=True)
    i, j = pos[:, None], pos[None, :]
    ok = doc[:, None] == doc[None, :]
    left, right = window_size
    if left >= 0:
        ok = ok & (j >= i - left)
    if right >= 0:
        ok = ok & (j <= i + right)
    y = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), attn_mask=ok)
    return y.transpose(0, 1)


@torch.no_grad()
def sharpen(model):
    """The starting weights: detour's initialization with each layer's q and k rows scaled so that the attention logits
    q.k / sqrt(D) have a standard deviation of about 1 (s^2 d sigma_w^2 = 1 on unit-variance normed inputs; at
    initialization they have 0.3 in base, 0.03 in tiny). Attention is then far from uniform, as in a trained model, and
    the first step's gradients show a wrong position or mask (uniform attention hides both). Timing is unaffected."""
    d = model.config.hidden_size
    for layer in model.model.layers:
        qk = layer.attn.Wqkv.weight[:2 * d]
        qk.mul_(1 / (qk.std() * d ** 0.5))
    return model


def setup(a, step_rows):
    """The run's state: device, the model at its initial weights, the attention backend, sizes, the deadline."""
    device = torch.device("cpu" if a.cpu_smoke else "cuda", None if a.cpu_smoke else torch.cuda.current_device())
    has_varlen = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    attn = detour.attention_backend("auto", device, True, 0.0) if device.type == "cuda" else \
        "varlen" if has_varlen else "sdpa"  # a CPU: varlen_reference stands in for the kernel
    config = detour.Config(vocab_size=a.vocab, max_position_embeddings=a.T, **gc.SPECIAL, **detour.PRESETS[a.preset])
    torch.manual_seed(0)
    model = sharpen(detour.ModernBERT(config)).to(device).train()
    model.model.attn_backend = attn
    return SimpleNamespace(
        device=device, config=config, model=model, attn=attn, smoke=a.cpu_smoke, bf16=True, dtype=torch.bfloat16,
        init_state={k: v.detach().clone() for k, v in model.state_dict().items()}, T=a.T, step_rows=step_rows,
        micro=a.micro, pool=a.pool, steps=a.steps, reps=a.reps, rows=a.rows.split(","), backend=a.backend, pools={},
        opt_cfg=SimpleNamespace(learning_rate=2e-4, weight_decay=1e-5, beta1=0.9, beta2=0.98, eps=1e-6),
        peak=detour.device_peak_flops(device), deadline=time.time() + (math.inf if a.budget is None else a.budget))


def resolve(spec, S, rows):
    """A variant spec -> flags, with "best" replaced by best_flags of the rows so far."""
    flags = parse_variant(spec, S.step_rows)
    if "best" in flags:
        flags = {**best_flags(rows), **{k: v for k, v in flags.items() if k != "best"}}
    return flags


def run_all(S, a, summary, write):
    """The floors, then each variant in order (skipped where the budget would not hold it); JSON after each."""
    specs = [v for v in a.variants.split(",") if v]
    phases = sorted({"clm" if "clm" in parse_variant(v, S.step_rows) else "mlm" for v in specs}, reverse=True)
    summary["floors"] = floors(S, phases)
    say_floors(summary["floors"])
    write()
    rows, refs = summary["rows"], {}
    for spec in specs:
        flags = resolve(spec, S, rows)
        name, mode, left = variant_name(flags), mode_of(flags), S.deadline - time.time()
        if name in [r["variant"] for r in rows]:  # (a "best" that is a variant already measured)
            row = dict(variant=spec, flags=flags, mode=mode, status="skip", detail=f"{spec} = {name}, measured above")
        elif left < (need := estimate_s(S, rows, mode)):
            row = dict(variant=name, flags=flags, mode=mode, status="skip",
                       detail=f"budget: {max(left, 0):.0f} s left, {mode} variants take {need:.0f} s")
        else:
            row, grads = run_variant(S, flags)
            check_row(S, row, grads, refs)
        rows.append(dict(row, spec=spec))
        say_row(row)
        write()
    summary["targets"] = targets(S, rows)


def say_floors(fl):
    parts = ", ".join(f"{k} {v * 1e3:.2f} ms" if k.endswith("_s") else f"{k} {v:,.1f}" for k, v in fl["parts"].items())
    print(f"[floors] {parts}", flush=True)
    for key, s in fl["steps"].items():
        mfu = f", MFU {s['mfu']:.1%}" if s["mfu"] else ""
        print(f"[floors] {key}: step >= {s['kernels_s'] * 1e3:.1f} ms of kernels, "
              f"{s['with_elementwise_s'] * 1e3:.1f} ms with elementwise: {s['tok_s']:,.0f} tok/s{mfu}", flush=True)


def say_row(r):
    if r["status"] == "skip" or "speed" not in r:
        print(f"[variant] {r['variant']}: {r['status']} {r['detail']}".rstrip(), flush=True)
        return
    speed = "; ".join(f"{k} {s['tok_s']:,} tok/s" + (f" MFU {s['mfu']:.1%}" if s["mfu"] else "")
                      + (f" peak {s['peak_gib']:.1f} GiB" if s["peak_gib"] else "") for k, s in r["speed"].items())
    rel = " ".join(f"{k} rel {r[k + '_rel']:.1e}" for k in ("loss", "grad_norm", "grads") if k + "_rel" in r)
    rel = f"against the reference: {rel}; " if rel else ""
    prof = ", ".join(f"{k} {v:.1f}" for k, v in r["profile_ms"].items())
    print(f"[variant] {r['variant']}: {r['status']}; first step {r['first_step_s']:.1f} s, {r['graphs']} graph(s), "
          f"{r['recompiles']} recompile(s), {r['graph_breaks']} graph break(s); {speed}; {rel}profiled step "
          f"{r['profile_wall_ms']:.1f} ms: {prof} ms. {r['detail']}".rstrip(), flush=True)


def targets(S, rows):
    """The issue's targets against the rows (reported; they apply to the base preset at 8192 on a GPU only)."""
    ok = [r for r in rows if r["status"] == "ok" and "speed" in r]
    mlm = [r for r in ok if r["phase"] == "mlm"]
    out = dict(applies=S.device.type == "cuda" and S.T == 8192 and S.config.hidden_size == 768)
    speed = lambda r: r["speed"][S.rows[0]]["tok_s"]  # noqa: E731
    step_s = lambda r: r["speed"][S.rows[0]]["step_s"]  # noqa: E731
    if mlm:
        fastest = max(mlm, key=speed)
        s = fastest["speed"][S.rows[0]]
        out.update(fastest=fastest["variant"], tok_s=s["tok_s"], mfu=s["mfu"], tok_s_met=s["tok_s"] >= TARGETS["tok_s"],
                   mfu_met=(s["mfu"] or 0) >= TARGETS["mfu"])
    if compiled := [r for r in mlm if r["mode"] != "eager"]:  # the first step's target is the compiled one's
        fastest = max(compiled, key=speed)
        out.update(fastest_compiled=fastest["variant"], first_step_s=fastest["first_step_s"],
                   first_step_met=fastest["first_step_s"] <= TARGETS["first_step_s"])
    by_flags = {frozenset(r["flags"].items()): r for r in ok}
    clm = ("clm", None)
    out["clm_over_mlm"] = {r["variant"]: step_s(r) / step_s(by_flags[key - {clm}])
                           for key, r in by_flags.items() if clm in key and key - {clm} in by_flags}
    print(f"[targets] {json.dumps(out, default=str)} (MFU >= {TARGETS['mfu']:.0%}, >= {TARGETS['tok_s']:,} tok/s, "
          f"CLM/MLM <= {TARGETS['clm_over_mlm']}, first step <= {TARGETS['first_step_s']:.0f} s)", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=GPU_VARIANTS, help="comma-separated, in order; flags joined by +")
    p.add_argument("--budget", type=float, default=None, help="seconds for the run: variants that would overrun it "
                   "(estimate_s) are skipped, and listed; default: no limit")
    p.add_argument("--out", default="out/gpu_ab.json")
    p.add_argument("--preset", default="base")
    p.add_argument("--vocab", type=int, default=50368, help="ModernBERT's vocabulary: the head weighs its weight")
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--step_tokens", type=int, default=65536, help="tokens per optimizer step (8 rows of 8192)")
    p.add_argument("--micro", type=int, default=2, help="rows per forward in the baseline (gpu_check's 16K tokens)")
    p.add_argument("--pool", type=int, default=3, help="distinct steps per row that the steps rotate through")
    p.add_argument("--steps", type=int, default=5, help="timed steps per row (median)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per floor (median)")
    p.add_argument("--rows", default="study,long", help="batch rows: study (mean ~262-token documents), long")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--cpu_smoke", action="store_true", help="toy sizes on the CPU, aot_eager (inductor's CPU compile "
                   "of each variant would take a minute), varlen_reference for the kernel, with assertions")
    a = p.parse_args(argv)
    if a.cpu_smoke:  # its sizes, unless given on the command line
        args = sys.argv[1:] if argv is None else argv
        given = {k for k in SMOKE if any(x == f"--{k}" or x.startswith(f"--{k}=") for x in args)}
        vars(a).update({k: v for k, v in SMOKE.items() if k not in given})
    elif not torch.cuda.is_available():
        print(f"gpu_ab: no CUDA device here (torch {torch.__version__}); nothing measured, run it on a GPU machine "
              "(or --cpu_smoke)")
        return 0
    step_rows = a.step_tokens // a.T
    if step_rows < 1 or step_rows % a.micro:
        p.error(f"--step_tokens {a.step_tokens} must be a multiple of --micro x --T = {a.micro * a.T}")
    try:
        for spec in a.variants.split(","):
            parse_variant(spec, step_rows)
    except ValueError as e:
        p.error(str(e))
    if any(r not in DOCS for r in a.rows.split(",")):
        p.error(f"--rows {a.rows!r}: each one of {', '.join(DOCS)}")
    return run(setup(a, step_rows), a)


def run(S, a):
    t0 = time.time()
    where = torch.cuda.get_device_name(S.device) if S.device.type == "cuda" else "CPU (smoke)"
    print(f"gpu_ab: {where}, torch {torch.__version__} (CUDA {torch.version.cuda}), {a.preset} "
          f"{S.model.num_params() / 1e6:.1f}M, T={S.T}, {S.step_rows} rows a step, attention {S.attn}, "
          f"compile backend {S.backend}", flush=True)
    summary = dict(device=where, torch=torch.__version__, cuda=torch.version.cuda, args=vars(a), attn=S.attn,
                   params=S.model.num_params(), rows=[])
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)

    def write():
        summary["wall_s"] = round(time.time() - t0, 1)
        text = json.dumps(summary, indent=1, default=str).encode()
        detour.atomic_write(a.out, lambda f: f.write(text))

    kernel = []
    if S.device.type == "cpu" and S.attn == "varlen":
        import torch.nn.attention.varlen as varlen
        kernel = [(varlen, "varlen_attn", varlen_reference)]
    with patched(kernel):
        run_all(S, a, summary, write)
    failed = [r for r in summary["rows"] if r["status"] == "FAIL"]
    summary["ok"] = not failed
    write()
    print(f"gpu_ab: {len(failed)} failed of {len(summary['rows'])} variants "
          f"({', '.join(r['variant'] for r in failed) or 'none'}), {time.time() - t0:.0f} s; wrote {a.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
