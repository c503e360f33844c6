"""
finetune.py: fine-tune encoder checkpoints on downstream tasks and compare them.

The paper judges the CLM detour downstream: the detour encoder and its MLM-only twin are fine-tuned
alike (same tasks, same seeds) and compared task by task (mean +- std over runs) and on average.
Replicates of one arm are joined with "+" (--ckpts A1+A2,B1+B2); the statistics' unit is the (task,
replicate) pair: an exact sign-flip test, a paired bootstrap, 95% intervals, the detectable difference.

  python finetune.py                                   # out/clm-decay vs out/mlm-decay, default tasks
  python finetune.py --ckpts A1+A2,B1+B2 --tasks chem=ner:../shared/bio/ner/BC5CDR-chem-IOB --seeds 3
  python finetune.py --probe true                      # linear probing: frozen encoder, head only
  python finetune.py --shard 0/4 ... --shard 3/4       # a quarter of the cells each (one per GPU), any order;
  python finetune.py --merge true                      # then results.md (each shard also tries when it ends)
Why the detour works (the paper's analyses, the last section of this file):
  python finetune.py --analysis cka --ckpts out/clm-decay,out/mlm-decay,out/mlm-s18-decay
  python finetune.py --analysis drift --ckpts out/clm-decay,out/clm          # checkpoint, its init
  python finetune.py --analysis transplant --ckpts out/clm-decay,out/mlm-decay --layers 0-1

A task is `name=kind:path` (kind: cls | multilabel | regression | ner, `kind+probe` for a linear
probe; path: train/dev/test files as data/tasks.py reads them), `default` the embedded tasks (ner,
notes, needle). Main metrics: cls macro F1, multilabel micro F1 (threshold 0.5), regression
Pearson, ner entity-level micro F1 (conlleval rules); the others are reported too.

Every Protocol field below is an option: `--key value` or `--key=value`. main() builds one
Protocol and passes it down; from Python: finetune.run(finetune.Protocol(seeds=2), ["a", "b"], "default").
"""
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
import torch.nn.functional as F
from tqdm import tqdm

import detour
from data import tasks  # task files, read and built (data/tasks.py, next to data/world.py)
from detour import fail

# ----------------------------------------------------------------------------------------
# The protocol. Its values are the paper's; the CPU default below shortens them.
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Protocol:
    ckpts: str = "out/clm-decay,out/mlm-decay"  # the two twins' final checkpoints (quick start); those that exist
    tasks: str = "default"          # comma-separated name=kind:path, or `default` (the embedded tasks)
    out_dir: str = "out/finetune"   # results.md / results.json
    tasks_dir: str = "data/tasks"   # where the embedded default tasks are written (once)
    pretrain_dir: str = "data/default"  # its val.txt / meta.json: default-task text seen in pretraining is dropped
    # protocol (paper)
    learning_rate: float = 5e-5     # peak lr, AdamW
    weight_decay: float = 0.01      # on weight matrices only (not biases, norms)
    batch_size: int = 16
    epochs: int = 10                # cls / multilabel / regression
    ner_epochs: int = 20            # token classification
    warmup_ratio: float = 0.10      # linear warmup over 10% of the steps, then linear decay to 0
    seeds: int = 5                  # fine-tuning seeds 0..seeds-1, the same for every checkpoint
    max_len: int = 512              # longer inputs are truncated (and counted)
    pooling: str = "mean"           # cls | mean (over real tokens; the released ModernBERT config uses mean)
    dropout: float = 0.0            # classifier_dropout, between the head and the classifier (HF default 0.0)
    grad_clip: float = 1.0          # max grad norm, 0 = off (HF Trainer's max_grad_norm default is 1.0)
    pos_weight: str = "none"        # multilabel BCE positive weight: none | auto (n_neg/n_pos per label) | a number
    # linear probing: the encoder is frozen and only the head trains. Its features are computed
    # once, without grad, so probe epochs cost almost nothing; lr and epochs are ours: a fresh
    # linear layer alone barely moves at 5e-5 in a few epochs.
    probe: bool = False             # probe every task (a task can also ask for it: kind+probe)
    probe_lr: float = 1e-3
    probe_epochs: int = 20
    # CPU default: the paper's 10/20 epochs x 5 seeds take hours on 2 CPU cores even for the
    # small model. On a CPU, unless --epochs/--ner_epochs/--seeds/--learning_rate are given, main uses these.
    cpu_epochs: int = 3
    cpu_ner_epochs: int = 3
    cpu_seeds: int = 3
    cpu_learning_rate: float = 5e-4  # the small CPU models barely move at 5e-5 in 3 epochs (near-chance scores)
    # embedded default tasks (data/tasks.py, world.py with new seeds; pretraining corpus seed is 1234),
    # sized so that the CPU default run of two small checkpoints takes a few minutes
    task_seed: int = 2025
    ner_sizes: str = "200,100,200"      # train, dev, test sentences (~17 tokens each)
    notes_sizes: str = "96,48,96"       # train, dev, test notes (~120 tokens each)
    needle_per_cell: str = "16,8,16"    # train, dev, test examples per (position, length) cell
    needle_lengths: str = "56,112,224"  # haystack length in words (~64/128/256 tokens with data/default)
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
    # the grid: a (checkpoint, task, seed) cell is skipped when <out_dir>/cells holds it (a rerun resumes)
    shard: str = ""                 # i/n: cells i, i+n, ... only; "" = all, or in a SLURM job array
                                    # $SLURM_ARRAY_TASK_ID - $SLURM_ARRAY_TASK_MIN / $SLURM_ARRAY_TASK_COUNT
    merge: bool = False             # train nothing: write results.md/.json from the cells (all must exist)
    # analysis (why the detour works; see the end of this file). "" = fine-tune and compare.
    analysis: str = ""              # cka | drift | transplant
    texts: str = ""                 # cka: one text per line; "" = <pretrain_dir>/val.txt (held-out pretraining text)
    layers: str = ""                # transplant: the group taken from the first checkpoint: 0-7 | 0-3,10 | attn | mlp

CPU_DEFAULTS = ("epochs", "ner_epochs", "seeds", "learning_rate")  # main: cpu_<key> unless --<key> is given
REPORTED = ("learning_rate", "weight_decay", "batch_size", "epochs", "ner_epochs", "warmup_ratio", "max_len",
            "pooling", "dropout", "grad_clip", "pos_weight", "probe", "probe_lr", "probe_epochs", "max_train",
            "max_eval")  # the protocol settings results.json records
P, N, F1 = detour.POSITIVE, detour.NON_NEGATIVE, detour.BETA  # > 0, >= 0, in [0, 1)
RULES = dict(ckpts=detour.NOT_EMPTY, tasks=detour.NOT_EMPTY, learning_rate=P, weight_decay=N, batch_size=P, epochs=P,
             ner_epochs=P, warmup_ratio=F1, seeds=P, max_len=(lambda v: v >= 3, ">= 3 ([CLS] a [SEP] b [SEP])"),
             pooling=detour.one_of("cls", "mean"), dropout=F1, grad_clip=N, probe_lr=P, probe_epochs=P, cpu_epochs=P,
             cpu_ner_epochs=P, cpu_seeds=P, cpu_learning_rate=P, task_seed=N, max_train=N, max_eval=N,
             pos_weight=(lambda v: v in ("none", "auto") or bool(re.fullmatch(r"[0-9.]+(e-?[0-9]+)?", v))
                         and float(v) > 0, "none | auto | a number > 0"), device=detour.DEVICE, dtype=detour.DTYPE,
             bootstrap_samples=P, analysis=detour.one_of("", "cka", "drift", "transplant"),
             shard=(lambda v: v == "" or bool(re.fullmatch(r"\d+/\d+", v)) and int(v[:v.index("/")]) < int(
                 v[v.index("/") + 1:]), "i/n with 0 <= i < n (e.g. 0/4), or \"\" for every cell"))  # checked by main
