"""
detour.py: continued pretraining of a ModernBERT encoder with a Causal LM detour.

The paper ("A Causal Language Modeling Detour Improves Encoder Continued Pretraining")
adapts an encoder to a new domain in two phases at a fixed token budget:
  Phase 1  --phase clm    causal attention mask, next-token loss at every position
           --phase mlm    (the baseline twin) bidirectional, 30% masking
  Phase 2  --phase decay  bidirectional MLM at 15%, ~10% of the Phase-1 tokens,
                          LR 1-sqrt cooldown from peak to 10% of peak, AdamW state kept.
The two twins differ only in the Phase-1 objective: same data, same order, same schedule.

One file: the model (parameter names identical to Hugging Face ModernBertForMaskedLM),
HF-format import/export, data loading, the training loop (single process or torchrun DDP).

  python data/prepare.py                                   # embedded default corpus
  torchrun --standalone --nproc_per_node=1 detour.py --phase clm
  torchrun --standalone --nproc_per_node=1 detour.py --phase decay --init_from out/clm

Every constant below can be overridden: `--key value` or `--key=value`.
"""
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------
# Defaults. Paper values unless the comment says otherwise; the `small` preset makes the
# default run fit a 2-core CPU in a few minutes.
# ----------------------------------------------------------------------------------------
phase = "clm"              # clm | mlm (Phase 1) | decay (Phase 2)
preset = "small"           # model shape when init_from=scratch: tiny | small | base | large
init_from = "scratch"      # scratch | an HF ModernBERT dir | a detour out_dir | resume
out_dir = ""               # "" = out/<phase> (Phase 1) or <init_from>-decay (decay)
data_dir = "data/default"  # train.bin / val.bin / meta.json from data/prepare.py
overwrite = False          # allow out_dir to hold a checkpoint of another phase
# objective
mlm_rate = 0.30            # Phase-1 MLM baseline masking rate (paper: 30%)
decay_mlm_rate = 0.15      # Phase-2 masking rate (paper: 15%)
doc_mask = True            # packed documents never attend across the [SEP] boundary
# data and batch
seq_len = 256              # paper: 8192
batch_size = 16            # micro-batch, sequences per rank per forward
global_batch_size = 32     # sequences per optimizer step over all ranks (paper: 384)
max_tokens = 2_000_000     # Phase-1 budget in tokens (paper: billions)
decay_ratio = 0.10         # decay length as a fraction of Phase-1 tokens
data_seed = 42             # data order seed (paper: 42)
seed = 17                  # model init / masking seed (paper: 17)
# optimizer (decoupled AdamW)
learning_rate = 2e-4       # peak lr (paper: 2e-4; the tiny CPU preset likes more)
warmup_tokens = 200_000    # paper: 100M, then constant
min_lr_ratio = 0.10        # decay ends at 10% of peak
beta1, beta2 = 0.9, 0.98
eps = 1e-6
weight_decay = 1e-5        # paper's *fully decoupled* wd; converted for torch AdamW below
grad_clip = 1.0            # 0 = off (upstream uses none; a safety net for small runs)
freeze_layers = ""         # e.g. "0-7" or "8-14": layers that do not train in this phase
# system
device = "auto"            # auto | cpu | cuda | cuda:N
dtype = "auto"             # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
compile = False            # torch.compile the model
attn_backend = "sdpa"      # sdpa (masked SDPA)
eval_interval = 100        # steps between validation
eval_tokens = 65_536       # fixed validation budget (split over ranks)
log_interval = 10
ckpt_interval = 200        # steps between checkpoints (also written at the end)
progress = True            # tqdm bar

PRESETS = {
    # hidden, intermediate, layers, heads; ModernBERT-base/large are the released shapes
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2),
    "small": dict(hidden_size=256, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4),
    "base": dict(hidden_size=768, intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12),
    "large": dict(hidden_size=1024, intermediate_size=2624, num_hidden_layers=28, num_attention_heads=16),
}
IGNORE = -100  # target value that carries no loss


# ----------------------------------------------------------------------------------------
# Command-line overrides: `--key value` or `--key=value`, typed like the default.
# ----------------------------------------------------------------------------------------
def _convert(key, text, default):
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise SystemExit(f"error: --{key} expects true/false, got {text!r}")
    if isinstance(default, int):
        try:
            return int(float(text)) if float(text).is_integer() else int(text)
        except ValueError:
            raise SystemExit(f"error: --{key} expects an integer, got {text!r}")
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise SystemExit(f"error: --{key} expects a number, got {text!r}")
    return text


