"""
detour.py: continued pretraining of a ModernBERT encoder with a Causal LM detour.

The paper ("A Causal Language Modeling Detour Improves Encoder Continued Pretraining") adapts an
encoder to a new domain in two phases at a fixed token budget:
  Phase 1  --phase clm    causal attention mask, next-token loss at every position
           --phase mlm    (the baseline twin) bidirectional, 30% masking
  Phase 2  --phase decay  bidirectional MLM at 15%, ~10% of the Phase-1 tokens,
                          LR 1-sqrt cooldown from peak to 10% of peak, AdamW state kept.
The two twins differ only in the Phase-1 objective: same data, same order, same schedule.

  python data/prepare.py     # the generated pair: data/world/general, data/world/bio
  bash runs/theta0.sh        # θ0, the general encoder: MLM on general text, then its decay
  torchrun --standalone --nproc_per_node=1 detour.py --phase clm     # θ0 continued on bio text
  torchrun --standalone --nproc_per_node=1 detour.py --phase decay --init_from out/clm

Every constant below can be overridden: `--key value` or `--key=value`. Each run keeps a copy of
this file as out_dir/detour.py, and the copy runs by itself (it imports nothing of this
repository): an ablation made by editing a constant stays reproducible.

Sections 1-6 are the method: 1 constants, 2 the phases, 3 the model (parameter names as HF's
ModernBertForMaskedLM), 4 objectives and data windows, 5 optimizer and schedule, 6 the training
loop. Section 7 is plumbing, to read when you need it: errors and files, the HF format, FLOPs,
the GPU path, DDP, the command line, checkpoints and where a run starts, main.
"""
import concurrent.futures
import functools
import hashlib
import importlib.util
import itertools
import json
import math
import os
import pickle
import re
import secrets
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields, make_dataclass, replace
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer, processors
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

# -------------------------------------------------------------------------------------------------
# 1. Constants. Paper values unless the comment says otherwise. The default run is the paper's
# setting in miniature, in minutes on a 2-core CPU: continued pretraining of θ0, a `tiny` general
# encoder standing in for ModernBERT-base (runs/theta0.sh builds it on generated everyday English),
# on the generated biomedical corpus, cut with θ0's tokenizer (data/prepare.py writes both).
phase = "clm"              # clm | mlm (Phase 1) | decay (Phase 2)
preset = "tiny"            # model shape from scratch: tiny | small | medium | base | large
init_from = "out/theta0/hf"  # θ0's HF export (runs/theta0.sh) | scratch | an HF ModernBERT dir
                           # (ModernBERT-base) | a detour out_dir | resume
out_dir = ""               # "" = out/<phase> (Phase 1) or <init_from>-decay (decay)
data_dir = "data/world/bio"  # train.bin / val.bin / meta.json from data/prepare.py
overwrite = False          # a fresh run may replace the checkpoint in out_dir, of any phase
                           # (else refused)
autoresume = False         # the same command is safe to rerun (a requeued job): continue
                           # out_dir's checkpoint of this phase and configuration, start if it
                           # has none, exit 0 if it is finished
early_decay = False        # a decay may start from a Phase 1 that stopped before its last step
                           # (else refused: the twins would be compared short of their budget)
new_data = False           # a resume or a decay may run on data other than its checkpoint's
                           # (another meta.json or tokenizer.json; else refused)
# objective
mlm_rate = 0.30            # Phase-1 MLM baseline masking rate (paper: 30%)
decay_mlm_rate = 0.15      # Phase-2 masking rate (paper: 15%)
doc_mask = True            # packed documents never attend across the [SEP] boundary
# data and batch
seq_len = 128              # paper: 8192
batch_size = 8             # micro-batch, sequences per rank per forward
global_batch_size = 8      # sequences per optimizer step over all ranks (paper: 384); the CPU
                           # default buys steps: the detour twin relearns bidirectional use
                           # only in its decay (10% of them)
max_tokens = 1_024_000     # Phase-1 budget in tokens (paper: billions): 1,000 steps, a 100-step
                           # decay (the studies' t1000 point)
decay_ratio = 0.10         # decay length as a fraction of Phase-1 tokens
decay_tokens = 0           # decay length in tokens; 0 = decay_ratio x Phase-1 tokens
data_seed = 42             # data order seed (paper: 42)
seed = 17                  # model init / masking seed (paper: 17)
# optimizer (decoupled AdamW)
learning_rate = 5e-4       # peak lr (paper: 2e-4, ModernBERT-base over billions of tokens; here
                           # the studies' value for the tiny θ0 at 1,000 steps)
warmup_tokens = 20_480     # linear warmup (20 steps here), then constant (paper: 100M)
min_lr_ratio = 0.10        # decay ends at 10% of peak
beta1 = 0.9
beta2 = 0.98
eps = 1e-6
weight_decay = 1e-5        # paper's *fully decoupled* wd; converted for torch AdamW below
grad_clip = 0.0            # max grad norm, 0 = off (upstream uses none: clipping would treat
                           # the twins unequally, MLM's early gradients being the larger)
freeze_layers = ""         # e.g. "0-7" or "8-14": layers that do not train in this phase
# system
device = "auto"            # auto | cpu | cuda | cuda:N
dtype = "auto"             # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
compile = False            # torch.compile the model
attn_backend = "auto"      # auto (varlen where it can run: CUDA, bf16; else sdpa) | sdpa |
                           # varlen (FlashAttention's variable-length kernel, documents apart)
eval_interval = 400        # steps between validation
eval_tokens = 65_536       # fixed validation budget (split over ranks)
log_interval = 20
ckpt_interval = 200        # steps between checkpoints (also written at the end)
progress = True            # tqdm bar
wandb_log = False          # also send every log.jsonl record to Weights & Biases (rank 0;
                           # pip install wandb)
wandb_project = "detour"
wandb_run_name = ""        # "" = out_dir
wandb_run_id = ""          # "" = a new W&B run; saved in the checkpoint, so a resumed or
                           # requeued run logs into its own

# The constants above, as the run's configuration (the command line overrides a copy).
DEFAULTS = {k: v for k, v in dict(globals()).items()
            if k.islower() and not k.startswith("_") and isinstance(v, (bool, int, float, str))}
# hidden, intermediate, layers, heads; ModernBERT-base/large are the released shapes
PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2),
    "small": dict(hidden_size=128, intermediate_size=192, num_hidden_layers=6,
                  num_attention_heads=2),
    "medium": dict(hidden_size=256, intermediate_size=384, num_hidden_layers=6,
                   num_attention_heads=4),
    "base": dict(hidden_size=768, intermediate_size=1152, num_hidden_layers=22,
                 num_attention_heads=12),
    "large": dict(hidden_size=1024, intermediate_size=2624, num_hidden_layers=28,
                  num_attention_heads=16),
}
IGNORE = -100  # target value that carries no loss
SPECIAL_IDS = ("pad_token_id", "cls_token_id", "sep_token_id", "mask_token_id", "unk_token_id")


# -------------------------------------------------------------------------------------------------
# 2. The phases: one row of PHASES per row of the objectives table (docs/model.md). A row holds
# what the phase runs: its attention, the function that makes its (inputs, targets), the function
# of its learning rate, and the constants it reads; cfg.phase only picks the row. An ablation is a
# constant edited above, a row added below, or a function of its own in a row (docs/model.md).
def next_token_targets(cfg, buf, config, n_real_vocab, sample):
    """Causal LM (the detour): the next token at every position (clm_batch)."""
    return clm_batch(buf, config.sep_token_id)


def masked_targets(cfg, buf, config, n_real_vocab, sample):
    """Masked LM at the phase's rate (masking_rate); the masks depend only on (seed, sample), so
    the twins and a resumed run draw the same ones (mlm_batch)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + sample)
    return mlm_batch(buf, masking_rate(cfg), gen, config, n_real_vocab)


def warmup_constant(cfg, tokens, total, step_tokens):
    """Phase 1's learning rate: linear warmup over warmup_tokens, then the constant peak. Read at
    the step's end, so the first step is above 0."""
    return cfg.learning_rate * min(1.0, (tokens + step_tokens) / max(cfg.warmup_tokens, 1))


def one_minus_sqrt(cfg, tokens, total, step_tokens):
    """The decay's learning rate: 1 - sqrt from the peak to min_lr_ratio x peak over the phase's
    tokens. Read at the step's start, so the first decay step runs at the peak (as Composer's
    schedulers do) and the cooldown is not cut short."""
    progress = min(tokens / max(total, 1), 1.0)
    floor = cfg.min_lr_ratio
    return cfg.learning_rate * (floor + (1 - floor) * (1 - math.sqrt(progress)))


@dataclass(frozen=True)
class Phase:
    causal: bool       # causal attention (the detour) or bidirectional -> attention_window
    batch: Callable    # (cfg, windows, config, n_real_vocab, sample) -> (inputs, targets)
    schedule: Callable  # (cfg, tokens, total, step_tokens) -> this step's learning rate
    rate: Optional[str]  # the constant holding the share of positions predicted (None: all)
    reads: tuple       # the constants only this phase reads: given to another phase, refused
    # continues: a Phase-2 phase. It starts where a Phase-1 run (a row that does not continue)
    # ended: its weights and AdamW moments (only the schedule restarts; start_point), its data
    # stream at the first window Phase 1 did not see (start_point), the keys of INHERITED from
    # its configuration (continued), and a budget of decay_tokens, or decay_ratio x Phase 1's
    # tokens (phase_budget).
    continues: bool = False


PHASE1 = ("max_tokens", "warmup_tokens")  # a Phase-1 run's budget and warmup
PHASES = {
    "clm": Phase(causal=True, batch=next_token_targets, schedule=warmup_constant, rate=None,
                 reads=PHASE1),
    "mlm": Phase(causal=False, batch=masked_targets, schedule=warmup_constant, rate="mlm_rate",
                 reads=(*PHASE1, "mlm_rate")),
    "decay": Phase(causal=False, batch=masked_targets, schedule=one_minus_sqrt,
                   rate="decay_mlm_rate", continues=True,
                   reads=("decay_mlm_rate", "decay_ratio", "decay_tokens", "min_lr_ratio",
                          "early_decay")),
}
def phase1_names():
    """The phases a continuing phase (the decay) can start from: every row that does not
    continue."""
    return [name for name, row in PHASES.items() if not row.continues]


# What a continuing phase takes from its Phase 1's configuration: the keys that keep the twins'
# continuation the same run (the data and its order, the batch, the seeds, the peak lr and
# AdamW's settings; the model's shape comes with the weights). Every other key is the running
# file's or the command line's. A value given on the command line runs, and a line says so.
INHERITED = ("data_dir", "seq_len", "batch_size", "global_batch_size", "doc_mask", "data_seed",
             "seed", "learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip")


def masking_rate(cfg):
    """The share of positions the phase predicts: the value of its `rate` constant (the baseline
    twin's mlm_rate, 30%; the decay's decay_mlm_rate, 15%), every position (1.0) without one."""
    rate = PHASES[cfg.phase].rate
    return 1.0 if rate is None else getattr(cfg, rate)


# -------------------------------------------------------------------------------------------------
# 3. The model. Names mirror transformers' ModernBertForMaskedLM so state dicts are identical.
@dataclass
class Config:
    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    local_attention: int = 128          # total window: a local token sees 64 on each side
    global_attn_every_n_layers: int = 3  # layers 0, 3, 6, ... are global
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    mlp_dropout: float = 0.0
    initializer_range: float = 0.02
    pad_token_id: int = 50283
    cls_token_id: int = 50281
    sep_token_id: int = 50282
    mask_token_id: int = 50284
    unk_token_id: int = 50280
    layer_types: list = field(default=None)  # None = derived from global_attn_every_n_layers
    # an HF source's other config.json fields: exported as they came
    hf_fields: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.layer_types is None:
            n = self.global_attn_every_n_layers
            self.layer_types = ["full_attention" if i % n == 0 else "sliding_attention"
                                for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"{len(self.layer_types)} layer_types for {self.num_hidden_layers} "
                             "layers: layer_types needs one per layer")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} does not split in "
                             f"{self.num_attention_heads} heads")
        if bad := set(self.layer_types) - {"full_attention", "sliding_attention"}:
            raise ValueError(f"layer_types holds {sorted(bad)[0]!r}")

    @property
    def special_ids(self):
        return [self.pad_token_id, self.cls_token_id, self.sep_token_id, self.mask_token_id,
                self.unk_token_id]


def rope_cos_sin(theta, head_dim, T, device):
    """Rotate-half (NeoX) RoPE tables over the full head_dim, computed in fp32."""
    dims = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (dims / head_dim))
    freqs = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return (x.float() * cos + torch.cat((-x2, x1), dim=-1).float() * sin).to(x.dtype)


def attention_window(causal, window=None):
    """What a query sees, as FlashAttention's (left, right) window: the keys up to `left`
    positions before it and up to `right` after it, -1 for no bound. The one rule of every
    attention path: may_attend's masks, block_sliding_attention's blocks, the varlen kernel and
    the FLOP count take it from here. Causal (the detour): nothing after. A local layer's
    `window` is half its span: a local token sees the 64 keys on each side of it, or (causal)
    itself and the 64 before it, as in the FlexBERT/Ettin training code (HF's decoder uses 63)."""
    left = -1 if window is None else window
    right = 0 if causal else left
    return left, right