IGNORE = detour.IGNORE  # target of a token that carries no loss (non-first sub-tokens, specials)

# ----------------------------------------------------------------------------------------
# Metrics, written out so that their definitions are visible.
# ----------------------------------------------------------------------------------------
def _f1(tp, fp, fn):
    return float(2 * tp / (2 * tp + fp + fn)) if tp else 0.0

def cls_metrics(gold, pred):
    """Accuracy and macro F1 over the labels that occur in gold or prediction (sklearn's default)."""
    gold, pred = np.asarray(gold), np.asarray(pred)
    f1s = [_f1(np.sum((pred == c) & (gold == c)), np.sum((pred == c) & (gold != c)),
               np.sum((pred != c) & (gold == c))) for c in np.union1d(gold, pred)]
    return dict(macro_f1=float(np.mean(f1s)), accuracy=float(np.mean(gold == pred)))

def multilabel_metrics(gold, pred):
    """gold, pred (N, L) 0/1: micro F1 pools all decisions; macro F1 averages labels (one never seen: 0, as sklearn)."""
    gold, pred = np.asarray(gold, bool), np.asarray(pred, bool)
    tp, fp, fn = (pred & gold).sum(0), (pred & ~gold).sum(0), (~pred & gold).sum(0)
    return dict(micro_f1=_f1(tp.sum(), fp.sum(), fn.sum()),
                macro_f1=float(np.mean([_f1(*c) for c in zip(tp, fp, fn)])))

def pearson(x, y):
    x, y = np.asarray(x, float) - np.mean(x), np.asarray(y, float) - np.mean(y)
    denom = math.sqrt(float((x * x).sum() * (y * y).sum()))
    return float((x * y).sum() / denom) if denom > 0 else 0.0

def ranks(x):
    """Ranks 1..n, ties get the average of their ranks (as Spearman needs): (first + last position + 1) / 2."""
    s = np.sort(np.asarray(x, float))
    return (np.searchsorted(s, x, "left") + np.searchsorted(s, x, "right") + 1) / 2

def regression_metrics(gold, pred):
    return dict(pearson=pearson(gold, pred), spearman=pearson(ranks(gold), ranks(pred)),
                mse=float(np.mean((np.asarray(gold) - np.asarray(pred)) ** 2)))

def entity_spans(tags):
    """BIO tags -> [(type, start, end)], conlleval / seqeval default (non-strict) rules:
    an entity continues only with I- of the same type; anything else closes it; an I-X
    that does not continue an X starts a new entity; the sentence end closes the last one."""
    spans, start, kind = [], None, None
    for i, tag in enumerate(list(tags) + ["O"]):
        prefix, _, typ = tag.partition("-")
        if start is not None and not (prefix == "I" and typ == kind):
            spans.append((kind, start, i - 1))
            start = None
        if prefix in ("B", "I") and start is None:
            start, kind = i, typ
    return spans

def entity_f1(gold_seqs, pred_seqs):
    """Entity-level exact match (type and boundaries), micro over all sentences -> (p, r, f1)."""
    gold = {(s,) + e for s, tags in enumerate(gold_seqs) for e in entity_spans(tags)}
    pred = {(s,) + e for s, tags in enumerate(pred_seqs) for e in entity_spans(tags)}
    tp = len(gold & pred)
    p, r = (tp / len(pred) if pred else 0.0), (tp / len(gold) if gold else 0.0)
    return p, r, (2 * p * r / (p + r) if p + r else 0.0)

def group_accuracy(examples, gold, pred):
    """Accuracy per group tag (the needle's [position, length]), by slot, then first appearance."""
    slots = range(max(len(ex["groups"]) for ex in examples))
    names = dict.fromkeys(ex["groups"][k] for k in slots for ex in examples if len(ex["groups"]) > k)
    return {g: float(np.mean([gold[i] == pred[i] for i, ex in enumerate(examples) if g in ex["groups"]]))
            for g in names}

# Each kind's predictions (one logit row per example, per labeled word for NER) -> metrics.
def cls_score(task, examples, out):
    gold, pred = [ex["y"] for ex in examples], [int(z.argmax()) for z in out]
    m = cls_metrics(gold, pred)
    if any(ex["groups"] for ex in examples):
        m["groups"] = group_accuracy(examples, gold, pred)
    return m

def ner_score(task, examples, out):
    pred_tags = []
    for ex, z in zip(examples, out):  # a word without a token of its own (mapped False) is O
        it = iter(z.argmax(-1).tolist())
        pred_tags.append([task["labels"][next(it)] if m else "O" for m in ex["mapped"]])
    p, r, f1 = entity_f1([ex["tags"] for ex in examples], pred_tags)
    return dict(f1=f1, precision=p, recall=r)

# ----------------------------------------------------------------------------------------
# The task kinds: what differs between them, in one table; every code path below is shared.
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    main: str                 # the main metric
    score: object             # (task, examples, logits per example) -> metrics
    loss: object              # (float logits, targets, pos_weight) -> loss
    target: torch.dtype       # of the training targets
    epochs: str               # the Protocol field that counts its epochs
    label_set: object         # training examples -> the sorted label set; [] = a single output
    per_token: bool = False   # CoNLL files; a prediction per word (its first sub-token)
    gold: object = None       # a label -> the label names it needs in the label set
    y: object = None          # (label, index of the label set) -> the training target
    min_labels: int = 0       # fewer in the training split is an error
    weighted: bool = False    # the loss takes --pos_weight
    one_output: bool = False  # a single output (regression), else one per label

KINDS = {
    "cls": Kind(
        main="macro_f1", score=cls_score, loss=lambda z, y, pw: F.cross_entropy(z, y), target=torch.long,
        epochs="epochs", label_set=lambda rows: sorted({ex["label"] for ex in rows}),
        gold=lambda label: [label], y=lambda label, index: index[label], min_labels=2),
    "multilabel": Kind(
        main="micro_f1", target=torch.float, epochs="epochs", weighted=True,
        score=lambda task, exs, out: multilabel_metrics([ex["y"] for ex in exs], [(z > 0).numpy() for z in out]),
        loss=lambda z, y, pw: F.binary_cross_entropy_with_logits(z, y, pos_weight=pw),
        label_set=lambda rows: sorted({x for ex in rows for x in ex["label"]}), gold=lambda label: label,
        y=lambda label, index: [1.0 if name in label else 0.0 for name in index]),
    "regression": Kind(
        main="pearson", target=torch.float, epochs="epochs", one_output=True, label_set=lambda rows: [],
        score=lambda task, exs, out: regression_metrics([ex["y"] for ex in exs], [float(z[0]) for z in out]),
        loss=lambda z, y, pw: F.mse_loss(z[:, 0], y), gold=lambda label: [], y=lambda label, index: label),
    "ner": Kind(
        main="f1", score=ner_score, loss=lambda z, y, pw: F.cross_entropy(z, y), target=torch.long,
        epochs="ner_epochs", label_set=lambda rows: sorted({t for s in rows for t in s["tags"]}), per_token=True),
}

# ----------------------------------------------------------------------------------------
# Checkpoints: an HF dir (config.json, model.safetensors, tokenizer.json) or a detour out_dir with one in hf/.
# ----------------------------------------------------------------------------------------
def hf_dir(path):
    for d in (path, os.path.join(path, "hf")):
        if os.path.exists(os.path.join(d, "config.json")):
            return d
    if os.path.exists(os.path.join(path, "ckpt.pt")):
        fail(f"{path} has ckpt.pt but no hf/ export; detour.py writes hf/ when a run finishes")
    fail(f"{path} is not a checkpoint: no config.json there or in {os.path.join(path, 'hf')}")

