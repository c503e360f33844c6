"""
finetune.py: fine-tune encoder checkpoints on downstream tasks and compare them.

The paper judges the CLM detour downstream: the detour encoder and its MLM-only twin are fine-tuned
alike (same tasks, same seeds) and compared task by task (mean +- std over runs) and on average.
Replicates of one arm are joined with "+" (--ckpts A1+A2,B1+B2); the statistics' unit is the (task,
replicate) pair. The tasks (files, kinds, encoding, metrics): data/tasks.py. Why the detour works
(CKA, weight drift, transplants): studies/analysis.py.

  python finetune.py                       # out/clm-decay vs out/mlm-decay (and θ0), default tasks
  python finetune.py --ckpts A1+A2,B1+B2 --tasks chem=ner:../shared/bio/ner/BC5CDR-chem-IOB
  python finetune.py --probe true          # linear probing: frozen encoder, head only
  python finetune.py --shard 0/4 ... --shard 3/4  # a quarter of the cells each (a GPU each)
  python finetune.py --merge true          # then results.md (each shard also tries at its end)

A task is `name=kind:path` (kind: cls | multilabel | regression | ner; `kind+probe` for a linear
probe), `default` the embedded tasks. Every Protocol field is an option, `--key value` or
`--key=value`; from Python: finetune.run(finetune.Protocol(seeds=2), ["a", "b"], "default").
"""
import contextlib
import copy
import fcntl
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.nn as nn
from tqdm import tqdm

import detour
from data import tasks  # task files, read and built (data/tasks.py, next to data/world.py)
from detour import fail

# ---- The protocol. Its values are the paper's; the CPU default below shortens them. ----
@dataclass(frozen=True)
class Protocol:
    ckpts: str = "out/clm-decay,out/mlm-decay,out/theta0"  # the twins' final checkpoints (the
                                    # first minus the second), then θ0, where both started: a
                                    # reference row; those that exist
    tasks: str = "default"          # comma-separated name=kind:path[@max_len], or `default`
    out_dir: str = "out/finetune"   # results.md / results.json
    tasks_dir: str = "data/tasks"   # where the embedded default tasks are written (once)
    pretrain_dir: str = "data/world/bio"  # default-task text seen in pretraining text: dropped
    # protocol (paper)
    protocol: str = ""              # a preset, paper-en | paper-fr (PRESETS, below); options win
    learning_rate: float = 5e-5     # peak lr, AdamW
    weight_decay: float = 0.01      # on weight matrices only (not biases, norms)
    batch_size: int = 16
    epochs: int = 10                # cls / multilabel / regression
    ner_epochs: int = 20            # token classification
    warmup_ratio: float = 0.10      # linear warmup over 10% of the steps, then linear decay to 0
    seeds: int = 5                  # fine-tuning seeds, the same for every checkpoint: ...
    first_seed: int = 0             # ... first_seed .. first_seed + seeds - 1
    max_len: int = 512              # longer inputs are truncated (and counted); a task's @N wins
    pooling: str = "mean"           # cls | mean (over real tokens, as the released ModernBERT)
    dropout: float = 0.0            # classifier_dropout, between head and classifier (HF: 0.0)
    grad_clip: float = 1.0          # max grad norm, 0 = off (HF Trainer's max_grad_norm: 1.0)
    pos_weight: str = "none"        # multilabel BCE: none | auto (n_neg/n_pos per label) | a number
    # scoring, from each run's kept predictions (a finished grid is scored again without training)
    selection: str = ""             # kind=metric,...: the dev metric that picks a run's epoch, its
                                    # test score reported ("" = each kind's main: data/tasks.py)
    ner_mode: str = "default"       # entities as seqeval finds them: default | strict (the scheme's
                                    # only; IOB2 or IOBES, as the tags are)
    # linear probing: a frozen encoder, its features computed once, so probe epochs cost almost
    # nothing; lr and epochs are ours: a fresh linear layer barely moves at 5e-5 in a few epochs
    probe: bool = False             # probe every task (a task can also ask for it: kind+probe)
    probe_lr: float = 1e-3
    probe_epochs: int = 20
    # CPU default: the paper's 10/20 epochs x 5 seeds take hours on 2 CPU cores even for the small
    # model; on a CPU, main uses these for the options of CPU_DEFAULTS not given.
    cpu_epochs: int = 3
    cpu_ner_epochs: int = 3
    cpu_seeds: int = 3
    cpu_learning_rate: float = 5e-4  # the small CPU models barely move at 5e-5 in 3 epochs
    # the default tasks (data/tasks.py: world.py, other seeds than pretraining's), sized for minutes
    task_seed: int = 2025
    ner_sizes: str = "200,100,200"      # train, dev, test sentences (~17 tokens each)
    notes_sizes: str = "96,48,96"       # train, dev, test notes (~120 tokens each)
    needle_per_cell: str = "16,8,16"    # train, dev, test examples per (position, length) cell
    needle_lengths: str = "56,112,224"  # haystack length in words (~64/128/256 tokens)
    needle_positions: str = "start,middle,end"
    rebuild_tasks: bool = False     # rewrite data/tasks even if it is up to date
    # shortening a protocol on a CPU: a fixed random subset (seed 0) of each split; 0 = all
    max_train: int = 0              # training examples per task
    max_eval: int = 0               # dev and test examples per task
    # system
    device: str = "auto"            # auto | cpu | cuda | cuda:N
    dtype: str = "auto"             # auto (bf16 autocast on GPU, fp32 on CPU) | float32 | bfloat16
    progress: bool = True           # tqdm bars
    bootstrap_samples: int = 10_000  # resamples of the paired bootstrap (fixed RNG seed 0)
    # the grid: a (checkpoint, task, seed) cell done in <out_dir>/cells is not run again
    shard: str = ""                 # i/n: cells i, i+n, ...; "" = all (in a SLURM array: its own)
    merge: bool = False             # train nothing: results.md/.json from the cells (all done)

# --protocol: the paper's two protocols (thesis, chapter 5), as field sets; an option given wins,
# and the CPU default does not touch them. What finetune.py cannot do as the paper did is in
# docs/finetuning.md (the French NER's nested span head; a length per task is name=kind:path@N).
PRESETS = {
    # English, BioClinical-ModernBERT's evaluation code: HF Trainer, no warmup, the best epoch by
    # weighted F1 (classification) or seqeval's default-mode F1 (NER), the tokenizer's 8,192
    "paper-en": dict(learning_rate=5e-5, weight_decay=0.01, batch_size=16, epochs=10,
                     ner_epochs=20, warmup_ratio=0.0, seeds=5, first_seed=42, max_len=8192,
                     pooling="mean", selection="cls=weighted_f1,multilabel=weighted_f1",
                     ner_mode="default"),
    # French, the tabib harness: a linear head on the CLS token, 10% warmup, weighted BCE, the best
    # epoch by weighted F1 (single-label), micro F1 (multilabel), strict IOB2 F1 (NER); 9 seeds
    # (their values are not published: 0-8 here); 2,048 tokens (its multilabel tasks: @4096)
    "paper-fr": dict(learning_rate=2e-5, weight_decay=0.01, batch_size=4, epochs=15,
                     ner_epochs=15, warmup_ratio=0.1, seeds=9, first_seed=0, max_len=2048,
                     pooling="cls", pos_weight="auto", ner_mode="strict",
                     selection="cls=weighted_f1,multilabel=micro_f1"),
}

