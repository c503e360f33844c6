"""
detour.py: continued pretraining of a ModernBERT encoder with a Causal LM detour.

The paper ("A Causal Language Modeling Detour Improves Encoder Continued Pretraining") adapts
an encoder to a new domain in two phases at a fixed token budget:
  Phase 1  --phase clm    causal attention mask, next-token loss at every position
           --phase mlm    (the baseline twin) bidirectional, 30% masking
  Phase 2  --phase decay  bidirectional MLM at 15%, ~10% of the Phase-1 tokens,
                          LR 1-sqrt cooldown from peak to 10% of peak, AdamW state kept.
The two twins differ only in the Phase-1 objective: same data, same order, same schedule.

  python data/prepare.py                                   # embedded default corpus
  torchrun --standalone --nproc_per_node=1 detour.py --phase clm
  torchrun --standalone --nproc_per_node=1 detour.py --phase decay --init_from out/clm

Every constant below can be overridden: `--key value` or `--key=value`. Each run keeps a copy
of this file as out_dir/detour.py: an ablation made by editing a constant stays reproducible.
Sections: 1 constants, 2 the phases, 3 the model (parameter names as HF's ModernBertForMaskedLM),
4 objectives and data windows, 5 optimizer and schedule, 6 the training loop, 7 plumbing
(files, HF format, FLOPs, DDP, CLI, resume, main).
"""
import concurrent.futures, functools, importlib.util, itertools, json, math, os, re, signal, sys, time  # noqa: E401
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from data import hf_format  # the Hugging Face file format (safetensors, config.json, tokenizer files)

# ----------------------------------------------------------------------------------------
# 1. Constants. Paper values unless the comment says otherwise; the `small` preset makes the
# default run fit a 2-core CPU in a few minutes.
phase = "clm"              # clm | mlm (Phase 1) | decay (Phase 2)
preset = "small"           # model shape when init_from=scratch: tiny | small | medium | base | large
init_from = "scratch"      # scratch | an HF ModernBERT dir | a detour out_dir | resume
out_dir = ""               # "" = out/<phase> (Phase 1) or <init_from>-decay (decay)
data_dir = "data/default"  # train.bin / val.bin / meta.json from data/prepare.py
overwrite = False          # a fresh run may replace the checkpoint in out_dir, of any phase (else refused)
autoresume = False         # the same command is safe to rerun (a requeued job): continue out_dir's checkpoint of
                           # this phase and configuration, start if it has none, exit 0 if it is finished
# objective
mlm_rate = 0.30            # Phase-1 MLM baseline masking rate (paper: 30%)
decay_mlm_rate = 0.15      # Phase-2 masking rate (paper: 15%)
doc_mask = True            # packed documents never attend across the [SEP] boundary
# data and batch
seq_len = 128              # paper: 8192
batch_size = 4             # micro-batch, sequences per rank per forward
global_batch_size = 4      # sequences per optimizer step over all ranks (paper: 384); the CPU default buys
                           # steps: the detour twin relearns bidirectional use only in its decay (10% of them)
max_tokens = 1_000_000     # Phase-1 budget in tokens (paper: billions): ~1,950 steps, a ~195-step decay
decay_ratio = 0.10         # decay length as a fraction of Phase-1 tokens
decay_tokens = 0           # decay length in tokens; 0 = decay_ratio x Phase-1 tokens
data_seed = 42             # data order seed (paper: 42)
seed = 17                  # model init / masking seed (paper: 17)
# optimizer (decoupled AdamW)
learning_rate = 2e-3       # peak lr (paper: 2e-4 for continued pretraining of base; a small
                           # model trained from scratch on a CPU budget wants more)
warmup_tokens = 20_480     # linear warmup (40 steps here), then constant (paper: 100M)
min_lr_ratio = 0.10        # decay ends at 10% of peak
beta1, beta2 = 0.9, 0.98
eps = 1e-6
weight_decay = 1e-5        # paper's *fully decoupled* wd; converted for torch AdamW below
grad_clip = 0.0            # max grad norm, 0 = off (upstream uses none: clipping would treat
                           # the twins unequally, MLM's early gradients being the larger)
freeze_layers = ""         # e.g. "0-7" or "8-14": layers that do not train in this phase
# system
device = "auto"            # auto | cpu | cuda | cuda:N
dtype = "auto"             # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
compile = False            # torch.compile the model
attn_backend = "auto"      # auto (varlen where it can run: CUDA, bf16; else sdpa) | sdpa | varlen (FlashAttention's
                           # variable-length kernel, documents apart) | dense_window (local layers on a T x T mask)
eval_interval = 400        # steps between validation
eval_tokens = 65_536       # fixed validation budget (split over ranks)
log_interval = 20
ckpt_interval = 200        # steps between checkpoints (also written at the end)
progress = True            # tqdm bar
wandb_log = False          # also send every log.jsonl record to Weights & Biases (rank 0; pip install wandb)
wandb_project = "detour"
wandb_run_name = ""        # "" = out_dir
wandb_run_id = ""          # "" = a new W&B run; saved in the checkpoint, so a resumed or requeued run logs into its own

# The constants above, as the run's configuration (the command line overrides a copy).
DEFAULTS = {k: v for k, v in dict(globals()).items()
            if k.islower() and not k.startswith("_") and isinstance(v, (bool, int, float, str))}
PRESETS = {  # hidden, intermediate, layers, heads; ModernBERT-base/large are the released shapes
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2),
    "small": dict(hidden_size=128, intermediate_size=192, num_hidden_layers=6, num_attention_heads=2),
    "medium": dict(hidden_size=256, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4),
    "base": dict(hidden_size=768, intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12),
    "large": dict(hidden_size=1024, intermediate_size=2624, num_hidden_layers=28, num_attention_heads=16),
}
IGNORE = -100  # target value that carries no loss


# ----------------------------------------------------------------------------------------
# 2. The phases: one entry per row of the objectives table (docs/model.md). Everything that differs
# between phases is read from here; cfg.phase only picks the entry.
@dataclass(frozen=True)
class Phase:  # each field, and after "->" the function where it acts
    causal: bool                       # causal attention (the detour) or bidirectional -> may_attend
    targets: str                       # "next" token -> clm_batch | "masked" -> mlm_batch; loss -> LinearCrossEntropy
    rate: str = ""                     # the constant holding the masking rate ("" = no masking) -> mlm_batch
    schedule: str = "warmup-constant"  # linear warmup, then constant | "1-sqrt" cooldown -> lr_at
    # continues -> start_point: start where a Phase-1 run ended: its weights (build_model) and AdamW moments (only the
    # schedule restarts), its data stream at the first window it did not see, its configuration (main); budget
    # decay_tokens or decay_ratio x the Phase-1 tokens (else max_tokens).
    continues: bool = False
    own: tuple = ()                    # the keys a continuing phase does not inherit from Phase 1 -> main


PHASES = {
    "clm": Phase(causal=True, targets="next"),
    "mlm": Phase(causal=False, targets="masked", rate="mlm_rate"),
    "decay": Phase(causal=False, targets="masked", rate="decay_mlm_rate", schedule="1-sqrt", continues=True,
                   own=("phase", "init_from", "out_dir", "overwrite", "freeze_layers", "progress", "decay_tokens",
                        "autoresume", "wandb_run_id")),
}


# ----------------------------------------------------------------------------------------
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
    hf_fields: dict = field(default_factory=dict)  # an HF source's other config.json fields: exported as they came

    def __post_init__(self):
        if self.layer_types is None:
            n = self.global_attn_every_n_layers
            self.layer_types = ["full_attention" if i % n == 0 else "sliding_attention"
                                for i in range(self.num_hidden_layers)]
        assert len(self.layer_types) == self.num_hidden_layers, "layer_types needs one entry per layer"
        assert self.hidden_size % self.num_attention_heads == 0, "hidden_size must divide into heads"

    @property
    def special_ids(self):
        return [self.pad_token_id, self.cls_token_id, self.sep_token_id, self.mask_token_id, self.unk_token_id]