def load_encoder(path):
    """A checkpoint path -> (detour.ModernBERT, tokenizers.Tokenizer), checked against each other."""
    tok_path = os.path.join(hf_dir(path), "tokenizer.json")
    if not os.path.exists(tok_path):
        fail(f"{tok_path} not found; the checkpoint needs its tokenizer (detour.save_hf(..., tokenizer_path=...))")
    model, tokenizer = detour.load_hf(os.path.dirname(tok_path)), detour.load_tokenizer(tok_path)
    c = model.config
    if tokenizer.get_vocab_size() > c.vocab_size:
        fail(f"{tok_path} has {tokenizer.get_vocab_size()} tokens but the model only {c.vocab_size}; wrong tokenizer?")
    for name, want in (("[CLS]", c.cls_token_id), ("[SEP]", c.sep_token_id), ("[PAD]", c.pad_token_id)):
        if tokenizer.token_to_id(name) != want:
            fail(f"{tok_path} maps {name} to {tokenizer.token_to_id(name)} but the model's config says {want}; "
                 "wrong tokenizer?")
    return model, tokenizer

# ----------------------------------------------------------------------------------------
# Encoding (tasks.encode, tasks.encode_words): [CLS] text [SEP] (or [CLS] a [SEP] b [SEP]); NER
# labels the first sub-token of each word and ignores the rest: a word is predicted once, from its first piece.
# ----------------------------------------------------------------------------------------
def encode_task(p, task, tokenizer):
    """A tasks.read_task (labels checked), every split encoded by `tokenizer` -> the task dict finetune_one takes."""
    K, index = KINDS[task["kind"]], {l: i for i, l in enumerate(task["labels"])}

    def encode_example(ex):  # -> (encoded example, truncated)
        if K.per_token:
            ids, target, mapped, cut = tasks.encode_words(p, tokenizer, ex["words"], [index[t] for t in ex["tags"]])
            return dict(ids=ids, target=target, mapped=mapped, tags=ex["tags"]), cut
        ids, cut = tasks.encode(p, tokenizer, ex["text"], ex["text_b"])
        return dict(ids=ids, y=K.y(ex["label"], index), groups=ex["groups"]), cut
    splits, n_trunc = {}, 0
    for split, (file, rows) in task["raw"].items():
        encoded = [encode_example(ex) for ex in rows]
        out, n_trunc = [ex for ex, _ in encoded], n_trunc + sum(cut for _, cut in encoded)
        limit = p.max_train if split == "train" else p.max_eval
        if 0 < limit < len(out):  # the same subset for every checkpoint and seed
            out = [out[i] for i in sorted(random.Random(0).sample(range(len(out)), limit))]
        splits[split] = out
    if n_trunc:
        print(f"{task['name']}: {n_trunc} examples truncated to max_len={p.max_len} tokens")
    return dict({k: task[k] for k in ("name", "kind", "path", "labels", "probe")}, **splits)

# ----------------------------------------------------------------------------------------
# Statistics of a comparison. The unit is one (task, pretraining replicate) pair: A's mean over
# fine-tuning seeds minus B's (same data order and seeds). Seeds are not independent evidence
# about pretraining: averaged, never counted as units. Both tests are one-sided (A > B).
# ----------------------------------------------------------------------------------------
def sign_flip_p(d):
    """Exact paired sign-flip (permutation) test: under H0 each unit's difference is as likely
    negative as positive, so all 2^n sign patterns are equally likely; p = share of patterns
    whose mean is >= the observed mean. The observed pattern counts, so p >= 1/2^n."""
    d = np.asarray(d, float)
    if len(d) > 20:  # 2^20 patterns is the most we enumerate; beyond, a seeded Monte Carlo
        signs = np.random.default_rng(0).choice([-1.0, 1.0], size=(2 ** 20, len(d)))
        return float((1 + np.sum((signs * d).mean(1) >= d.mean() - 1e-12)) / (1 + 2 ** 20))
    signs = 1.0 - 2.0 * ((np.arange(2 ** len(d))[:, None] >> np.arange(len(d))) & 1)
    return float(np.mean((signs * d).mean(1) >= d.mean() - 1e-12))

def paired_bootstrap(a, b, samples=10_000, seed=0):
    """One-sided bootstrap p that `a` beats `b` over the paired units a_i - b_i resampled with a fixed
    seed: p = (1 + #means <= 0) / (1 + samples) >= 1/(samples + 1), never printed as 0. Anti-conservative
    for a handful of units (it takes the observed spread for the population's): read it next to sign_flip_p."""
    d = np.asarray(a, float) - np.asarray(b, float)
    if not np.any(d):
        return 1.0  # no difference at all: no evidence
    means = d[np.random.default_rng(seed).integers(0, len(d), size=(samples, len(d)))].mean(1)
    return float((1 + np.sum(means <= 0)) / (1 + samples))

BOOTSTRAP_UNITS = 8  # below it no bootstrap p (None): it takes the units for the population, too few to stand for it

def t_quantile(q, df):
    """Student-t quantile for q in (0.5, 1): the pdf integrated numerically (no scipy at run time)."""
    x = np.linspace(0.0, 100.0, 1_000_001)
    logc = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    pdf = np.exp(logc - (df + 1) / 2 * np.log1p(x * x / df))
    cdf = 0.5 + np.concatenate([[0.0], np.cumsum((pdf[1:] + pdf[:-1]) / 2 * np.diff(x))])
    return float(np.interp(q, cdf, x))

def mean_interval(d, level=0.95):
    """-> (mean, lo, hi): d's mean and two-sided t interval; lo = hi = mean for one unit (no spread)."""
    d = np.asarray(d, float)
    m, n = float(d.mean()), len(d)
    half = t_quantile(0.5 + level / 2, n - 1) * float(d.std(ddof=1)) / math.sqrt(n) if n > 1 else 0.0
    return m, m - half, m + half

def detectable_difference(d, alpha=0.05, power=0.80):
    """The smallest true mean difference a one-sided paired t test at `alpha` over these
    units would detect with `power`, given their spread: (t_{1-alpha} + t_power) * sd / sqrt(n)."""
    d, df = np.asarray(d, float), len(d) - 1
    if df < 1:
        return float("nan")
    return (t_quantile(1 - alpha, df) + t_quantile(power, df)) * float(d.std(ddof=1)) / math.sqrt(len(d))

def format_p(p):
    """A p-value as text; it is never 0 (every p here has a floor above 0)."""
    return f"{p:.2g}" if p < 0.01 else f"{p:.3f}"

# ----------------------------------------------------------------------------------------
# The fine-tuning model: transformers' ModernBertFor{Token,Sequence}Classification, layer for
# layer: encoder body -> [pooling, sequence tasks] -> the checkpoint's *pretrained* MLM head
# (dense, GELU, LayerNorm) -> dropout (classifier_dropout) -> a new linear classifier. HF's
# parameter names (model.*, head.*, classifier.*); only the MLM decoder is left out.
# ----------------------------------------------------------------------------------------
class TaskModel(nn.Module):
    def __init__(self, encoder, n_out, per_token, pooling, dropout):
        super().__init__()
        self.model, self.head, self.per_token, self.pooling = encoder.model, encoder.head, per_token, pooling
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
            return self.head(h[target != IGNORE])
        if self.pooling == "cls":
            return self.head(h[:, 0])
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))

    def forward(self, x):
        return self.classifier(self.drop(x))

def get_device(p):
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if p.device == "auto" else p.device)