def may_attend(b, qi, kj, T, causal, window=None, attention_mask=None, doc_ids=None):
    """True where query qi of row b may attend to key kj (broadcasting integer tensors; keys
    outside [0, T) never): attention_window's rule, packed documents apart, padding unseen."""
    left, right = attention_window(causal, window)
    ok = (kj >= 0) & (kj < T)
    if left >= 0:
        ok = ok & (qi - kj <= left)
    if right >= 0:
        ok = ok & (kj - qi <= right)
    qc = qi.clamp(0, T - 1)  # safe lookups; outside positions are masked above
    kc = kj.clamp(0, T - 1)
    if doc_ids is not None:  # packed documents stay apart
        ok = ok & (doc_ids[b, qc] == doc_ids[b, kc])
    if attention_mask is not None:  # padding keys are invisible
        ok = ok & attention_mask[b, kc].bool()
    return ok | (qi == kj)  # every query sees itself: no empty row, no NaN


def dense_mask(B, T, device, causal, window=None, attention_mask=None, doc_ids=None):
    """Boolean (B, 1, T, T) may_attend mask: the global layers' (with `window`, the local layers'
    written densely: the O(T^2) reference of block_sliding_attention)."""
    i = torch.arange(T, device=device)
    b = torch.arange(B, device=device).view(B, 1, 1)
    ok = may_attend(b, i[:, None], i[None, :], T, causal, window, attention_mask, doc_ids)
    return ok.expand(B, T, T)[:, None]


def key_blocks(causal, window):
    """Key blocks of `window` tokens a query block needs: the one before and its own, and the one
    after when the window reaches forward (bidirectional)."""
    right = attention_window(causal, window)[1]
    return 2 + int(right > 0)


def block_sliding_mask(B, T, device, causal, window, attention_mask=None, doc_ids=None):
    """The exact mask of block_sliding_attention: (B * blocks, 1, window, key blocks x window)."""
    n = -(-T // window)
    keys = key_blocks(causal, window) * window
    qi = torch.arange(n * window, device=device).view(n, window, 1)
    first_key = (torch.arange(n, device=device).view(n, 1, 1) - 1) * window
    kj = first_key + torch.arange(keys, device=device)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    ok = may_attend(b, qi, kj, T, causal, window, attention_mask, doc_ids)
    return ok.expand(B, n, window, keys).reshape(B * n, 1, window, keys)


def block_sliding_attention(q, k, v, mask, window, causal, dropout=0.0):
    """Sliding-window attention in O(T x window), not O(T^2), on (B, H, T, D): query block b
    attends to the keys of blocks b-1, b, b+1 (b-1, b when causal), which hold every key within
    `window` of its queries; block_sliding_mask keeps exactly those, so it equals dense attention
    under the window mask, in one SDPA call over the blocks."""
    B, H, T, D = q.shape
    n = -(-T // window)
    nb = key_blocks(causal, window)
    pad = n * window - T
    qb = F.pad(q, (0, 0, 0, pad)).unflatten(2, (n, window)).transpose(1, 2).flatten(0, 1)

    def keys(x):  # one zero block before, windows of nb blocks: (B * n, H, nb * window, D)
        x = F.pad(x, (0, 0, window, pad + (nb - 2) * window)).unfold(2, nb * window, window)
        return x.permute(0, 2, 1, 4, 3).flatten(0, 1)  # unfold is a view; this makes the one copy

    y = F.scaled_dot_product_attention(qb, keys(k), keys(v), attn_mask=mask, dropout_p=dropout)
    return y.unflatten(0, (B, n)).transpose(1, 2).flatten(2, 3)[:, :, :T]


def attention_fns(config, B, T, device, causal, attention_mask=None, doc_ids=None,
                  backend="sdpa", dropout=0.0, spans=None):
    """{layer kind: attend(q, k, v) -> y} on (B, H, T, head_dim) tensors, the masks built once per
    forward and shared by the layers of a kind. backend: sdpa (the local layers by
    block_sliding_attention) or varlen (CUDA, on `spans`: section 7's GPU path)."""
    half = config.local_attention // 2
    if backend == "varlen":
        attend = functools.partial(varlen_attention, spans=spans, causal=causal)
        return {"full_attention": functools.partial(attend, window=None),
                "sliding_attention": functools.partial(attend, window=half)}
    full_mask = None  # without padding or documents: SDPA's own causal flag, no T x T tensor
    if attention_mask is not None or doc_ids is not None:
        full_mask = dense_mask(B, T, device, causal, None, attention_mask, doc_ids)
    local_mask = block_sliding_mask(B, T, device, causal, half, attention_mask, doc_ids)
    nothing_after = attention_window(causal)[1] == 0
    full = functools.partial(F.scaled_dot_product_attention, attn_mask=full_mask,
                             dropout_p=dropout, is_causal=nothing_after and full_mask is None)
    local = functools.partial(block_sliding_attention, mask=local_mask, window=half,
                              causal=causal, dropout=dropout)
    return {"full_attention": full, "sliding_attention": local}


class Embeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size,
                                           padding_idx=config.pad_token_id)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)
        self.drop = nn.Dropout(config.embedding_dropout)

    def forward(self, idx):
        return self.drop(self.norm(self.tok_embeddings(idx)))


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        # rows [Q; K; V]
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.out_drop = nn.Dropout(config.attention_dropout)

    def forward(self, x, rope, attend):  # attend(q, k, v): this layer kind's, from attention_fns
        B, T, _ = x.shape
        qkv = self.Wqkv(x).view(B, T, 3, self.n_head, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = attend(apply_rope(q, *rope), apply_rope(k, *rope), v)
        return self.out_drop(self.Wo(y.transpose(1, 2).reshape(B, T, -1)))


class MLP(nn.Module):
    """GeGLU: Wi gives [input; gate]; the first half goes through exact (erf) GELU."""

    def __init__(self, config):
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.drop = nn.Dropout(config.mlp_dropout)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        inp, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.drop(F.gelu(inp) * gate))


class Layer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        # Layer 0 has no attention norm: the embedding LayerNorm just ran (as upstream).
        self.attn_norm = (nn.Identity() if layer_idx == 0 else
                          nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False))
        self.attn = Attention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)
        self.mlp = MLP(config)

    def forward(self, x, rope, attend):
        x = x + self.attn(self.attn_norm(x), rope, attend)
        return x + self.mlp(self.mlp_norm(x))


class Encoder(nn.Module):
    """The body (HF `ModernBertModel`): embeddings, layers, final norm."""

    def __init__(self, config, attn_backend="sdpa"):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList([Layer(config, i) for i in range(config.num_hidden_layers)])
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)
        self.attn_backend = attn_backend  # see attention_fns; may be changed at any time

    def forward(self, idx, attention_mask=None, causal=False, doc_ids=None,
                output_hidden_states=False, spans=None):
        """idx (B, T) -> final hidden states (B, T, d); output_hidden_states: also the embedding
        and layer outputs."""
        config = self.config
        B, T = idx.shape
        head_dim = config.hidden_size // config.num_attention_heads
        dropout = config.attention_dropout if self.training else 0.0
        attend = attention_fns(config, B, T, idx.device, causal, attention_mask, doc_ids,
                               self.attn_backend, dropout, spans)
        thetas = {"full_attention": config.global_rope_theta,
                  "sliding_attention": config.local_rope_theta}
        ropes = {kind: rope_cos_sin(theta, head_dim, T, idx.device)
                 for kind, theta in thetas.items()}
        x = self.embeddings(idx)
        hidden = [x]
        for layer, kind in zip(self.layers, config.layer_types):
            x = layer(x, ropes[kind], attend[kind])
            if output_hidden_states:
                hidden.append(x)
        x = self.final_norm(x)
        return (x, hidden) if output_hidden_states else x


class Head(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)

    def forward(self, x):
        return self.norm(F.gelu(self.dense(x)))


class LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of the decoder's logits (h @ weight.T + bias) without ever holding all
    N x V of them: chunk by chunk, the gradient (softmax - one-hot) becomes those of h, weight and
    bias in the forward pass, and backward only scales them. Rows with target IGNORE (padding
    slots) count nothing: mean over `n`."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, n, chunk=1024):
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)
        grad_b = torch.zeros_like(bias, dtype=torch.float32)
        loss = torch.zeros((), device=h.device)
        for s in range(0, h.size(0), chunk):
            hc = h[s:s + chunk]
            t = targets[s:s + chunk]
            real = (t != IGNORE).float()[:, None]  # x * 1.0 is x: no change to real rows
            t = t.clamp_min(0)
            logits = F.linear(hc, weight, bias).float()  # softmax in fp32, also under autocast
            lse = logits.logsumexp(-1)
            loss += ((lse - logits.gather(1, t[:, None]).squeeze(1)) * real[:, 0]).sum()
            g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            g[torch.arange(len(t), device=t.device), t] -= 1
            g *= real
            grad_h[s:s + chunk] = g @ weight
            grad_w += g.t() @ hc
            grad_b += g.sum(0)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.n = n
        ctx.w_dtype = weight.dtype  # fp32 sums, returned in the weight's dtype
        return loss / ctx.n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scale = grad_loss / ctx.n
        grad_w = (grad_w * scale).to(ctx.w_dtype)
        grad_b = (grad_b * scale).to(ctx.w_dtype)
        return grad_h * scale, grad_w, grad_b, None, None, None


class ModernBERT(nn.Module):
    """ModernBertForMaskedLM with one extra switch: `causal`. attn_backend: see attention_fns."""

    def __init__(self, config, attn_backend="sdpa"):
        super().__init__()
        self.config = config
        self.model = Encoder(config, attn_backend)
        self.head = Head(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        self.decoder.weight = self.model.embeddings.tok_embeddings.weight  # tied
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """As upstream: truncated normal at 2 std, std 0.02, output projections (attn.Wo, mlp.Wo,
        head.dense) at 0.02 / sqrt(2 x layers); norms 1, decoder bias 0 (its weight is the
        embedding). Draws in module order."""
        std = self.config.initializer_range
        std_out = std / math.sqrt(2.0 * self.config.num_hidden_layers)

        def normal(weight, s):
            nn.init.trunc_normal_(weight, std=s, a=-2 * s, b=2 * s)

        normal(self.model.embeddings.tok_embeddings.weight, std)
        for layer in self.model.layers:
            normal(layer.attn.Wqkv.weight, std)
            normal(layer.attn.Wo.weight, std_out)
            normal(layer.mlp.Wi.weight, std)
            normal(layer.mlp.Wo.weight, std_out)
        normal(self.head.dense.weight, std_out)
        nn.init.zeros_(self.decoder.bias)
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)

    def forward(self, idx, targets=None, causal=False, attention_mask=None, doc_ids=None,
                spans=None, capacity=None):
        """-> (logits, loss). Without targets: dense logits (B, T, V). With targets (B, T; IGNORE =
        no loss): the LinearCrossEntropy loss with the head only on the supervised positions
        (15-30% of tokens for MLM), or with `capacity` (--compile) on that many slots, the
        supervised positions first: one shape, one compiled graph."""
        h = self.model(idx, attention_mask=attention_mask, causal=causal, doc_ids=doc_ids,
                       spans=spans)
        if targets is None:
            return self.decoder(self.head(h)), None
        targets = targets.reshape(-1)
        keep = targets != IGNORE
        if capacity is None:  # eager: the head on exactly the supervised positions
            slot = keep.nonzero().view(-1)
            n = len(slot)
        else:  # compiled: `capacity` slots, the supervised positions first, then -1
            slot = torch.nonzero_static(keep, size=capacity, fill_value=-1).view(-1)
            n = (slot >= 0).sum()
        h = h.reshape(-1, h.size(-1))[slot.clamp(0)]
        targets = torch.where(slot >= 0, targets[slot.clamp(0)], IGNORE)
        loss = LinearCrossEntropy.apply(self.head(h), self.decoder.weight, self.decoder.bias,
                                        targets, n)
        return None, loss

    @torch.no_grad()
    def score(self, idx, targets, causal=False, doc_ids=None, spans=None, chunk=1024):
        """(mean loss, share of argmax hits) on the supervised positions, never N x V logits at
        once."""
        h = self.model(idx, causal=causal, doc_ids=doc_ids, spans=spans)
        keep = targets.reshape(-1) != IGNORE
        h = self.head(h.reshape(-1, h.size(-1))[keep])
        targets = targets.reshape(-1)[keep]
        loss = torch.zeros((), device=h.device)
        hits = torch.zeros((), dtype=torch.long, device=h.device)
        for s in range(0, len(targets), chunk):
            logits = self.decoder(h[s:s + chunk]).float()
            t = targets[s:s + chunk]
            loss += F.cross_entropy(logits, t, reduction="sum")
            hits += (logits.argmax(-1) == t).sum()
        return loss / len(targets), hits / len(targets)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


