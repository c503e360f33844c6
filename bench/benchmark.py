"""Training-step speed and peak memory: detour's ModernBERT against transformers' ModernBertForMaskedLM.

    python bench/benchmark.py                    # CPU: small preset, T = 512..4096, 1 thread, ~4 minutes
    python bench/benchmark.py --compare logits,dense_head   # what one optimization buys (see VARIANTS)
    python bench/benchmark.py --device cuda --preset base --lengths 1024,2048,4096,8192 --tokens 16384 \
        [--compile --warmup 3] [--attn_backend varlen]

A script, not a test (pytest collects only test_*.py). One process; the same weights (ours
exported with save_hf, loaded by transformers), the same batch and the same threads for both;
the two models alternate step by step so that machine noise hits both alike; medians.
A step is forward + backward + AdamW step, as in training:
  ours  mlm: bidirectional, 30% masking, head and loss on the masked positions only (sparse
             prediction), document mask from [SEP] on the packed rows; training mode, so the
             loss is LinearCrossEntropy's (no N x V logits).
        clm: causal=True, next-token targets at every position (dense head), document mask.
  HF    attn_implementation="sdpa", bidirectional, `labels` (dense logits, its default), the
        same inputs and targets. HF has no causal ModernBertForMaskedLM, so the clm row compares
        the same tokens with a dense head on every position for both.
--compare A,B times any two of VARIANTS the same way (default ours,hf); the ablations are detour's
model with one optimization turned off, so `--compare ours,logits` is what the chunked loss buys.
Peak memory is taken on each row's last warm-up step (untimed; use --warmup 2 or more with
--compile), once the AdamW state exists: it counts gradients, activations and temporaries.
CPU: the growth of the process's peak resident set (VmHWM, reset by writing 5 to
/proc/self/clear_refs) over the resident set just before the step, with glibc told, for that
step only, to give every block of 64 KiB or more its own mmap, so that freed tensors leave the
resident set at once and it follows live memory (timed steps keep glibc's usual 32 MiB
threshold: the small one costs page faults). A first step can add one-time library buffers;
that errs against whichever model has them. GPU: the growth of torch.cuda.max_memory_allocated.
"""
import argparse
import contextlib
import copy
import ctypes
import functools
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a file (python bench/x.py), not imported: the repository root, for detour and bench
    sys.path.insert(0, ROOT)
import detour  # noqa: E402