CPU_DEFAULTS = ("epochs", "ner_epochs", "seeds", "learning_rate")  # cpu_<key> unless --<key> given
REPORTED = ("learning_rate", "weight_decay", "batch_size", "epochs", "ner_epochs", "warmup_ratio",
            "max_len", "pooling", "dropout", "grad_clip", "pos_weight", "probe", "probe_lr",
            "probe_epochs", "max_train", "max_eval")  # the protocol settings results.json records
POSITIVE = detour.POSITIVE          # > 0
NON_NEGATIVE = detour.NON_NEGATIVE  # >= 0
PROPORTION = detour.BETA            # in [0, 1): warmup_ratio (of the steps), dropout (a chance)
# (a float is finite: detour.convert refuses inf, 1e999 and nan as the command line is read)


def is_pos_weight(v):
    if v in ("none", "auto"):
        return True
    try:
        return 0 < float(v) < math.inf
    except ValueError:  # not a number ("." and "high" included)
        return False

def is_selection(v):
    """kind=metric pairs, each metric one of the kind's selectable ones (data/tasks.py's KINDS)."""
    pairs = [item.partition("=") for item in v.split(",") if item]
    once = len({kind for kind, _, _ in pairs}) == len(pairs)  # a kind twice: one would not act
    return once and all(kind in tasks.KINDS and metric in tasks.KINDS[kind].selectable
                        for kind, _, metric in pairs)

SELECTABLE = "; ".join(f"{k}={'|'.join(kind.selectable)}" for k, kind in tasks.KINDS.items())

def is_shard(v):
    parts = v.split("/")
    return v == "" or bool(re.fullmatch(r"\d+/\d+", v)) and int(parts[0]) < int(parts[1])

RULES = dict(  # checked by main, in this order
    ckpts=detour.NOT_EMPTY, tasks=detour.NOT_EMPTY, learning_rate=POSITIVE,
    weight_decay=NON_NEGATIVE, batch_size=POSITIVE, epochs=POSITIVE, ner_epochs=POSITIVE,
    warmup_ratio=PROPORTION, seeds=POSITIVE,
    max_len=(lambda v: v >= 3, ">= 3 ([CLS] a [SEP] b [SEP])"),
    pooling=detour.one_of("cls", "mean"),
    dropout=PROPORTION, grad_clip=NON_NEGATIVE, probe_lr=POSITIVE,
    probe_epochs=POSITIVE, cpu_epochs=POSITIVE, cpu_ner_epochs=POSITIVE, cpu_seeds=POSITIVE,
    cpu_learning_rate=POSITIVE,
    task_seed=NON_NEGATIVE, max_train=NON_NEGATIVE, max_eval=NON_NEGATIVE,
    pos_weight=(is_pos_weight, "none | auto | a finite number > 0"), device=detour.DEVICE,
    dtype=detour.DTYPE, bootstrap_samples=POSITIVE,
    shard=(is_shard, "i/n with 0 <= i < n (e.g. 0/4), or \"\" for every cell"),
    protocol=detour.one_of("", *PRESETS), first_seed=NON_NEGATIVE,
    selection=(is_selection, f"kind=metric,..., each kind once ({SELECTABLE})"),
    ner_mode=detour.one_of("default", "strict"),
    out_dir=detour.NOT_A_FILE, tasks_dir=detour.NOT_A_FILE)

# ---- Statistics of a comparison. The unit is one (task, pretraining replicate) pair: A's mean over
# fine-tuning seeds minus B's (same data order and seeds). Seeds are not independent evidence
# about pretraining: averaged, never counted as units. Both tests are one-sided (A > B). ----
def sign_flip_p(d):
    """Exact paired sign-flip test: under H0 all 2^n sign patterns of the differences are equally
    likely; p = the share whose mean is >= the observed one (which counts: p >= 1/2^n)."""
    d = np.asarray(d, float)
    if len(d) > 20:  # 2^20 patterns is the most we enumerate; beyond, a seeded Monte Carlo
        signs = np.random.default_rng(0).choice([-1.0, 1.0], size=(2 ** 20, len(d)))
        return float((1 + np.sum((signs * d).mean(1) >= d.mean() - 1e-12)) / (1 + 2 ** 20))
    signs = 1.0 - 2.0 * ((np.arange(2 ** len(d))[:, None] >> np.arange(len(d))) & 1)
    return float(np.mean((signs * d).mean(1) >= d.mean() - 1e-12))

def paired_bootstrap(a, b, samples=10_000, seed=0):
    """One-sided p that `a` beats `b`, the units a_i - b_i resampled: (1 + #means <= 0) / (1 +
    samples), never 0. Anti-conservative for few units: read it next to sign_flip_p."""
    d = np.asarray(a, float) - np.asarray(b, float)
    if not np.any(d):
        return 1.0  # no difference at all: no evidence
    means = d[np.random.default_rng(seed).integers(0, len(d), size=(samples, len(d)))].mean(1)
    return float((1 + np.sum(means <= 0)) / (1 + samples))

BOOTSTRAP_UNITS = 8  # below it no bootstrap p (None): so few units cannot stand for a population

def t_quantile(q, df):
    """Student-t quantile for q in (0.5, 1): the pdf integrated numerically (no scipy)."""
    x = np.linspace(0.0, 100.0, 1_000_001)
    logc = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    pdf = np.exp(logc - (df + 1) / 2 * np.log1p(x * x / df))
    cdf = 0.5 + np.concatenate([[0.0], np.cumsum((pdf[1:] + pdf[:-1]) / 2 * np.diff(x))])
    return float(np.interp(q, cdf, x))

def mean_interval(d, level=0.95):
    """-> (mean, lo, hi): d's mean and two-sided t interval; lo = hi = mean for one unit."""
    d = np.asarray(d, float)
    mean = float(d.mean())
    n = len(d)
    half = 0.0
    if n > 1:
        half = t_quantile(0.5 + level / 2, n - 1) * float(d.std(ddof=1)) / math.sqrt(n)
    return mean, mean - half, mean + half