def apply_overrides(namespace, argv, prog="detour.py"):
    """Set namespace[key] from argv; unknown keys and badly typed values are one-line errors."""
    known = {k for k, v in namespace.items()
             if not k.startswith("_") and isinstance(v, (bool, int, float, str)) and k.islower()}
    i, changed = 0, {}
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise SystemExit(f"error: unexpected argument {arg!r}; use --key value or --key=value")
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
        else:
            key = arg[2:]
            if i + 1 >= len(argv):
                raise SystemExit(f"error: --{key} needs a value (e.g. --{key}=...)")
            text = argv[i + 1]
            i += 1
        i += 1
        if key not in known:
            close = [k for k in sorted(known) if k.startswith(key[:3])][:5]
            hint = f" (did you mean {', '.join('--' + c for c in close)}?)" if close else ""
            raise SystemExit(f"error: unknown option --{key}{hint}; see the constants at the top of {prog}")
        namespace[key] = changed[key] = _convert(key, text, namespace[key])
    return changed


# ----------------------------------------------------------------------------------------
# The model. Names mirror transformers' ModernBertForMaskedLM so state dicts are identical.
# ----------------------------------------------------------------------------------------
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
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def attention_masks(T, device, causal, local_half, attention_mask=None, doc_ids=None):
    """Boolean (B|1, 1, T, T) masks, True = may attend, for global and sliding-window layers.

    The one place where the CLM detour differs from MLM in the model: `causal` adds j <= i.
    A local token sees |i - j| <= local_half (64 for a 128 window); with `causal` that is
    itself and the 64 before it, as in the FlexBERT/Ettin training code (HF's decoder twin
    uses 63 before).
    """
    i = torch.arange(T, device=device)
    rel = i[None, :] - i[:, None]                      # j - i
    allowed = (rel <= 0) if causal else torch.ones(T, T, dtype=torch.bool, device=device)
    allowed = allowed[None, None]
    if doc_ids is not None:                            # packed documents stay apart
        allowed = allowed & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    if attention_mask is not None:                     # padding keys are invisible
        allowed = allowed & attention_mask.bool()[:, None, None, :]
    allowed = allowed | torch.eye(T, dtype=torch.bool, device=device)  # no empty rows (pad queries)
    local = allowed & (rel.abs() <= local_half)[None, None]
    return allowed, local


class Embeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps, bias=False)
        self.drop = nn.Dropout(c.embedding_dropout)

    def forward(self, idx):
        return self.drop(self.norm(self.tok_embeddings(idx)))


class Attention(nn.Module):
    def __init__(self, c, layer_idx):
        super().__init__()
        self.n_head, self.head_dim = c.num_attention_heads, c.hidden_size // c.num_attention_heads
        self.is_local = c.layer_types[layer_idx] == "sliding_attention"
        self.Wqkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=False)  # rows [Q; K; V]
        self.Wo = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.dropout = c.attention_dropout
        self.out_drop = nn.Dropout(c.attention_dropout)

    def forward(self, x, rope, mask):
        B, T, _ = x.shape
        q, k, v = self.Wqkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out_drop(self.Wo(y.transpose(1, 2).reshape(B, T, -1)))


class MLP(nn.Module):
    """GeGLU: Wi gives [input; gate]; the first half goes through exact (erf) GELU."""

    def __init__(self, c):
        super().__init__()
        self.Wi = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.drop = nn.Dropout(c.mlp_dropout)
        self.Wo = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        inp, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.drop(F.gelu(inp) * gate))


class Layer(nn.Module):
    def __init__(self, c, layer_idx):
        super().__init__()
        # Layer 0 has no attention norm: the embedding LayerNorm just ran (as upstream).
        self.attn_norm = nn.Identity() if layer_idx == 0 else nn.LayerNorm(c.hidden_size, eps=c.norm_eps, bias=False)
        self.attn = Attention(c, layer_idx)
        self.mlp_norm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps, bias=False)
        self.mlp = MLP(c)

    def forward(self, x, rope, mask):
        x = x + self.attn(self.attn_norm(x), rope, mask)
        return x + self.mlp(self.mlp_norm(x))