# -------------------------------------------------------------------------------------------------
# 4. Objectives and data windows. A packed token stream ([CLS] doc [SEP] [CLS] doc [SEP] ...) is
# cut into windows. The order is a pure function of (data_seed, sample index): the CLM and MLM
# twins see the same windows in the same order, a resumed run continues exactly, and 1 or N ranks
# with the same global batch see the same rows.
def document_ids(idx, sep_token_id):
    """Document index of every token in a packed stream: the [SEP]s strictly before it ([SEP]
    closes a document)."""
    is_sep = (idx == sep_token_id).int()
    return torch.cumsum(is_sep, dim=1) - is_sep


def load_data(data_dir, split):
    """(meta.json, the split's token ids as a memmap): nothing is read until used."""
    meta_path = os.path.join(data_dir, "meta.json")
    bin_path = os.path.join(data_dir, f"{split}.bin")
    # the command that builds data_dir
    if missing := [p for p in (meta_path, bin_path) if not os.path.exists(p)]:
        fail(f"{missing[0]} not found; run `python data/prepare.py --input FILES --out_dir "
             f"{data_dir}` (without --input: a generated corpus), or set --data_dir")
    meta = check_meta(read_json(meta_path, SPECIAL_IDS + ("vocab_size", "dtype"), PREPARE),
                      meta_path)
    size = os.path.getsize(bin_path)
    itemsize = np.dtype(meta["dtype"]).itemsize
    count = meta.get(f"n_{split}_tokens", size // itemsize)
    if size % itemsize or size // itemsize != count:
        fail(f"{bin_path} does not hold {count} {meta['dtype']} token ids as {meta_path} says; "
             f"{PREPARE}")
    if size == 0:
        fail(f"{bin_path} is empty; re-run data/prepare.py on a non-empty corpus")
    return meta, np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r")


class Windows:
    """Non-overlapping windows of seq_len + 1 tokens (+1: the last CLM target), in a fresh
    permutation every epoch."""

    def __init__(self, data, seq_len, data_seed):
        self.data = data
        self.T = seq_len
        self.seed = data_seed
        self.n = (len(data) - 1) // seq_len
        if self.n < 1:
            fail(f"{len(data)} tokens cannot fill one window of seq_len={seq_len}; prepare more "
                 "data or lower --seq_len")
        self._epoch = None  # the epoch whose permutation _perm holds
        self._perm = None

    def rows(self, first_sample, count):
        out = np.empty((count, self.T + 1), dtype=np.int64)
        for r in range(count):
            epoch, pos = divmod(first_sample + r, self.n)
            if epoch != self._epoch:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.n, generator=g).numpy()
                self._epoch = epoch
            start = int(self._perm[pos]) * self.T
            out[r] = self.data[start:start + self.T + 1]
        return torch.from_numpy(out)


def clm_batch(buf, sep_id):
    """Causal LM: the next token at every position but a [SEP] (the next document is unrelated)."""
    x = buf[:, :-1]
    y = buf[:, 1:].clone()
    y[x == sep_id] = IGNORE
    return x, y


def mlm_batch(buf, rate, gen, config, n_real_vocab):
    """Masked LM: `rate` of the non-special tokens (80% [MASK], 10% random, 10% kept), loss only
    there. Unlike FlexBERT, special tokens are never chosen nor random replacements, and every
    document gets a prediction."""
    x = buf[:, :-1]
    special = functools.reduce(torch.logical_or, [x == i for i in config.special_ids])
    score = torch.rand(x.shape, generator=gen).masked_fill_(special, 2.0)
    chosen = score < rate
    doc = document_ids(x, config.sep_token_id)
    key = (torch.arange(x.size(0))[:, None] * x.size(1) + doc).reshape(-1)
    doc_min = torch.full((x.numel(),), 2.0).scatter_reduce(0, key, score.reshape(-1), "amin")
    chosen |= (score == doc_min[key].view_as(score)) & ~special
    y = torch.where(chosen, x, IGNORE)
    action = torch.rand(x.shape, generator=gen)
    skip = sorted(i for i in set(config.special_ids) if i < n_real_vocab)
    random_tok = torch.randint(n_real_vocab - len(skip), x.shape, generator=gen)
    for i in skip:  # the r-th non-special id: r moved past every special id at or below it
        random_tok += random_tok >= i
    x = torch.where(chosen & (action < 0.8), config.mask_token_id, x)
    x = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_tok, x)
    return x, y


def make_batch(cfg, buf, config, n_real_vocab, sample):
    """(inputs, targets) of the windows `buf` for the run's phase: its row's batch function."""
    return PHASES[cfg.phase].batch(cfg, buf, config, n_real_vocab, sample)


def unigram_log_probs(counts, vocab_size):
    """log p(token) of the train stream's add-one smoothed unigram: the baseline every loss is
    read against."""
    padded = np.zeros(vocab_size)
    padded[:len(counts)] = counts[:vocab_size]
    smoothed = torch.from_numpy(padded) + 1
    return (smoothed / smoothed.sum()).log().float()


# -------------------------------------------------------------------------------------------------
# 5. Optimizer and schedule
def torch_weight_decay(cfg):
    """The paper's *fully decoupled* weight decay for torch's AdamW: FlexBERT applies
    p *= 1 - (lr_t / peak_lr) * wd, torch p *= 1 - lr_t * wd_torch, so wd_torch = wd / peak_lr
    (1e-5 / 2e-4 = 0.05)."""
    return cfg.weight_decay / cfg.learning_rate


def make_optimizer(model, cfg, fused=False):
    """AdamW, biases and norms not decayed. Frozen parameters are in the groups too (no grad:
    AdamW skips them), so the groups stay the same across phases and a decay can load the state of
    a run with other frozen layers."""
    decay = []
    no_decay = []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": torch_weight_decay(cfg)},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, fused=fused or None)


def set_hyperparameters(optimizer, cfg):
    """This run's AdamW settings on both groups (decayed, not decayed). Loading a checkpoint's
    state brings back the checkpoint's settings with its moments: a decay or a resume keeps the
    moments and runs with what its configuration, and so its record, says."""
    for group, decayed in zip(optimizer.param_groups, (True, False)):
        group["lr"] = cfg.learning_rate  # the schedule sets each step's (lr_at)
        group["betas"] = (cfg.beta1, cfg.beta2)
        group["eps"] = cfg.eps
        group["weight_decay"] = torch_weight_decay(cfg) if decayed else 0.0


def lr_at(cfg, tokens, total, step_tokens=0):
    """LR of the step that starts after `tokens` of the phase's `total` tokens (`step_tokens` per
    step): the phase's schedule (section 2: warmup_constant, one_minus_sqrt)."""
    return PHASES[cfg.phase].schedule(cfg, tokens, total, step_tokens)


# -------------------------------------------------------------------------------------------------
# 6. Training: where a phase starts, setup() builds the Run, train() is the loop.
# Where a phase starts and how long it runs. A Phase-1 run starts afresh (or from a general
# encoder's weights) and spends max_tokens. A continuing phase (the decay) keeps what its Phase 1
# ended with: the weights, AdamW's moments, the position in the data stream, and a budget that is
# a share of Phase 1's tokens. A resumed run continues exactly where its checkpoint stopped.
def steps_for(tokens, global_batch_size, seq_len):
    """Optimizer steps that spend `tokens` (the last one may pass them), one at least."""
    return max(1, math.ceil(tokens / (global_batch_size * seq_len)))


def phase_budget(cfg, phase1_tokens):
    """-> (the phase's tokens, its steps): decay_tokens or decay_ratio x Phase 1's for a
    continuing phase, else max_tokens. Every phase's budget below one optimizer step is refused."""
    budget = cfg.max_tokens
    knob = "--max_tokens"
    what = f"--max_tokens {budget}"
    if PHASES[cfg.phase].continues and cfg.decay_tokens:
        budget = cfg.decay_tokens
        knob = "--decay_tokens"
        what = f"--decay_tokens {budget}"
    elif PHASES[cfg.phase].continues:
        budget = int(cfg.decay_ratio * phase1_tokens)
        knob = "--decay_ratio"
        what = f"the decay's budget, --decay_ratio {cfg.decay_ratio} x {phase1_tokens} = {budget},"
    step_tokens = cfg.global_batch_size * cfg.seq_len
    if budget < step_tokens:
        fail(f"{what} is less than one optimizer step, global_batch_size x seq_len = "
             f"{cfg.global_batch_size} x {cfg.seq_len} = {step_tokens} tokens; raise {knob} or "
             "lower those")
    return budget, steps_for(budget, cfg.global_batch_size, cfg.seq_len)


def phase1_tokens_of(cfg, ckpt):
    """The Phase-1 tokens a run's budget follows from: a resumed run's saved count, a decay's
    Phase-1 checkpoint's tokens, else 0 (a Phase-1 run's budget is max_tokens)."""
    if cfg.init_from == "resume":
        return ckpt["phase1_tokens"]
    return ckpt["tokens"] if PHASES[cfg.phase].continues else 0


def start_point(cfg, ckpt, optimizer):
    """-> dict(start_step, start_tokens, sample0: windows already drawn, phase1_tokens, budget,
    total_steps). A resumed run continues exactly (AdamW state, position, RNG); a continuing
    phase (decay) keeps Phase 1's AdamW moments and starts on the first window Phase 1 did not
    see; other runs start afresh. Every AdamW setting is this run's (set_hyperparameters)."""
    step = 0
    tokens = 0
    sample0 = 0
    if cfg.init_from == "resume":
        optimizer.load_state_dict(ckpt["optimizer"])
        step = ckpt["step"]
        tokens = ckpt["tokens"]
        sample0 = ckpt["sample0"]
        torch.set_rng_state(ckpt["torch_rng"])
    elif PHASES[cfg.phase].continues:
        optimizer.load_state_dict(ckpt["optimizer"])  # keep Adam moments; the schedule resets
        sample0 = ckpt["sample0"] + ckpt["step"] * ckpt["config"]["global_batch_size"]  # new data
    set_hyperparameters(optimizer, cfg)
    phase1_tokens = phase1_tokens_of(cfg, ckpt)
    budget, total_steps = phase_budget(cfg, phase1_tokens)
    return dict(start_step=step, start_tokens=tokens, sample0=sample0, phase1_tokens=phase1_tokens,
                budget=budget, total_steps=total_steps)


@dataclass(frozen=True)
class Run:
    """What setup() builds for one phase; the loop's own state (step, tokens, the last loss) is in
    train()'s locals."""
    phase: Phase                 # the phase's row of PHASES: causal or not, targets, schedule
    rank: int                    # this process under torchrun (0 alone)
    world: int                   # the number of processes
    master: bool                 # rank 0: writes the files and prints
    device: torch.device
    config: Config               # the model's shape and special token ids
    raw_model: ModernBERT        # the model itself: evaluated, checkpointed, exported
    model: nn.Module             # what trains: raw_model, wrapped by DDP and torch.compile if on
    optimizer: torch.optim.Optimizer
    amp: object                  # bf16 autocast, or a null context in fp32
    frozen: list                 # the layers that do not train (--freeze_layers)
    n_real_vocab: int            # the tokenizer's vocabulary (the model's may be padded)
    windows: "Windows"           # the training windows
    val: "Windows"               # the validation windows
    unigram_logp: torch.Tensor   # log p of the train stream's unigram: every loss's baseline
    tokenizer: Optional[str]     # the data's tokenizer.json, exported with the model (or None)
    data_identity: dict          # digests of the data's meta.json and tokenizer.json
    peak_flops: Optional[float]  # the device's bf16 peak, for MFU (None: CPU, unknown GPU)
    accum: int                   # micro-batches per rank per optimizer step
    tokens_per_step: int         # tokens per optimizer step over all ranks
    start_step: int              # the step the run starts at (a resumed run's)
    start_tokens: int            # the phase's tokens before start_step
    sample0: int                 # windows drawn before this phase (a decay's: Phase 1's)
    phase1_tokens: int           # Phase 1's tokens (a decay's budget follows from them)
    budget: int                  # the phase's tokens
    total_steps: int             # the phase's optimizer steps
    stop: "StopRequest"          # SIGTERM/SIGINT, recorded for the loop to act on
    log: object = None           # rank 0: log.jsonl, open for appending (open_outputs)
    wandb: object = None         # rank 0 with --wandb_log: the W&B run