def rope_cos_sin(theta, head_dim, T, device):
    """Rotate-half (NeoX) RoPE tables over the full head_dim, computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return (x.float() * cos + torch.cat((-x2, x1), dim=-1).float() * sin).to(x.dtype)


def may_attend(b, qi, kj, T, causal, window=None, attention_mask=None, doc_ids=None):
    """True where query qi of row b may attend to key kj (broadcasting integer tensors; keys outside [0, T) never):
    the one predicate of every attention path. A local token sees |qi - kj| <= window (64 for a 128 window); causal,
    itself and the 64 before it, as in the FlexBERT/Ettin training code (HF's decoder uses 63)."""
    ok = (kj >= 0) & (kj < T)
    if causal:
        ok = ok & (kj <= qi)
    if window is not None:
        ok = ok & ((qi - kj).abs() <= window)
    qc, kc = qi.clamp(0, T - 1), kj.clamp(0, T - 1)  # safe lookups; outside positions are masked above
    if doc_ids is not None:                          # packed documents stay apart
        ok = ok & (doc_ids[b, qc] == doc_ids[b, kc])
    if attention_mask is not None:                   # padding keys are invisible
        ok = ok & attention_mask[b, kc].bool()
    return ok | (qi == kj)                           # every query sees itself: no empty row, no NaN


def dense_mask(B, T, device, causal, window=None, attention_mask=None, doc_ids=None):
    """Boolean (B, 1, T, T) may_attend mask: the global layers', and with `window` block_sliding_attention's."""
    i, b = torch.arange(T, device=device), torch.arange(B, device=device).view(B, 1, 1)
    return may_attend(b, i[:, None], i[None, :], T, causal, window, attention_mask, doc_ids).expand(B, T, T)[:, None]


def block_sliding_mask(B, T, device, causal, window, attention_mask=None, doc_ids=None):
    """The exact mask of block_sliding_attention: (B * blocks, 1, window, 2|3 window)."""
    n, nb = -(-T // window), 2 if causal else 3
    qi = torch.arange(n * window, device=device).view(n, window, 1)
    kj = (torch.arange(n, device=device).view(n, 1, 1) - 1) * window + torch.arange(nb * window, device=device)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    ok = may_attend(b, qi, kj, T, causal, window, attention_mask, doc_ids)
    return ok.expand(B, n, window, nb * window).reshape(B * n, 1, window, nb * window)


def block_sliding_attention(q, k, v, mask, window, causal, dropout=0.0):
    """Sliding-window attention in O(T x window), not O(T^2), on (B, H, T, D): query block b attends to the keys of
    blocks b-1, b, b+1 (b-1, b when causal), which hold every key within `window` of its queries; block_sliding_mask
    keeps exactly those, so it equals dense attention under the window mask, in one SDPA call over the blocks."""
    B, H, T, D = q.shape
    n, nb = -(-T // window), 2 if causal else 3
    pad = n * window - T
    qb = F.pad(q, (0, 0, 0, pad)).unflatten(2, (n, window)).transpose(1, 2).flatten(0, 1)

    def keys(x):  # one zero block before, overlapping windows of nb blocks: (B * n, H, nb * window, D)
        x = F.pad(x, (0, 0, window, pad + (nb - 2) * window)).unfold(2, nb * window, window)
        return x.permute(0, 2, 1, 4, 3).flatten(0, 1)  # unfold is a view; this makes the one copy

    y = F.scaled_dot_product_attention(qb, keys(k), keys(v), attn_mask=mask, dropout_p=dropout)
    return y.unflatten(0, (B, n)).transpose(1, 2).flatten(2, 3)[:, :, :T]


def document_spans(key):
    """The varlen kernel's sequences in (B, T) rows -> (int32 cu_seqlens into the B x T tokens, longest): a span
    starts at each row start (a row end cuts a document) and where `key` (the document id) changes."""
    start = torch.cat([torch.ones_like(key[:, :1], dtype=torch.bool), key[:, 1:] != key[:, :-1]], 1)
    cu = torch.cat([start.view(-1).nonzero().view(-1), torch.tensor([key.numel()])]).int()
    return cu, int(cu.diff().max())


def varlen_attention(q, k, v, spans, window, causal):
    """Attention within each span by FlashAttention's variable-length kernel on (B, H, T, D): no pair across documents
    nor (causal) above the diagonal is computed; window_size (left, right) is may_attend's |qi - kj| <= window."""
    from torch.nn.attention.varlen import varlen_attn  # torch >= 2.10: attention_backend checks
    B, H, T, D = q.shape
    (cu, longest), left = spans, -1 if window is None else window
    flat = [x.transpose(1, 2).reshape(B * T, H, D) for x in (q, k, v)]
    y = varlen_attn(*flat, cu, cu, longest, longest, window_size=(left, 0 if causal else left))
    return y.view(B, T, H, D).transpose(1, 2)


def attention_fns(config, B, T, device, causal, attention_mask=None, doc_ids=None, backend="sdpa", dropout=0.0,
                  spans=None):
    """{layer kind: attend(q, k, v) -> y} on (B, H, T, head_dim) tensors, the masks built once per forward and
    shared by the layers of a kind. backend: sdpa (local layers by block_sliding_attention), varlen (CUDA, on
    `spans`), dense_window (local layers under the dense T x T window mask: the benchmark's O(T^2) reference)."""
    half, masks = config.local_attention // 2, (attention_mask, doc_ids)
    if backend == "varlen":
        return {kind: functools.partial(varlen_attention, spans=spans, window=w, causal=causal)
                for kind, w in (("full_attention", None), ("sliding_attention", half))}
    full_mask = None  # without padding or documents: SDPA's own causal flag, no T x T tensor
    if attention_mask is not None or doc_ids is not None:
        full_mask = dense_mask(B, T, device, causal, None, *masks)
    if backend == "dense_window":
        window_mask = dense_mask(B, T, device, causal, half, *masks)
        local = functools.partial(F.scaled_dot_product_attention, attn_mask=window_mask, dropout_p=dropout)
    else:
        local = functools.partial(block_sliding_attention, mask=block_sliding_mask(B, T, device, causal, half, *masks),
                                  window=half, causal=causal, dropout=dropout)
    return {"full_attention": functools.partial(F.scaled_dot_product_attention, attn_mask=full_mask, dropout_p=dropout,
                                                is_causal=causal and full_mask is None),
            "sliding_attention": local}


class Embeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)
        self.drop = nn.Dropout(config.embedding_dropout)

    def forward(self, idx):
        return self.drop(self.norm(self.tok_embeddings(idx)))


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)  # rows [Q; K; V]
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.out_drop = nn.Dropout(config.attention_dropout)

    def forward(self, x, rope, attend):  # attend(q, k, v): this layer kind's attention, from attention_fns
        B, T, _ = x.shape
        q, k, v = self.Wqkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
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

    def forward(self, idx, attention_mask=None, causal=False, doc_ids=None, output_hidden_states=False, spans=None):
        """idx (B, T) -> final hidden states (B, T, d); output_hidden_states: also the embedding and layer outputs."""
        config, (B, T) = self.config, idx.shape
        head_dim = config.hidden_size // config.num_attention_heads
        attend = attention_fns(config, B, T, idx.device, causal, attention_mask, doc_ids, self.attn_backend,
                               config.attention_dropout if self.training else 0.0, spans)
        ropes = {"full_attention": rope_cos_sin(config.global_rope_theta, head_dim, T, idx.device),
                 "sliding_attention": rope_cos_sin(config.local_rope_theta, head_dim, T, idx.device)}
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
    """Mean cross-entropy of the decoder's logits (h @ weight.T + bias) without ever holding all N x V of them:
    chunk by chunk, the gradient (softmax - one-hot) becomes those of h, weight and bias in the forward pass, and
    backward only scales them. Rows with target IGNORE (padding slots) count nothing: mean over `n`."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, n, chunk=1024):
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)
        grad_b = torch.zeros_like(bias, dtype=torch.float32)
        loss = torch.zeros((), device=h.device)
        for s in range(0, h.size(0), chunk):
            hc, t = h[s:s + chunk], targets[s:s + chunk]
            real, t = (t != IGNORE).float()[:, None], t.clamp_min(0)  # x * 1.0 is x: no change to real rows
            logits = F.linear(hc, weight, bias).float()  # softmax in fp32, also under autocast
            lse = logits.logsumexp(-1)
            loss += ((lse - logits.gather(1, t[:, None]).squeeze(1)) * real[:, 0]).sum()
            g = logits.sub_(lse[:, None]).exp_()          # softmax, in place of the logits
            g[torch.arange(len(t), device=t.device), t] -= 1
            g *= real
            grad_h[s:s + chunk] = g @ weight
            grad_w += g.t() @ hc
            grad_b += g.sum(0)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.n, ctx.w_dtype = n, weight.dtype  # fp32 sums, returned in the weight's dtype
        return loss / ctx.n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scale = grad_loss / ctx.n
        return grad_h * scale, (grad_w * scale).to(ctx.w_dtype), (grad_b * scale).to(ctx.w_dtype), None, None, None


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
        """As upstream: truncated normal at 2 std, std 0.02, output projections (attn.Wo, mlp.Wo, head.dense) at
        0.02 / sqrt(2 x layers); norms 1, decoder bias 0 (its weight is the embedding). Draws in module order."""
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

    def forward(self, idx, targets=None, causal=False, attention_mask=None, doc_ids=None, spans=None, capacity=None):
        """-> (logits, loss). Without targets: dense logits (B, T, V). With targets (B, T; IGNORE = no loss): the
        LinearCrossEntropy loss with the head only on the supervised positions (15-30% of tokens for MLM), or with
        `capacity` (--compile) on that many slots, the supervised positions first: one shape, one compiled graph."""
        h = self.model(idx, attention_mask=attention_mask, causal=causal, doc_ids=doc_ids, spans=spans)
        if targets is None:
            return self.decoder(self.head(h)), None
        keep, targets = targets.reshape(-1) != IGNORE, targets.reshape(-1)
        slot = keep.nonzero() if capacity is None else torch.nonzero_static(keep, size=capacity, fill_value=-1)
        slot, n = slot.view(-1), len(slot) if capacity is None else (slot >= 0).sum()
        h, targets = h.reshape(-1, h.size(-1))[slot.clamp(0)], torch.where(slot >= 0, targets[slot.clamp(0)], IGNORE)
        return None, LinearCrossEntropy.apply(self.head(h), self.decoder.weight, self.decoder.bias, targets, n)

    @torch.no_grad()
    def score(self, idx, targets, causal=False, doc_ids=None, spans=None, chunk=1024):
        """(mean loss, share of argmax hits) on the supervised positions, never N x V logits at once."""
        h = self.model(idx, causal=causal, doc_ids=doc_ids, spans=spans)
        keep = targets.reshape(-1) != IGNORE
        h, targets = self.head(h.reshape(-1, h.size(-1))[keep]), targets.reshape(-1)[keep]
        loss, hits = torch.zeros((), device=h.device), torch.zeros((), dtype=torch.long, device=h.device)
        for s in range(0, len(targets), chunk):
            logits, t = self.decoder(h[s:s + chunk]).float(), targets[s:s + chunk]
            loss += F.cross_entropy(logits, t, reduction="sum")
            hits += (logits.argmax(-1) == t).sum()
        return loss / len(targets), hits / len(targets)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


# ----------------------------------------------------------------------------------------
# 4. Objectives and data windows. A packed token stream ([CLS] doc [SEP] [CLS] doc [SEP] ...) is
# cut into windows. The order is a pure function of (data_seed, sample index): the CLM and MLM
# twins see the same windows in the same order, a resumed run continues exactly, and 1 or N ranks
# with the same global batch see the same rows.
def document_ids(idx, sep_token_id):
    """Document index of every token in a packed stream: the [SEP]s strictly before it ([SEP] closes a document)."""
    is_sep = (idx == sep_token_id).int()
    return torch.cumsum(is_sep, dim=1) - is_sep


def load_data(data_dir, split):
    meta_path, bin_path = os.path.join(data_dir, "meta.json"), os.path.join(data_dir, f"{split}.bin")
    if missing := [p for p in (meta_path, bin_path) if not os.path.exists(p)]:  # the command that builds data_dir
        fail(f"{missing[0]} not found; run `python data/prepare.py --input FILES --out_dir {data_dir}` (without "
             "--input: a generated corpus), or set --data_dir")
    fix = "re-run data/prepare.py"
    meta = read_json(meta_path, ("vocab_size", "dtype", "pad_token_id", "cls_token_id", "sep_token_id",
                                 "mask_token_id", "unk_token_id"), fix)
    if meta["dtype"] not in ("uint16", "uint32") or os.path.getsize(bin_path) % np.dtype(meta["dtype"]).itemsize:
        fail(f"{bin_path} does not hold {meta['dtype']} token ids as {meta_path} says; {fix}")
    if os.path.getsize(bin_path) == 0:
        fail(f"{bin_path} is empty; re-run data/prepare.py on a non-empty corpus")
    return meta, np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r")


class Windows:
    """Non-overlapping windows of seq_len + 1 tokens (+1: the last CLM target), in a fresh permutation every epoch."""

    def __init__(self, data, seq_len, data_seed):
        self.data, self.T, self.seed = data, seq_len, data_seed
        self.n = (len(data) - 1) // seq_len
        if self.n < 1:
            fail(f"{len(data)} tokens cannot fill one window of seq_len={seq_len}; prepare more data or lower --seq_len")
        self._epoch, self._perm = None, None

    def rows(self, first_sample, count):
        out = np.empty((count, self.T + 1), dtype=np.int64)
        for r in range(count):
            epoch, pos = divmod(first_sample + r, self.n)
            if epoch != self._epoch:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g).numpy()
            start = int(self._perm[pos]) * self.T
            out[r] = self.data[start:start + self.T + 1]
        return torch.from_numpy(out)


def clm_batch(buf, sep_id):
    """Causal LM: the next token at every position but a [SEP] (the next document is unrelated)."""
    x, y = buf[:, :-1], buf[:, 1:].clone()
    y[x == sep_id] = IGNORE
    return x, y


def mlm_batch(buf, rate, gen, config, n_real_vocab):
    """Masked LM: `rate` of the non-special tokens (80% [MASK], 10% random, 10% kept), loss only there. Unlike
    FlexBERT, special tokens are never chosen nor random replacements, and every document gets a prediction."""
    x = buf[:, :-1]
    special = functools.reduce(torch.logical_or, [x == i for i in config.special_ids])
    score = torch.rand(x.shape, generator=gen).masked_fill_(special, 2.0)
    chosen = score < rate
    key = (torch.arange(x.size(0))[:, None] * x.size(1) + document_ids(x, config.sep_token_id)).reshape(-1)
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


def predicted_fraction(cfg):
    """Share of positions the phase predicts: every one for CLM, the masking rate for MLM/decay."""
    rate = PHASES[cfg.phase].rate
    return getattr(cfg, rate) if rate else 1.0


def make_batch(cfg, buf, config, n_real_vocab, sample):
    """(inputs, targets, causal) for the run's phase; masks depend only on (seed, sample)."""
    phase = PHASES[cfg.phase]
    if phase.targets == "next":
        x, y = clm_batch(buf, config.sep_token_id)
    else:
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + sample)
        x, y = mlm_batch(buf, predicted_fraction(cfg), gen, config, n_real_vocab)
    return x, y, phase.causal