def autocast(p, dev):
    bf16 = p.dtype == "bfloat16" or (p.dtype == "auto" and dev.type == "cuda")
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16)

def pad_batch(examples, pad_id, dev):
    """-> (ids, attention mask, targets), each (B, T) on dev, padded with pad_id, 0 and IGNORE."""
    T = max(len(ex["ids"]) for ex in examples)
    pad = lambda rows, value: torch.tensor([r + [value] * (T - len(r)) for r in rows], dtype=torch.long).to(dev)
    return (pad([ex["ids"] for ex in examples], pad_id), pad([[1] * len(ex["ids"]) for ex in examples], 0),
            pad([ex.get("target", []) for ex in examples], IGNORE))

def targets(K, examples, dev):
    """A batch's training targets: one per labeled word (NER) or per example."""
    ys = [y for ex in examples for y in ex["target"] if y != IGNORE] if K.per_token else [ex["y"] for ex in examples]
    return torch.tensor(ys, dtype=K.target).to(dev)

def length_batches(examples, batch_size, order=None):
    """`order` (default: all examples) sorted by length, cut into batches of indices: little padding (a CPU saver)."""
    order = sorted(range(len(examples)) if order is None else order, key=lambda i: len(examples[i]["ids"]))
    return [order[s:s + batch_size] for s in range(0, len(order), batch_size)]

def train_order(examples, rng, batch_size, group=8):
    """One epoch of shuffled training batches. Like HF's group_by_length: every `group` batches'
    worth of shuffled examples is cut into length_batches; the batches are then shuffled again."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    batches = [b for s in range(0, len(order), group * batch_size)
               for b in length_batches(examples, batch_size, order[s:s + group * batch_size])]
    rng.shuffle(batches)
    return batches

def head_inputs(tm, examples, idx, feats, dev):
    if feats is not None:  # probing: precomputed, the encoder does not run
        return (torch.cat if tm.per_token else torch.stack)([feats[i] for i in idx]).to(dev)
    ids, mask, target = pad_batch([examples[i] for i in idx], tm.model.config.pad_token_id, dev)
    return tm.features(ids, mask, target)

@torch.no_grad()
def per_example(p, model, examples, dev, rows, per_token=False):
    """rows(batch indices) over length batches, `model` in eval mode, without grad -> per example, in
    input order, a CPU tensor: its row, or with per_token a row per labeled word (= mapped word)."""
    model.eval()
    out = [None] * len(examples)
    for idx in length_batches(examples, p.batch_size):
        with autocast(p, dev):
            x = rows(idx).cpu()
        if per_token:
            x = x.split([sum(examples[i]["mapped"]) for i in idx])
        for i, v in zip(idx, x):
            out[i] = v
    return out

def probe_features(p, model, task):
    """A frozen encoder's head inputs, per split, on the CPU: computed once for all of a probe's seeds."""
    dev = get_device(p)
    tm = TaskModel(model.to(dev), 1, KINDS[task["kind"]].per_token, p.pooling, p.dropout).to(dev)  # classifier unused
    return {s: per_example(p, tm, task[s], dev, lambda idx: head_inputs(tm, task[s], idx, None, dev).float(),
                           tm.per_token) for s in ("train", "dev", "test")}

def evaluate(p, tm, task, split, feats, dev):
    """Predict a split -> metrics dict (the task's main metric under `main`)."""
    K, examples = KINDS[task["kind"]], task[split]
    out = per_example(p, tm, examples, dev, lambda idx: tm(head_inputs(tm, examples, idx, feats, dev)).float(),
                      K.per_token)
    m = K.score(task, examples, out)
    return dict(m, main=m[K.main])

# ----------------------------------------------------------------------------------------
# Fine-tuning one (checkpoint, task, seed).
# ----------------------------------------------------------------------------------------
def pos_weights(p, train, n_out, dev):
    """--pos_weight for the multilabel BCE: none, auto (n_neg/n_pos per label) or a number."""
    if p.pos_weight == "none":
        return None
    y = torch.tensor([ex["y"] for ex in train])
    return ((len(y) - y.sum(0)) / y.sum(0).clamp(min=1) if p.pos_weight == "auto"
            else torch.full((n_out,), float(p.pos_weight))).to(dev)

def optimizer(p, tm, frozen):
    """AdamW over the classifier (probe) or everything, decay on weight matrices only -> (opt, params, peak lr)."""
    params = list(tm.classifier.parameters()) if frozen else list(tm.parameters())
    groups = [dict(params=[q for q in params if q.dim() >= 2], weight_decay=p.weight_decay),
              dict(params=[q for q in params if q.dim() < 2], weight_decay=0.0)]
    peak = p.probe_lr if frozen else p.learning_rate
    return torch.optim.AdamW(groups, lr=peak), params, peak

def finetune_one(p, model, task, seed, feats=None, desc=""):
    """Fine-tune a fresh copy of `model`'s encoder (for a probe task: a head on the frozen encoder,
    on `feats` = probe_features if given, shared across seeds) with `seed`; the epoch with the best
    dev main metric is tested. -> dict(dev, test: metrics, epoch, losses: mean loss per epoch)"""
    dev, K, frozen, train = get_device(p), KINDS[task["kind"]], task["probe"] or p.probe, task["train"]
    torch.manual_seed(seed)  # the classifier's init and dropout; the batch order has its own RNG
    n_out = 1 if K.one_output else len(task["labels"])
    # fine-tuning starts from a fresh copy of the encoder every seed; probing shares the loaded
    # one (moved to the device) and only ever runs it once, without grad, in probe_features()
    tm = TaskModel(model.to(dev) if frozen else copy.deepcopy(model), n_out, K.per_token, p.pooling, p.dropout).to(dev)
    feats = (feats or probe_features(p, model, task)) if frozen else dict.fromkeys(("train", "dev", "test"))
    pw = pos_weights(p, train, n_out, dev) if K.weighted else None
    opt, params, peak = optimizer(p, tm, frozen)
    n_epochs = p.probe_epochs if frozen else getattr(p, K.epochs)
    per_epoch = math.ceil(len(train) / p.batch_size)
    total, warm = n_epochs * per_epoch, max(1, int(p.warmup_ratio * n_epochs * per_epoch))
    order_rng = random.Random(seed)
    best, best_state, best_epoch, step, losses = None, None, 0, 0, []
    bar = tqdm(total=total, desc=desc, disable=not p.progress, leave=False, dynamic_ncols=True)
    for epoch in range(1, n_epochs + 1):
        epoch_loss = []
        for idx in train_order(train, order_rng, p.batch_size):
            tm.train()
            # linear warmup to the peak, then linear decay to 0 at the last step
            lr = peak * (step + 1) / warm if step < warm else peak * (total - step) / max(1, total - warm)
            for g in opt.param_groups:
                g["lr"] = lr
            with autocast(p, dev):
                logits = tm(head_inputs(tm, train, idx, feats["train"], dev))
            loss = K.loss(logits.float(), targets(K, [train[i] for i in idx], dev), pw)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if p.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, p.grad_clip)
            opt.step()
            step += 1
            epoch_loss.append(loss.item())
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{epoch_loss[-1]:.3f}")
        losses.append(float(np.mean(epoch_loss)))
        m = evaluate(p, tm, task, "dev", feats["dev"], dev)
        if best is None or m["main"] > best["main"]:
            best, best_epoch = m, epoch
            best_state = {k: v.detach().clone() for k, v in tm.state_dict().items()
                          if not frozen or k.startswith("classifier.")}
    bar.close()
    tm.load_state_dict(best_state, strict=not frozen)
    return dict(dev=best, test=evaluate(p, tm, task, "test", feats["test"], dev), epoch=best_epoch, losses=losses)