def detectable_difference(d, alpha=0.05, power=0.80):
    """The smallest true mean difference a one-sided paired t test at `alpha` over these
    units would detect with `power`, given their spread: (t_{1-alpha} + t_power) * sd / sqrt(n)."""
    d = np.asarray(d, float)
    df = len(d) - 1
    if df < 1:
        return float("nan")
    t_sum = t_quantile(1 - alpha, df) + t_quantile(power, df)
    return t_sum * float(d.std(ddof=1)) / math.sqrt(len(d))

def format_p(p):
    """A p-value as text; it is never 0 (every p here has a floor above 0)."""
    return f"{p:.2g}" if p < 0.01 else f"{p:.3f}"

# ---- The fine-tuning model: transformers' ModernBertFor{Token,Sequence}Classification: encoder
# body -> [pooling] -> the checkpoint's *pretrained* MLM head (dense, GELU, LayerNorm) -> dropout
# -> a new linear classifier; HF's parameter names (model.*, head.*, classifier.*). ----
class TaskModel(nn.Module):
    def __init__(self, encoder, n_out, per_token, pooling, dropout):
        super().__init__()
        self.model = encoder.model
        self.head = encoder.head
        self.per_token = per_token
        self.pooling = pooling
        self.drop = nn.Dropout(dropout)
        self.classifier = nn.Linear(encoder.config.hidden_size, n_out)
        std = encoder.config.hidden_size ** -0.5  # HF's "final_out" init of the classifier
        nn.init.trunc_normal_(self.classifier.weight, std=std, a=-2 * std, b=2 * std)
        nn.init.zeros_(self.classifier.bias)

    def features(self, ids, mask, target=None):
        """Classifier inputs: head(pooled body output) (B, d), or for NER head(h) of the
        labeled tokens (N, d) (the head is per position, so selecting first is the same)."""
        h = self.model(ids, attention_mask=mask)
        if self.per_token:
            return self.head(h[target != detour.IGNORE])  # the labeled tokens
        if self.pooling == "cls":
            return self.head(h[:, 0])
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))

    def forward(self, x):
        return self.classifier(self.drop(x))

def get_device(protocol):
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(auto if protocol.device == "auto" else protocol.device)

def autocast(protocol, dev):
    bf16 = protocol.dtype == "bfloat16" or (protocol.dtype == "auto" and dev.type == "cuda")
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16)

def head_inputs(task_model, examples, idx, feats, dev):
    if feats is not None:  # probing: precomputed, the encoder does not run
        join = torch.cat if task_model.per_token else torch.stack
        return join([feats[i] for i in idx]).to(dev)
    batch = [examples[i] for i in idx]
    ids, mask, target = tasks.pad_batch(batch, task_model.model.config.pad_token_id, dev)
    return task_model.features(ids, mask, target)

@torch.no_grad()
def per_example(protocol, model, examples, dev, rows, per_token=False):
    """rows(batch indices) over length batches, in eval mode, without grad -> per example in input
    order a CPU tensor: its row, or with per_token a row per labeled (mapped) word."""
    model.eval()
    out = [None] * len(examples)
    for idx in tasks.length_batches(examples, protocol.batch_size):
        with autocast(protocol, dev):
            x = rows(idx).cpu()
        if per_token:
            x = x.split([sum(examples[i]["mapped"]) for i in idx])
        for i, v in zip(idx, x):
            out[i] = v
    return out

def probe_features(protocol, model, task):
    """A frozen encoder's head inputs per split, on the CPU: computed once for all seeds."""
    dev = get_device(protocol)
    per_token = tasks.KINDS[task["kind"]].per_token
    task_model = TaskModel(model.to(dev), 1, per_token, protocol.pooling, protocol.dropout).to(dev)
    feats = {}
    for split in ("train", "dev", "test"):
        def rows(idx):
            return head_inputs(task_model, task[split], idx, None, dev).float()
        feats[split] = per_example(protocol, task_model, task[split], dev, rows, per_token)
    return feats

def evaluate(protocol, task_model, task, split, feats, dev):
    """Predict a split -> its predictions in the kept form (data/tasks.py). Logits that are not
    finite (a diverged run) are an error: argmax or a threshold would turn them into a score."""
    kind = tasks.KINDS[task["kind"]]
    examples = task[split]

    def rows(idx):
        return task_model(head_inputs(task_model, examples, idx, feats, dev)).float()
    out = per_example(protocol, task_model, examples, dev, rows, kind.per_token)
    if not all(bool(torch.isfinite(z).all()) for z in out):
        fail(f"task {task['name']}: predictions on {split} are not finite (the run diverged); "
             "lower --learning_rate (--probe_lr for a probe)")
    return kind.predict(examples, out)

def scoring_of(protocol, task):
    """How a task's runs are scored -> dict(main: the metric that picks the epoch, --selection's
    or the kind's; for NER seqeval's mode and the tags' scheme). Cells record it; another scoring
    is computed again from their kept predictions."""
    chosen = dict(item.split("=") for item in protocol.selection.split(",") if item)
    scoring = dict(main=chosen.get(task["kind"], tasks.KINDS[task["kind"]].main))
    if tasks.KINDS[task["kind"]].per_token:
        scoring.update(ner_mode=protocol.ner_mode, scheme=task["scheme"])
    return scoring

# ---- Fine-tuning one (checkpoint, task, seed). ----
def optimizer(protocol, task_model, frozen):
    """AdamW over the classifier (probe) or all; decay on matrices -> (opt, params, peak lr)"""
    params = list((task_model.classifier if frozen else task_model).parameters())
    groups = [dict(params=[q for q in params if q.dim() >= 2], weight_decay=protocol.weight_decay),
              dict(params=[q for q in params if q.dim() < 2], weight_decay=0.0)]
    peak = protocol.probe_lr if frozen else protocol.learning_rate
    return torch.optim.AdamW(groups, lr=peak), params, peak

def scheduled_lr(peak, step, warm, total):
    """Linear warmup to the peak, then linear decay to 0 at the last step."""
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (total - step) / max(1, total - warm)

