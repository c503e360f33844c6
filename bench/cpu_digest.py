"""The CPU path's fingerprint: short CLM, MLM and decay runs (one process, and two gloo ranks under
torchrun), each reduced to digests of what a docs table could depend on: log.jsonl's records (the
wall-clock fields dropped), the checkpoint's weights and AdamW state, the step/tokens/data position,
and every exported file (hf/, init/). Run it on two commits and compare: equal digests mean a
change left the CPU path bitwise as it was.

  python bench/cpu_digest.py --out /tmp/before.json            # on the old commit
  python bench/cpu_digest.py --out /tmp/after.json --compare /tmp/before.json

It prepares the generated biomedical corpus alone (data/prepare.py --register bio, the default
before the θ0 pair) in a temporary directory (about 10 s) and trains the `small` preset from scratch
for a few dozen steps per run, one thread per process: about two minutes. The detour.py defaults it
ran on before the default became θ0 continued (issue 51) are given explicitly (FROM_SCRATCH), so the
digests of earlier commits still compare.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ("tok_per_s", "mfu")  # wall-clock fields: they differ on every run
SHORT = ["--max_tokens", "25600", "--eval_interval", "25", "--log_interval", "5", "--ckpt_interval", "20",
         "--eval_tokens", "4096", "--warmup_tokens", "5120", "--progress", "false"]
# The Phase-1 defaults of detour.py when these digests were first taken; a decay inherits them.
FROM_SCRATCH = ["--init_from", "scratch", "--preset", "small", "--batch_size", "4", "--global_batch_size", "4",
                "--learning_rate", "2e-3"]
PHASE1_ONLY = ("--max_tokens", "--warmup_tokens")  # a decay refuses them: its budget and schedule are its own
# (name, launcher ranks, arguments); a decay names the Phase-1 run it continues.
RUNS = [
    ("clm", 1, ["--phase", "clm"]),
    ("clm-decay", 1, ["--phase", "decay", "--init_from", "{out}/clm"]),
    ("mlm", 1, ["--phase", "mlm", "--batch_size", "2", "--freeze_layers", "0-1"]),
    ("mlm-decay", 1, ["--phase", "decay", "--init_from", "{out}/mlm", "--decay_tokens", "5120"]),
    ("clm-ddp", 2, ["--phase", "clm", "--batch_size", "2"]),
    ("clm-ddp-decay", 2, ["--phase", "decay", "--init_from", "{out}/clm-ddp"]),
    ("mlm-ddp", 2, ["--phase", "mlm", "--batch_size", "2"]),
]


def sha(data):
    return hashlib.sha256(data).hexdigest()[:16]


def tensor_digest(obj):
    """One digest of every tensor in a nested state (dicts in key order, lists in order)."""
    h = hashlib.sha256()

    def visit(x, prefix):
        if isinstance(x, torch.Tensor):
            h.update(prefix.encode())
            h.update(x.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                visit(x[k], f"{prefix}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                visit(v, f"{prefix}/{i}")
        else:
            h.update(f"{prefix}={x!r}".encode())

    visit(obj, "")
    return h.hexdigest()[:16]


def digest_run(directory):
    """The digests of one out_dir."""
    with open(os.path.join(directory, "log.jsonl")) as f:
        records = [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f if line.strip()]
    ckpt = torch.load(os.path.join(directory, "ckpt.pt"), map_location="cpu", weights_only=True)
    out = {"log": sha(json.dumps(records, sort_keys=True).encode()), "last": records[-1],
           "weights": tensor_digest(ckpt["model"]), "adamw": tensor_digest(ckpt["optimizer"]["state"]),
           "position": [ckpt["step"], ckpt["tokens"], ckpt["sample0"], ckpt["phase1_tokens"]]}
    for sub in ("hf", "init"):
        folder = os.path.join(directory, sub)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            with open(os.path.join(folder, name), "rb") as f:
                out[f"{sub}/{name}"] = sha(f.read())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the digests, as JSON")
    ap.add_argument("--compare", default="", help="an earlier --out: print every digest that differs, exit 1 if any")
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    digests = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        subprocess.run([sys.executable, "data/prepare.py", "--register", "bio", "--out_dir", data], cwd=ROOT,
                       env=env, check=True, stdout=subprocess.DEVNULL)
        for name, ranks, extra in RUNS:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
            argv = [a.format(out=tmp) for a in extra]
            short = FROM_SCRATCH + SHORT
            if "decay" in argv:
                short = [a for k, v in zip(SHORT[::2], SHORT[1::2]) if k not in PHASE1_ONLY for a in (k, v)]
            cmd = [*launcher, "detour.py", "--data_dir", data, *short, *argv, "--out_dir", os.path.join(tmp, name)]
            subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
            digests[name] = digest_run(os.path.join(tmp, name))
            print(name, digests[name]["weights"], digests[name]["log"], flush=True)
    with open(args.out, "w") as f:
        json.dump(digests, f, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        differ = [f"{run} {key}: {before.get(run, {}).get(key)} -> {value}" for run, d in digests.items()
                  for key, value in d.items() if before.get(run, {}).get(key) != value]
        print("\n".join(differ) or f"bitwise equal: {len(digests)} runs, every digest")
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