# ----------------------------------------------------------------------------------------
# The comparison: every checkpoint x task x seed, then the tables.
# ----------------------------------------------------------------------------------------
def mean_std(xs):
    """dict(mean, std): the sample standard deviation, 0 for a single run."""
    xs = np.asarray(xs, float)
    return dict(mean=float(xs.mean()), std=float(xs.std(ddof=1)) if len(xs) > 1 else 0.0)

def arms_of(ckpt_paths):
    """Checkpoints grouped into arms: a path, a list of paths or "A1+A2" (replicates, in one order for all arms)."""
    arms = [list(p) if isinstance(p, (list, tuple)) else [q for q in p.split("+") if q] for p in ckpt_paths]
    flat = [p for arm in arms for p in arm]
    if len(set(flat)) != len(flat):
        fail(f"a checkpoint is listed twice in {','.join('+'.join(a) for a in arms)}")
    if len({len(arm) for arm in arms[:2]}) > 1:  # compared replicate by replicate
        fail(f"{'+'.join(arms[0])} and {'+'.join(arms[1])} have different numbers of replicates; pair them one to one")
    return arms

def compare(results, names, first, second, samples=10_000):
    """Statistics of arm first - arm second (as many replicates each) into results; `samples`: bootstrap resamples."""
    A, B = results["scores"][first], results["scores"][second]
    # one unit per (task, replicate): the replicates' seed-averaged scores, paired by index (as many in both arms)
    units = {n: [x - y for x, y in zip(A[n]["replicate_means"], B[n]["replicate_means"])] for n in names}
    flat = [u for n in names for u in units[n]]
    boot = paired_bootstrap(flat, [0.0] * len(flat), samples) if len(flat) >= BOOTSTRAP_UNITS else None
    # 95% intervals over units: a task's over its replicates (pretraining + fine-tuning noise), the average's over all;
    # None from one unit: with one replicate per arm a task has no pretraining spread (its seeds' is fine-tuning's)
    results.update(difference={n: A[n]["mean"] - B[n]["mean"] for n in names + ["average"]},
                   ci95={n: mean_interval(d)[1:] if len(d) > 1 else None for n, d in dict(units, average=flat).items()},
                   units=flat, p_sign_flip=sign_flip_p(flat), p_bootstrap=boot,
                   detectable_difference=detectable_difference(flat))

def arm_scores(p, arm, names, result):
    """One arm's scores from result[(checkpoint, task, seed)] -> {task: dict(runs, mean, std, replicate_means),
    "average": dict(mean, std, per_run)}; runs in the order replicate, seed."""
    scores = {n: dict(runs=[dict(replicate=rep, checkpoint=ckpt, seed=seed, **result[ckpt, n, seed])
                            for rep, ckpt in enumerate(arm) for seed in range(p.seeds)]) for n in names}
    for sc in scores.values():
        sc.update(mean_std([r["test"]["main"] for r in sc["runs"]]), replicate_means=[
            float(np.mean([r["test"]["main"] for r in sc["runs"] if r["replicate"] == k])) for k in range(len(arm))])
    # the average column: each (replicate, seed) run's mean over tasks, then mean +- std
    per_run = [float(np.mean([scores[n]["runs"][i]["test"]["main"] for n in names]))
               for i in range(len(arm) * p.seeds)]
    scores["average"] = dict(mean_std(per_run), per_run=per_run)
    return scores

# ----------------------------------------------------------------------------------------
# The grid: every (checkpoint, task, seed) is a cell, a run that writes its own JSON under
# <out_dir>/cells, skipped when that holds the same protocol, checkpoint and task data: the same
# command resumes a killed grid. --shard i/n runs cells i, i+n, ... (a process per GPU, a SLURM
# array); the process that finds every cell done writes the results.
# ----------------------------------------------------------------------------------------
def grid_cells(p, arms, task_specs):
    """Read and check every task and checkpoint (all errors come before any training) -> every cell,
    in the fixed order arm, replicate, task, seed: dict(key, checkpoint, task, seed, read, file, identity)."""
    read = {name: tasks.read_task(name, kind, path, KINDS, frozen) for name, kind, path, frozen in task_specs}
    data = {name: dict(kind=kind, probe=frozen or p.probe, files=tasks.digest(f for f, _ in read[name]["raw"].values()))
            for name, kind, _, frozen in task_specs}
    files = lambda ckpt: [os.path.join(hf_dir(ckpt), f) for f in ("config.json", "model.safetensors", "tokenizer.json")]
    digest = {ckpt: load_encoder(ckpt) and tasks.digest(files(ckpt)) for arm in arms for ckpt in arm}  # loaded: checked
    protocol, slug = {k: getattr(p, k) for k in REPORTED}, lambda s: re.sub(r"[^\w-]+", "_", s)  # one file name
    return [dict(key=(ckpt, name, seed), checkpoint=ckpt, task=name, seed=seed, read=read[name],
                 file=os.path.join(p.out_dir, "cells", slug(os.path.normpath(ckpt)), f"{slug(name)}.seed{seed}.json"),
                 identity=dict(protocol=protocol, checkpoint=digest[ckpt], task=data[name]))
            for arm in arms for ckpt in arm for name, *_ in task_specs for seed in range(p.seeds)]

def cells_done(cells, quiet=False):
    """{key: result} of the cells whose JSON is there, complete and made with the cell's identity; the
    other files (corrupt, or made with another protocol, checkpoint or task data) are named, one line per reason."""
    done, skipped = {}, {}
    for c in cells:
        try:
            with open(c["file"], "rb") as f:
                d = json.loads(f.read())
            old, new, r = d["identity"], c["identity"], d["result"]
            assert {"dev", "test", "epoch", "losses"} <= set(r) and d["checkpoint"] == c["checkpoint"]
            why = "made with " + ", ".join([f"{k} {old['protocol'].get(k)} (now {v})" for k, v in new["protocol"]
                                            .items() if old["protocol"].get(k) != v] + [
                f"other {k} files" for k in ("checkpoint", "task") if old[k] != new[k]])
        except FileNotFoundError:
            continue
        except (ValueError, KeyError, TypeError, AttributeError, AssertionError):
            old, why = None, "not a complete cell result (corrupt?)"
        if old == c["identity"]:
            done[c["key"]] = r
        else:
            skipped.setdefault(why, []).append(c["file"])
    for why, files in skipped.items() if not quiet else ():
        others = f" and {len(files) - 1} other cells" * (len(files) > 1)
        print(f"note: {files[0]}{others} {why}: not reused, to be run again")
    return done