@torch.no_grad()
def evaluate(model, cfg, run):
    """The phase's loss, argmax accuracy and the train unigram's loss on fixed validation windows
    (masks seeded by the window index; a micro-batch per rank at least), averaged over ranks, by
    the raw (eager) model."""
    model.eval()
    windows = max(cfg.eval_tokens // cfg.seq_len, run.world * cfg.batch_size)
    n = max(1, min(run.val.n, windows))
    T = cfg.seq_len
    total = torch.zeros(4)  # sums of loss x k, acc x k, unigram x k, k (k = windows in the batch)
    for first in range(run.rank * cfg.batch_size, n, run.world * cfg.batch_size):
        k = min(cfg.batch_size, n - first)
        rows = [run.val.data[i * T:(i + 1) * T + 1].astype(np.int64)
                for i in range(first, first + k)]
        batch = prepare(cfg, run, torch.from_numpy(np.stack(rows)), 10**9 + first)
        with run.amp:
            loss, acc = model.score(batch.x, batch.y_dev, causal=run.phase.causal,
                                    doc_ids=batch.doc_ids, spans=batch.spans)
        unigram = -run.unigram_logp[batch.y[batch.y != IGNORE]].mean()
        total += torch.tensor([loss.item() * k, acc.item() * k, unigram.item() * k, k])
    if run.world > 1:
        dist.all_reduce(total)
    model.train()
    return dict(zip(("loss", "acc", "unigram"), (total[:3] / total[3]).tolist()))


def vocabulary_checked(data_dir, meta, config, train_data, val_data):
    """The train stream's token counts (the unigram baseline), once every id of train.bin and
    val.bin is checked to be in the vocabulary: train's from the counts data/prepare.py wrote,
    val's read in chunks."""
    counts = train_counts(data_dir, meta, train_data)
    vocab = min(config.vocab_size, meta["vocab_size"])
    for split, largest in (("train", len(counts) - 1), ("val", largest_id(val_data))):
        if largest >= vocab:
            fail(f"token id {largest} in {data_dir}/{split}.bin is outside the vocabulary "
                 f"({meta['vocab_size']}); the data was prepared with another tokenizer: re-run "
                 "prepare.py")
    return counts


def setup(cfg, ckpt):
    """The Run of a resolved configuration and the checkpoint it starts from (None: scratch, HF):
    the model (frozen layers, backend, DDP, compile), AdamW, the windows, where it starts."""
    rank, world, device = setup_distributed(cfg)
    torch.manual_seed(cfg.seed)
    meta, train_data = load_data(cfg.data_dir, "train")
    _, val_data = load_data(cfg.data_dir, "val")
    raw_model = build_model(cfg, meta, ckpt)
    config = raw_model.config
    counts = vocabulary_checked(cfg.data_dir, meta, config, train_data, val_data)
    frozen = parse_layers(cfg.freeze_layers, config.num_hidden_layers)
    for i in frozen:  # the paper's freeze interventions: these layers keep their weights
        raw_model.model.layers[i].requires_grad_(False)
    raw_model.to(device)
    use_bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda")
    raw_model.model.attn_backend = attention_backend(cfg.attn_backend, device, use_bf16,
                                                     config.attention_dropout, rank == 0)
    optimizer = make_optimizer(raw_model, cfg, fused=device.type == "cuda")
    start = start_point(cfg, ckpt, optimizer)
    if cfg.global_batch_size % (cfg.batch_size * world):
        fail(f"global_batch_size {cfg.global_batch_size} is not a multiple of batch_size x ranks "
             f"= {cfg.batch_size * world}; change --global_batch_size or --batch_size")
    model = raw_model
    if world > 1:
        model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.compile:  # DDP first, then compile (as PyTorch documents)
        model = torch.compile(model)
    tokenizer = data_tokenizer(cfg.data_dir, meta)
    if tokenizer:  # read now, not when the export needs it at the end of the run
        hf_tokenizer_files(config, tokenizer)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    run = Run(
        **start, phase=PHASES[cfg.phase], rank=rank, world=world, master=rank == 0,
        device=device, config=config, raw_model=raw_model, model=model, optimizer=optimizer,
        amp=amp, frozen=frozen, n_real_vocab=meta["vocab_size"],
        windows=Windows(train_data, cfg.seq_len, cfg.data_seed),
        val=Windows(val_data, cfg.seq_len, cfg.data_seed),
        unigram_logp=unigram_log_probs(counts, config.vocab_size), tokenizer=tokenizer,
        data_identity=data_identity(cfg.data_dir),
        peak_flops=device_peak_flops(device),
        accum=cfg.global_batch_size // (cfg.batch_size * world),
        tokens_per_step=cfg.global_batch_size * cfg.seq_len, stop=StopRequest(world))
    return replace(run, **open_outputs(cfg, run))


def train(cfg, ckpt=None):
    """Train one phase: an optimizer step per iteration until the phase's token budget is spent."""
    run = setup(cfg, ckpt)
    model = run.model
    optimizer = run.optimizer
    step = run.start_step
    tokens = run.start_tokens
    bar = tqdm(total=run.total_steps, initial=step, disable=not (run.master and cfg.progress),
               dynamic_ncols=True)
    if continues_an_encoder(cfg):  # θ0 on the domain text before continued pretraining
        score_start(cfg, run, bar)
    model.train()
    clock = Throughput(tokens)
    batches = micro_batches(cfg, run, step)
    while step < run.total_steps:
        # the schedule's learning rate for this step
        lr = lr_at(cfg, tokens, run.budget, run.tokens_per_step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # forward and backward of this rank's micro-batches; DDP syncs gradients on the last one
        loss = torch.zeros(1, device=run.device)
        for micro in range(run.accum):
            batch = next(batches)
            sync = run.world == 1 or micro == run.accum - 1
            with nullcontext() if sync else model.no_sync():
                with run.amp:
                    micro_loss = model(batch.x, batch.y_dev, run.phase.causal,
                                       doc_ids=batch.doc_ids, spans=batch.spans,
                                       capacity=batch.capacity)[1]
                (micro_loss / run.accum).backward()
            loss += micro_loss.detach().float() / run.accum
            clock.flops += batch.flops
        # the loss averaged over ranks, kept on the device (no host sync per step)
        if run.world > 1:
            dist.all_reduce(loss)
            loss /= run.world
        # the optimizer step
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens += run.tokens_per_step
        bar.update(1)
        last_step = step == run.total_steps
        # every log_interval steps: training loss, lr, speed and MFU
        record = None
        if step % cfg.log_interval == 0 or last_step:
            record = dict(step=step, tokens=tokens, loss=round(check_finite(cfg, loss, step), 5),
                          lr=lr, **clock.read(tokens, run.peak_flops))
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}",
                            tok_s=f"{record['tok_per_s']:,}")
        # every eval_interval steps: the validation loss, next to the unigram's on the same targets
        if step % cfg.eval_interval == 0 or last_step:
            record = {**(record or dict(step=step, tokens=tokens, lr=lr)),
                      **validate(cfg, run, step, bar)}
        if record and run.master:
            write_record(run, record)
        # every ckpt_interval steps and at the end: a checkpoint (the HF export follows the loop)
        if step % cfg.ckpt_interval == 0 or last_step:
            save_run(cfg, run, step, tokens, loss)
        # SIGTERM/SIGINT on any rank: all ranks checkpoint and stop at this step (at the last
        # step the run is finished, not stopped: its checkpoint is saved, its export follows)
        if run.stop.requested() and not last_step:
            save_run(cfg, run, step, tokens, loss)
            print_stopped(cfg, run, step)
            break
    bar.close()
    finished = step == run.total_steps
    if finished and run.master:  # the HF export, also of a finished run whose export was cut
        finish(cfg, run, tokens, trained=step > run.start_step)
    if run.world > 1:
        dist.destroy_process_group()
    if run.master and finished:  # after the ranks have parted: no rank waits
        print_samples(cfg, run)
    return run.raw_model


def validate(cfg, run, step, bar):
    """The validation fields of the step's record; rank 0 prints them beside the unigram's loss."""
    ev = evaluate(run.raw_model, cfg, run)
    if run.master:
        bar.write(f"step {step}: val {cfg.phase} loss {ev['loss']:.4f} (unigram "
                  f"{ev['unigram']:.4f}), accuracy {ev['acc']:.4f}")
    return {f"val_{k}": round(v, 5) for k, v in ev.items()}


def continues_an_encoder(cfg):
    """A Phase-1 run that starts from trained weights (θ0, ModernBERT-base), at its first step."""
    return cfg.init_from not in ("scratch", "resume") and not PHASES[cfg.phase].continues


def score_start(cfg, run, bar):
    """The encoder a Phase-1 run continues, scored on this data before its first step, as every
    twin is scored at the end of its decay: by the continuing phase's objective (MLM at 15%), on
    the same validation windows and masks. Continued pretraining is worth what it gains on this."""
    name = next(name for name, row in PHASES.items() if row.continues)
    ev = evaluate(run.raw_model, replace(cfg, phase=name), replace(run, phase=PHASES[name]))
    if run.master:
        bar.write(f"step 0: {cfg.init_from} on this data, before {cfg.phase}: val {name} loss "
                  f"{ev['loss']:.4f} (unigram {ev['unigram']:.4f}), accuracy {ev['acc']:.4f}")
        write_record(run, dict(step=0, tokens=0, **{f"start_val_{k}": round(v, 5)
                                                     for k, v in ev.items()}))


@torch.no_grad()
def generate(model, ids, n_new):
    """Greedy continuation of the token ids `ids`, in causal mode -> the n_new ids that follow."""
    x = torch.tensor([ids], device=next(model.parameters()).device)
    for _ in range(n_new):
        x = torch.cat([x, model(x, causal=True)[0][:, -1:].argmax(-1)], dim=1)
    return x[0, len(ids):].tolist()


@torch.no_grad()
def fill_masks(model, ids, positions, k=3):
    """`ids` with [MASK] at `positions`, bidirectional -> the model's top-k ids at each position."""
    x = torch.tensor([ids], device=next(model.parameters()).device)
    x[0, positions] = model.config.mask_token_id
    return model(x)[0][0, positions].topk(k).indices.tolist()


