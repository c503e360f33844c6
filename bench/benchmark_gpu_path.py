"""The 8192-token training path, measured on a CPU: what the GPU-path changes buy, before against after.

    git show 4fd3d0f:detour.py > /tmp/before/detour.py
    python bench/benchmark_gpu_path.py --before /tmp/before/detour.py --data data/bio [--parts batch,work,compile,memory]

A script, not a test. Parts (each prints its own table):
  batch    MLM batch preparation (detour.mlm_batch) for 4 x 8192 tokens on one thread, before and after,
           alternating, medians; the two must give the same tensors bit for bit.
  work     attention work per backend at T = 8192 (4 rows) on the base preset, with the document lengths of
           --data's train.bin cut into windows as training cuts them: the query-key pairs executed divided by
           the pairs the document and window masks allow (detour.attention_pairs), attention alone and the
           whole model (detour.model_flops). sdpa: the global layers' dense masked SDPA computes every one of
           the T x T pairs, the local layers 64 queries x 192 keys per block (128 causal); varlen: the allowed
           pairs, and (an upper bound of a tiled kernel) whole 128 x 128 tiles that hold an allowed pair.
  compile  torch.compile recompiles per phase: 20 MLM steps and 20 CLM steps of the tiny preset under
           --compile true, before and after; the graphs dynamo has compiled after each step.
  memory   peak resident memory of one base forward + backward (MLM, real vocabulary) at --memory_shape (2 x 4096)
           on the CPU's sdpa path, before and after, each in a fresh process (VmHWM growth over the model's RSS).
"""
import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def windows(data_dir, T, n_rows):
    meta = json.load(open(os.path.join(data_dir, "meta.json")))
    data = np.memmap(os.path.join(data_dir, "train.bin"), dtype=meta["dtype"], mode="r")
    n = min(n_rows, (len(data) - 1) // T)
    return torch.from_numpy(np.stack([data[i * T:(i + 1) * T + 1].astype(np.int64) for i in range(n)])), meta


def part_batch(before, after, data_dir):
    torch.set_num_threads(1)
    buf, meta = windows(data_dir, 8192, 4)
    config = after.Config(**{k: meta[k] for k in ("pad_token_id", "cls_token_id", "sep_token_id", "mask_token_id",
                                                  "unk_token_id")})
    times = {"before": [], "after": []}
    for i in range(11):
        out = {}
        for name, mod in (("before", before), ("after", after))[::1 if i % 2 else -1]:
            t0 = time.perf_counter()
            out[name] = mod.mlm_batch(buf, 0.30, torch.Generator().manual_seed(i), config, meta["vocab_size"])
            times[name].append(time.perf_counter() - t0)
        assert all(torch.equal(a, b) for a, b in zip(out["before"], out["after"])), "mlm_batch changed its output"
    b, a = (statistics.median(times[k][1:]) * 1e3 for k in ("before", "after"))
    print(f"\nMLM batch preparation, 4 x 8192 tokens, 1 thread, median of 10: before {b:.2f} ms, after {a:.2f} ms "
          f"({b / a:.1f}x); outputs bitwise equal")


def tiles(n, window, causal, tile=128):
    """Whole tile x tile blocks of one document's n x n square that hold an allowed pair."""
    nb = -(-n // tile)
    a, b = np.meshgrid(np.arange(nb), np.arange(nb), indexing="ij")
    ok = np.ones_like(a, dtype=bool) if not causal else b <= a
    if window is not None:
        ok &= np.maximum(0, (np.abs(a - b) - 1) * tile + 1) <= window
    return int(ok.sum()) * tile * tile


def part_work(after, data_dir, T=8192, rows=64):
    buf, meta = windows(data_dir, T, rows)
    config = after.Config(**after.PRESETS["base"])
    half = config.local_attention // 2
    lengths = []
    for r in range(0, len(buf), 4):  # micro-batches of 4 rows, documents cut by [SEP] and by row ends
        cu, _ = after.document_spans(after.document_ids(buf[r:r + 4, :-1], meta["sep_token_id"]))
        lengths += cu.diff().tolist()
    tokens, kinds = len(buf) * T, config.layer_types
    n_global, n_local = kinds.count("full_attention"), kinds.count("sliding_attention")
    print(f"\nAttention work at T = {T}, base preset ({n_global} global + {n_local} local layers), {len(buf)} rows of "
          f"{data_dir}: {len(lengths)} spans, mean {np.mean(lengths):.0f} tokens, median {np.median(lengths):.0f}, "
          f"max {max(lengths)}")
    print(f"{'phase':6} {'backend':22} {'attention executed/needed':>26} {'model executed/needed':>22}")
    for phase, causal in (("mlm", False), ("clm", True)):
        needed = {w: after.attention_pairs(lengths, w, causal) for w in (None, half)}
        need_att = n_global * needed[None] + n_local * needed[half]
        n_blocks = -(-T // half)
        executed = {
            "sdpa (dense mask)": n_global * len(buf) * T * T + n_local * len(buf) * n_blocks * half * (2 if causal else 3) * half,
            "varlen (pairs)": need_att,
            "varlen (128x128 tiles)": n_global * sum(tiles(n, None, causal) for n in lengths)
            + n_local * sum(tiles(n, half, causal) for n in lengths)}
        model_needed = after.model_flops(config, lengths, causal, tokens * (0.3 if phase == "mlm" else 1))
        for name, pairs in executed.items():
            model = model_needed + 3 * 4 * config.hidden_size * (pairs - need_att)
            print(f"{phase:6} {name:22} {pairs / need_att:>26.2f} {model / model_needed:>22.2f}")


COMPILE_RUN = r"""
import sys, json, os
sys.path.insert(0, os.path.dirname(sys.argv[1]))
sys.path.insert(0, sys.argv[4])  # the repository root, for bench.fixtures
import torch
from torch._dynamo.utils import counters
detour = __import__(os.path.basename(sys.argv[1])[:-3])
from bench.fixtures import write_tiny_data
data = write_tiny_data(os.path.join(sys.argv[2], "data"))
seen, lr_at = [], detour.lr_at
def hook(cfg, *a, **k):  # called once at the start of every step: the graphs compiled so far
    seen.append((cfg.phase, counters["stats"]["unique_graphs"]))
    return lr_at(cfg, *a, **k)
detour.lr_at = hook
for phase in ("mlm", "clm"):
    detour.main(["--data_dir", data, "--phase", phase, "--init_from", "scratch", "--preset", "tiny", "--seq_len", "32", "--batch_size", "2",
                 "--global_batch_size", "2", "--max_tokens", str(20 * 64), "--learning_rate", "3e-3",
                 "--warmup_tokens", "1024", "--progress", "false", "--eval_interval", "1000", "--eval_tokens", "64",
                 "--ckpt_interval", "1000", "--compile", "true", "--out_dir", os.path.join(sys.argv[2], phase)])
    seen.append((phase, counters["stats"]["unique_graphs"]))
print(json.dumps(seen))
"""


def part_compile(before_path):
    print("\ntorch.compile, 20 MLM then 20 CLM steps of the tiny preset: graphs compiled after steps 1, 2, ..., 20")
    for name, path in (("before", before_path), ("after", os.path.join(ROOT, "detour.py"))):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.time()
            p = subprocess.run([sys.executable, "-c", COMPILE_RUN, path, d, "", ROOT],
                               capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            if p.returncode:
                print(f"{name}: failed: {p.stderr[-800:]}")
                continue
            seen = json.loads(p.stdout.strip().splitlines()[-1])
        for phase in ("mlm", "clm"):
            graphs = [g for ph, g in seen if ph == phase][1:]  # after step 1 .. after the last step
            base = graphs[0]
            print(f"{name:7} {phase}: {graphs[-1] - base} new graph(s) after step 1 "
                  f"(per step: {[g - base for g in graphs]}); {time.time() - t0:.0f} s for both phases")


MEMORY_RUN = r"""
import sys, os, resource
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import torch
torch.set_num_threads(1)
detour = __import__(os.path.basename(sys.argv[1])[:-3])
def hwm():
    return int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]) * 1024
def rss():
    return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) * 1024
c = detour.Config(**detour.PRESETS["base"], pad_token_id=0, unk_token_id=1, cls_token_id=2, sep_token_id=3, mask_token_id=4)
torch.manual_seed(0)
m = detour.ModernBERT(c).train()
g = torch.Generator().manual_seed(0)
B, T = int(sys.argv[2]), int(sys.argv[3])
buf = torch.randint(5, 50000, (B, T + 1), generator=g)
pos = torch.cumsum(torch.randint(150, 450, (T // 100,), generator=g), 0)
buf[:, pos[pos < T + 1]] = c.sep_token_id   # documents of 150-450 tokens, as the bio abstracts
x, y = detour.mlm_batch(buf, 0.3, torch.Generator().manual_seed(1), c, 50280)
doc = detour.document_ids(x, c.sep_token_id)
open("/proc/self/clear_refs", "w").write("5")
base = rss()
loss = m(x, y, doc_ids=doc)[1]
loss.backward()
print(hwm() - base, loss.item())
"""


def part_memory(before_path, shape):
    B, T = shape.split("x")
    print(f"\nPeak memory, base preset, one forward + backward, MLM, {B} x {T} tokens, CPU sdpa (fp32, 1 thread):")
    for name, path in (("before", before_path), ("after", os.path.join(ROOT, "detour.py"))):
        t0 = time.time()
        p = subprocess.run([sys.executable, "-c", MEMORY_RUN, path, B, T], capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        if p.returncode:
            print(f"{name}: failed: {p.stderr[-800:]}")
            continue
        grow, loss = p.stdout.split()
        print(f"{name:7} peak growth {int(grow) / 2**30:.2f} GiB over the model's resident set (loss {float(loss):.6f}, "
              f"{time.time() - t0:.0f} s)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the detour.py to compare against (e.g. git show 4fd3d0f:detour.py)")
    p.add_argument("--data", default=os.path.join(ROOT, "data", "default"), help="a prepared data dir (document lengths)")
    p.add_argument("--parts", default="batch,work,compile,memory")
    p.add_argument("--memory_shape", default="2x4096", help="B x T of the memory part (2 x 4096: about 15 GB or more)")
    args = p.parse_args()
    parts = args.parts.split(",")
    sys.path.insert(0, ROOT)
    after = load(os.path.join(ROOT, "detour.py"), "detour_after")
    before = load(args.before, "detour_before")
    print(f"detour GPU-path benchmark on CPU: torch {torch.__version__}, before = {args.before}")
    if "batch" in parts:
        part_batch(before, after, args.data)
    if "work" in parts:
        part_work(after, args.data)
    if "compile" in parts:
        part_compile(args.before)
    if "memory" in parts:
        part_memory(args.before, args.memory_shape)


if __name__ == "__main__":
    main()