def run_cells(p, cells, shard):
    """Fine-tune every cell not done yet, one checkpoint loaded (and each task encoded) at a time; a cell
    is claimed by a lock on <file>.lock; one held elsewhere is waited for at the end (run here if its process
    died), so each process ends with its grid whole: two grids sharing cells both report. `shard`: printed."""
    dev, model, task, done = get_device(p), (None,), (None,), cells_done(cells)
    print(f"{shard}: {len(cells)} here, {len(done)} of them done already")
    todo = [(c, fcntl.LOCK_NB) for c in cells if c["key"] not in done]
    for c, nonblocking in todo:  # grows: a cell held elsewhere comes back once, at the end, waiting for its lock
        os.makedirs(os.path.dirname(c["file"]), exist_ok=True)
        with open(c["file"] + ".lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | nonblocking)  # released when the process ends, killed or not
            except BlockingIOError:
                print(f"{c['file']}: another process is running this cell; left to it, waited for at the end")
                todo.append((c, 0))
                continue
            except OSError:  # no locks on this filesystem (Lustre without flock): distinct shards never share a cell
                print(f"note: {lock.name} cannot be locked on this filesystem; the cell runs unlocked")
            if cells_done([c], quiet=True):  # finished by another process meanwhile
                continue
            if model[0] != c["checkpoint"]:
                model = (c["checkpoint"], *load_encoder(c["checkpoint"]))
                model[1].to(dev)
            if task[0] != c["key"][:2]:  # a frozen encoder's features: once for all seeds
                t = encode_task(p, c["read"], model[2])
                task = (c["key"][:2], t, probe_features(p, model[1], t) if t["probe"] or p.probe else None)
            t0, name = time.time(), os.path.basename(c["checkpoint"].rstrip("/"))
            r = finetune_one(p, model[1], task[1], c["seed"], task[2], desc=f"{name} {c['task']} seed {c['seed']}")
            cell = dict({k: c[k] for k in ("checkpoint", "task", "seed", "identity")}, device=str(dev), result=r)
            detour.atomic_write(c["file"], lambda f: f.write(json.dumps(cell, indent=1).encode("utf-8")))
            os.remove(lock.name)
            print(f"{c['checkpoint']} {c['task']} seed {c['seed']}: dev {100 * r['dev']['main']:.2f} "
                  f"test {100 * r['test']['main']:.2f} (epoch {r['epoch']}, {time.time() - t0:.0f}s)")

def run(p, ckpt_paths, task_specs, report="results", note=""):
    """Fine-tune every replicate of every arm (arms_of) on every task (a --tasks string or tasks.parse_tasks' list),
    seeds 0..p.seeds-1, as cells (p.shard's; none with p.merge); once all are done, compare the first arm with the
    second, write <p.out_dir>/<report>.md (`note` above the table) and .json -> results (None while cells miss)"""
    arms = arms_of(ckpt_paths)
    if isinstance(task_specs, str):
        if "default" in [s.strip() for s in task_specs.split(",")]:
            tasks.build_default_tasks(p)
        task_specs = tasks.parse_tasks(task_specs, p.tasks_dir, KINDS)
    cells, (shard, n) = grid_cells(p, arms, task_specs), (int(x) for x in (p.shard or "0/1").split("/"))
    if not p.merge:
        run_cells(p, cells[shard::n], f"shard {shard}/{n} of {len(cells)} cells")
    result = cells_done(cells)
    missing = [c["file"] for c in cells if c["key"] not in result]
    if missing:
        what = f"{len(missing)} of {len(cells)} cells not done ({', '.join(missing[:3])}{', ...' * (len(missing) > 3)})"
        if p.merge:
            fail(f"{what}; run every shard first (the same command without --merge true)")
        return print(f"{what}; the process that finishes the last one writes {report}.md (or: --merge true)")
    labels, read = ["+".join(arm) for arm in arms], {c["task"]: c["read"] for c in cells}
    results = dict(checkpoints=labels, seeds=list(range(p.seeds)), tasks=[
        dict(name=name, kind=kind, path=path, main=KINDS[kind].main, probe=frozen or p.probe,
             labels=read[name]["labels"]) for name, kind, path, frozen in task_specs], scores={},
        protocol=cells[0]["identity"]["protocol"])
    if note:
        results["note"] = note
    for label, arm in zip(labels, arms):
        results["scores"][label] = arm_scores(p, arm, [t[0] for t in task_specs], result)
    if len(arms) >= 2:
        compare(results, [t[0] for t in task_specs], *labels[:2], samples=p.bootstrap_samples)
    return write_report(p, report, results, markdown(results, p.bootstrap_samples))

def md_table(head, rows):
    """A markdown table: the header's cells, the rule, then each row's cells."""
    line = lambda cells: "| " + " | ".join(cells) + " |"
    return [line(head), "|---" * len(head) + "|"] + [line(cells) for cells in rows]

def markdown(results, bootstrap_samples):
    """The results as markdown: the main table, then per-group accuracy for tasks with groups."""
    pct, names = lambda x: f"{100 * x:.1f}", [t["name"] for t in results["tasks"]]
    rows = []
    for ckpt in results["checkpoints"]:
        sc = results["scores"][ckpt]
        rows.append([ckpt] + [f"{pct(sc[n]['mean'])} ± {pct(sc[n]['std'])}" for n in names + ["average"]])
        for k, rep in enumerate(ckpt.split("+") if "+" in ckpt else []):  # each replicate, seeds averaged
            means = [sc[n]["replicate_means"][k] for n in names]
            rows.append([f"· replicate {k + 1}: {rep}"] + [pct(x) for x in means] + [pct(np.mean(means))])
    if "difference" in results:
        d, ci = results["difference"], results["ci95"]
        na = dict.fromkeys(names, "n/a (1 replicate)") | {"average": "n/a (1 unit)"}  # no interval from one unit
        rows.append(["difference (first − second arm) [95% CI]"] + [f"{100 * d[n]:+.1f} " + (
            f"[{100 * ci[n][0]:+.1f}, {100 * ci[n][1]:+.1f}]" if ci[n] else f"[{na[n]}]") for n in names + ["average"]])
    cols = [f"{t['name']} ({t['main']}{', probe' if t['probe'] else ''})" for t in results["tasks"]]
    lines = [results["note"], ""] if results.get("note") else []
    lines += md_table(["checkpoint"] + cols + ["average"], rows)
    reps = len(results["scores"][results["checkpoints"][0]][names[0]].get("replicate_means", [0]))
    lines += ["", f"Test-set scores in %, mean ± std over all runs ({reps} pretraining replicate(s) x seeds "
              f"{results['seeds']}); each run's epoch is chosen on dev. average: the mean over tasks of each "
              "run, then mean ± std over runs."]
    if "difference" in results:
        n, boot = len(results["units"]), results["p_bootstrap"]
        lines += ["", f"Units: the {n} (task × pretraining replicate) paired differences, each the first's mean over "
                  f"fine-tuning seeds minus the second's. One-sided tests that the first beats the second: exact "
                  f"sign-flip p = {format_p(results['p_sign_flip'])} (floor 1/2^{n} = {format_p(0.5 ** n)})"
                  + (f"; paired bootstrap p = {format_p(boot)} ({bootstrap_samples} resamples, anti-conservative for "
                     "few units). " if boot is not None else f" (no bootstrap p below {BOOTSTRAP_UNITS} units). ")
                  + ("95% CI per task: t interval over the replicates (pretraining and fine-tuning noise)" if reps > 1
                     else "95% CI per task: none, one pretraining run per arm (its seeds: fine-tuning noise only)")
                  + "; for the average, over the units. Smallest average difference this design detects (80% power, "
                  f"one-sided 5%, from the units' spread): {100 * results['detectable_difference']:.1f} points."]
    for name in names:
        runs = {c: results["scores"][c][name]["runs"] for c in results["checkpoints"]}
        groups = list(next(iter(runs.values()))[0]["test"].get("groups", {}))
        if groups:
            accs = [[c] + [pct(np.mean([r["test"]["groups"][g] for r in rs])) for g in groups]
                    for c, rs in runs.items()]
            lines += ["", f"{name}: test accuracy by group (%, mean over runs)", ""]
            lines += md_table(["checkpoint"] + groups, accs)
    return "\n".join(lines) + "\n"

def write_report(p, name, results, text):
    """<p.out_dir>/<name>.md (the text, also printed) and .json (the results), written atomically. -> results"""
    os.makedirs(p.out_dir, exist_ok=True)
    for ext, content in ((".md", text), (".json", json.dumps(results, indent=1))):
        detour.atomic_write(os.path.join(p.out_dir, name + ext), lambda f: f.write(content.encode("utf-8")))
    print("\n" + text + f"\nwritten to {p.out_dir}/{name}.md and {name}.json")
    return results

def main(argv=None):
    """The command line -> one Protocol (defaults, --key overrides, CPU default) -> run or an analysis."""
    settings = asdict(Protocol())
    given = detour.apply_overrides(settings, sys.argv[1:] if argv is None else argv, "finetune.py",
                                   ("class Protocol", "\nCPU_DEFAULTS"))
    array = {k: os.environ.get("SLURM_ARRAY_TASK_" + k, "0" if k == "MIN" else "") for k in ("ID", "MIN", "COUNT")}
    if "shard" not in given and "SLURM_ARRAY_TASK_COUNT" in os.environ:  # a SLURM job array: one shard per array task
        if bad := next((k for k, v in array.items() if not v.isdigit()), None):
            fail(f"$SLURM_ARRAY_TASK_{bad} is {array[bad]!r}, not a number; give --shard i/n (it wins over the array)")
        settings["shard"] = f"{int(array['ID']) - int(array['MIN'])}/{array['COUNT']}"
    detour.check(settings, RULES, "finetune.py")
    for key in ("out_dir", "tasks_dir"):  # before anything is read or written
        if os.path.exists(settings[key]) and not os.path.isdir(settings[key]):
            fail(f"--{key} {settings[key]} is a file, not a directory; give a directory (it is created if missing)")
    p = Protocol(**settings)
    paths = [q.strip() for q in p.ckpts.split(",") if q.strip()]  # "A1+A2": replicates of one arm
    if p.analysis in ("cka", "drift"):  # no fine-tuning: the CPU default does not apply
        return (cka_divergence if p.analysis == "cka" else drift)(p, paths)
    if p.analysis == "transplant" and not p.layers:
        fail("--analysis transplant needs --layers (e.g. 0-7, attn or mlp)")
    if get_device(p).type == "cpu":  # the CPU default (see the Protocol): unless given explicitly
        p = replace(p, **{k: getattr(p, "cpu_" + k) for k in CPU_DEFAULTS if k not in given})
        print(f"CPU default: {p.epochs} epochs ({p.ner_epochs} for NER), {p.seeds} seeds, lr {p.learning_rate:g} "
              "(paper: 10 / 20 epochs, 5 seeds, 5e-5; set --epochs/--ner_epochs/--seeds/--learning_rate to change)")
    if p.analysis == "transplant":
        return transplant(p, paths, p.layers, p.tasks)
    found = [q for q in paths if all(os.path.isdir(r) for r in q.split("+") if r)]
    if not found:
        fail(f"no checkpoint found among {', '.join(paths)}; train them (the README's quick start) or pass --ckpts")
    for q in [q for q in paths if q not in found]:
        print(f"note: {q} not found, skipped")
    return run(p, found, p.tasks)


# ========================================================================================
# Analyses: why does the detour work? The paper's analyses, built on the functions above (--analysis;
# layers are numbered from 0, as in --freeze_layers; results in <out_dir>/<mode>.md and .json):
#   cka         d = 1 - linear CKA per layer between A and B on held-out sentences (--texts); a
#               third checkpoint C, B's seed twin, adds r = d(A, B) / d(B, C)
#   drift       where the detour moved the weights: ||W - W0|| / ||W0|| per layer, attention and MLP apart
#   transplant  which layers carry the gain: a layer group (0-7, attn or mlp) of A put into B, linear-probed
# ========================================================================================
def linear_cka(x, y):
    """Linear CKA (Kornblith et al., 2019) of two representations x (n, p), y (n, q) of the same n
    inputs: ||Y'X||^2 / (||X'X|| ||Y'Y||) of the centered columns; 1 = the same up to a rotation and
    a scale, near 0 = unrelated. Float64: the terms are fourth powers of the activations."""
    x = np.asarray(x, np.float64) - np.mean(x, 0)
    y = np.asarray(y, np.float64) - np.mean(y, 0)
    return float(np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)))