def print_samples(cfg, run, n=2, length=32):
    """The end of a phase made visible on the first n validation documents: a greedy causal
    continuation after clm, the top-3 fills of three masks after mlm and decay. fp32, sdpa, no
    random draws; ids without a tokenizer."""
    tokenizer = load_tokenizer(run.tokenizer) if run.tokenizer else None

    def piece(i):  # a token's text, or its id without a tokenizer
        return tokenizer.decode([i]) if tokenizer else f" {i}"

    model = run.raw_model.eval()
    backend = model.model.attn_backend
    model.model.attn_backend = "sdpa"
    stream = np.asarray(run.val.data[:100_000]).astype(np.int64)
    documents = np.split(stream, np.flatnonzero(stream == run.config.sep_token_id) + 1)
    for ids in [d[:length].tolist() for d in documents if len(d) >= 12][:n]:  # [CLS] doc ([SEP])
        if run.phase.causal:
            prompt = "".join(map(piece, ids[1:9])).strip()
            continuation = "".join(map(piece, generate(model, ids[:9], 16))).strip()
            print(f"sample ({cfg.phase}, greedy): {prompt!r} -> {continuation!r}")
            continue
        positions = [1 + (j + 1) * (len(ids) - 2) // 4 for j in range(3)]
        tops = fill_masks(model, ids, positions)
        fills = ", ".join(f"{'/'.join(piece(t).strip() for t in top)} ({piece(ids[p]).strip()})"
                          for p, top in zip(positions, tops))
        # a [MASK] keeps the space before the word it hides
        shown = "".join(("[MASK]", " [MASK]")[piece(i)[:1] == " "] if p in positions else piece(i)
                        for p, i in enumerate(ids))
        print(f"sample ({cfg.phase}): {shown.strip()}\n  top-3 fills (true token): {fills}")
    model.model.attn_backend = backend
    model.train()


# -------------------------------------------------------------------------------------------------
# 7. Plumbing (not the method): errors and files, the Hugging Face format, FLOPs, the GPU path,
# distributed, the command line, then checkpoints with every resume and inheritance rule, and main.
def fail(message):
    """A user's mistake: `error: <what>; <how to fix it>` on one line, exit status 1, no
    traceback. Under torchrun every rank meets the same bad input: rank 0 alone prints it; the
    others exit 1 quietly a second later, so that rank 0 has printed before torchrun (which stops
    the other workers when one exits) stops it, and is named the root cause."""
    rank = int(os.environ.get("RANK", "0"))
    time.sleep(1 if rank else 0)
    raise SystemExit(1 if rank else f"error: {message}")


def os_reason(error):
    """An OSError in a few words: 'Not a directory', 'Permission denied', 'No space left'."""
    return error.strerror or type(error).__name__


def make_dirs(path):
    """os.makedirs, where a file in the way or a missing permission is one line naming the path."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        fail(f"cannot create the directory {path} ({os_reason(e)}); choose another path, or "
             "make it writable")


def atomic_write(path, write_fn):
    """write_fn(a temp file opened "wb"), fsync, rename: never a half-written file, a crash keeps
    the previous one. A filesystem error is one line naming the path."""
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        fail(f"cannot write {path} ({os_reason(e)}); free space, make its directory writable, "
             "or choose another path")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_json(path, keys=(), fix="re-create it"):
    """A JSON object from `path` that has `keys`; anything else is a one-line error."""
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read())
    except ValueError as e:  # UnicodeDecodeError included
        fail(f"{path} is not valid JSON ({e}); {fix}")
    if not isinstance(d, dict):
        fail(f"{path} holds a JSON {type(d).__name__}, not an object; {fix}")
    if missing := [k for k in keys if k not in d]:
        fail(f"{path} lacks {', '.join(missing)}; {fix}")
    return d


PREPARE = "re-run data/prepare.py"  # the fix of a dataset that is not as meta.json says


def check_meta(meta, path):
    """meta.json's fields of the types data/prepare.py writes; anything else is one line."""
    def integer(k):
        return isinstance(meta.get(k), int) and not isinstance(meta.get(k), bool)

    if not integer("vocab_size") or meta["vocab_size"] < 1:
        fail(f"{path} has vocab_size {meta['vocab_size']!r}, not a positive integer; {PREPARE}")
    if bad := [k for k in SPECIAL_IDS if not integer(k) or not 0 <= meta[k] < meta["vocab_size"]]:
        fail(f"{path} has {bad[0]} {meta[bad[0]]!r}, not an id below vocab_size "
             f"{meta['vocab_size']}; {PREPARE}")
    if meta["dtype"] not in ("uint16", "uint32"):
        fail(f"{path} has dtype {meta['dtype']!r}, not uint16 or uint32; {PREPARE}")
    if np.iinfo(meta["dtype"]).max < meta["vocab_size"] - 1:
        fail(f"{path} says {meta['dtype']} for a vocabulary of {meta['vocab_size']}; {PREPARE}")
    counts = [k for k in ("n_train_tokens", "n_val_tokens", "max_train_token_id") if k in meta]
    if bad := [k for k in counts if not integer(k) or meta[k] < 0]:
        fail(f"{path} has {bad[0]} {meta[bad[0]]!r}, not a count; {PREPARE}")
    if bad := [k for k in ("tokenizer", "train_counts") if not isinstance(meta.get(k, ""), str)]:
        fail(f"{path} has {bad[0]} {meta[bad[0]]!r}, not a file name; {PREPARE}")
    return meta


def data_tokenizer(data_dir, meta):
    """The data's tokenizer.json (None without one), checked against meta.json: the same
    vocabulary size, and its special tokens at meta.json's ids."""
    path = os.path.join(data_dir, meta.get("tokenizer", "tokenizer.json"))
    if not os.path.exists(path):
        return None
    tokenizer = load_tokenizer(path)
    fix = f"{PREPARE} (its meta.json and tokenizer.json are written together)"
    if tokenizer.get_vocab_size() != meta["vocab_size"]:
        fail(f"{path} has {tokenizer.get_vocab_size()} tokens but {data_dir}/meta.json says "
             f"vocab_size {meta['vocab_size']}; {fix}")
    for key in SPECIAL_IDS:
        name = f"[{key.split('_')[0].upper()}]"
        at = tokenizer.token_to_id(name)
        if at is not None and at != meta[key]:
            fail(f"{path} has {name} at id {at} but {data_dir}/meta.json says {key} "
                 f"{meta[key]}; {fix}")
    return path


def data_identity(data_dir):
    """What identifies a dataset, recorded in each checkpoint: the digests of its meta.json (its
    counts, source and dtype) and of its tokenizer; never its token files (O(corpus))."""
    meta = read_json(os.path.join(data_dir, "meta.json"), fix=PREPARE)
    identity = {}
    for name in ("meta.json", meta.get("tokenizer", "tokenizer.json")):
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                identity[name] = hashlib.sha256(f.read()).hexdigest()[:16]
    return identity


def largest_id(data, chunk=1 << 24):
    """The largest token id of a token file, read in chunks: memory flat in its size."""
    return max(int(np.asarray(data[s:s + chunk]).max()) for s in range(0, len(data), chunk))


def train_counts(data_dir, meta, train_data):
    """How often each token id occurs in train.bin (up to the largest id): prepare.py counts the
    whole stream while writing it, so start-up reads no tokens; data it prepared before it did
    are counted from their first 50M tokens."""
    if "train_counts" not in meta:
        return np.bincount(np.asarray(train_data[:50_000_000]))
    path = os.path.join(data_dir, meta["train_counts"])
    try:
        return np.trim_zeros(np.load(path), "b")
    except (OSError, ValueError, EOFError) as e:
        fail(f"{path} cannot be read ({type(e).__name__}); re-run data/prepare.py")


def load_tokenizer(path):
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises its own exception types
        fail(f"{path} is not a tokenizer.json the tokenizers library can load "
             f"({str(e).splitlines()[0][:80]}); use the one data/prepare.py wrote")


# The Hugging Face format: model.safetensors (an 8-byte header length, a JSON header, raw
# little-endian tensor bytes), the released models' config.json fields, and the tokenizer files
# AutoTokenizer and pipeline("fill-mask") read. Written here, not imported: the saved copy of
# this file runs alone.
ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "F64": torch.float64, "I64": torch.int64, "I32": torch.int32}
# ModernBERT's released config.json (answerdotai/ModernBERT-base, -large): the fields detour's
# Config does not hold. An export carries them with these values (transformers' own default
# pooling is "cls", the released models' "mean"), or with an HF source's.
RELEASED = dict(hidden_activation="gelu", classifier_pooling="mean", classifier_dropout=0.0,
                classifier_activation="gelu", classifier_bias=False, attention_bias=False,
                mlp_bias=False, norm_bias=False, decoder_bias=True,
                deterministic_flash_attn=False, gradient_checkpointing=False,
                initializer_cutoff_factor=2.0, position_embedding_type="absolute",
                reference_compile=True, sparse_prediction=False, sparse_pred_ignore_index=-100)
# A source's fields that describe its file, not the model, or that the export derives.
NOT_KEPT = ("architectures", "model_type", "rope_parameters", "transformers_version",
            "torch_dtype", "dtype")


def read_safetensors(path, fix="re-export or re-download it"):
    """A .safetensors file -> {name: tensor}; a corrupt or truncated file is one line."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
    except (ValueError, UnicodeDecodeError):
        fail(f"{path} is not a safetensors file (corrupt header); {fix}")
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = (8 + n + offset for offset in info["data_offsets"])
        if end > len(raw) or info["dtype"] not in ST_DTYPES:
            fail(f"{path} is truncated or corrupt at tensor {name!r}; {fix}")
        tensor = torch.frombuffer(bytearray(raw[start:end]), dtype=ST_DTYPES[info["dtype"]])
        tensors[name] = tensor.reshape(info["shape"])
    return tensors


def safetensors_chunks(tensors):
    """{name: tensor} -> the file's byte strings in order (header, then each tensor's bytes)."""
    names = {v: k for k, v in ST_DTYPES.items()}
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    blobs = []
    for name, t in tensors.items():
        b = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # align tensor data to 8 bytes
    return [len(h).to_bytes(8, "little"), h, *blobs]


def config_from_hf(d):
    """Config's fields (a dict) from an HF config.json dict, older (global_rope_theta, ...) or
    newer (layer_types, rope_parameters). The source's other fields are kept, and exported as
    they came (its classifier_pooling, id2label, ...)."""
    if d.get("model_type") != "modernbert":
        fail(f"config.json has model_type={d.get('model_type')!r}, not 'modernbert'; "
             "detour loads ModernBERT checkpoints only")
    for bad in ("norm_bias", "attention_bias", "mlp_bias", "classifier_bias"):
        if d.get(bad):
            fail(f"config.json sets {bad}=true; detour's ModernBERT has no biases there")
    if d.get("hidden_activation", "gelu") != "gelu":
        fail("config.json hidden_activation is not 'gelu'; unsupported")
    own = [f.name for f in fields(Config)]
    kw = {name: d[name] for name in own if name in d and d[name] is not None}
    kw["hf_fields"] = {k: v for k, v in d.items()
                       if k not in NOT_KEPT + tuple(own) and not k.startswith("_")}
    for kind, key in (("full_attention", "global_rope_theta"),
                      ("sliding_attention", "local_rope_theta")):
        if kind in (d.get("rope_parameters") or {}):
            kw[key] = d["rope_parameters"][kind].get("rope_theta", getattr(Config, key))
    return kw


def hf_config_json(config):
    """config.json of a model: the released fields, under an HF source's kept ones, under the
    model's own; rope_parameters carries both RoPE thetas in the newer form, the older keys
    stay too."""
    own = {k: v for k, v in asdict(config).items() if k != "hf_fields"}
    rope = {kind: {"rope_type": "default", "rope_theta": own[key]} for kind, key in
            (("full_attention", "global_rope_theta"), ("sliding_attention", "local_rope_theta"))}
    return {**RELEASED, **config.hf_fields, **own, "architectures": ["ModernBertForMaskedLM"],
            "model_type": "modernbert", "tie_word_embeddings": True,
            "bos_token_id": own["cls_token_id"], "eos_token_id": own["sep_token_id"],
            "layer_norm_eps": own["norm_eps"], "rope_parameters": rope}


def load_hf(directory):
    """An HF ModernBERT directory (config.json + model.safetensors) -> ModernBERT."""
    cfg_path = os.path.join(directory, "config.json")
    st_path = os.path.join(directory, "model.safetensors")
    for p in (cfg_path, st_path):
        if not os.path.exists(p):
            fail(f"{p} not found; point at a directory with config.json and model.safetensors")
    fix = "re-export or re-download it"
    d = read_json(cfg_path, fix=fix)
    try:
        config = config_from_hf(d)
    except (AttributeError, TypeError, KeyError) as e:  # a field of another shape than HF's
        fail(f"{cfg_path} is not a ModernBERT config.json ({type(e).__name__}: {e}); {fix}")
    sd = read_safetensors(st_path)
    sd.setdefault("decoder.weight", sd.get("model.embeddings.tok_embeddings.weight"))  # tied
    return model_of(f"{cfg_path} with {st_path}", config, sd, fix)


def save_hf(model, directory, tokenizer_path=None):
    """config.json, model.safetensors (and the tokenizer's files) for AutoModelForMaskedLM and
    pipeline("fill-mask"), whole or absent: written into a hidden directory beside `directory`,
    then renamed into place (replace_directory), so that a kill at any moment leaves the earlier
    state or the complete export, never a part of it. Other files there are kept."""
    model = getattr(model, "_orig_mod", model)
    sd = {k: v.float() if v.is_floating_point() else v
          for k, v in model.state_dict().items() if k != "decoder.weight"}
    chunks = safetensors_chunks(sd)
    files = {"config.json": json.dumps(hf_config_json(model.config), indent=2)}
    if tokenizer_path:
        files.update(hf_tokenizer_files(model.config, tokenizer_path))
    path = os.path.normpath(directory)
    make_dirs(os.path.dirname(path) or ".")  # an error names the directory asked for
    partial = hidden(path, "partial")
    remove_tree(partial)  # what a killed export left
    make_dirs(partial)
    atomic_write(os.path.join(partial, "model.safetensors"), lambda f: [*map(f.write, chunks)])
    for name, text in files.items():
        atomic_write(os.path.join(partial, name), lambda f: f.write(text.encode()))
    carry_others(path, partial)
    replace_directory(partial, path)


def carry_others(path, partial):
    """The files of an earlier `path` that the new export does not write (a tokenizer.json put
    there by hand, a README) go into it too: an export replaces its own files, not the rest."""
    if not os.path.isdir(path):
        return
    for name in sorted(set(os.listdir(path)) - set(os.listdir(partial))):
        source = os.path.join(path, name)
        try:
            if os.path.isdir(source):
                shutil.copytree(source, os.path.join(partial, name), copy_function=os.link)
            else:
                os.link(source, os.path.join(partial, name))  # a hard link: no copy of the bytes
        except OSError as e:
            fail(f"cannot keep {source} in the new export ({os_reason(e)}); move it out of {path}")


def hidden(path, tag):
    """The hidden name beside `path` for an export in the making (partial) or the one it
    replaces (old): `.hf.partial`, `.hf.old`."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{tag}")


