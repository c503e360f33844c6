"""Where a base-preset training step's GPU time goes (one call on a lent GPU, after gpu_check.py).

    python bench/gpu_profile.py --out out/gpu_profile.txt

gpu_check.py measured 13.6% MFU eager and 22% compiled at 16,384 tokens per step, with tokens/s flat
from T = 1024 to 8192: attention is not the cost. This asks why, in one run: (1) tokens/s and MFU
against tokens per step (a launch- or host-bound step gains with more tokens, a kernel-bound one does
not); (2) a torch.profiler trace of one eager step: GPU-busy time over wall time, and the kernels
that take it; (3) optionally the compiled step at the largest size.
"""
import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a file (python bench/x.py), not imported: the repository root, for detour and bench
    sys.path.insert(0, ROOT)
from bench import gpu_check as gc  # noqa: E402
detour = gc.detour


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--tokens", default="16384,65536")
    p.add_argument("--compiled", action="store_true")
    p.add_argument("--out", default="out/gpu_profile.txt")
    a = p.parse_args()
    sizes = [int(t) for t in a.tokens.split(",")]
    if not torch.cuda.is_available():
        print(f"gpu_profile: no CUDA device here (torch {torch.__version__}); nothing profiled, run it on a GPU machine")
        return
    dev = torch.device("cuda")
    config = detour.Config(vocab_size=50368, max_position_embeddings=a.T, **gc.SPECIAL, **detour.PRESETS["base"])
    torch.manual_seed(0)
    model = detour.ModernBERT(config).to(dev).train()
    model.model.attn_backend = "varlen"
    opt_cfg = argparse.Namespace(learning_rate=2e-4, weight_decay=1e-5, beta1=0.9, beta2=0.98, eps=1e-6)
    opt = detour.make_optimizer(model, opt_cfg, fused=True)
    peak = detour.device_peak_flops(dev)
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    def make_step(runner, phase, tokens, compiled):
        B = max(1, tokens // a.T)
        x, y = gc.training_batch(config, gc.packed_rows(config, B, a.T, seed=a.T), phase, seed=a.T)
        cu, longest = detour.document_spans(detour.document_ids(x, config.sep_token_id))
        n_pred = int((y != gc.IGNORE).sum())
        flops = detour.model_flops(config, cu.diff().tolist(), phase == "clm", n_pred)
        x, y, spans = x.to(dev), y.to(dev), (cu.to(dev), longest)
        cap = gc.head_capacity(phase, B * a.T) if compiled else None  # once, outside the timed step

        def step():
            with gc.bf16(dev):
                _, loss = runner(x, y, causal=phase == "clm", spans=spans, capacity=cap)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        return step, flops, B * a.T

    say(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, base {model.num_params() / 1e6:.1f}M, T={a.T}")
    for phase in ("mlm", "clm"):
        for tokens in sizes:
            step, flops, n = make_step(model, phase, tokens, False)
            first, dt, pk, grow, loss = gc.time_steps(step, dev, 2, 5)
            say(f"eager {phase} tokens/step {n:>6}: {dt * 1e3:7.1f} ms, {n / dt:9,.0f} tok/s, MFU {flops / dt / peak:.1%}, peak {pk / 2**30:.1f} GiB")
    # One eager step per phase at the smallest size under the profiler: GPU-busy time and top kernels.
    for phase in ("mlm", "clm"):
        step, flops, n = make_step(model, phase, sizes[0], False)
        step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        ev = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in ev) / 1e6
        launches = sum(e.count for e in ev)
        say(f"profile eager {phase} {n} tokens: wall {wall * 1e3:.1f} ms (profiled), GPU kernels {busy * 1e3:.1f} ms, {launches} kernels")
        for e in sorted(ev, key=lambda e: -e.self_device_time_total)[:18]:
            say(f"  {e.self_device_time_total / 1e3:8.2f} ms  x{e.count:<5} {e.key[:110]}")
    if a.compiled:
        step, flops, n = make_step(torch.compile(model), "mlm", sizes[-1], True)
        first, dt, pk, grow, loss = gc.time_steps(step, dev, 2, 5)
        say(f"compiled mlm tokens/step {n}: {dt * 1e3:.1f} ms, {n / dt:,.0f} tok/s, MFU {flops / dt / peak:.1%}, first step {first:.0f} s")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