class PeakMemory:
    """Peak memory growth (bytes) between start() and stop()."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.libc = None
        if not self.cuda:
            try:
                self.libc = ctypes.CDLL("libc.so.6")
            except OSError:
                print("note: not glibc; CPU peak memory may count freed memory that malloc keeps")
            self._thresholds(32 << 20)  # the timed steps: where glibc's own threshold settles

    def _thresholds(self, mmap_bytes):
        if self.libc:
            self.libc.mallopt(-3, mmap_bytes)      # M_MMAP_THRESHOLD (fixed: no dynamic change)
            self.libc.mallopt(-1, 2 * mmap_bytes)  # M_TRIM_THRESHOLD: give the heap top back too

    @staticmethod
    def _status_kib(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        raise RuntimeError(f"{key} not in /proc/self/status")

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        self._thresholds(64 << 10)
        if self.libc:
            self.libc.malloc_trim(0)
        self.base = self._status_kib("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS

    def stop(self):
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        self._thresholds(32 << 20)
        return self._status_kib("VmHWM") * 1024 - self.base


DATA = os.path.join(ROOT, "data", "default")


def packed_rows(n_rows, T, config, seed, prepared):
    """(rows of T + 1 tokens, real vocabulary size): windows of data/default/train.bin when it
    is prepared (`prepared` = detour.load_data's (meta, tokens), else None: synthetic
    documents, [CLS] random [SEP])."""
    g = np.random.default_rng(seed)
    if prepared:
        meta, data = prepared
        starts = g.integers(0, len(data) - T - 1, n_rows)
        return torch.from_numpy(np.stack([data[s:s + T + 1].astype(np.int64) for s in starts])), meta["vocab_size"]
    rows = []
    for _ in range(n_rows):
        row = []
        while len(row) < T + 1:
            row += [config.cls_token_id, *g.integers(5, 8192, int(g.integers(20, 400))), config.sep_token_id]
        rows.append(row[:T + 1])
    return torch.tensor(rows), 8192


VARIANTS = {
    "ours": "detour.ModernBERT as trained: sparse head, chunked loss, block-sparse sliding window",
    "hf": "transformers' ModernBertForMaskedLM (sdpa), dense logits at every position",
    "logits": "ours, but the loss from materialized logits (no LinearCrossEntropy)",
    "dense_head": "ours, but head and logits at every position, loss on the supervised ones (no sparse prediction)",
    "dense_window": "ours, but local layers as dense SDPA under the T x T sliding-window mask",
}


def forward_loss(variant, model, x, y, causal, doc_ids):
    """One training forward of `variant` (see VARIANTS): (output to keep alive, loss)."""
    if variant == "hf":
        out = model(input_ids=x, labels=y)
        return out, out.loss
    if variant == "dense_head":
        logits = model.decoder(model.head(model.model(x, causal=causal, doc_ids=doc_ids)))
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=detour.IGNORE)
    if variant == "logits":
        keep = y.reshape(-1) != detour.IGNORE
        h = model.model(x, causal=causal, doc_ids=doc_ids).reshape(-1, model.config.hidden_size)[keep]
        logits = model.decoder(model.head(h))
        return logits, F.cross_entropy(logits.float(), y.reshape(-1)[keep])
    if variant == "dense_window":
        with dense_local_layers():
            return model(x, y, causal=causal, doc_ids=doc_ids)
    spans = detour.document_spans(doc_ids.cpu()) if model.model.attn_backend == "varlen" else None
    return model(x, y, causal=causal, doc_ids=doc_ids, spans=spans and (spans[0].to(x.device), spans[1]))


def dense_window_fns(config, B, T, device, causal, attention_mask=None, doc_ids=None, backend="sdpa", dropout=0.0,
                     spans=None):
    """detour.attention_fns with the local layers as one dense SDPA under the T x T window mask (detour.dense_mask
    with the window): the O(T^2) reference that block_sliding_attention is measured against."""
    full_mask = None
    if attention_mask is not None or doc_ids is not None:
        full_mask = detour.dense_mask(B, T, device, causal, None, attention_mask, doc_ids)
    window_mask = detour.dense_mask(B, T, device, causal, config.local_attention // 2, attention_mask, doc_ids)
    nothing_after = detour.attention_window(causal)[1] == 0
    sdpa = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout)
    return {"full_attention": functools.partial(sdpa, attn_mask=full_mask, is_causal=nothing_after and full_mask is None),
            "sliding_attention": functools.partial(sdpa, attn_mask=window_mask)}


@contextlib.contextmanager
def dense_local_layers():
    """detour's forward with dense_window_fns (the forward only builds masks; backward needs none)."""
    real = detour.attention_fns
    detour.attention_fns = dense_window_fns
    try:
        yield
    finally:
        detour.attention_fns = real


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", choices=list(detour.PRESETS))
    p.add_argument("--lengths", default="512,1024,2048,4096")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per step (batch = tokens // T, at least 1)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per model and row (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for both models; 1 by default: on a small shared CPU, OpenMP threads "
                        "wait on each other's busy cores and the timings scatter")
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile both models")
    p.add_argument("--phases", default="mlm,clm")
    p.add_argument("--attn_backend", default="sdpa", help="ours: sdpa | varlen (CUDA)")
    p.add_argument("--compare", default="ours,hf", help="A,B: two of " + ", ".join(VARIANTS))
    args = p.parse_args()
    pair = args.compare.split(",")
    if len(pair) != 2 or pair[0] == pair[1] or not set(pair) <= set(VARIANTS):
        p.error(f"--compare needs two different names from {', '.join(VARIANTS)}, e.g. ours,hf")
    if args.warmup < 1:
        p.error("--warmup must be at least 1: peak memory is measured on the warm-up step")

    import transformers
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    lengths = [int(t) for t in args.lengths.split(",")]
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    special = dict(pad_token_id=0, unk_token_id=1, cls_token_id=2, sep_token_id=3, mask_token_id=4)
    prepared = detour.load_data(DATA, "train") if os.path.exists(os.path.join(DATA, "train.bin")) else None
    if prepared:
        special = {k: prepared[0][k] for k in special}
    config = detour.Config(vocab_size=50368, max_position_embeddings=max(8192, max(lengths)), **special,
                           **detour.PRESETS[args.preset])  # the real ModernBERT vocabulary: a realistic head
    torch.manual_seed(0)
    ours = detour.ModernBERT(config)
    with tempfile.TemporaryDirectory() as d:
        detour.save_hf(ours, d)
        hf = transformers.AutoModelForMaskedLM.from_pretrained(d, attn_implementation="sdpa")
    ours.model.attn_backend = args.attn_backend
    models = {k: (hf if k == "hf" else copy.deepcopy(ours)).to(device).train() for k in pair}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-5, weight_decay=0.0) for k, m in models.items()}
    for k, m in models.items():  # create the AdamW state now (zero gradients: the weights stay equal)
        for param in m.parameters():
            param.grad = torch.zeros_like(param)
        opts[k].step()
        opts[k].zero_grad(set_to_none=True)
    runners = {k: (torch.compile(m) if args.compile else m) for k, m in models.items()}
    meter = PeakMemory(device)

    def step(name, x, y, causal, doc_ids, measure):
        if measure:
            meter.start()
        t0 = time.perf_counter()
        with amp:
            out, loss = forward_loss(name, runners[name], x, y, causal, doc_ids)
        loss.backward()  # outputs stay alive through backward, as in a training loop
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        del out, loss
        return dt, meter.stop() if measure else None

    name = os.popen("lscpu 2>/dev/null | grep 'Model name'").read().split(":")[-1].strip()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{name or 'CPU'}, {args.threads} thread{'s' * (args.threads > 1)}"
    print(f"detour benchmark: {args.preset} preset (d={config.hidden_size}, L={config.num_hidden_layers}, "
          f"V={config.vocab_size}, {ours.num_params() / 1e6:.1f}M params), {where}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}{', compiled' if args.compile else ''}")
    print(f"step = fwd + bwd + AdamW on max(T, {args.tokens}) tokens (batch = max(1, {args.tokens} // T)), "
          f"median of {args.steps} alternating steps after {args.warmup} warm-up")
    A, B_ = pair
    label = {k: "HF" if k == "hf" else k for k in pair}
    print("A = " + VARIANTS[A] + "\nB = " + VARIANTS[B_])
    columns = ["phase", "T", "batch", f"{label[A]} tok/s", f"{label[B_]} tok/s", "A/B",
               f"{label[A]} MiB", f"{label[B_]} MiB", "A TF/s", "A clm/mlm"]
    widths = [6] + [max(6, len(c) + 2) for c in columns[1:]]
    head = "".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(columns, widths)))
    print(head)
    print("-" * len(head))
    a_time = {}
    for phase in args.phases.split(","):
        for T in lengths:
            B = max(1, args.tokens // T)
            buf, n_real = packed_rows(B, T, config, seed=T, prepared=prepared)
            if phase == "clm":
                x, y = detour.clm_batch(buf, config.sep_token_id)
            else:
                x, y = detour.mlm_batch(buf, 0.30, torch.Generator().manual_seed(T), config, n_real)
            doc_ids = detour.document_ids(x, config.sep_token_id)
            x, y, doc_ids = x.to(device), y.to(device), doc_ids.to(device)
            times, mems = {A: [], B_: []}, {}
            for i in range(args.warmup + args.steps):
                for k in pair if i % 2 == 0 else pair[::-1]:  # alternate who goes first
                    last_warmup = i == args.warmup - 1
                    dt, mem = step(k, x, y, phase == "clm", doc_ids, measure=last_warmup)
                    if last_warmup:
                        mems[k] = mem
                    if i >= args.warmup:
                        times[k].append(dt)
            t = {k: statistics.median(v) for k, v in times.items()}
            a_time[phase, T] = t[A]
            tok = B * T
            cu, _ = detour.document_spans(doc_ids.cpu())
            flops = detour.model_flops(config, cu.diff().tolist(), phase == "clm", int((y != detour.IGNORE).sum()))
            tflops = "" if A == "hf" else f"{flops / t[A] / 1e12:.3f}"
            ratio = f"{a_time[phase, T] / a_time['mlm', T]:.2f}" if phase == "clm" and ("mlm", T) in a_time else ""
            row = [phase, T, B, f"{tok / t[A]:,.0f}", f"{tok / t[B_]:,.0f}", f"{t[B_] / t[A]:.2f}",
                   f"{mems[A] / 2**20:,.0f}", f"{mems[B_] / 2**20:,.0f}", tflops, ratio]
            print("".join(f"{v:<{w}}" if i == 0 else f"{v:>{w}}" for i, (v, w) in enumerate(zip(row, widths))),
                  flush=True)
    print("A TF/s: detour.model_flops (attention pairs the masks allow, head on the supervised positions) / step time")
    peak = detour.device_peak_flops(device)
    if peak:
        print(f"MFU = A TF/s / {peak / 1e12:.0f} TF/s (bf16 peak of this device)")


if __name__ == "__main__":
    main()