def remove_tree(path):
    """Remove a directory (or a file) if it is there; a filesystem error is one line."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
    except OSError as e:
        fail(f"cannot remove {path} ({os_reason(e)}); make its directory writable")


def replace_directory(new, path):
    """Put the complete directory `new` at `path`: an earlier one is renamed aside first and
    removed after, so `path` is either the earlier directory or the new one (absent only between
    two renames)."""
    old = hidden(path, "old")
    remove_tree(old)
    try:
        if os.path.lexists(path):
            os.replace(path, old)
        os.replace(new, path)
    except OSError as e:
        fail(f"cannot put the export in place at {path} ({os_reason(e)}); make its directory "
             "writable")
    remove_tree(old)


def hf_dir(path):
    """An HF directory (config.json, model.safetensors, tokenizer.json) or a detour out_dir with
    one in hf/ -> that directory."""
    for d in (path, os.path.join(path, "hf")):
        if os.path.exists(os.path.join(d, "config.json")):
            return d
    if os.path.exists(os.path.join(path, "ckpt.pt")):
        fail(f"{path} has ckpt.pt but no hf/ export; detour.py writes hf/ when a run finishes")
    fail(f"{path} is not a checkpoint: no config.json there or in {os.path.join(path, 'hf')}")


def load_encoder(path):
    """A checkpoint (hf_dir) -> (ModernBERT, Tokenizer), checked against each other: what
    finetune.py and the analyses fine-tune and compare."""
    tok_path = os.path.join(hf_dir(path), "tokenizer.json")
    if not os.path.exists(tok_path):
        fail(f"{tok_path} not found; the checkpoint needs its tokenizer "
             "(detour.save_hf(..., tokenizer_path=...))")
    model = load_hf(os.path.dirname(tok_path))
    tokenizer = load_tokenizer(tok_path)
    config = model.config
    if tokenizer.get_vocab_size() > config.vocab_size:
        fail(f"{tok_path} has {tokenizer.get_vocab_size()} tokens but the model only "
             f"{config.vocab_size}; wrong tokenizer?")
    for name, want in (("[CLS]", config.cls_token_id), ("[SEP]", config.sep_token_id),
                       ("[PAD]", config.pad_token_id)):
        if tokenizer.token_to_id(name) != want:
            fail(f"{tok_path} maps {name} to {tokenizer.token_to_id(name)} but the model's config "
                 f"says {want}; wrong tokenizer?")
    return model, tokenizer


def hf_tokenizer_files(config, tokenizer_path):
    """{file name: text} of the data's tokenizer for AutoTokenizer and pipeline("fill-mask"):
    [MASK] takes the space before it; [CLS] a [SEP] is added, as prepare.py stores documents,
    unless the tokenizer has a post-processor of its own. A bad file is one line."""
    load_tokenizer(tokenizer_path)  # a file the tokenizers library cannot read is a one-line error
    d = read_json(tokenizer_path, ("added_tokens",), "use the tokenizer.json data/prepare.py wrote")
    names = {t["id"]: t for t in d["added_tokens"]}
    special = {f"{k}_token": names[i]["content"] for k in ("cls", "sep", "pad", "mask", "unk")
               if (i := getattr(config, f"{k}_token_id")) in names}
    names.get(config.mask_token_id, {})["lstrip"] = True
    tok = Tokenizer.from_str(json.dumps(d))
    cls = special.get("cls_token")
    sep = special.get("sep_token")
    if tok.post_processor is None and cls and sep:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, config.cls_token_id), (sep, config.sep_token_id)])
    hf_config = dict(tokenizer_class="PreTrainedTokenizerFast",
                     model_max_length=config.max_position_embeddings,
                     clean_up_tokenization_spaces=False, **special)
    return {"tokenizer.json": tok.to_str(pretty=True),
            "tokenizer_config.json": json.dumps(hf_config, indent=2),
            "special_tokens_map.json": json.dumps(special, indent=2)}


# Model FLOPs, for MFU
def keys_within(n, reach):
    """Keys within `reach` positions on one side of each query of an n-token document, summed
    (reach -1: all of them)."""
    return float(np.minimum(np.arange(n), n if reach < 0 else reach).sum())


def attention_pairs(lengths, window=None, causal=False):
    """The query-key pairs attention_window allows in documents of these lengths: each query sees
    itself, up to `left` keys before it and up to `right` after it."""
    left, right = attention_window(causal, window)
    before = sum(keys_within(n, left) for n in lengths)
    after = sum(keys_within(n, right) for n in lengths)
    return float(np.sum(lengths)) + before + after


def model_flops(config, lengths, causal=False, predicted=None):
    """FLOPs of a training step (3 x forward, a multiply-add 2) on documents of these lengths. Per
    token and layer: Wqkv 3d^2, Wo d^2, Wi 2dI, Wo Id; 2d per allowed pair; the head d^2 + dV on
    `predicted` tokens (default all)."""
    d = config.hidden_size
    tokens = float(np.sum(lengths))
    windows = {"full_attention": None, "sliding_attention": config.local_attention // 2}
    dense = tokens * 2 * (4 * d * d + 3 * d * config.intermediate_size)
    forward = sum(dense + 4 * d * attention_pairs(lengths, windows[kind], causal)
                  for kind in config.layer_types)
    forward += (tokens if predicted is None else predicted) * 2 * (d * d + d * config.vocab_size)
    return 3 * forward


class Throughput:
    """Tokens per second and MFU since the run started (FLOPs on allowed pairs / bf16 peak)."""

    def __init__(self, tokens):
        self.t0 = time.time()
        self.tokens0 = tokens
        self.flops = 0.0  # the model FLOPs of the steps since t0 (the loop adds each batch's)

    def read(self, tokens, peak_flops):
        seconds = max(time.time() - self.t0, 1e-9)
        speed = {"tok_per_s": round((tokens - self.tokens0) / seconds)}
        if peak_flops:
            speed["mfu"] = round(self.flops / seconds / peak_flops, 4)
        return speed


# The GPU path: the attention backend decided once, batches prepared ahead, one compiled shape,
# no syncs.
def attention_backend(wanted, device, bf16, dropout, warn=True):
    """The backend, decided at start-up (never mid-run): varlen where it can run, else sdpa
    (quiet for auto on CPU)."""
    if wanted == "sdpa":
        return "sdpa"
    cuda = torch.device(device).type == "cuda"
    new_enough = not cuda or torch.cuda.get_device_capability(device) >= (8, 0)
    checks = [("a CUDA device", cuda), ("bf16", bf16), ("attention_dropout 0", dropout == 0),
              ("sm80+", new_enough),
              ("torch >= 2.10", importlib.util.find_spec("torch.nn.attention.varlen"))]
    needs = [need for need, ok in checks if not ok]
    if not needs:
        return "varlen"
    if warn and (cuda or wanted == "varlen"):
        print(f"warning: attn_backend={wanted} needs {', '.join(needs)}; using sdpa",
              file=sys.stderr)
    return "sdpa"


def document_spans(key):
    """The varlen kernel's sequences in (B, T) rows -> (int32 cu_seqlens into the B x T tokens,
    longest): a span starts at each row start (a row end cuts a document) and where `key` (the
    document id) changes."""
    row_start = torch.ones_like(key[:, :1], dtype=torch.bool)
    start = torch.cat([row_start, key[:, 1:] != key[:, :-1]], 1)
    cu = torch.cat([start.view(-1).nonzero().view(-1), torch.tensor([key.numel()])]).int()
    return cu, int(cu.diff().max())


def varlen_attention(q, k, v, spans, window, causal):
    """Attention within each span by FlashAttention's variable-length kernel on (B, H, T, D): no
    pair across documents nor (causal) above the diagonal is computed; its window_size is
    attention_window's."""
    from torch.nn.attention.varlen import varlen_attn  # torch >= 2.10: attention_backend checks
    B, H, T, D = q.shape
    cu, longest = spans
    flat = [x.transpose(1, 2).reshape(B * T, H, D) for x in (q, k, v)]
    y = varlen_attn(*flat, cu, cu, longest, longest, window_size=attention_window(causal, window))
    return y.view(B, T, H, D).transpose(1, 2)


def head_capacity(n, rate):
    """The compiled head's fixed slots for n positions predicted at `rate`: all of them for CLM
    (rate 1); for MLM the rate's count + 8 standard deviations + 8, so that a batch above it (one
    compile more) is never seen."""
    return min(n, math.ceil(rate * n + 8 * math.sqrt(n * rate * (1 - rate))) + 8)


class Batch(NamedTuple):
    """A micro-batch as the model takes it (prepare)."""
    x: torch.Tensor                  # input ids (B, T), on the device
    y: torch.Tensor                  # targets (B, T), IGNORE = no loss; on the CPU (the unigram)
    y_dev: torch.Tensor              # the targets on the device
    doc_ids: Optional[torch.Tensor]  # document index per token for the masks (sdpa, doc_mask)
    spans: Optional[tuple]           # (cu_seqlens, longest) for the varlen kernel
    capacity: Optional[int]          # the compiled head's slots (--compile), else None
    flops: float                     # the model FLOPs of its forward and backward, for MFU


def prepare(cfg, run, buf, sample):
    """The windows `buf` as a Batch (masks seeded by `sample`), built on the CPU and copied
    without blocking. Under --compile the head's capacity is one per phase (head_capacity); a
    batch above it takes all positions."""
    x, y = make_batch(cfg, buf, run.config, run.n_real_vocab, sample)
    doc_ids = document_ids(x, run.config.sep_token_id) if cfg.doc_mask else torch.zeros_like(x)
    cu, longest = document_spans(doc_ids)
    n = int((y != IGNORE).sum())
    cap = head_capacity(y.numel(), masking_rate(cfg))
    varlen = run.raw_model.model.attn_backend == "varlen"
    pin = run.device.type == "cuda"

    def to_device(t):
        return (t.pin_memory() if pin else t).to(run.device, non_blocking=True)

    capacity = None
    if cfg.compile:
        capacity = cap if n <= cap else y.numel()
    return Batch(x=to_device(x), y=y, y_dev=to_device(y),
                 doc_ids=to_device(doc_ids) if cfg.doc_mask and not varlen else None,
                 spans=(to_device(cu), longest) if varlen else None, capacity=capacity,
                 flops=model_flops(run.config, cu.diff().numpy(), run.phase.causal, n))


def micro_batches(cfg, run, step):
    """This rank's micro-batches from `step` on, each prepared on a worker thread while the one
    before trains."""
    firsts = (run.sample0 + s * cfg.global_batch_size + (m * run.world + run.rank) * cfg.batch_size
              for s in itertools.count(step) for m in range(run.accum))

    def load(first):
        return prepare(cfg, run, run.windows.rows(first, cfg.batch_size), first)

    with concurrent.futures.ThreadPoolExecutor(1) as worker:
        ahead = worker.submit(load, next(firsts))
        for first in firsts:
            current = ahead.result()
            ahead = worker.submit(load, first)
            yield current


def check_finite(cfg, loss, step):
    """The last step's loss, read from the device; a diverged run stops here, before it logs or
    checkpoints."""
    if not math.isfinite(value := loss.item()):
        fail(f"loss is {value} at step {step}; the last good checkpoint is kept in {cfg.out_dir}. "
             "Try a lower --learning_rate or --grad_clip 1.0")
    return value


# Dense (no sparsity) bf16 tensor peak in FLOP/s from the vendors' data sheets; a key matches
# when all its words are words of torch.cuda.get_device_name(). The first match wins.
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12, "H100": 989e12,
                   "H200": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12,
                   "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10": 125e12, "A6000": 155e12,
                   "4090": 165e12, "3090": 71e12, "MI300X": 1307e12}


def device_peak_flops(device):
    """bf16 peak FLOP/s of `device` (for MFU), or None on CPU and on GPUs not in the table."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    words = torch.cuda.get_device_name(device).replace("-", " ").split()
    matches = (flops for key, flops in PEAK_BF16_FLOPS.items()
               if all(w in words for w in key.split()))
    return next(matches, None)


# Distributed: torchrun, and stopping together
def setup_distributed(cfg):
    """-> (rank, world, device), from torchrun's RANK/WORLD_SIZE/LOCAL_RANK (multi-node by
    torchrun's flags)."""
    dev = cfg.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1, torch.device(dev)
    if missing := [k for k in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]:
        fail(f"RANK and WORLD_SIZE are set but {', '.join(missing)} not; launch with torchrun, "
             "or unset RANK and WORLD_SIZE to run one process")
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    if dev.startswith("cuda"):
        torch.cuda.set_device(local)
        dev = f"cuda:{local}"
    # Rendezvous keys are namespaced by torchrun's restart count: after a worker dies and torchrun
    # --max-restarts restarts the group, stale addresses of the dead group must not be read.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_store)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # NCCL reduces CUDA tensors only; the evaluation and stop-flag all_reduces are on CPU tensors
    # (the loss stays on the device), so a CUDA run also gets gloo for those.
    backend = "cpu:gloo,cuda:nccl" if dev.startswith("cuda") else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world,
                            store=dist.PrefixStore(f"detour/attempt{attempt}", store))
    return rank, world, torch.device(dev)