def train_epoch(protocol, task_model, task, feats, run):
    """One epoch of batches -> its mean loss. `run`: the optimizer (opt, params, peak), the schedule
    (step, warm, total), the batch order's RNG, pos_weight, the device, the bar, epoch and desc. A
    loss that is not finite (a diverged run) is an error, not a run trained on NaN."""
    kind = tasks.KINDS[task["kind"]]
    train = task["train"]
    losses = []
    for idx in tasks.train_order(train, run["order_rng"], protocol.batch_size):
        task_model.train()
        lr = scheduled_lr(run["peak"], run["step"], run["warm"], run["total"])
        for group in run["opt"].param_groups:
            group["lr"] = lr
        with autocast(protocol, run["dev"]):
            logits = task_model(head_inputs(task_model, train, idx, feats, run["dev"]))
        batch_targets = tasks.targets(kind, [train[i] for i in idx], run["dev"])
        loss = kind.loss(logits.float(), batch_targets, run["pos_weight"])
        run["opt"].zero_grad(set_to_none=True)
        loss.backward()
        if protocol.grad_clip:
            torch.nn.utils.clip_grad_norm_(run["params"], protocol.grad_clip)
        run["opt"].step()
        run["step"] += 1
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            fail(f"{run['desc']}: the training loss is {losses[-1]} at epoch {run['epoch']}, "
                 f"step {run['step']} (the run diverged); lower --learning_rate (--probe_lr for a "
                 "probe)")
        run["bar"].update(1)
        run["bar"].set_postfix(epoch=run["epoch"], loss=f"{losses[-1]:.3f}")
    return float(np.mean(losses))

def finetune_one(protocol, model, task, seed, feats=None, desc=""):
    """Fine-tune a fresh copy of `model`'s encoder (for a probe task: a head on the frozen encoder,
    on `feats` = probe_features if given, shared across seeds) with `seed`; dev and test are
    predicted after every epoch and kept; the epoch with the best dev main metric is the run's
    (tasks.score). -> dict(dev, test: metrics, epoch, losses: mean loss per epoch, predictions)"""
    dev = get_device(protocol)
    kind = tasks.KINDS[task["kind"]]
    frozen = task["probe"] or protocol.probe
    torch.manual_seed(seed)  # the classifier's init and dropout; the batch order has its own RNG
    n_out = 1 if kind.one_output else len(task["labels"])
    # a fresh copy of the encoder per seed; a probe shares the loaded one (run once: probe_features)
    encoder = model.to(dev) if frozen else copy.deepcopy(model)
    task_model = TaskModel(encoder, n_out, kind.per_token, protocol.pooling, protocol.dropout)
    task_model.to(dev)
    if not frozen:
        feats = dict.fromkeys(("train", "dev", "test"))
    elif not feats:
        feats = probe_features(protocol, model, task)
    pos_weight = tasks.pos_weights(protocol, task["train"], n_out, dev) if kind.weighted else None
    opt, params, peak = optimizer(protocol, task_model, frozen)
    n_epochs = protocol.probe_epochs if frozen else getattr(protocol, kind.epochs)
    per_epoch = math.ceil(len(task["train"]) / protocol.batch_size)
    total = n_epochs * per_epoch
    bar = tqdm(total=total, desc=desc, disable=not protocol.progress, leave=False,
               dynamic_ncols=True)
    run = dict(opt=opt, params=params, peak=peak, step=0, total=total, dev=dev, bar=bar,
               warm=max(1, int(protocol.warmup_ratio * n_epochs * per_epoch)),
               order_rng=random.Random(seed), pos_weight=pos_weight, desc=desc or task["name"])
    kept = dict(labels=task["labels"], dev=tasks.kept_gold(task, "dev"),
                test=tasks.kept_gold(task, "test"))
    predicted = dict(dev=[], test=[])
    losses = []
    for epoch in range(1, n_epochs + 1):
        run["epoch"] = epoch
        losses.append(train_epoch(protocol, task_model, task, feats["train"], run))
        for split, preds in predicted.items():
            preds.append(evaluate(protocol, task_model, task, split, feats[split], dev))
    bar.close()
    for split, preds in predicted.items():
        kept[split]["pred"] = np.stack(preds)
    result = dict(tasks.score(task["kind"], kept, scoring_of(protocol, task)), losses=losses)
    return dict(result, predictions=kept)

# ---- The comparison: every checkpoint x task x seed, then the tables. ----
def seed_list(protocol):
    return list(range(protocol.first_seed, protocol.first_seed + protocol.seeds))

def mean_std(xs):
    """dict(mean, std): the sample standard deviation, 0 for a single run."""
    xs = np.asarray(xs, float)
    return dict(mean=float(xs.mean()), std=float(xs.std(ddof=1)) if len(xs) > 1 else 0.0)

def resolved(path):
    """The directory a checkpoint path names: its HF directory (X and X/hf are one checkpoint), the
    spelling (X/, ./X) and links resolved."""
    for directory in (path, os.path.join(path, "hf")):
        if os.path.exists(os.path.join(directory, "config.json")):
            return os.path.realpath(directory)
    return os.path.realpath(path)

def arms_of(ckpt_paths):
    """Checkpoints grouped into arms: a path, a list of paths or "A1+A2" (replicates, paired). One
    checkpoint named twice (X,X/: their cells would be one file) is an error."""
    arms = [list(arm) if isinstance(arm, (list, tuple)) else [q for q in arm.split("+") if q]
            for arm in ckpt_paths]
    seen = {}
    for path in [path for arm in arms for path in arm]:
        if resolved(path) in seen:
            fail(f"a checkpoint is listed twice in {','.join('+'.join(a) for a in arms)}: "
                 f"{seen[resolved(path)]} and {path} are {resolved(path)}; list each once")
        seen[resolved(path)] = path
    if len({len(arm) for arm in arms[:2]}) > 1:  # compared replicate by replicate
        fail(f"{'+'.join(arms[0])} and {'+'.join(arms[1])} have different numbers of replicates; "
             "pair them one to one")
    return arms

def compare(results, names, first, second, samples=10_000):
    """Statistics of arm first - arm second (as many replicates each), into results."""
    a = results["scores"][first]
    b = results["scores"][second]
    # one unit per (task, replicate): the replicates' seed-averaged scores, paired by index
    units = {n: [x - y for x, y in zip(a[n]["replicate_means"], b[n]["replicate_means"])]
             for n in names}
    flat = [u for n in names for u in units[n]]
    boot = None
    if len(flat) >= BOOTSTRAP_UNITS:
        boot = paired_bootstrap(flat, [0.0] * len(flat), samples)
    # 95% intervals over units: a task's over its replicates (pretraining + fine-tuning noise),
    # the average's over all; None from one unit: with one replicate per arm a task has no
    # pretraining spread (its seeds' is fine-tuning's)
    ci95 = {n: mean_interval(d)[1:] if len(d) > 1 else None
            for n, d in dict(units, average=flat).items()}
    results.update(difference={n: a[n]["mean"] - b[n]["mean"] for n in names + ["average"]},
                   ci95=ci95, units=flat, p_sign_flip=sign_flip_p(flat), p_bootstrap=boot,
                   detectable_difference=detectable_difference(flat))

