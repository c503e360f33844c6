"""Training-step speed and peak memory: detour's ModernBERT against transformers' ModernBertForMaskedLM.

    python tests/benchmark.py                    # CPU: small preset, T = 512..4096, 1 thread, ~4 minutes
    python tests/benchmark.py --device cuda --preset base --lengths 1024,2048,4096,8192 [--compile]

A script, not a test (pytest collects only test_*.py). One process; the same weights (ours
exported with save_hf, loaded by transformers), the same batch and the same threads for both;
the two models alternate step by step so that machine noise hits both alike; medians.
A step is forward + backward + AdamW step, as in training:
  ours  mlm: bidirectional, 30% masking, head and loss on the masked positions only (sparse
             prediction), document mask from [SEP] on the packed rows.
        clm: causal=True, next-token targets at every position (dense head), document mask.
  HF    attn_implementation="sdpa", bidirectional, `labels` (dense logits, its default), the
        same inputs and targets. HF has no causal ModernBertForMaskedLM, so the clm row compares
        the same tokens with a dense head on every position for both.
Peak memory, CPU: the growth of the process's peak resident set (VmHWM, reset before each step
by writing 5 to /proc/self/clear_refs) over the resident set just before the step; glibc is told
to serve every block of 64 KiB or more with its own mmap, so freed tensors leave the resident set
at once and it follows live memory. GPU: torch.cuda.max_memory_allocated growth over the step.
Both include gradients, activations and temporaries; the weights and AdamW state exist before.
"""
import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import detour  # noqa: E402


class PeakMemory:
    """Peak memory growth (bytes) between start() and stop()."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.trim = None
        if not self.cuda:
            try:
                libc = ctypes.CDLL("libc.so.6")
                libc.mallopt(-3, 64 * 1024)   # M_MMAP_THRESHOLD: fixed, so large frees go back to the OS
                libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD: give back the heap top early too
                self.trim = libc.malloc_trim
            except OSError:
                print("note: not glibc; CPU peak memory may count freed memory kept by malloc")

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
        if self.trim:
            self.trim(0)
        self.base = self._status_kib("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS

    def stop(self):
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return self._status_kib("VmHWM") * 1024 - self.base


def packed_rows(n_rows, T, config, seed):
    """Rows of T + 1 tokens from data/default/train.bin when prepared (real packed documents),
    else synthetic documents ([CLS] random tokens [SEP], lengths 20..400)."""
    g = np.random.default_rng(seed)
    path = os.path.join(ROOT, "data", "default", "train.bin")
    if os.path.exists(path):
        data = np.memmap(path, dtype=np.uint16, mode="r")
        starts = g.integers(0, len(data) - T - 1, n_rows)
        return torch.from_numpy(np.stack([data[s:s + T + 1].astype(np.int64) for s in starts])), 8192
    rows = []
    for _ in range(n_rows):
        row = []
        while len(row) < T + 1:
            row += [config.cls_token_id, *g.integers(5, 8192, int(g.integers(20, 400))), config.sep_token_id]
        rows.append(row[:T + 1])
    return torch.tensor(rows), 8192


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
    args = p.parse_args()

    import transformers
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    lengths = [int(t) for t in args.lengths.split(",")]
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    config = detour.Config(vocab_size=50368, max_position_embeddings=max(8192, max(lengths)),
                           pad_token_id=0, unk_token_id=1, cls_token_id=2, sep_token_id=3, mask_token_id=4,
                           **detour.PRESETS[args.preset])
    torch.manual_seed(0)
    ours = detour.ModernBERT(config)
    with tempfile.TemporaryDirectory() as d:
        detour.save_hf(ours, d)
        hf = transformers.AutoModelForMaskedLM.from_pretrained(d, attn_implementation="sdpa")
    models = {"ours": ours.to(device).train(), "hf": hf.to(device).train()}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-5) for k, m in models.items()}
    runners = {k: (torch.compile(m) if args.compile else m) for k, m in models.items()}
    meter = PeakMemory(device)

    def step(name, x, y, causal, doc_ids):
        meter.start()
        t0 = time.perf_counter()
        with amp:
            if name == "ours":
                out = runners[name](x, y, causal=causal, doc_ids=doc_ids)
                loss = out[1]
            else:
                out = runners[name](input_ids=x, labels=y)
                loss = out.loss
        loss.backward()  # outputs stay alive through backward, as in a training loop
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        del out, loss
        return dt, meter.stop()

    name = os.popen("lscpu 2>/dev/null | grep 'Model name'").read().split(":")[-1].strip()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{name or 'CPU'}, {args.threads} threads"
    print(f"detour benchmark: {args.preset} preset (d={config.hidden_size}, L={config.num_hidden_layers}, "
          f"V={config.vocab_size}, {ours.num_params() / 1e6:.1f}M params), {where}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}{', compiled' if args.compile else ''}")
    print(f"step = fwd + bwd + AdamW on {args.tokens} tokens (batch = tokens // T), "
          f"median of {args.steps} alternating steps after {args.warmup} warm-up")
    head = f"{'phase':<6}{'T':>6}{'batch':>6}{'ours tok/s':>12}{'HF tok/s':>10}{'ours/HF':>9}" \
           f"{'ours MiB':>10}{'HF MiB':>8}{'ours TF/s':>10}{'clm/mlm':>9}"
    print(head)
    print("-" * len(head))
    ours_time = {}
    for phase in args.phases.split(","):
        for T in lengths:
            B = max(1, args.tokens // T)
            buf, n_real = packed_rows(B, T, config, seed=T)
            if phase == "clm":
                x, y = detour.clm_batch(buf, config.sep_token_id)
            else:
                x, y = detour.mlm_batch(buf, 0.30, torch.Generator().manual_seed(T), config, n_real)
            doc_ids = detour.document_ids(x, config.sep_token_id)
            x, y, doc_ids = x.to(device), y.to(device), doc_ids.to(device)
            times, mems = {"ours": [], "hf": []}, {"ours": [], "hf": []}
            for i in range(args.warmup + args.steps):
                for k in ("ours", "hf") if i % 2 == 0 else ("hf", "ours"):
                    dt, mem = step(k, x, y, phase == "clm", doc_ids)
                    if i >= args.warmup:
                        times[k].append(dt)
                        mems[k].append(mem)
            t = {k: statistics.median(v) for k, v in times.items()}
            ours_time[phase, T] = t["ours"]
            tok = B * T
            flops = detour.model_flops_per_token(config, T, causal=phase == "clm",
                                                 head_fraction=(y != detour.IGNORE).float().mean().item())
            ratio = f"{ours_time[phase, T] / ours_time['mlm', T]:.2f}" if phase == "clm" and ("mlm", T) in ours_time else ""
            print(f"{phase:<6}{T:>6}{B:>6}{tok / t['ours']:>12,.0f}{tok / t['hf']:>10,.0f}{t['hf'] / t['ours']:>9.2f}"
                  f"{max(mems['ours']) / 2**20:>10,.0f}{max(mems['hf']) / 2**20:>8,.0f}"
                  f"{flops * tok / t['ours'] / 1e12:>10.3f}{ratio:>9}", flush=True)
    print("ours TF/s: detour.model_flops_per_token (head on the supervised positions) x tokens / step time")


if __name__ == "__main__":
    main()