class StopRequest:
    """SIGTERM or SIGINT (cluster preemption, Ctrl-C), recorded by the handler and acted on by the
    loop at the end of a step: every rank checkpoints and stops at the same step."""

    def __init__(self, world):
        self.world = world
        self.signal = None  # the signal received (any rank's, once requested() has agreed)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handle)

    def handle(self, signum, frame):
        self.signal = signum

    def requested(self):
        """Whether a signal came on any rank (all ranks ask at the same step; none waits)."""
        if self.world > 1:
            flag = torch.tensor([0 if self.signal is None else int(self.signal)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self.signal = int(flag.item()) or None
        return self.signal is not None


# The command line: `--key value` or `--key=value`, typed like the default, checked against
# RULES: (test, what the value must be) per constant, at start-up (resolve) before anything is
# read or written. finetune.py and data/prepare.py have their own tables.
def one_of(*names):
    """The rule of a choice among `names`."""
    return (lambda v: v in names), "one of " + " | ".join(n or '""' for n in names)


def is_device(v):
    if v in ("auto", "cpu"):
        return True
    return bool(re.fullmatch(r"cuda(:\d+)?", v)) and int(v[5:] or 0) < torch.cuda.device_count()


def is_not_a_file(v):
    return not os.path.isfile(v)


POSITIVE = (lambda v: v > 0, "> 0")
NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
NOT_EMPTY = (bool, "not empty")
RATE = (lambda v: 0 < v < 1, "in (0, 1)")
FRACTION = (lambda v: 0 <= v <= 1, "in [0, 1]")
BETA = (lambda v: 0 <= v < 1, "in [0, 1)")
DEVICE = (is_device, "auto | cpu | cuda | cuda:N, a device this machine has")
DTYPE = one_of("auto", "float32", "bfloat16")
NOT_A_FILE = (is_not_a_file, "a directory, not a file")  # data_dir, out_dir, init_from
DIRECTORY = (lambda v: bool(v) and is_not_a_file(v), "not empty, a directory, not a file")
# torch's generators take seeds below 2^64: a seed x 1,000,003 + a window's index stays far below
SEED = (lambda v: 0 <= v < 2**32, "in [0, 2^32)")
RULES = dict(phase=one_of(*PHASES), preset=one_of(*PRESETS), init_from=DIRECTORY,
             data_dir=DIRECTORY, out_dir=NOT_A_FILE, mlm_rate=RATE, decay_mlm_rate=RATE,
             seq_len=POSITIVE, batch_size=POSITIVE, global_batch_size=POSITIVE,
             max_tokens=POSITIVE, decay_ratio=(lambda v: 0 < v <= 1, "in (0, 1]"),
             decay_tokens=NON_NEGATIVE, data_seed=SEED, seed=SEED,
             learning_rate=POSITIVE, warmup_tokens=NON_NEGATIVE, min_lr_ratio=FRACTION,
             beta1=BETA, beta2=BETA, eps=POSITIVE, weight_decay=NON_NEGATIVE,
             grad_clip=NON_NEGATIVE, device=DEVICE, dtype=DTYPE, eval_interval=POSITIVE,
             eval_tokens=POSITIVE, attn_backend=one_of("auto", "sdpa", "varlen"),
             log_interval=POSITIVE, ckpt_interval=POSITIVE)
BOOLEANS = {"1": True, "true": True, "yes": True, "on": True,
            "0": False, "false": False, "no": False, "off": False}


def check(values, rules, prog="detour.py"):
    """Every value against its rule (keys absent from `values` skipped); the first break is an
    error."""
    for key, (test, want) in rules.items():
        if key in values and not test(values[key]):
            fail(f"--{key} {values[key]!r} must be {want}; see python {prog} --help")


def convert(key, text, default):
    """The text of --key as the type of its default."""
    try:
        if isinstance(default, bool):
            return BOOLEANS[text.lower()]
        if isinstance(default, int):
            return int(float(text)) if float(text).is_integer() else int(text)
        if isinstance(default, float) and not math.isfinite(float(text)):
            raise ValueError(text)  # inf or nan (1e999 reads as inf): no rule means them
        return float(text) if isinstance(default, float) else text
    except (KeyError, ValueError):
        kind = "a finite number"
        if isinstance(default, bool):
            kind = "true/false"
        elif isinstance(default, int):
            kind = "an integer"
        fail(f"--{key} expects {kind}, got {text!r}; e.g. --{key} {str(default).lower()}")


def print_help(prog, block):
    """`prog`'s source from block[0] up to block[1] (every constant, its default and comment)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), prog)) as f:
        source = f.read()
    print(f"usage: python {prog} [--key value | --key=value ...]; every option, its default and "
          "comment:\n")
    print(block[0] + source.split(block[0], 1)[1].split(block[1])[0].rstrip())


def apply_overrides(namespace, argv, prog="detour.py",
                    block=("# 1. Constants", "# The constants above")):
    """Set namespace[key] from argv -> {key: value given}. -h/--help prints `prog`'s constants
    (print_help) and exits."""
    known = {k for k, v in namespace.items()
             if k.islower() and not k.startswith("_") and isinstance(v, (bool, int, float, str))}
    changed = {}
    args = iter(argv)
    for arg in args:
        if arg in ("-h", "--help"):
            print_help(prog, block)
            raise SystemExit(0)
        if not arg.startswith("--"):
            fail(f"unexpected argument {arg!r}; use --key value or --key=value")
        key, eq, text = arg[2:].partition("=")
        if not eq:  # --key value
            text = next(args, None)
            if text is None:
                fail(f"--{key} needs a value (e.g. --{key}=...)")
        if key not in known:
            close = [k for k in sorted(known) if k.startswith(key[:3])][:5]
            hint = f" (did you mean {', '.join('--' + c for c in close)}?)" if close else ""
            fail(f"unknown option --{key}{hint}; see the constants at the top of {prog}")
        namespace[key] = changed[key] = convert(key, text, namespace[key])
    return changed


def parse_layers(spec, n_layers):
    """'0-7' or '0-3,10' -> sorted layer indices."""
    out = set()
    for part in filter(None, spec.replace(" ", "").split(",")):
        try:
            a, _, b = part.partition("-")
            first = int(a)
            last = int(b or a)
        except ValueError:
            fail(f"--freeze_layers {spec!r} is not like '0-7' or '0-3,10'")
        if last < first:
            fail(f"--freeze_layers range {part!r} is empty (its end is below its start); write it "
                 f"low-high, e.g. {b}-{a}")
        out.update(range(first, last + 1))
    if out and max(out) >= n_layers:
        fail(f"--freeze_layers {spec!r} names layer {max(out)}, the model has {n_layers}")
    return sorted(out)


# Checkpoints (written atomically: a crash mid-write keeps the last one) and the record of a run:
# ckpt.pt, run.json (the configuration that ran), the copy of detour.py, log.jsonl, hf/.
# A checkpoint is data: torch's safe loader reads tensors and plain values, never code.
CHECKPOINT_KEYS = ("model", "optimizer", "model_args", "config", "torch_rng", "phase", "step",
                   "tokens", "sample0", "phase1_tokens")


def load_checkpoint(directory):
    """out_dir/ckpt.pt as data (weights_only: a pickle that would run code is refused, and
    nothing in it runs), checked to be one detour wrote."""
    path = os.path.join(directory, "ckpt.pt")
    if not os.path.exists(path):
        fail(f"no checkpoint at {path}; train Phase 1 first (--phase "
             f"{' or '.join(phase1_names())})")
    try:  # mmap: tensors are read when used
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        fail(f"{path} holds more than tensors and plain values, and detour loads checkpoints as "
             f"data only ({str(e).splitlines()[0][:80]}); use a checkpoint detour wrote")
    except Exception as e:
        fail(f"{path} is unreadable ({type(e).__name__}); restore it or retrain")
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        fail(f"{path} is not a checkpoint detour wrote (it lacks {', '.join(missing[:4])}); "
             "start from an HF directory (--init_from DIR with config.json) or retrain")
    return ckpt


def model_of(source, config_kwargs, state, fix):
    """A ModernBERT of a config and its weights; a config that does not agree with itself or with
    the weights is one line naming `source`."""
    try:
        model = ModernBERT(Config(**config_kwargs))
        missing, unexpected = model.load_state_dict(state, strict=False)
    except (TypeError, ValueError, RuntimeError, ArithmeticError) as e:
        fail(f"{source} does not describe a ModernBERT its weights fit "
             f"({str(e).strip().splitlines()[-1][:120]}); {fix}")
    if missing or unexpected:
        fail(f"{source} does not match a ModernBertForMaskedLM: missing {missing[:3]}, "
             f"unexpected {unexpected[:3]}; {fix}")
    return model


def build_model(cfg, meta, ckpt):
    """The model a run starts from: the checkpoint's weights, an HF directory's, or a fresh one
    (scratch); then the data must fit it."""
    if ckpt is not None:
        source = cfg.out_dir if cfg.init_from == "resume" else cfg.init_from
        model = model_of(os.path.join(source, "ckpt.pt"), ckpt["model_args"], ckpt["model"],
                         "use a checkpoint detour wrote")
    elif cfg.init_from == "scratch":
        vocab = -(-meta["vocab_size"] // 64) * 64  # pad to a multiple of 64, as ModernBERT does
        special = {k: meta[k] for k in SPECIAL_IDS}
        model = ModernBERT(Config(vocab_size=vocab, max_position_embeddings=max(8192, cfg.seq_len),
                                  **PRESETS[cfg.preset], **special))
    else:
        model = load_hf(cfg.init_from)
    config = model.config
    retokenize = "prepare the data with the model's tokenizer (data/prepare.py --tokenizer)"
    if meta["vocab_size"] > config.vocab_size:
        fail(f"data vocab ({meta['vocab_size']}) is larger than the model's "
             f"({config.vocab_size}); {retokenize}")
    for k in ("pad_token_id", "cls_token_id", "sep_token_id", "mask_token_id"):
        if meta.get(k) != getattr(config, k):
            fail(f"data {k}={meta.get(k)} but model {k}={getattr(config, k)}; {retokenize}")
    if cfg.seq_len > config.max_position_embeddings:
        fail(f"--seq_len {cfg.seq_len} exceeds max_position_embeddings "
             f"{config.max_position_embeddings}; lower --seq_len")
    return model


def save_run(cfg, run, step, tokens, loss):
    """Rank 0 checkpoints the run at `step`: what start_point needs to resume it (never a
    diverged one), the configuration that ran (record_of) and its data's identity."""
    check_finite(cfg, loss, step)
    if not run.master:
        return
    make_dirs(cfg.out_dir)
    phase1_tokens = run.phase1_tokens if run.phase.continues else tokens
    ckpt = dict(model=run.raw_model.state_dict(), optimizer=run.optimizer.state_dict(),
                model_args=asdict(run.config), config=record_of(vars(cfg)),
                torch_rng=torch.get_rng_state(), phase=cfg.phase, step=step, tokens=tokens,
                sample0=run.sample0, phase1_tokens=phase1_tokens, data=run.data_identity)
    atomic_write(os.path.join(cfg.out_dir, "ckpt.pt"), lambda f: torch.save(ckpt, f))


# What belongs to one run in its out_dir: a run that starts afresh removes the old run's first,
# so that no file of it is read as the new run's (ckpt.pt and the exports; log.jsonl is cut,
# run.json and detour.py are written anew).
RUN_FILES = ("ckpt.pt", "hf", "init")


def clear_old_run(out_dir):
    """Remove what an earlier run left in out_dir (RUN_FILES, and an export it was making),
    before a fresh run writes."""
    for name in RUN_FILES:
        path = os.path.join(out_dir, name)
        for leftover in (path, hidden(path, "partial"), hidden(path, "old")):
            remove_tree(leftover)


def open_outputs(cfg, run):
    """Rank 0: the record (run.json: the values that run; detour.py: the code that runs),
    log.jsonl cut to a resumed checkpoint (a kill -9 can leave later records), a run from
    scratch's step-0 weights (init/, for weight-drift analysis) -> {log: the open log, wandb: the
    W&B run or None}."""
    if not run.master:
        return {}
    make_dirs(cfg.out_dir)
    if cfg.init_from != "resume" and run.start_step == 0:
        clear_old_run(cfg.out_dir)
    with open(os.path.abspath(__file__), "rb") as f:
        source = f.read()
    atomic_write(os.path.join(cfg.out_dir, "detour.py"), lambda f: f.write(source))
    record = json.dumps(record_of(vars(cfg)), indent=1) + "\n"
    atomic_write(os.path.join(cfg.out_dir, "run.json"), lambda f: f.write(record.encode()))
    log_path = os.path.join(cfg.out_dir, "log.jsonl")
    if os.path.exists(log_path):  # a run from step 0 keeps none of an earlier attempt's records
        with open(log_path) as f:
            kept = [line for line in f
                    if line.strip() and json.loads(line)["step"] <= run.start_step]
        atomic_write(log_path, lambda f: f.write("".join(kept).encode()))
    c = run.config
    print(f"detour: phase={cfg.phase} params={run.raw_model.num_params() / 1e6:.2f}M "
          f"layers={c.num_hidden_layers} d={c.hidden_size} ranks={run.world} accum={run.accum} "
          f"steps={run.total_steps} tokens/step={run.tokens_per_step} "
          f"frozen={run.frozen or 'none'} out_dir={cfg.out_dir}")
    if cfg.init_from == "scratch" and run.start_step == 0:
        save_hf(run.raw_model, os.path.join(cfg.out_dir, "init"), run.tokenizer)
    wandb_run = None
    if cfg.wandb_log:  # nanoGPT's tracker: imported only when asked for (resolve checked it)
        import wandb
        wandb_run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name or cfg.out_dir,
                               config=record_of(vars(cfg)), dir=cfg.out_dir, id=cfg.wandb_run_id,
                               resume="allow")
    try:
        log = open(log_path, "a")
    except OSError as e:
        fail(f"cannot write {log_path} ({os_reason(e)}); make {cfg.out_dir} writable")
    return {"log": log, "wandb": wandb_run}


def export_whole(directory, tokenizer):
    """Whether `directory` holds a complete HF export (its files, the tokenizer's if any)."""
    names = ["config.json", "model.safetensors"]
    if tokenizer:
        names.append("tokenizer.json")
    return all(os.path.isfile(os.path.join(directory, n)) for n in names)


def finish(cfg, run, tokens, trained):
    """Rank 0, at the end of a run: the HF export, written when this run trained or when the one
    there is missing or incomplete (a kill during the export of a finished run)."""
    directory = os.path.join(cfg.out_dir, "hf")
    if trained or not export_whole(directory, run.tokenizer):
        save_hf(run.raw_model, directory, run.tokenizer)
    print(f"detour: done, {tokens:,} tokens; HF export in {directory}")


def write_record(run, record):
    """One record into log.jsonl (flushed: a kill loses none) and, with --wandb_log, W&B."""
    run.log.write(json.dumps(record) + "\n")
    run.log.flush()
    if run.wandb:
        run.wandb.log(record, step=record["step"])


def print_stopped(cfg, run, step):
    if not run.master:
        return
    again = f"--init_from resume --out_dir {cfg.out_dir}"
    if cfg.autoresume:
        again = "the same command"
    print(f"detour: stopped by signal {run.stop.signal} at step {step}; checkpoint saved. "
          f"Continue with {again}")


# Resolution: the configuration of a run, decided in one place before anything trains: the
# running file's constants, under what the run continues (a resumed run: its saved configuration;
# a decay: the keys of INHERITED from its Phase 1), under argv. Each key acts where it is
# declared: a phase's own keys in its row's `reads`, the conditional ones in WHEN, every other
# key in every run. A key given that does not act is refused; the record holds the keys that act.
Settings = make_dataclass("Settings", [(k, type(v)) for k, v in DEFAULTS.items()], frozen=True)
# Keys that change nothing computed: --autoresume lets them differ from the checkpoint's.
RERUN_KEYS = ("out_dir", "overwrite", "progress", "autoresume", "early_decay", "new_data",
              "wandb_log", "wandb_project", "wandb_run_name", "wandb_run_id")
PHASE_KEYS = {key for row in PHASES.values() for key in row.reads}
STARTS = (lambda v: v["init_from"] != "resume", "when a run starts, not on --init_from resume")
WANDB = (lambda v: v["wandb_log"], "with --wandb_log true")
WHEN = dict(
    preset=(lambda v: v["init_from"] == "scratch", "with --init_from scratch (a checkpoint or an "
            "HF directory brings its own shape)"),
    decay_ratio=(lambda v: v["decay_tokens"] == 0, "with --decay_tokens 0 (else decay_tokens is "
                 "the budget)"),
    new_data=(lambda v: v["init_from"] == "resume" or PHASES[v["phase"]].continues,
              "on a resume or a decay"),
    early_decay=STARTS, overwrite=STARTS, autoresume=STARTS,
    wandb_project=WANDB, wandb_run_name=WANDB, wandb_run_id=WANDB)


def acts(key, values):
    """Whether `key` acts in the run of `values`."""
    return where_else(key, values) is None


def where_else(key, values):
    """None where `key` acts in the run of `values`; else where it would."""
    if key in PHASE_KEYS and key not in PHASES[values["phase"]].reads:
        readers = [name for name, row in PHASES.items() if key in row.reads]
        return f"in --phase {' | '.join(readers)}"
    if key in WHEN and not WHEN[key][0](values):
        return WHEN[key][1]
    return None


def record_of(values):
    """The run's record (run.json, the checkpoint's configuration): the keys that act."""
    return {k: values[k] for k in DEFAULTS if acts(k, values)}


def say(line):
    """A line at start, printed once (rank 0 under torchrun)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line)


def resolve(argv):
    """argv -> (the run's frozen configuration, the checkpoint it starts from or None), or None
    when --autoresume finds the run finished. Each checkpoint is read once and checked before
    anything of it is merged."""
    values = dict(DEFAULTS)
    given = apply_overrides(values, config_args(argv))
    check(values, RULES)
    phase = PHASES[values["phase"]]
    ckpt = None
    if values["init_from"] == "resume":
        ckpt = resumed(values, given)
    elif phase.continues:
        ckpt = continued(values, given)
    else:
        values["out_dir"] = values["out_dir"] or os.path.join("out", values["phase"])
        ckpt = starting_weights(values["init_from"])
    check(values, RULES)  # again: also what a resumed or continuing run inherits
    for key in given:
        if where := where_else(key, values):
            fail(f"--{key} does not act in this run (it acts {where}); drop it")
    if values["init_from"] != "resume":
        ckpt = existing_run(values, ckpt)
        if ckpt is False:
            return None
    if values["init_from"] == "resume" or phase.continues:
        check_data(values, ckpt)
    if values["wandb_log"]:
        if importlib.util.find_spec("wandb") is None:
            fail("--wandb_log true needs the wandb package; pip install wandb (or --wandb_log "
                 "false)")
        values["wandb_run_id"] = values["wandb_run_id"] or secrets.token_hex(4)  # W&B's id form
    cfg = Settings(**{k: values[k] for k in DEFAULTS})
    phase_budget(cfg, phase1_tokens_of(cfg, ckpt))  # a budget below one step is refused here
    return cfg, ckpt


def starting_weights(source):
    """A Phase-1 run's --init_from -> a detour out_dir's checkpoint (its weights), or None (scratch,
    an HF directory); nothing to start from is one line naming what builds the default, θ0."""
    if os.path.exists(os.path.join(source, "ckpt.pt")):  # a detour out_dir
        return load_checkpoint(source)
    if source != "scratch" and not os.path.exists(os.path.join(source, "config.json")):
        fail(f"--init_from {source}: no model there (an HF directory's config.json, or a detour "
             "out_dir's ckpt.pt); build the default θ0 with bash runs/theta0.sh, give a "
             "ModernBERT directory, or --init_from scratch")
    return None


def config_args(argv):
    """A run's run.json given first (`detour.py out/clm/run.json --out_dir out/again`, as
    nanoGPT's configurator) -> its keys as --key=value, then the rest of argv."""
    if not argv or not argv[0].endswith(".json"):
        return argv
    saved = read_json(argv[0], fix="give the run.json a detour run wrote")
    texts = {True: "true", False: "false"}
    return [f"--{k}={texts.get(v, v) if isinstance(v, bool) else v}" for k, v in saved.items()
            ] + list(argv[1:])


def existing_run(values, ckpt):
    """A run that starts where out_dir already holds a checkpoint: refused, unless --overwrite
    (the old run is removed as this one starts) or --autoresume / a torchrun restart (it is
    continued, or False when it is finished and whole)."""
    path = os.path.join(values["out_dir"], "ckpt.pt")
    if not os.path.exists(path):
        return ckpt
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0  # torchrun restarts
    if not (values["autoresume"] or restarted or values["overwrite"]):
        fail(f"{path} exists (phase {load_checkpoint(values['out_dir']).get('phase')}); use "
             "--init_from resume to continue it, another --out_dir, or --overwrite true")
    if values["autoresume"] or restarted:
        return autoresumed(values, load_checkpoint(values["out_dir"]))
    return ckpt


def check_data(values, ckpt):
    """A resume or a decay runs on the data its checkpoint ran on (data_identity), unless
    --new_data true says other data is meant."""
    source = values["out_dir"] if values["init_from"] == "resume" else values["init_from"]
    saved = ckpt.get("data")
    if saved is None:
        say(f"detour: {source}/ckpt.pt records no data identity (detour did not record it then); "
            "its data is not checked")
        return
    load_data(values["data_dir"], "train")  # a missing or malformed dataset: its own line
    here = data_identity(values["data_dir"])
    if here == saved:
        return
    differ = ", ".join(sorted(n for n in {*saved, *here} if saved.get(n) != here.get(n)))
    then = ckpt["config"].get("data_dir")
    if not values["new_data"]:
        fail(f"{values['data_dir']} is not the data {source} ran on ({then}): its {differ} "
             "differ; point --data_dir at that data, or pass --new_data true if other data is "
             "meant")
    say(f"detour: --new_data: running on {values['data_dir']}, not the data {source} ran on "
        f"({then}; {differ} differ)")


def resumed(values, given):
    """--init_from resume: out_dir's checkpoint, and its saved configuration under argv. A value
    that differs from this file's, or that the checkpoint lacks, is said. -> the checkpoint."""
    if not values["out_dir"]:
        if PHASES[values["phase"]].continues:
            fail(f"to resume a {values['phase']} run, name it: --init_from resume --out_dir "
                 f"out/clm-{values['phase']}")
        values["out_dir"] = os.path.join("out", values["phase"])
    out = values["out_dir"]
    ckpt = load_checkpoint(out)
    saved = ckpt["config"]
    if "phase" in given and given["phase"] != ckpt.get("phase"):
        fail(f"--phase {given['phase']}, but {values['out_dir']} holds a {ckpt.get('phase')} run; "
             "a resume continues its own phase: drop --phase")
    values.update({k: v for k, v in saved.items() if k in DEFAULTS}, **given)
    values["out_dir"] = out  # where it is now, not where it was
    not_here(saved, out)
    quiet = {*RERUN_KEYS, *given, "init_from", "phase"}
    runs = [f"{k} {v!r} (this file: {DEFAULTS[k]!r})" for k, v in saved.items()
            if k in DEFAULTS and k not in quiet and v != DEFAULTS[k]]
    if runs:
        say(f"detour: resume: {out}'s values run: {'; '.join(runs)}; --key value changes one")
    absent = [f"{k} {values[k]!r}" for k in DEFAULTS
              if k not in saved and k not in quiet and acts(k, values)]
    if absent:
        say(f"detour: resume: not in {out}'s configuration, this file's values run: "
            f"{'; '.join(absent)}")
    return ckpt


def not_here(saved, source):
    """A line for the keys of a run's configuration that this file does not have (a constant
    removed or renamed since): they cannot act, and the run goes on without them."""
    if missing := [k for k in saved if k not in DEFAULTS]:
        say(f"detour: {source}'s configuration has {', '.join(missing)}, which this file does "
            "not: they do not act in this run")


def continued(values, given):
    """A continuing phase (the decay): Phase 1's finished checkpoint, and the keys of INHERITED
    from its configuration; every other key is this file's or argv's. Where an inherited value
    differs from this file's or argv's, a line says which runs. -> the Phase-1 checkpoint."""
    source = values["init_from"]
    starts = phase1_names()
    phase1 = " or ".join(starts)
    if source == "scratch" or "init_from" not in given:
        fail(f"--phase {values['phase']} starts from a Phase-1 checkpoint ({phase1}); pass "
             f"--init_from out/{starts[0]}")
    ckpt = load_checkpoint(source)
    if ckpt.get("phase") not in PHASES or PHASES[ckpt.get("phase")].continues:
        fail(f"--phase {values['phase']} needs a Phase-1 checkpoint ({phase1}); {source} holds "
             f"phase {ckpt.get('phase')!r}")
    saved = ckpt["config"]
    planned = steps_for(*(saved.get(k, DEFAULTS[k])
                          for k in ("max_tokens", "global_batch_size", "seq_len")))
    if ckpt["step"] < planned and not values["early_decay"]:
        fail(f"{source} stopped at step {ckpt['step']} of the {planned} its Phase 1 planned; "
             "finish it (--init_from resume), or decay from it anyway with --early_decay true")
    values.update({k: saved[k] for k in INHERITED if k in saved and k not in given})
    kept = [f"{k} {saved[k]!r} (this file: {DEFAULTS[k]!r})" for k in INHERITED
            if k in saved and k not in given and saved[k] != DEFAULTS[k]]
    if kept:
        say(f"detour: {source}'s values run, as a decay continues its Phase 1: "
            f"{'; '.join(kept)}; --key value changes one")
    changed = [f"{k} {given[k]!r} ({source}: {saved[k]!r})" for k in INHERITED
               if k in saved and k in given and given[k] != saved[k]]
    if changed:
        say(f"detour: the command line's values run, not {source}'s: {'; '.join(changed)}")
    if absent := [f"{k} {values[k]!r}" for k in INHERITED if k not in saved]:
        say(f"detour: not in {source}'s configuration, this file's values run: "
            f"{'; '.join(absent)}")
    values["out_dir"] = values["out_dir"] or source.rstrip("/") + "-decay"
    return ckpt


def autoresumed(values, ckpt):
    """--autoresume, as Composer's: out_dir's checkpoint of this phase and configuration -> the
    run, continued as --init_from resume does (values changed to say so); finished with its
    export whole -> False (said once; exit 0), finished without it -> continued, which writes it;
    of another phase or configuration -> refused, naming what differs. A resumed run's
    checkpoint says init_from "resume"."""
    path = os.path.join(values["out_dir"], "ckpt.pt")
    saved = ckpt["config"]
    not_here(saved, values["out_dir"])
    ignored = {*RERUN_KEYS, *(["init_from"] if saved.get("init_from") == "resume" else [])}
    if differ := [f"{k} {saved[k]!r} there, {v!r} here" for k, v in values.items()
                  if k in saved and k not in ignored and saved[k] != v]:
        fail(f"--autoresume: {path} was run with another configuration ({'; '.join(differ)}); "
             "rerun it with its settings, or give another --out_dir")
    finished = ckpt["step"] >= phase_budget(Settings(**values), ckpt["phase1_tokens"])[1]
    meta = load_data(values["data_dir"], "train")[0]
    whole = export_whole(os.path.join(values["out_dir"], "hf"),
                         data_tokenizer(values["data_dir"], meta))
    if finished and whole:
        say(f"detour: {values['out_dir']} is finished (step {ckpt['step']}, "
            f"{ckpt['tokens']:,} tokens); nothing to do")
        return False
    say(f"detour: autoresume: continuing {path} from step {ckpt['step']}"
        + (" (finished; its HF export is written again)" if finished else ""))
    values["init_from"] = "resume"
    # the requeued job logs into its own W&B run
    values["wandb_run_id"] = values["wandb_run_id"] or saved.get("wandb_run_id") or ""
    return ckpt


def main(argv):
    """resolve(), then train(); None when there is nothing to do (an --autoresume run finished)."""
    resolution = resolve(argv)
    if resolution is None:
        return None
    cfg, ckpt = resolution
    return train(cfg, ckpt)


if __name__ == "__main__":
    main(sys.argv[1:])