def arm_scores(protocol, arm, names, result):
    """One arm's scores from result[(checkpoint, task, seed)] -> {task: dict(runs, mean, std,
    replicate_means), "average": dict(mean, std, per_run)}; runs in the order replicate, seed."""
    scores = {n: dict(runs=[dict(replicate=rep, checkpoint=ckpt, seed=seed, **result[ckpt, n, seed])
                            for rep, ckpt in enumerate(arm) for seed in seed_list(protocol)])
              for n in names}
    for score in scores.values():
        mains = [r["test"]["main"] for r in score["runs"]]
        score.update(mean_std(mains), replicate_means=[
            float(np.mean([r["test"]["main"] for r in score["runs"] if r["replicate"] == k]))
            for k in range(len(arm))])
    # the average column: each (replicate, seed) run's mean over tasks, then mean +- std
    per_run = [float(np.mean([scores[n]["runs"][i]["test"]["main"] for n in names]))
               for i in range(len(arm) * protocol.seeds)]
    scores["average"] = dict(mean_std(per_run), per_run=per_run)
    return scores

# ---- The grid: each (checkpoint, task, seed) cell writes its JSON under <out_dir>/cells, and is
# skipped when that holds the same protocol, checkpoint and task data: the same command resumes a
# grid. --shard i/n runs cells i, i+n, ...; the process that finds every cell done reports. ----
def slug(name):
    """A checkpoint or task name as one file name."""
    return re.sub(r"[^\w-]+", "_", name)

def checkpoint_files(ckpt):
    """The files of a checkpoint that its cells' identity digests."""
    names = ("config.json", "model.safetensors", "tokenizer.json")
    return [os.path.join(detour.hf_dir(ckpt), name) for name in names]

def grid_cells(protocol, arms, task_specs):
    """Read and check every task and checkpoint (all errors before any training) -> the cells in
    the order arm, replicate, task, seed: dict(key, checkpoint, task, seed, read, file, preds (its
    kept predictions), identity, scoring)"""
    read = {spec[0]: tasks.read_task(*spec) for spec in task_specs}
    for task in read.values():  # strict scoring: gold that the scheme does not allow is an error
        if "scheme" in task and protocol.ner_mode == "strict":
            tasks.check_strict(task)
    data = {name: dict(kind=kind, probe=frozen or protocol.probe,
                       files=tasks.digest(f for f, _ in read[name]["raw"].values()))
            for name, kind, _, frozen, _ in task_specs}
    for name, *_, max_len in task_specs:
        if max_len:  # a length of its own (name=kind:path@N)
            data[name]["max_len"] = max_len
    digest = {ckpt: detour.load_encoder(ckpt) and tasks.digest(checkpoint_files(ckpt))
              for arm in arms for ckpt in arm}  # each checkpoint loaded: checked
    settings = {k: getattr(protocol, k) for k in REPORTED}

    def cell_file(ckpt, name, seed):
        return os.path.join(protocol.out_dir, "cells", slug(os.path.normpath(ckpt)),
                            f"{slug(name)}.seed{seed}.json")
    cells = [dict(key=(ckpt, name, seed), checkpoint=ckpt, task=name, seed=seed, read=read[name],
                  file=cell_file(ckpt, name, seed),
                  preds=cell_file(ckpt, name, seed)[:-len(".json")] + ".preds.npz",
                  identity=dict(protocol=settings, checkpoint=digest[ckpt], task=data[name]),
                  scoring=scoring_of(protocol, read[name]))
             for arm in arms for ckpt in arm for name, *_ in task_specs
             for seed in seed_list(protocol)]
    return one_file_each(cells)

def one_file_each(cells):
    """Two cells with one file (names that differ only where slug maps to "_": a/b and a_b) would
    overwrite each other's result, the grid never whole: an error."""
    first = {}
    for cell in cells:
        other = first.setdefault(cell["file"], cell)
        if other is not cell:
            fail(f"{other['checkpoint']} {other['task']} and {cell['checkpoint']} {cell['task']} "
                 f"would share the cell file {cell['file']}; rename a checkpoint directory or task "
                 "so that their names differ in letters, digits, - or _")
    return cells

def changes(old, new):
    """Why a cell made with identity `old` differs from `new`: the settings and files changed."""
    settings = [f"{k} {old['protocol'].get(k)} (now {v})" for k, v in new["protocol"].items()
                if old["protocol"].get(k) != v]
    files = [f"other {k} files" for k in ("checkpoint", "task") if old[k] != new[k]]
    return "made with " + ", ".join(settings + files)

def cells_done(cells, quiet=False):
    """{key: saved JSON} of the cells whose JSON is there, complete and of the cell's identity;
    other files (corrupt, or of another protocol, checkpoint or task data): named, a line per
    reason."""
    done = {}
    skipped = {}
    for cell in cells:
        try:
            with open(cell["file"], "rb") as f:
                saved = json.loads(f.read())
            old = saved["identity"]
            result = saved["result"]
            assert {"dev", "test", "epoch", "losses"} <= set(result)
            assert saved["checkpoint"] == cell["checkpoint"]
            why = changes(old, cell["identity"])
        except (FileNotFoundError, NotADirectoryError):  # not there (a bad --out_dir: see writing)
            continue
        except (ValueError, KeyError, TypeError, AttributeError, AssertionError):
            old = None
            why = "not a complete cell result (corrupt?)"
        if old == cell["identity"]:
            done[cell["key"]] = saved
        else:
            skipped.setdefault(why, []).append(cell["file"])
    for why, files in skipped.items() if not quiet else ():
        others = f" and {len(files) - 1} other cells" * (len(files) > 1)
        print(f"note: {files[0]}{others} {why}: not reused, to be run again")
    return done