def text_examples(p, tokenizer, path):
    """A text file -> examples {ids}: each sentence of each line as [CLS] sentence [SEP], cut into
    chunks of p.max_len. Sentences, not lines: CKA needs many more inputs than hidden dimensions."""
    cls, sep, room = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]"), p.max_len - 2
    out = []
    for line in tasks.read_lines(path):
        for sentence in re.split(r"(?<=[.!?])\s+", line.strip()):
            ids = tokenizer.encode(sentence, add_special_tokens=False).ids
            out += [dict(ids=[cls] + ids[s:s + room] + [sep]) for s in range(0, len(ids), room)]
    if not out:
        fail(f"{path} holds no text")
    return out

def layer_features(p, model, examples):
    """Every example's hidden states mean-pooled over its real tokens, at the embedding output and
    after each layer -> L + 1 float64 arrays (n, d); bidirectional, as the encoder is used downstream."""
    dev = get_device(p)
    body = model.model.to(dev)

    def pooled(idx):  # (B, L + 1, d); float64, which autocast leaves alone
        ids, mask, _ = pad_batch([examples[i] for i in idx], body.config.pad_token_id, dev)
        m = mask.unsqueeze(-1).double()
        hidden = body(ids, attention_mask=mask, output_hidden_states=True)[1]
        return torch.stack([(h.double() * m).sum(1) / m.sum(1) for h in hidden], 1)
    return [f.numpy() for f in torch.stack(per_example(p, body, examples, dev, pooled), 1)]

def same_tokenizer(tokenizers, paths):
    if any(t.get_vocab() != tokenizers[0].get_vocab() for t in tokenizers):
        fail(f"{', '.join(paths)} do not share one tokenizer; the analysis feeds them the same token ids")

def cka_divergence(p, paths, text_path=None):
    """d = 1 - linear CKA between checkpoints A and B on held-out sentences, at the embedding
    output and after every layer. A third checkpoint C, B's seed-noise control (B's objective,
    another seed), adds d(B, C) and r = d(A, B) / d(B, C): how many times seed noise A and B differ."""
    if len(paths) not in (2, 3):
        fail("--analysis cka needs --ckpts A,B or A,B,C (C: B's twin trained with another seed)")
    text_path = text_path or p.texts or os.path.join(p.pretrain_dir, "val.txt")
    if not os.path.isfile(text_path):
        fail(f"{text_path} is not a file; pass --texts (a file, one text per line) or run data/prepare.py")
    feats, tokenizers, examples = [], [], None
    for path in paths:
        model, tokenizer = load_encoder(path)
        tokenizers.append(tokenizer)
        same_tokenizer(tokenizers, paths)
        examples = examples or text_examples(p, tokenizer, text_path)
        print(f"cka: {path} on {len(examples)} sentences of {text_path}")
        feats.append(layer_features(p, model, examples))
    if len({len(f) for f in feats}) > 1:
        fail(f"{', '.join(paths)} differ in depth; CKA is compared layer by layer")
    # d per layer; CKA <= 1 (Cauchy-Schwarz), max() only hides rounding below 0
    d = lambda i, j, l: max(0.0, 1 - linear_cka(feats[i][l], feats[j][l]))
    rows = [dict(layer=name, d_ab=d(0, 1, l))
            for l, name in enumerate(["embeddings"] + [f"layer {i}" for i in range(len(feats[0]) - 1)])]
    for l, row in enumerate(rows if len(paths) == 3 else []):
        row["d_bc"] = d(1, 2, l)
        row["r"] = row["d_ab"] / row["d_bc"] if row["d_bc"] > 0 else None
    results = dict(checkpoints=dict(zip("ABC", paths)), texts=text_path, n_texts=len(examples),
                   max_len=p.max_len, rows=rows)
    control = len(paths) == 3  # the report: a row per layer, the columns of C only with C
    cells = lambda row: [row["layer"], f"{row['d_ab']:.4f}"] + (
        [f"{row['d_bc']:.4f}", "—" if row["r"] is None else f"{row['r']:.2f}"] if control else [])
    lines = md_table(["layer", "d(A, B)"] + (["d(B, C)", "r = d(A, B) / d(B, C)"] if control else []),
                     [cells(row) for row in rows])
    lines += [""] + [f"{k}: {path}" for k, path in results["checkpoints"].items()]
    lines.append(f"d = 1 - linear CKA of mean-pooled hidden states (padding excluded) on "
                 f"{len(examples)} sentences of {text_path}; layer i = the output of layer i.")
    if control:
        lines.append("r > 1: A and B differ by more than two seeds of B's objective do.")
    return write_report(p, "cka", results, "\n".join(lines) + "\n")