class Encoder(nn.Module):
    """The body (HF `ModernBertModel`): embeddings, layers, final norm."""

    def __init__(self, c):
        super().__init__()
        self.config = c
        self.embeddings = Embeddings(c)
        self.layers = nn.ModuleList([Layer(c, i) for i in range(c.num_hidden_layers)])
        self.final_norm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps, bias=False)

    def forward(self, idx, attention_mask=None, causal=False, doc_ids=None, output_hidden_states=False):
        """idx (B, T) -> final hidden states (B, T, d); with output_hidden_states also the list
        [embedding output, layer 1 output, ..., layer L output] (before the final norm)."""
        c, (B, T) = self.config, idx.shape
        head_dim = c.hidden_size // c.num_attention_heads
        full, local = attention_masks(T, idx.device, causal, c.local_attention // 2, attention_mask, doc_ids)
        ropes = {"full_attention": rope_cos_sin(c.global_rope_theta, head_dim, T, idx.device),
                 "sliding_attention": rope_cos_sin(c.local_rope_theta, head_dim, T, idx.device)}
        x = self.embeddings(idx)
        hidden = [x]
        for layer, kind in zip(self.layers, c.layer_types):
            x = layer(x, ropes[kind], local if kind == "sliding_attention" else full)
            if output_hidden_states:
                hidden.append(x)
        x = self.final_norm(x)
        return (x, hidden) if output_hidden_states else x


class Head(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps, bias=False)

    def forward(self, x):
        return self.norm(F.gelu(self.dense(x)))


class ModernBERT(nn.Module):
    """ModernBertForMaskedLM with one extra switch: `causal`."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Encoder(config)
        self.head = Head(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        self.decoder.weight = self.model.embeddings.tok_embeddings.weight  # tied
        self.apply(self._init_weights)

    def _init_weights(self, module):
        # Truncated normal at 2 std; output projections scaled down with depth (as upstream).
        c = self.config
        std_in, std_out = c.initializer_range, c.initializer_range / math.sqrt(2.0 * c.num_hidden_layers)
        if isinstance(module, nn.Embedding):
            nn.init.trunc_normal_(module.weight, std=std_in, a=-2 * std_in, b=2 * std_in)
        elif isinstance(module, nn.Linear):
            is_out = any(module is m for m in self._out_projections())
            std = std_out if is_out else std_in
            if module is not self.decoder:  # the decoder weight *is* the embedding
                nn.init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def _out_projections(self):
        if not hasattr(self, "head"):
            return []
        outs = [self.head.dense]
        for layer in self.model.layers:
            outs += [layer.attn.Wo, layer.mlp.Wo]
        return outs

    def forward(self, idx, targets=None, causal=False, attention_mask=None, doc_ids=None):
        """Returns (logits, loss).

        Without targets: dense logits (B, T, V), loss None.
        With targets (B, T; IGNORE = no loss): the head runs only on supervised positions
        (sparse prediction: for MLM that is 15-30% of tokens) and logits are (N, V) for those.
        CLM and MLM share this code: the caller decides `causal` and what the targets are.
        """
        h = self.model(idx, attention_mask=attention_mask, causal=causal, doc_ids=doc_ids)
        if targets is None:
            return self.decoder(self.head(h)), None
        keep = targets.reshape(-1) != IGNORE
        logits = self.decoder(self.head(h.reshape(-1, h.size(-1))[keep]))
        loss = F.cross_entropy(logits.float(), targets.reshape(-1)[keep])
        return logits, loss

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


# ----------------------------------------------------------------------------------------
# Hugging Face format: config.json + model.safetensors, read and written with a few lines
# (an 8-byte header length, a JSON header, raw little-endian tensor bytes).
# ----------------------------------------------------------------------------------------
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32}


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    try:
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
    except (ValueError, UnicodeDecodeError):
        raise SystemExit(f"error: {path} is not a safetensors file (corrupt header); re-export or re-download it")
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if base + end > len(raw) or info["dtype"] not in _ST_DTYPES:
            raise SystemExit(f"error: {path} is truncated or corrupt at tensor {name!r}; re-export or re-download it")
        t = torch.frombuffer(bytearray(raw[base + start:base + end]), dtype=_ST_DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    return out


def write_safetensors(tensors, path):
    names = {v: k for k, v in _ST_DTYPES.items()}
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, t in tensors.items():
        b = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # align tensor data to 8 bytes
    _atomic_write(path, lambda f: [f.write(len(h).to_bytes(8, "little")), f.write(h), *map(f.write, blobs)])


def _atomic_write(path, write_fn):
    """Write to a temp file in the same directory, fsync, rename: never a half-written file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write_fn(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def config_from_hf(d):
    """Config from an HF config.json dict, in the older (global_rope_theta, ...) or the
    newer (layer_types, rope_parameters) form."""
    if d.get("model_type") != "modernbert":
        raise SystemExit(f"error: config.json has model_type={d.get('model_type')!r}, not 'modernbert'; "
                         "detour loads ModernBERT checkpoints only")
    kw = {f.name: d[f.name] for f in fields(Config) if f.name in d and d[f.name] is not None}
    rp = d.get("rope_parameters") or {}
    if "full_attention" in rp:
        kw["global_rope_theta"] = rp["full_attention"].get("rope_theta", Config.global_rope_theta)
    if "sliding_attention" in rp:
        kw["local_rope_theta"] = rp["sliding_attention"].get("rope_theta", Config.local_rope_theta)
    for bad in ("norm_bias", "attention_bias", "mlp_bias", "classifier_bias"):
        if d.get(bad):
            raise SystemExit(f"error: config.json sets {bad}=true; detour's ModernBERT has no biases there")
    if d.get("hidden_activation", "gelu") != "gelu":
        raise SystemExit("error: config.json hidden_activation is not 'gelu'; unsupported")
    return Config(**kw)


def config_to_hf(c):
    d = asdict(c)
    d.update(model_type="modernbert", architectures=["ModernBertForMaskedLM"],
             bos_token_id=c.cls_token_id, eos_token_id=c.sep_token_id,
             hidden_activation="gelu", classifier_activation="gelu", norm_bias=False,
             attention_bias=False, mlp_bias=False, decoder_bias=True, classifier_bias=False,
             tie_word_embeddings=True, initializer_cutoff_factor=2.0,
             rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": c.global_rope_theta},
                              "sliding_attention": {"rope_type": "default", "rope_theta": c.local_rope_theta}})
    for k in ("global_rope_theta", "local_rope_theta", "global_attn_every_n_layers", "unk_token_id"):
        d.pop(k)  # newer transformers rejects unknown keys in strict mode; layer_types carries the pattern
    return d


def load_hf(directory):
    """An HF ModernBERT directory (config.json + model.safetensors) -> ModernBERT."""
    cfg_path, st_path = os.path.join(directory, "config.json"), os.path.join(directory, "model.safetensors")
    for p in (cfg_path, st_path):
        if not os.path.exists(p):
            raise SystemExit(f"error: {p} not found; point at a directory with config.json and model.safetensors")
    with open(cfg_path) as f:
        config = config_from_hf(json.load(f))
    model = ModernBERT(config)
    sd = read_safetensors(st_path)
    sd.setdefault("decoder.weight", sd.get("model.embeddings.tok_embeddings.weight"))  # tied: omitted by HF
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise SystemExit(f"error: {st_path} does not match a ModernBertForMaskedLM: "
                         f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model


def save_hf(model, directory, tokenizer_path=None):
    """Write config.json + model.safetensors (and tokenizer.json) loadable by
    transformers.AutoModelForMaskedLM.from_pretrained."""
    model = getattr(model, "_orig_mod", model)
    os.makedirs(directory, exist_ok=True)
    sd = {k: v.float() if v.is_floating_point() else v for k, v in model.state_dict().items() if k != "decoder.weight"}
    write_safetensors(sd, os.path.join(directory, "model.safetensors"))
    text = json.dumps(config_to_hf(model.config), indent=2).encode()
    _atomic_write(os.path.join(directory, "config.json"), lambda f: f.write(text))
    if tokenizer_path:
        data = open(tokenizer_path, "rb").read()
        _atomic_write(os.path.join(directory, "tokenizer.json"), lambda f: f.write(data))


def document_ids(idx, sep_token_id):
    """Document index of every token in a packed stream: [SEP] closes a document, so a
    token's id counts the [SEP]s strictly before it."""
    is_sep = (idx == sep_token_id).int()
    return torch.cumsum(is_sep, dim=1) - is_sep