def claimed(lock, flags, cell):
    """Whether this process holds the cell's lock (flock `flags`; released when the process ends,
    killed or not); False: another process runs the cell."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | flags)
    except BlockingIOError:
        print(f"{cell['file']}: another process is running this cell; left to it, waited for at "
              "the end")
        return False
    except OSError:  # no locks on this filesystem (Lustre without flock): shards share no cell
        print(f"note: {lock.name} cannot be locked on this filesystem; the cell runs unlocked")
    return True

def run_cells(protocol, cells, shard):
    """Fine-tune every cell not done, one checkpoint loaded (each task encoded) at a time. A cell is
    claimed by a lock on <file>.lock; one held elsewhere is waited for at the end (run here if its
    process died), so each process ends with its grid whole. `shard`: printed."""
    dev = get_device(protocol)
    loaded = (None,)   # (checkpoint, model, tokenizer)
    encoded = (None,)  # ((checkpoint, task name), task, a frozen encoder's features: for all seeds)
    done = cells_done(cells)
    print(f"{shard}: {len(cells)} here, {len(done)} of them done already")
    todo = [(cell, fcntl.LOCK_NB) for cell in cells if cell["key"] not in done]
    for cell, flags in todo:  # grows: a cell held elsewhere comes back once, at the end, waiting
        with writing(cell["file"] + ".lock"):
            os.makedirs(os.path.dirname(cell["file"]), exist_ok=True)
            lock = open(cell["file"] + ".lock", "a")
        with lock:
            if not claimed(lock, flags, cell):
                todo.append((cell, 0))
                continue
            if cells_done([cell], quiet=True):  # finished by another process meanwhile
                continue
            if loaded[0] != cell["checkpoint"]:
                loaded = (cell["checkpoint"], *detour.load_encoder(cell["checkpoint"]))
                loaded[1].to(dev)
            if encoded[0] != cell["key"][:2]:
                task = tasks.encode_task(protocol, cell["read"], loaded[2])
                probed = task["probe"] or protocol.probe
                feats = probe_features(protocol, loaded[1], task) if probed else None
                encoded = (cell["key"][:2], task, feats)
            run_cell(protocol, cell, loaded[1], *encoded[1:], dev)
            os.remove(lock.name)

def run_cell(protocol, cell, model, task, feats, dev):
    """Fine-tune one cell and save its JSON."""
    start = time.time()
    desc = f"{os.path.basename(cell['checkpoint'].rstrip('/'))} {cell['task']} seed {cell['seed']}"
    result = finetune_one(protocol, model, task, cell["seed"], feats, desc=desc)
    tasks.write_kept(cell["preds"], result.pop("predictions"))  # first: the JSON vouches for them
    saved = dict({k: cell[k] for k in ("checkpoint", "task", "seed", "identity")},
                 device=str(dev), result=result, scoring=cell["scoring"])
    detour.atomic_write(cell["file"], lambda f: f.write(json.dumps(saved, indent=1).encode()))
    print(f"{cell['checkpoint']} {cell['task']} seed {cell['seed']}: "
          f"dev {100 * result['dev']['main']:.2f} test {100 * result['test']['main']:.2f} "
          f"(epoch {result['epoch']}, {time.time() - start:.0f}s)")

def run(protocol, ckpt_paths, task_specs, report="results", note=""):
    """Every replicate of every arm (arms_of) on every task (--tasks or parse_tasks' list) and seed,
    as cells (the shard's; none with --merge); once all are done, the first arm against the second
    in <out_dir>/<report>.md (`note` above the table) and .json -> results (None: cells miss)"""
    arms = arms_of(ckpt_paths)
    if isinstance(task_specs, str):
        if "default" in [s.strip() for s in task_specs.split(",")]:
            tasks.build_default_tasks(protocol)
        task_specs = tasks.parse_tasks(task_specs, protocol.tasks_dir)
    cells = grid_cells(protocol, arms, task_specs)
    shard, n = (int(x) for x in (protocol.shard or "0/1").split("/"))
    if not protocol.merge:
        run_cells(protocol, cells[shard::n], f"shard {shard}/{n} of {len(cells)} cells")
    saved = cells_done(cells)
    missing = [cell["file"] for cell in cells if cell["key"] not in saved]
    if missing:
        listed_files = ", ".join(missing[:3]) + ", ..." * (len(missing) > 3)
        what = f"{len(missing)} of {len(cells)} cells not done ({listed_files})"
        if protocol.merge:
            fail(f"{what}; run every shard first (the same command without --merge true)")
        return print(f"{what}; the process that finishes the last one writes {report}.md "
                     "(or: --merge true)")
    results = grid_results(protocol, arms, task_specs, cells, rescored(cells, saved))
    if note:
        results["note"] = note
    if len(arms) >= 2:
        names = [spec[0] for spec in task_specs]
        compare(results, names, *results["checkpoints"][:2], samples=protocol.bootstrap_samples)
    return write_report(protocol, report, results, markdown(results, protocol.bootstrap_samples))

def grid_results(protocol, arms, task_specs, cells, result):
    """The results of a whole grid, {key: result} of every cell -> dict(checkpoints, seeds, tasks,
    scores, protocol[, preset]), the comparison still to add."""
    first = {cell["task"]: cell for cell in cells}  # a cell of each task: its scoring and labels
    results = dict(checkpoints=["+".join(arm) for arm in arms], seeds=seed_list(protocol),
                   tasks=[dict(name=name, kind=kind, path=path, main=first[name]["scoring"]["main"],
                               probe=frozen or protocol.probe, labels=first[name]["read"]["labels"],
                               max_len=max_len or protocol.max_len,
                               scoring=first[name]["scoring"])
                          for name, kind, path, frozen, max_len in task_specs],
                   scores={}, protocol=cells[0]["identity"]["protocol"])
    if protocol.protocol:
        results["preset"] = protocol.protocol
    names = [spec[0] for spec in task_specs]
    for label, arm in zip(results["checkpoints"], arms):
        results["scores"][label] = arm_scores(protocol, arm, names, result)
    return results

# ---- Kept predictions (tasks.write_kept), next to each cell: <cell>.preds.npz. A finished grid is
# scored again in another scoring (--selection, --ner_mode) without training: the run's epoch,
# chosen on dev, may change with the metric; the weights never depended on it. ----
def described(scoring):
    return ", ".join(f"{k} {v}" for k, v in scoring.items())

def read_kept(cell, made):
    """A cell's kept predictions; none (a cell from before they were kept): an error naming the cell
    and the scoring it was made in."""
    try:
        return tasks.read_kept(cell["preds"], f"delete it and {cell['file']} to run the cell again")
    except FileNotFoundError:
        fail(f"{cell['file']} was scored with {described(made)}, and {cell['preds']} is not there "
             "(a cell made before predictions were kept); score as it was made, or delete the cell "
             "to run it again")

def made_with(cell, saved):
    """The scoring a done cell's result was made in; a cell from before cells recorded it was
    scored in each kind's main metric and seqeval's default mode, reading tags as IOB2."""
    if "scoring" in saved:
        return saved["scoring"]
    old = dict(main=tasks.KINDS[cell["read"]["kind"]].main)
    if "scheme" in cell["scoring"]:
        old.update(ner_mode="default", scheme="IOB2")
    return old

def rescored(cells, saved):
    """{key: result} of the done cells in their scoring: the saved result when it was made in it,
    else tasks.score of the kept predictions (no training; the losses stay), said in one line."""
    again = [cell for cell in cells if made_with(cell, saved[cell["key"]]) != cell["scoring"]]
    if again:
        made = described(made_with(again[0], saved[again[0]["key"]]))
        print(f"note: {len(again)} of {len(cells)} cells made in another scoring (the first: "
              f"{made}; now {described(again[0]['scoring'])}), scored again from their kept "
              "predictions")
    result = {cell["key"]: saved[cell["key"]]["result"] for cell in cells}
    for cell in again:
        kept = read_kept(cell, made_with(cell, saved[cell["key"]]))
        score = tasks.score(cell["read"]["kind"], kept, cell["scoring"])
        result[cell["key"]] = dict(score, losses=result[cell["key"]]["losses"])
    return result

# ---- The report. ----
def md_table(head, rows):
    """A markdown table: the header's cells, the rule, then each row's cells."""
    def line(cells):
        return "| " + " | ".join(cells) + " |"
    return [line(head), "|---" * len(head) + "|"] + [line(cells) for cells in rows]

def pct(x):
    return f"{100 * x:.1f}"

def score_rows(results):
    """The main table's rows: each arm (mean ± std), its replicates, the difference [95% CI]."""
    names = [t["name"] for t in results["tasks"]]
    rows = []
    for ckpt in results["checkpoints"]:
        scores = results["scores"][ckpt]
        rows.append([ckpt] + [f"{pct(scores[n]['mean'])} ± {pct(scores[n]['std'])}"
                              for n in names + ["average"]])
        for k, rep in enumerate(ckpt.split("+") if "+" in ckpt else []):  # seeds averaged
            means = [scores[n]["replicate_means"][k] for n in names]
            rows.append([f"· replicate {k + 1}: {rep}"] + [pct(x) for x in means]
                        + [pct(np.mean(means))])
    if "difference" in results:
        d = results["difference"]
        ci = results["ci95"]
        none = dict.fromkeys(names, "n/a (1 replicate)") | {"average": "n/a (1 unit)"}
        rows.append(["difference (first − second arm) [95% CI]"] + [
            f"{100 * d[n]:+.1f} " + (f"[{100 * ci[n][0]:+.1f}, {100 * ci[n][1]:+.1f}]" if ci[n]
                                     else f"[{none[n]}]") for n in names + ["average"]])
    return rows

def statistics_text(results, replicates, bootstrap_samples):
    """The paragraph under the table: units, both tests, intervals, the detectable difference."""
    n = len(results["units"])
    boot = results["p_bootstrap"]
    if boot is None:
        bootstrap = f" (no bootstrap p below {BOOTSTRAP_UNITS} units). "
    else:
        bootstrap = (f"; paired bootstrap p = {format_p(boot)} ({bootstrap_samples} resamples, "
                     "anti-conservative for few units). ")
    per_task = "t interval over the replicates (pretraining and fine-tuning noise)"
    if replicates == 1:
        per_task = "none, one pretraining run per arm (its seeds: fine-tuning noise only)"
    return (f"Units: the {n} (task × pretraining replicate) paired differences, each the first's "
            "mean over fine-tuning seeds minus the second's. One-sided tests that the first beats "
            f"the second: exact sign-flip p = {format_p(results['p_sign_flip'])} (floor 1/2^{n} = "
            f"{format_p(0.5 ** n)})" + bootstrap + "95% CI per task: " + per_task
            + "; for the average, over the units. "
            "Smallest average difference this design detects (80% power, one-sided 5%, from the "
            f"units' spread): {100 * results['detectable_difference']:.1f} points.")

def scoring_text(results):
    """Each task's scoring: the metric that picks its runs' epochs (and is reported), and for NER
    seqeval's mode and the tags' scheme."""
    def one(task):
        scoring = task.get("scoring", dict(main=task["main"]))
        entities = ""
        if "scheme" in scoring:
            mode = scoring["ner_mode"]
            entities = f", entities by seqeval's {mode} mode on {scoring['scheme']} tags"
        return f"{task['name']} {scoring['main']}{entities}"
    return ("Scoring (the dev metric that picks each run's epoch, its test score reported): "
            + "; ".join(one(task) for task in results["tasks"]) + ".")

def markdown(results, bootstrap_samples):
    """The results as markdown: the main table, then per-group accuracy for tasks with groups."""
    names = [t["name"] for t in results["tasks"]]
    cols = [f"{t['name']} ({t['main']}{', probe' if t['probe'] else ''})" for t in results["tasks"]]
    lines = [results["note"], ""] if results.get("note") else []
    lines += md_table(["checkpoint"] + cols + ["average"], score_rows(results))
    first = results["scores"][results["checkpoints"][0]][names[0]]
    replicates = len(first.get("replicate_means", [0]))
    lines += ["", f"Test-set scores in %, mean ± std over all runs ({replicates} pretraining "
              f"replicate(s) x seeds {results['seeds']}); each run's epoch is chosen on dev. "
              "average: the mean over tasks of each run, then mean ± std over runs."]
    lines += ["", scoring_text(results)]
    if "difference" in results:
        lines += ["", statistics_text(results, replicates, bootstrap_samples)]
    for name in names:
        runs = {c: results["scores"][c][name]["runs"] for c in results["checkpoints"]}
        groups = list(next(iter(runs.values()))[0]["test"].get("groups", {}))
        if groups:
            accs = [[c] + [pct(np.mean([r["test"]["groups"][g] for r in rs])) for g in groups]
                    for c, rs in runs.items()]
            lines += ["", f"{name}: test accuracy by group (%, mean over runs)", ""]
            lines += md_table(["checkpoint"] + groups, accs)
    return "\n".join(lines) + "\n"

@contextlib.contextmanager
def writing(path):
    """Around the writes to a path: a filesystem error that bad input causes (a file where a
    directory goes, no permission, a full disk) ends in one line naming the path, no traceback."""
    try:
        yield
    except OSError as e:
        fail(f"cannot write {path} ({e.strerror or e}); give --out_dir a directory this user can "
             "write (a missing one is created)")

def write_report(protocol, name, results, text):
    """<out_dir>/<name>.md (the text, also printed) and .json (the results) -> results"""
    with writing(protocol.out_dir):
        os.makedirs(protocol.out_dir, exist_ok=True)
    for ext, content in ((".md", text), (".json", json.dumps(results, indent=1))):
        path = os.path.join(protocol.out_dir, name + ext)
        detour.atomic_write(path, lambda f: f.write(content.encode("utf-8")))  # errors: one line
    print("\n" + text + f"\nwritten to {protocol.out_dir}/{name}.md and {name}.json")
    return results

# ---- The command line. ----
def array_shard():
    """In a SLURM job array, one shard per array task: $SLURM_ARRAY_TASK_ID - _MIN of _COUNT."""
    array = {k: os.environ.get("SLURM_ARRAY_TASK_" + k, "0" if k == "MIN" else "")
             for k in ("ID", "MIN", "COUNT")}
    if bad := next((k for k, v in array.items() if not v.isdigit()), None):
        fail(f"$SLURM_ARRAY_TASK_{bad} is {array[bad]!r}, not a number; give --shard i/n (it wins "
             "over the array)")
    return f"{int(array['ID']) - int(array['MIN'])}/{array['COUNT']}"

def protocol_of(argv, protocol_class=Protocol, rules=RULES, prog="finetune.py"):
    """The command line -> (a protocol_class: defaults, a --protocol preset, --key overrides (they
    win), a SLURM array's shard, checked before anything is read or written; {key: value given})."""
    settings = asdict(protocol_class())
    given = detour.apply_overrides(settings, argv, prog, ("class Protocol", "\nCPU_DEFAULTS"))
    if "shard" not in given and "SLURM_ARRAY_TASK_COUNT" in os.environ:
        settings["shard"] = array_shard()
    detour.check(settings, rules, prog)
    preset = {k: v for k, v in PRESETS.get(settings["protocol"], {}).items() if k not in given}
    settings.update(preset)
    if preset:
        fields = ", ".join(f"{k} {v}" for k, v in preset.items())
        print(f"protocol {settings['protocol']}: {fields} (an option given wins)")
    return protocol_class(**settings), given

def cpu_default(protocol, given):
    """On a CPU, the cpu_<key> values (see the Protocol) for the keys of CPU_DEFAULTS neither given
    nor set by a --protocol preset."""
    fixed = set(given) | set(PRESETS.get(protocol.protocol, {}))
    shortened = {k: getattr(protocol, "cpu_" + k) for k in CPU_DEFAULTS if k not in fixed}
    if get_device(protocol).type != "cpu" or not shortened:
        return protocol
    protocol = replace(protocol, **shortened)
    print(f"CPU default: {protocol.epochs} epochs ({protocol.ner_epochs} for NER), "
          f"{protocol.seeds} seeds, lr {protocol.learning_rate:g} (paper: 10 / 20 epochs, 5 seeds, "
          "5e-5; set --epochs/--ner_epochs/--seeds/--learning_rate to change)")
    return protocol

DEFAULT_TASK_OPTIONS = ("task_seed", "ner_sizes", "notes_sizes", "needle_per_cell",
                        "needle_lengths", "needle_positions", "rebuild_tasks", "tasks_dir",
                        "pretrain_dir")  # they build the default tasks (tasks.build_default_tasks)

def idle_rules(protocol, specs, arms):
    """(option, whether it acts on nothing in this run, why) for the options that may. In a --merge
    the protocol's settings (REPORTED) act by choosing the cells (their identity holds them);
    elsewhere where something trains with them."""
    trains = not protocol.merge
    probed = {kind for _, kind, _, frozen, _ in specs if frozen or protocol.probe}
    tuned = {kind for _, kind, _, frozen, _ in specs if not (frozen or protocol.probe)}
    chosen = {item.partition("=")[0] for item in protocol.selection.split(",") if item}
    missing = ", ".join(sorted(chosen - probed - tuned))
    few = len(arms) < 2 or len(specs) * len(arms[0]) < BOOTSTRAP_UNITS
    default = "default" in [item.strip() for item in protocol.tasks.split(",")]
    return [
        ("epochs", trains and not tuned - {"ner"}, "no cls, multilabel or regression task trains"),
        ("ner_epochs", trains and "ner" not in tuned, "no NER task is fine-tuned"),
        ("learning_rate", trains and not tuned, "every task is a probe: --probe_lr"),
        ("probe_lr", trains and not probed, "no task is probed"),
        ("probe_epochs", trains and not probed, "no task is probed"),
        ("probe", all(spec[3] for spec in specs), "every task is a probe already (+probe)"),
        ("pos_weight", trains and "multilabel" not in probed | tuned, "no multilabel task"),
        ("pooling", trains and probed | tuned == {"ner"}, "NER tasks alone pool nothing"),
        ("max_len", trains and all(spec[4] for spec in specs), "every task has its own @N"),
        ("ner_mode", "ner" not in probed | tuned, "no NER task"),
        ("selection", bool(missing), f"no {missing} task"),
        ("bootstrap_samples", few, f"no bootstrap below two arms and {BOOTSTRAP_UNITS} units"),
        # a merge takes its grid's command line (device, dtype, progress: the cells' own), and
        # merges every cell
        ("shard", protocol.merge, "--merge true merges every shard's cells"),
    ] + [
        (key, not default, "no default task (--tasks default)") for key in DEFAULT_TASK_OPTIONS]

def idle_options(protocol, given, specs, arms):
    """The options given that act on nothing in this run -> {key: why}; cpu_<key> acts where
    <key> would, on a CPU, when <key> is neither given nor set by the preset."""
    rules = idle_rules(protocol, specs, arms)
    idle = {key: why for key, is_idle, why in rules if is_idle}
    fixed = set(given) | set(PRESETS.get(protocol.protocol, {}))
    for key in CPU_DEFAULTS:
        if get_device(protocol).type != "cpu" or key in fixed:
            idle["cpu_" + key] = f"--{key} is set, or this is not a CPU"
        elif key in idle:
            idle["cpu_" + key] = idle[key]
    return {key: idle[key] for key in given if key in idle}

def refuse_idle(idle):
    """The first option given that acts on nothing: one line (the record is the truth)."""
    for key, why in idle.items():
        fail(f"--{key} does not act in this run ({why}); drop it")

def listed(ckpts):
    """--ckpts -> its checkpoints ("A1+A2": replicates of one arm)."""
    return [q.strip() for q in ckpts.split(",") if q.strip()]

def main(argv=None):
    """The command line -> one Protocol (defaults, --key overrides, CPU default) -> run."""
    protocol, given = protocol_of(sys.argv[1:] if argv is None else argv)
    paths = listed(protocol.ckpts)
    protocol = cpu_default(protocol, given)
    found = [q for q in paths if all(os.path.isdir(r) for r in q.split("+") if r)]
    if not found:
        fail(f"no checkpoint found among {', '.join(paths)}; train them (the README's quick start) "
             "or pass --ckpts")
    for q in [q for q in paths if q not in found]:
        print(f"note: {q} not found, skipped")
    specs = tasks.parse_tasks(protocol.tasks, protocol.tasks_dir)
    refuse_idle(idle_options(protocol, given, specs, arms_of(found)))
    if protocol.protocol == "paper-fr" and "ner" in [spec[1] for spec in specs]:
        print("note: the French paper's NER (QUAERO) used a nested-NER span head (biaffine, 4,000 "
              "steps, head lr 1e-3); finetune.py trains a token classifier on flat tags: its NER "
              "rows are not the paper's (docs/finetuning.md)")
    return run(protocol, found, protocol.tasks)

if __name__ == "__main__":
    main()