def part_of(name):
    """A parameter name -> (part, layer): ("attn", i) for layer i's Wqkv, Wo, attn_norm, ("mlp", i)
    for its Wi, Wo, mlp_norm, ("embeddings", None), or ("head", None): the final norm and MLM head."""
    m = re.match(r"model\.layers\.(\d+)\.(attn|mlp)", name)  # also matches attn_norm, mlp_norm
    if m:
        return m.group(2), int(m.group(1))
    return ("embeddings" if name.startswith("model.embeddings.") else "head"), None

def same_shapes(a, b, paths):
    shapes = lambda m: {n: tuple(w.shape) for n, w in m.named_parameters()}
    if shapes(a) != shapes(b):
        fail(f"{paths[0]} and {paths[1]} do not have the same architecture (parameter names and shapes)")

def weight_drift(model, init):
    """Relative Frobenius change ||W - W0|| / ||W0|| of `model` from `init` per part (part_of; its tensors
    as one W), and per tensor: a norm's gain (1 at init, norm sqrt(d)) weighs as much as a std-0.02 matrix
    of d^2 entries. -> ({(part, layer): change}, {parameter name: change})"""
    start, sums, tensors = dict(init.named_parameters()), {}, {}
    ratio = lambda d2, b2: math.sqrt(d2 / b2) if b2 else None  # None: W0 = 0 (a zero-initialized bias)
    for name, w in model.named_parameters():
        w0 = start[name].detach().double()
        d2, b2 = float(((w.detach().double() - w0) ** 2).sum()), float((w0 ** 2).sum())
        tensors[name] = ratio(d2, b2)
        s = sums.setdefault(part_of(name), [0.0, 0.0])
        s[0], s[1] = s[0] + d2, s[1] + b2
    return {k: ratio(*s) for k, s in sums.items()}, tensors

def bar(x, top, width=24):
    """x as a bar of eighth blocks; `top` fills `width` characters."""
    eighths = round(8 * width * x / top) if top > 0 else 0
    return ("█" * (eighths // 8) + " ▏▎▍▌▋▊▉"[eighths % 8]).rstrip().ljust(width)

def drift(p, paths):
    """weight_drift of checkpoint A from B, its initialization (or any earlier checkpoint of the same shape)."""
    if len(paths) != 2:
        fail("--analysis drift needs --ckpts CHECKPOINT,INIT")
    model, init = (detour.load_hf(hf_dir(path)) for path in paths)  # weights only: no tokenizer needed
    same_shapes(model, init, paths)
    d, tensors = weight_drift(model, init)
    emb, head = d[("embeddings", None)], d[("head", None)]
    layers = [dict(layer=i, attn=d[("attn", i)], mlp=d[("mlp", i)]) for i in range(model.config.num_hidden_layers)]
    results = dict(checkpoint=paths[0], init=paths[1], embeddings=emb, layers=layers, head=head, tensors=tensors)
    # the report: every part as a number and a bar (one scale for all), then as a table
    top = max([emb, head] + [r[k] for r in layers for k in ("attn", "mlp")])
    show = lambda x: f"{x:.4f} {bar(x, top)}"
    chart = [f"embeddings    {show(emb)}"] + [f"layer {r['layer']:2d} attn {show(r['attn'])}  mlp {show(r['mlp'])}"
                                              for r in layers] + [f"head          {show(head)}"]
    table = ["| part | attention | MLP |", "|---|---|---|", f"| embeddings | {emb:.4f} | |"]
    table += [f"| layer {r['layer']} | {r['attn']:.4f} | {r['mlp']:.4f} |" for r in layers]
    table.append(f"| final norm + MLM head | {head:.4f} | |")
    return write_report(p, "drift", results, "\n".join(
        [f"Weight drift of {paths[0]} from {paths[1]}: ||W - W0|| / ||W0|| per part (attention = Wqkv, Wo, attn_norm; "
         "MLP = Wi, Wo, mlp_norm).", "", "```", *[c.rstrip() for c in chart], "```", "", *table]) + "\n")

def group_names(model, spec):
    """A layer group's parameters: attn or mlp (that module of every layer, with its norm) or layers 0-7, 0-3,10,
    where "embeddings" may stand among the layers (embeddings,0: the embeddings and layer 0)."""
    names, n_layers = [name for name, _ in model.named_parameters()], model.config.num_hidden_layers
    if spec in ("attn", "mlp"):
        return [n for n in names if part_of(n)[0] == spec]
    parts = spec.replace(" ", "").split(",")
    try:
        chosen = detour.parse_layers(",".join(q for q in parts if q != "embeddings"), n_layers) + (
            ["embeddings"] if "embeddings" in parts else [])  # part_of names them ("embeddings", None)
    except SystemExit:  # parse_layers' message names --freeze_layers
        chosen = []
    if not chosen:
        fail(f"--layers {spec!r} should be attn, mlp or layers like 0-7, 0-3,10 or embeddings,0 (the model has "
             f"{n_layers}, from 0)")
    return [n for n in names if part_of(n)[1] in chosen or part_of(n)[0] in chosen]

def transplant_model(donor, recipient, spec):
    """A copy of `recipient` whose layer group `spec` (see group_names) holds `donor`'s weights."""
    hybrid, source = copy.deepcopy(recipient), dict(donor.named_parameters())
    hybrid.load_state_dict({name: source[name] for name in group_names(recipient, spec)}, strict=False)
    return hybrid

def transplant(p, paths, spec, task_specs):
    """The hybrids of checkpoints A, B (layer group `spec` from A, the rest from B; A1+A2,B1+B2: one hybrid per
    replicate pair), saved as HF dirs in p.out_dir and linear-probed next to A and B: a probe keeps the encoder
    frozen, where fine-tuning would retrain the transplanted layers and blur what they carry."""
    arms = arms_of(paths)
    if len(arms) != 2:
        fail("--analysis transplant needs --ckpts A,B (the layers come from A, the rest from B)")
    name = "transplant-" + spec.replace(",", "_")
    hybrids = [os.path.join(p.out_dir, name, f"r{k + 1}") if len(arms[0]) > 1 else os.path.join(p.out_dir, name)
               for k in range(len(arms[0]))]
    for pa, pb, hybrid_dir in zip(*arms, hybrids):
        (a, tok_a), (b, tok_b) = load_encoder(pa), load_encoder(pb)
        same_tokenizer([tok_a, tok_b], [pa, pb])
        same_shapes(a, b, [pa, pb])
        detour.save_hf(transplant_model(a, b, spec), hybrid_dir, os.path.join(hf_dir(pb), "tokenizer.json"))
    return run(replace(p, probe=True), [paths[0], "+".join(hybrids), paths[1]], task_specs, report=name,
               note=f"{'+'.join(hybrids)}: layers {spec} from {paths[0]}, the rest from {paths[1]} (linear probes)")


if __name__ == "__main__":
    main()