def unigram_log_probs(counts, vocab_size):
    """log p(token) of the train stream's add-one smoothed unigram: the baseline every loss is read against."""
    padded = np.zeros(vocab_size)
    padded[:len(counts)] = counts[:vocab_size]
    smoothed = torch.from_numpy(padded) + 1
    return (smoothed / smoothed.sum()).log().float()


# ----------------------------------------------------------------------------------------
# 5. Optimizer and schedule
def torch_weight_decay(cfg):
    """The paper's *fully decoupled* weight decay for torch's AdamW: FlexBERT applies p *= 1 - (lr_t / peak_lr) * wd,
    torch p *= 1 - lr_t * wd_torch, so wd_torch = wd / peak_lr (1e-5 / 2e-4 = 0.05)."""
    return cfg.weight_decay / cfg.learning_rate


def make_optimizer(model, cfg, fused=False):
    """AdamW, biases and norms not decayed. Frozen parameters are in the groups too (no grad: AdamW skips them), so
    the groups stay the same across phases and a decay can load the state of a run with other frozen layers."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": torch_weight_decay(cfg)}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=fused or None)


def lr_at(cfg, tokens, total, step_tokens=0):
    """LR of the step that starts after `tokens` tokens of this phase (`step_tokens` per step).
    Phase 1: linear warmup then constant, read at the step's end, so the first step is above 0.
    Decay: 1 - sqrt from the peak to min_lr_ratio x peak, read at the step's start, so the first
    decay step runs at the peak (as Composer's schedulers do) and the cooldown is not cut short."""
    peak = cfg.learning_rate
    if PHASES[cfg.phase].schedule == "1-sqrt":
        progress = min(tokens / max(total, 1), 1.0)
        return peak * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * (1 - math.sqrt(progress)))
    return peak * min(1.0, (tokens + step_tokens) / max(cfg.warmup_tokens, 1))


# ----------------------------------------------------------------------------------------
# 6. Training: setup() gathers the run's state, train() is the loop.
@torch.no_grad()
def evaluate(model, cfg, run):
    """The phase's loss, argmax accuracy and the train unigram's loss on fixed validation windows (masks seeded by
    the window index; a micro-batch per rank at least), averaged over ranks, by the raw (eager) model."""
    model.eval()
    n, T = max(1, min(run.val.n, max(cfg.eval_tokens // cfg.seq_len, run.world * cfg.batch_size))), cfg.seq_len
    total = torch.zeros(4)  # sums of loss x k, acc x k, unigram x k, k (k = windows in the batch)
    for first in range(run.rank * cfg.batch_size, n, run.world * cfg.batch_size):
        k = min(cfg.batch_size, n - first)
        buf = torch.from_numpy(np.stack([run.val.data[i * T:(i + 1) * T + 1].astype(np.int64)
                                         for i in range(first, first + k)]))
        b = prepare(cfg, run, buf, 10**9 + first)
        with run.amp:
            loss, acc = model.score(b.x, b.y_dev, causal=b.causal, doc_ids=b.doc_ids, spans=b.spans)
        total += torch.tensor([loss.item() * k, acc.item() * k, -run.unigram_logp[b.y[b.y != IGNORE]].mean().item() * k, k])
    if run.world > 1:
        dist.all_reduce(total)
    model.train()
    return dict(zip(("loss", "acc", "unigram"), (total[:3] / total[3]).tolist()))


def setup(cfg):
    """The run's state in one namespace: model (raw_model; model, wrapped), optimizer, windows, start_point, ranks."""
    rank, world, device = setup_distributed(cfg)
    torch.manual_seed(cfg.seed)
    meta, train_data = load_data(cfg.data_dir, "train")
    _, val_data = load_data(cfg.data_dir, "val")
    raw_model, ckpt = build_model(cfg, meta)
    config = raw_model.config
    counts = train_counts(cfg.data_dir, meta, train_data)  # the vocabulary check and the unigram
    if len(counts) > min(config.vocab_size, meta["vocab_size"]):
        fail(f"token id {len(counts) - 1} in {cfg.data_dir}/train.bin is outside the vocabulary "
             f"({meta['vocab_size']}); the data was prepared with another tokenizer: re-run prepare.py")
    frozen = parse_layers(cfg.freeze_layers, config.num_hidden_layers)
    for i in frozen:  # the paper's freeze interventions: these layers keep their weights
        raw_model.model.layers[i].requires_grad_(False)
    raw_model.to(device)
    use_bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda")
    raw_model.model.attn_backend = attention_backend(cfg.attn_backend, device, use_bf16, config.attention_dropout, rank == 0)
    optimizer = make_optimizer(raw_model, cfg, fused=device.type == "cuda")
    start = start_point(cfg, ckpt, optimizer)
    if cfg.global_batch_size % (cfg.batch_size * world):
        fail(f"global_batch_size {cfg.global_batch_size} is not a multiple of batch_size x ranks = "
             f"{cfg.batch_size * world}; change --global_batch_size or --batch_size")
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None) if world > 1 else raw_model
    model = torch.compile(model) if cfg.compile else model  # DDP first, then compile (as PyTorch documents)
    tokenizer = os.path.join(cfg.data_dir, meta.get("tokenizer", "tokenizer.json"))
    tokenizer = tokenizer if os.path.exists(tokenizer) else None
    if tokenizer:  # read now, not when the export needs it at the end of the run
        hf_tokenizer_files(config, tokenizer)
    run = SimpleNamespace(
        **start, rank=rank, world=world, master=rank == 0, device=device, model=model, raw_model=raw_model,
        optimizer=optimizer, config=config, frozen=frozen, n_real_vocab=meta["vocab_size"],
        amp=torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext(),
        accum=cfg.global_batch_size // (cfg.batch_size * world), tokens_per_step=tokens_per_step,
        windows=Windows(train_data, cfg.seq_len, cfg.data_seed), val=Windows(val_data, cfg.seq_len, cfg.data_seed),
        unigram_logp=unigram_log_probs(counts, config.vocab_size), peak_flops=device_peak_flops(device),
        tokenizer=tokenizer, signal=None, loss=torch.zeros(1), wandb=None)
    for sig in (signal.SIGTERM, signal.SIGINT):  # cluster preemption / Ctrl-C: checkpoint, then exit
        signal.signal(sig, lambda s, _: setattr(run, "signal", s))
    run.log = open_outputs(cfg, run)
    return run


def train(cfg):
    """Train one phase: an optimizer step per iteration until the phase's token budget is spent."""
    run = setup(cfg)
    model, optimizer, step, tokens = run.model, run.optimizer, run.step, run.tokens
    bar = tqdm(total=run.total_steps, initial=step, disable=not (run.master and cfg.progress), dynamic_ncols=True)
    model.train()
    t0, tok0, flops, batches = time.time(), tokens, 0.0, micro_batches(cfg, run, step)
    while step < run.total_steps:
        # the schedule's learning rate for this step
        lr = lr_at(cfg, tokens, run.budget, run.tokens_per_step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # forward and backward of this rank's micro-batches; DDP syncs gradients on the last one
        loss_sum = torch.zeros(1, device=run.device)
        for micro in range(run.accum):
            b = next(batches)
            with nullcontext() if run.world == 1 or micro == run.accum - 1 else model.no_sync():
                with run.amp:
                    loss = model(b.x, b.y_dev, b.causal, doc_ids=b.doc_ids, spans=b.spans, capacity=b.capacity)[1]
                (loss / run.accum).backward()
            loss_sum += loss.detach().float() / run.accum
            flops += b.flops
        # the loss averaged over ranks, kept on the device (no host sync per step): check_finite reads it
        if run.world > 1:
            dist.all_reduce(loss_sum)
            loss_sum /= run.world
        run.loss = loss_sum
        # the optimizer step
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step, tokens = step + 1, tokens + run.tokens_per_step
        bar.update(1)
        last_step = step == run.total_steps
        # every log_interval steps: training loss, lr, speed and MFU (FLOPs on allowed pairs / bf16 peak)
        record = None
        if step % cfg.log_interval == 0 or last_step:
            record = dict(step=step, tokens=tokens, loss=round(check_finite(cfg, run, step), 5), lr=lr,
                          tok_per_s=round((tokens - tok0) / max(time.time() - t0, 1e-9)))
            if run.peak_flops:
                record["mfu"] = round(flops / max(time.time() - t0, 1e-9) / run.peak_flops, 4)
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{record['tok_per_s']:,}")
        # every eval_interval steps: the validation loss, next to the unigram's on the same targets
        if step % cfg.eval_interval == 0 or last_step:
            ev = evaluate(run.raw_model, cfg, run)
            record = {**(record or dict(step=step, tokens=tokens, lr=lr)),
                      **{f"val_{k}": round(v, 5) for k, v in ev.items()}}
            if run.master:
                bar.write(f"step {step}: val {cfg.phase} loss {ev['loss']:.4f} (unigram {ev['unigram']:.4f}), "
                          f"accuracy {ev['acc']:.4f}")
        if record and run.master:  # log.jsonl (flushed: a kill loses none) and, with --wandb_log, Weights & Biases
            run.log.write(json.dumps(record) + "\n")
            run.log.flush()
            if run.wandb:
                run.wandb.log(record, step=step)
        # every ckpt_interval steps and at the end: a checkpoint; at the last step also the HF export
        if step % cfg.ckpt_interval == 0 or last_step:
            save_run(cfg, run, step, tokens)
        if last_step and run.master:
            save_hf(run.raw_model, os.path.join(cfg.out_dir, "hf"), run.tokenizer)
            print(f"detour: done, {tokens:,} tokens; HF export in {os.path.join(cfg.out_dir, 'hf')}")
        # SIGTERM/SIGINT on any rank: all ranks checkpoint and stop at this step
        if stop_requested(run):
            save_run(cfg, run, step, tokens)
            if run.master:
                print(f"detour: stopped by signal {run.signal} at step {step}; checkpoint saved. "
                      f"Continue with {'the same command' if cfg.autoresume else '--init_from resume --out_dir ' + cfg.out_dir}")
            break
    bar.close()
    if run.world > 1:
        dist.destroy_process_group()
    if run.master and step == run.total_steps:  # after the ranks have parted: no rank waits on these
        print_samples(cfg, run)
    return run.raw_model


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
    """The end of a phase made visible on the first n validation documents: a greedy causal continuation after clm,
    the top-3 fills of three masks after mlm and decay. fp32, sdpa, no random draws; ids without a tokenizer."""
    tok = load_tokenizer(run.tokenizer) if run.tokenizer else None
    piece = (lambda i: tok.decode([i])) if tok else (lambda i: f" {i}")
    model, backend = run.raw_model.eval(), run.raw_model.model.attn_backend
    model.model.attn_backend = "sdpa"
    stream = np.asarray(run.val.data[:100_000]).astype(np.int64)
    for ids in [d[:length].tolist() for d in np.split(stream, np.flatnonzero(stream == run.config.sep_token_id) + 1)
                if len(d) >= 12][:n]:  # [CLS] document ([SEP])
        if PHASES[cfg.phase].causal:
            text = ["".join(map(piece, x)).strip() for x in (ids[1:9], generate(model, ids[:9], 16))]
            print(f"sample ({cfg.phase}, greedy): {text[0]!r} -> {text[1]!r}")
            continue
        pos = [1 + (j + 1) * (len(ids) - 2) // 4 for j in range(3)]
        fills = ", ".join(f"{'/'.join(piece(t).strip() for t in top)} ({piece(ids[p]).strip()})"
                          for p, top in zip(pos, fill_masks(model, ids, pos)))
        shown = "".join(("[MASK]", " [MASK]")[piece(i)[:1] == " "] if p in pos else piece(i) for p, i in enumerate(ids))
        print(f"sample ({cfg.phase}): {shown.strip()}\n  top-3 fills (true token): {fills}")
    model.model.attn_backend = backend
    model.train()


# ----------------------------------------------------------------------------------------
# 7. Plumbing: errors and files, the Hugging Face format, FLOPs, distributed, the command line,
# then checkpoints with every resume and inheritance rule, and main.
def fail(message):
    """A user's mistake: `error: <what>; <how to fix it>` on one line, exit status 1, no traceback. Under torchrun every
    rank meets the same bad input: rank 0 alone prints it; the others exit 1 quietly a second later, so that rank 0 has
    printed before torchrun (which stops the other workers when one exits) stops it, and is named the root cause."""
    rank = int(os.environ.get("RANK", "0"))
    time.sleep(1 if rank else 0)
    raise SystemExit(1 if rank else f"error: {message}")


def atomic_write(path, write_fn):
    """write_fn(a temp file opened "wb"), fsync, rename: never a half-written file, a crash keeps the previous one."""
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
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
    if missing := [k for k in keys if not isinstance(d, dict) or k not in d]:
        fail(f"{path} lacks {', '.join(missing)}; {fix}")
    return d


def train_counts(data_dir, meta, train_data):
    """How often each token id occurs in train.bin (up to the largest id): prepare.py counts the whole
    stream while writing it, so start-up reads no tokens; data it prepared before it did are counted
    from their first 50M tokens."""
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
        fail(f"{path} is not a tokenizer.json the tokenizers library can load ({str(e).splitlines()[0][:80]}); "
             "use the one data/prepare.py wrote")


# The Hugging Face format (config.json, model.safetensors, tokenizer files) is data/hf_format.py's: a file format, with
# no detour in it. Here: the model built from it and written into it, its errors as one line.
def config_from_hf(d):
    """Config from an HF config.json dict, older (global_rope_theta, ...) or newer (layer_types, rope_parameters)."""
    if d.get("model_type") != "modernbert":
        fail(f"config.json has model_type={d.get('model_type')!r}, not 'modernbert'; "
             "detour loads ModernBERT checkpoints only")
    for bad in ("norm_bias", "attention_bias", "mlp_bias", "classifier_bias"):
        if d.get(bad):
            fail(f"config.json sets {bad}=true; detour's ModernBERT has no biases there")
    if d.get("hidden_activation", "gelu") != "gelu":
        fail("config.json hidden_activation is not 'gelu'; unsupported")
    kw = {f.name: d[f.name] for f in fields(Config) if f.name in d and d[f.name] is not None}
    kw["hf_fields"] = hf_format.source_fields(d, [f.name for f in fields(Config)])
    for kind, key in (("full_attention", "global_rope_theta"), ("sliding_attention", "local_rope_theta")):
        if kind in (d.get("rope_parameters") or {}):
            kw[key] = d["rope_parameters"][kind].get("rope_theta", getattr(Config, key))
    return Config(**kw)


def load_hf(directory):
    """An HF ModernBERT directory (config.json + model.safetensors) -> ModernBERT."""
    cfg_path, st_path = os.path.join(directory, "config.json"), os.path.join(directory, "model.safetensors")
    for p in (cfg_path, st_path):
        if not os.path.exists(p):
            fail(f"{p} not found; point at a directory with config.json and model.safetensors")
    model = ModernBERT(config_from_hf(read_json(cfg_path, fix="re-export or re-download it")))
    try:
        with open(st_path, "rb") as f:
            sd = hf_format.decode_safetensors(f.read())
    except ValueError as e:
        fail(f"{st_path} {e}; re-export or re-download it")
    sd.setdefault("decoder.weight", sd.get("model.embeddings.tok_embeddings.weight"))  # tied: omitted by HF
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        fail(f"{st_path} does not match a ModernBertForMaskedLM: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model


def save_hf(model, directory, tokenizer_path=None):
    """config.json, model.safetensors (and the tokenizer's files) for AutoModelForMaskedLM and pipeline("fill-mask")."""
    model = getattr(model, "_orig_mod", model)
    os.makedirs(directory, exist_ok=True)
    sd = {k: v.float() if v.is_floating_point() else v for k, v in model.state_dict().items() if k != "decoder.weight"}
    chunks = hf_format.encode_safetensors(sd)
    atomic_write(os.path.join(directory, "model.safetensors"), lambda f: [*map(f.write, chunks)])
    fields = {k: v for k, v in asdict(model.config).items() if k != "hf_fields"}
    files = {"config.json": json.dumps(hf_format.config_json(fields, model.config.hf_fields), indent=2)}
    if tokenizer_path:
        files.update(hf_tokenizer_files(model.config, tokenizer_path))
    for name, text in files.items():
        atomic_write(os.path.join(directory, name), lambda f: f.write(text.encode()))


def hf_tokenizer_files(config, tokenizer_path):
    """{file name: text} of the data's tokenizer for AutoTokenizer and pipeline("fill-mask"); a bad file: one line."""
    load_tokenizer(tokenizer_path)  # a file the tokenizers library cannot read is a one-line error
    d = read_json(tokenizer_path, ("added_tokens",), "use the tokenizer.json data/prepare.py wrote")
    return hf_format.tokenizer_files(d, config)


# Model FLOPs, for MFU
def attention_pairs(lengths, window=None, causal=False):
    """The query-key pairs may_attend allows in documents of these lengths: query i sees itself, the
    min(i, window) keys before it (all i without a window) and, unless causal, as many after it."""
    before = sum(float(np.minimum(np.arange(n), n if window is None else window).sum()) for n in lengths)
    return float(np.sum(lengths)) + before * (1 if causal else 2)


def model_flops(config, lengths, causal=False, predicted=None):
    """FLOPs of a training step (3 x forward, a multiply-add 2) on documents of these lengths. Per token and layer: Wqkv
    3d^2, Wo d^2, Wi 2dI, Wo Id; 2d per allowed pair; the head d^2 + dV on `predicted` tokens (default all)."""
    d, inter, tokens = config.hidden_size, config.intermediate_size, float(np.sum(lengths))
    windows = {"full_attention": None, "sliding_attention": config.local_attention // 2}
    forward = sum(tokens * 2 * (4 * d * d + 3 * d * inter) + 4 * d * attention_pairs(lengths, windows[kind], causal)
                  for kind in config.layer_types)
    forward += (tokens if predicted is None else predicted) * 2 * (d * d + d * config.vocab_size)
    return 3 * forward


# The GPU path: the attention backend decided once, batches prepared ahead, one compiled shape, no syncs.
def attention_backend(wanted, device, bf16, dropout, warn=True):
    """The backend, decided at start-up (never mid-run): varlen where it can run, else sdpa (quiet for auto on CPU)."""
    cuda = torch.device(device).type == "cuda"
    needs = [need for need, ok in (("a CUDA device", cuda), ("bf16", bf16), ("attention_dropout 0", dropout == 0),
                                   ("sm80+", not cuda or torch.cuda.get_device_capability(device) >= (8, 0)),
                                   ("torch >= 2.10", importlib.util.find_spec("torch.nn.attention.varlen"))) if not ok]
    if (fallback := wanted in ("auto", "varlen") and needs) and warn and (cuda or wanted == "varlen"):
        print(f"warning: attn_backend={wanted} needs {', '.join(needs)}; using sdpa", file=sys.stderr)
    return "sdpa" if fallback else "varlen" if wanted == "auto" else wanted


def head_capacity(n, rate):
    """The compiled head's fixed slots for n positions predicted at `rate`: all of them for CLM (rate 1); for MLM the
    rate's count + 8 standard deviations + 8, so that a batch above it (one compile more) is never seen."""
    return min(n, math.ceil(rate * n + 8 * math.sqrt(n * rate * (1 - rate))) + 8)


def prepare(cfg, run, buf, sample):
    """The windows `buf` as a batch (masks seeded by `sample`), built on the CPU and copied without blocking. Under
    --compile the head's capacity is one per phase (head_capacity); a batch above it takes all positions."""
    x, y, causal = make_batch(cfg, buf, run.config, run.n_real_vocab, sample)
    doc_ids = document_ids(x, run.config.sep_token_id) if cfg.doc_mask else torch.zeros_like(x)
    (cu, longest), n = document_spans(doc_ids), int((y != IGNORE).sum())
    cap = head_capacity(y.numel(), predicted_fraction(cfg))
    varlen, pin = run.raw_model.model.attn_backend == "varlen", run.device.type == "cuda"
    dev = lambda t: (t.pin_memory() if pin else t).to(run.device, non_blocking=True)  # noqa: E731
    return SimpleNamespace(x=dev(x), y=y, y_dev=dev(y), causal=causal, spans=(dev(cu), longest) if varlen else None,
                           doc_ids=dev(doc_ids) if cfg.doc_mask and not varlen else None,
                           capacity=(cap if n <= cap else y.numel()) if cfg.compile else None,
                           flops=model_flops(run.config, cu.diff().numpy(), causal, n))


def micro_batches(cfg, run, step):
    """This rank's micro-batches from `step` on, each prepared on a worker thread while the one before trains."""
    firsts = (run.sample0 + s * cfg.global_batch_size + (m * run.world + run.rank) * cfg.batch_size
              for s in itertools.count(step) for m in range(run.accum))
    load = lambda first: prepare(cfg, run, run.windows.rows(first, cfg.batch_size), first)  # noqa: E731
    with concurrent.futures.ThreadPoolExecutor(1) as worker:
        ahead = worker.submit(load, next(firsts))
        for first in firsts:
            current, ahead = ahead.result(), worker.submit(load, first)
            yield current


def check_finite(cfg, run, step):
    """The last step's loss, read from the device; a diverged run stops here, before it logs or checkpoints."""
    if not math.isfinite(loss := run.loss.item()):
        fail(f"loss is {loss} at step {step}; the last good checkpoint is kept in {cfg.out_dir}. "
             "Try a lower --learning_rate or --grad_clip 1.0")
    return loss


# Dense (no sparsity) bf16 tensor peak in FLOP/s from the vendors' data sheets; a key matches
# when all its words are words of torch.cuda.get_device_name(). The first match wins.
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12, "H100": 989e12,
                   "H200": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12,
                   "L40": 181e12, "L4": 121e12, "A10": 125e12, "A6000": 155e12, "4090": 165e12,
                   "3090": 71e12, "MI300X": 1307e12}


def device_peak_flops(device):
    """bf16 peak FLOP/s of `device` (for MFU), or None on CPU and on GPUs not in the table."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    words = torch.cuda.get_device_name(device).replace("-", " ").split()
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if all(w in words for w in key.split())), None)


# Distributed: torchrun, and stopping together
def setup_distributed(cfg):
    """-> (rank, world, device), from torchrun's RANK/WORLD_SIZE/LOCAL_RANK (multi-node by torchrun's flags)."""
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1, torch.device(dev)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
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
    dist.init_process_group("cpu:gloo,cuda:nccl" if dev.startswith("cuda") else "gloo", rank=rank, world_size=world,
                            store=dist.PrefixStore(f"detour/attempt{attempt}", store))
    return rank, world, torch.device(dev)


def stop_requested(run):
    """Whether SIGTERM/SIGINT came on any rank: all ranks stop at the same step, none is left waiting."""
    if run.world > 1:
        flag = torch.tensor([0 if run.signal is None else int(run.signal)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        run.signal = int(flag.item()) or None
    return run.signal is not None


# The command line: `--key value` or `--key=value`, typed like the default, checked against RULES:
# (test, what the value must be) per constant, at start-up (main) before anything is read or
# written. finetune.py and data/prepare.py have their own tables.
POSITIVE, NON_NEGATIVE, NOT_EMPTY = (lambda v: v > 0, "> 0"), (lambda v: v >= 0, ">= 0"), (bool, "not empty")
RATE, FRACTION = (lambda v: 0 < v < 1, "in (0, 1)"), (lambda v: 0 <= v <= 1, "in [0, 1]")
BETA = (lambda v: 0 <= v < 1, "in [0, 1)")
one_of = lambda *names: ((lambda v: v in names), "one of " + " | ".join(n or '""' for n in names))  # noqa: E731
DEVICE = (lambda v: v in ("auto", "cpu") or bool(re.fullmatch(r"cuda(:\d+)?", v)) and int(v[5:] or 0) < torch.cuda
          .device_count(), "auto | cpu | cuda | cuda:N, a device this machine has")
DTYPE = one_of("auto", "float32", "bfloat16")
NOT_A_FILE = (lambda v: not os.path.isfile(v), "a directory, not a file")  # data_dir, out_dir, init_from
DIRECTORY = (lambda v: bool(v) and NOT_A_FILE[0](v), "not empty, " + NOT_A_FILE[1])
RULES = dict(phase=one_of(*PHASES), preset=one_of(*PRESETS), init_from=DIRECTORY, data_dir=DIRECTORY, out_dir=NOT_A_FILE,
             mlm_rate=RATE, decay_mlm_rate=RATE, seq_len=POSITIVE, batch_size=POSITIVE, global_batch_size=POSITIVE,
             max_tokens=POSITIVE, decay_ratio=(lambda v: 0 < v <= 1, "in (0, 1]"), decay_tokens=NON_NEGATIVE,
             data_seed=NON_NEGATIVE, seed=NON_NEGATIVE, learning_rate=POSITIVE, warmup_tokens=NON_NEGATIVE,
             min_lr_ratio=FRACTION, beta1=BETA, beta2=BETA, eps=POSITIVE, weight_decay=NON_NEGATIVE,
             grad_clip=NON_NEGATIVE, device=DEVICE, dtype=DTYPE, eval_interval=POSITIVE, eval_tokens=POSITIVE,
             attn_backend=one_of("auto", "sdpa", "varlen", "dense_window"), log_interval=POSITIVE, ckpt_interval=POSITIVE)
BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def check(values, rules, prog="detour.py"):
    """Every value against its rule (keys absent from `values` skipped); the first break is an error."""
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
        return float(text) if isinstance(default, float) else text
    except (KeyError, ValueError):
        kind = "true/false" if isinstance(default, bool) else "an integer" if isinstance(default, int) else "a number"
        fail(f"--{key} expects {kind}, got {text!r}; e.g. --{key} {str(default).lower()}")


def apply_overrides(namespace, argv, prog="detour.py", block=("# 1. Constants", "# The constants above")):
    """Set namespace[key] from argv -> {key: value given}. -h/--help prints `prog`'s source from block[0] up to
    block[1] (every constant, its default and comment) and exits."""
    known = {k for k, v in namespace.items()
             if k.islower() and not k.startswith("_") and isinstance(v, (bool, int, float, str))}
    changed, args = {}, iter(argv)
    for arg in args:
        if arg in ("-h", "--help"):
            source = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), prog)).read()
            print(f"usage: python {prog} [--key value | --key=value ...]; every option, its default and comment:\n")
            print(block[0] + source.split(block[0], 1)[1].split(block[1])[0].rstrip())
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
            first, last = int(a), int(b or a)
        except ValueError:
            fail(f"--freeze_layers {spec!r} is not like '0-7' or '0-3,10'")
        if last < first:
            fail(f"--freeze_layers range {part!r} is empty (its end is below its start); write it low-high, e.g. {b}-{a}")
        out.update(range(first, last + 1))
    if out and max(out) >= n_layers:
        fail(f"--freeze_layers {spec!r} names layer {max(out)}, the model has {n_layers}")
    return sorted(out)


# Checkpoints (written atomically: a crash mid-write keeps the last one) and where a run starts:
# every resume and inheritance rule is below.
def load_checkpoint(directory):
    path = os.path.join(directory, "ckpt.pt")
    if not os.path.exists(path):
        fail(f"no checkpoint at {path}; train Phase 1 first (--phase clm or mlm)")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)  # tensors read when used
    except Exception as e:
        fail(f"{path} is unreadable ({type(e).__name__}); restore it or retrain")


def resolve_out_dir(cfg):
    """out_dir, by default out/<phase>; a continuing phase's default is <init_from>-decay."""
    if cfg.out_dir:
        return cfg.out_dir
    if PHASES[cfg.phase].continues and cfg.init_from == "resume":
        fail("to resume a decay run, name it: --init_from resume --out_dir out/clm-decay")
    return cfg.init_from.rstrip("/") + "-decay" if PHASES[cfg.phase].continues else os.path.join("out", cfg.phase)


def build_model(cfg, meta):
    """-> (the model a run starts from, its checkpoint or None: scratch or HF). A fresh run must not overwrite
    another run's; a continuing phase (decay) needs a Phase-1 checkpoint; the data must fit the model."""
    resume, ckpt_path, ckpt = cfg.init_from == "resume", os.path.join(cfg.out_dir, "ckpt.pt"), None
    if not resume and os.path.exists(ckpt_path) and not cfg.overwrite:
        fail(f"{ckpt_path} exists (phase {load_checkpoint(cfg.out_dir).get('phase')}); "
             "use --init_from resume to continue it, another --out_dir, or --overwrite true")
    if cfg.init_from == "scratch":
        vocab = -(-meta["vocab_size"] // 64) * 64  # pad to a multiple of 64, as ModernBERT does
        model = ModernBERT(Config(vocab_size=vocab, max_position_embeddings=max(8192, cfg.seq_len), **PRESETS[cfg.preset],
                                  **{k: meta[k] for k in ("pad_token_id", "cls_token_id", "sep_token_id",
                                                          "mask_token_id", "unk_token_id")}))
    elif resume or PHASES[cfg.phase].continues or os.path.exists(os.path.join(cfg.init_from, "ckpt.pt")):
        ckpt = load_checkpoint(cfg.out_dir if resume else cfg.init_from)
        model = ModernBERT(Config(**ckpt["model_args"]))
        model.load_state_dict(ckpt["model"])
    else:
        model = load_hf(cfg.init_from)
    config, retokenize = model.config, "prepare the data with the model's tokenizer (data/prepare.py --tokenizer)"
    if meta["vocab_size"] > config.vocab_size:
        fail(f"data vocab ({meta['vocab_size']}) is larger than the model's ({config.vocab_size}); {retokenize}")
    for k in ("pad_token_id", "cls_token_id", "sep_token_id", "mask_token_id"):
        if meta.get(k) != getattr(config, k):
            fail(f"data {k}={meta.get(k)} but model {k}={getattr(config, k)}; {retokenize}")
    if cfg.seq_len > config.max_position_embeddings:
        fail(f"--seq_len {cfg.seq_len} exceeds max_position_embeddings {config.max_position_embeddings}; lower --seq_len")
    if PHASES[cfg.phase].continues and not resume and ckpt.get("phase") not in ("clm", "mlm"):
        fail(f"--phase {cfg.phase} needs a Phase-1 (clm or mlm) checkpoint; {cfg.init_from} holds phase {ckpt.get('phase')!r}")
    return model, ckpt


def start_point(cfg, ckpt, optimizer):
    """-> dict(step, tokens, sample0: windows already drawn, phase1_tokens, budget: the phase's tokens). A resumed run
    continues exactly (AdamW state, position, RNG); a continuing phase (decay) keeps Phase 1's AdamW moments and
    starts on the first window Phase 1 did not see; other runs start afresh."""
    step, tokens, sample0, phase1_tokens = 0, 0, 0, 0
    if cfg.init_from == "resume":
        optimizer.load_state_dict(ckpt["optimizer"])
        step, tokens, sample0, phase1_tokens = ckpt["step"], ckpt["tokens"], ckpt["sample0"], ckpt["phase1_tokens"]
        torch.set_rng_state(ckpt["torch_rng"])
    elif PHASES[cfg.phase].continues:
        optimizer.load_state_dict(ckpt["optimizer"])  # keep Adam moments; only the schedule resets
        phase1_tokens = ckpt["tokens"]
        sample0 = ckpt["sample0"] + ckpt["step"] * ckpt["config"]["global_batch_size"]  # fresh data
    for group in optimizer.param_groups:  # lr/wd come from this run's schedule, not the checkpoint
        group["weight_decay"] = torch_weight_decay(cfg) if group["weight_decay"] else 0.0
    budget, total_steps = phase_budget(cfg, phase1_tokens)
    return dict(step=step, tokens=tokens, sample0=sample0, phase1_tokens=phase1_tokens, budget=budget,
                total_steps=total_steps)


def phase_budget(cfg, phase1_tokens):
    """-> (the phase's tokens: decay_tokens or decay_ratio x Phase 1's for a continuing phase, else max_tokens; steps)."""
    budget = (cfg.decay_tokens or int(cfg.decay_ratio * phase1_tokens)) if PHASES[cfg.phase].continues else cfg.max_tokens
    return budget, max(1, math.ceil(budget / (cfg.global_batch_size * cfg.seq_len)))


def save_run(cfg, run, step, tokens):
    """Rank 0 checkpoints the run at `step`: what start_point needs to resume it (never a diverged one)."""
    check_finite(cfg, run, step)
    if run.master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        ckpt = dict(model=run.raw_model.state_dict(), optimizer=run.optimizer.state_dict(),
                    model_args=asdict(run.config), config=vars(cfg), torch_rng=torch.get_rng_state(), phase=cfg.phase,
                    step=step, tokens=tokens, sample0=run.sample0,
                    phase1_tokens=run.phase1_tokens if PHASES[cfg.phase].continues else tokens)
        atomic_write(os.path.join(cfg.out_dir, "ckpt.pt"), lambda f: torch.save(ckpt, f))


def open_outputs(cfg, run):
    """Rank 0: out_dir/detour.py (the code that runs), log.jsonl cut to a resumed checkpoint (a kill -9 can leave later
    records), a run from scratch's step-0 weights (init/, for weight-drift analysis) -> the open log."""
    if not run.master:
        return None
    os.makedirs(cfg.out_dir, exist_ok=True)
    source = open(os.path.abspath(__file__), "rb").read()
    atomic_write(os.path.join(cfg.out_dir, "detour.py"), lambda f: f.write(source))
    log_path = os.path.join(cfg.out_dir, "log.jsonl")
    if os.path.exists(log_path):  # a run that starts afresh (step 0) keeps none of an earlier attempt's records
        with open(log_path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= run.step]
        atomic_write(log_path, lambda f: f.write("".join(kept).encode()))
    c = run.config
    print(f"detour: phase={cfg.phase} params={run.raw_model.num_params() / 1e6:.2f}M layers={c.num_hidden_layers} "
          f"d={c.hidden_size} ranks={run.world} accum={run.accum} steps={run.total_steps} "
          f"tokens/step={run.tokens_per_step} frozen={run.frozen or 'none'} out_dir={cfg.out_dir}")
    if cfg.init_from == "scratch" and run.step == 0:
        save_hf(run.raw_model, os.path.join(cfg.out_dir, "init"), run.tokenizer)
    if cfg.wandb_log:  # nanoGPT's tracker: imported only when asked for (main checked that it is installed)
        import wandb
        run.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name or cfg.out_dir, config=vars(cfg),
                               dir=cfg.out_dir, id=cfg.wandb_run_id or None, resume="allow")
        cfg.wandb_run_id = run.wandb.id  # into the checkpoint's configuration: a resume continues this W&B run
    return open(log_path, "a")


def main(argv):
    """The constants, under what a run inherits (a resumed run its saved configuration, a continuing phase Phase 1's but
    the keys it owns), under argv; with --autoresume (or torchrun restarting the group) out_dir's own run continued;
    then train()."""
    cfg = dict(DEFAULTS)
    given = apply_overrides(cfg, argv)
    check(cfg, RULES)
    phase = PHASES.get(cfg["phase"])
    if cfg["init_from"] == "resume":  # continue with the saved configuration (a key it lacks: today's default)
        out = resolve_out_dir(SimpleNamespace(**cfg))
        saved = load_checkpoint(out)["config"]
        cfg = {**cfg, **{k: v for k, v in saved.items() if not k.startswith("_")}, **given, "out_dir": out}
    elif phase and phase.continues and os.path.exists(os.path.join(cfg["init_from"], "ckpt.pt")):
        # Same data, model shape, batch and peak lr as Phase 1 unless told otherwise.
        saved = load_checkpoint(cfg["init_from"])["config"]
        cfg = {**cfg, **{k: v for k, v in saved.items() if not k.startswith("_") and k not in phase.own}, **given}
    check(cfg, RULES)  # again: also what a resumed or continuing run inherits (its device must exist here)
    cfg = SimpleNamespace(**cfg)
    if PHASES[cfg.phase].continues and cfg.init_from == "scratch":
        fail(f"--phase {cfg.phase} starts from a Phase-1 checkpoint; pass --init_from out/clm")
    step_tokens = cfg.global_batch_size * cfg.seq_len
    if not PHASES[cfg.phase].continues and cfg.max_tokens < step_tokens:
        fail(f"--max_tokens {cfg.max_tokens} is less than one optimizer step, global_batch_size x seq_len = "
             f"{cfg.global_batch_size} x {cfg.seq_len} = {step_tokens} tokens; raise --max_tokens or lower those")
    if cfg.wandb_log and importlib.util.find_spec("wandb") is None:
        fail("--wandb_log true needs the wandb package; pip install wandb (or --wandb_log false)")
    cfg.out_dir = resolve_out_dir(cfg)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0  # torchrun --max-restarts: continue
    if (cfg.autoresume or restarted) and cfg.init_from != "resume" and os.path.exists(f"{cfg.out_dir}/ckpt.pt"):
        cfg = autoresume_run(cfg, load_checkpoint(cfg.out_dir))
    return train(cfg) if cfg else None


def autoresume_run(cfg, ckpt):
    """--autoresume, as Composer's: out_dir's checkpoint of this phase and configuration -> the run, continued as
    --init_from resume does; finished -> None (said once; exit 0); of another phase or configuration -> refused, naming
    what differs. Keys that change nothing computed may differ, and a resumed run's checkpoint says init_from "resume"."""
    path, saved, master = os.path.join(cfg.out_dir, "ckpt.pt"), ckpt["config"], int(os.environ.get("RANK", "0")) == 0
    ignored = {"out_dir", "overwrite", "progress", "autoresume", "wandb_log", "wandb_project", "wandb_run_name", "wandb_run_id",
               *(["init_from"] if saved.get("init_from") == "resume" else [])}
    if differ := [f"{k} {saved[k]!r} there, {v!r} here" for k, v in vars(cfg).items()
                  if k in saved and k not in ignored and saved[k] != v]:
        fail(f"--autoresume: {path} was run with another configuration ({'; '.join(differ)}); rerun it with its "
             "settings, or give another --out_dir")
    if ckpt["step"] >= phase_budget(cfg, ckpt["phase1_tokens"])[1]:
        if master:
            print(f"detour: {cfg.out_dir} is finished (step {ckpt['step']}, {ckpt['tokens']:,} tokens); nothing to do")
        return None
    if master:
        print(f"detour: autoresume: continuing {path} from step {ckpt['step']}")
    wandb_run = cfg.wandb_run_id or saved.get("wandb_run_id") or ""  # the requeued job logs into its own W&B run
    return SimpleNamespace(**{**vars(cfg), "init_from": "resume", "wandb_run_id": wandb_run})


if __name__ == "__main__":
    main(sys.argv[1:])
