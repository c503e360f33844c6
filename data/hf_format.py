"""The Hugging Face file format of a ModernBERT checkpoint, as plain data: model.safetensors (an 8-byte header length,
a JSON header, raw little-endian tensor bytes), the released models' config.json fields, and the tokenizer files that
AutoTokenizer and pipeline("fill-mask") read. It is a file format like the corpora and tasks beside it, so it knows
nothing of detour: detour.load_hf and detour.save_hf read and write the files (atomically), build the model, and turn
this module's ValueErrors into one-line errors.
"""
import json

import torch
from tokenizers import Tokenizer, processors

ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "F64": torch.float64, "I64": torch.int64, "I32": torch.int32}

# ModernBERT's released config.json (answerdotai/ModernBERT-base, -large): the fields detour's Config does not hold. An
# export carries them with these values (transformers' own default pooling is "cls", the released models' "mean"), or
# with an HF source's. NOT_KEPT: a source's fields that describe its file, not the model, or that the export derives.
RELEASED = dict(hidden_activation="gelu", classifier_pooling="mean", classifier_dropout=0.0,
                classifier_activation="gelu", classifier_bias=False, attention_bias=False, mlp_bias=False,
                norm_bias=False, decoder_bias=True, deterministic_flash_attn=False, gradient_checkpointing=False,
                initializer_cutoff_factor=2.0, position_embedding_type="absolute", reference_compile=True,
                sparse_prediction=False, sparse_pred_ignore_index=-100)
NOT_KEPT = ("architectures", "model_type", "rope_parameters", "transformers_version", "torch_dtype", "dtype")


def decode_safetensors(raw):
    """The bytes of a .safetensors file -> {name: tensor}; ValueError says what is wrong with them."""
    try:
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
    except (ValueError, UnicodeDecodeError):
        raise ValueError("is not a safetensors file (corrupt header)") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = (8 + n + offset for offset in info["data_offsets"])
        if end > len(raw) or info["dtype"] not in ST_DTYPES:
            raise ValueError(f"is truncated or corrupt at tensor {name!r}")
        out[name] = torch.frombuffer(bytearray(raw[start:end]), dtype=ST_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def encode_safetensors(tensors):
    """{name: tensor} -> the file's byte strings in order (header, then each tensor's bytes), for one write."""
    names = {v: k for k, v in ST_DTYPES.items()}
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, t in tensors.items():
        b = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # align tensor data to 8 bytes
    return [len(h).to_bytes(8, "little"), h, *blobs]


def source_fields(d, model_fields):
    """The fields of an HF source's config.json that the model's own fields do not cover: kept, and exported as they
    came (its classifier_pooling, id2label, ...)."""
    return {k: v for k, v in d.items() if k not in NOT_KEPT + tuple(model_fields) and not k.startswith("_")}


def config_json(fields, kept):
    """config.json of a model with detour Config `fields` (a dict): the released fields, under an HF source's `kept`
    ones, under the model's; rope_parameters carries both RoPE thetas in the newer form, the older keys stay too."""
    rope = {kind: {"rope_type": "default", "rope_theta": fields[key]} for kind, key in
            (("full_attention", "global_rope_theta"), ("sliding_attention", "local_rope_theta"))}
    return {**RELEASED, **kept, **fields, "architectures": ["ModernBertForMaskedLM"], "model_type": "modernbert",
            "tie_word_embeddings": True, "bos_token_id": fields["cls_token_id"], "eos_token_id": fields["sep_token_id"],
            "layer_norm_eps": fields["norm_eps"], "rope_parameters": rope}


def tokenizer_files(d, config):
    """{file name: text} for AutoTokenizer and pipeline("fill-mask") from a tokenizer.json's dict `d` and the model's
    special ids (`config`): [MASK] takes the space before it; [CLS] a [SEP] is added, as prepare.py stores documents,
    unless the tokenizer has a post-processor of its own."""
    names = {t["id"]: t for t in d["added_tokens"]}
    special = {f"{k}_token": names[i]["content"] for k in ("cls", "sep", "pad", "mask", "unk")
               if (i := getattr(config, f"{k}_token_id")) in names}
    names.get(config.mask_token_id, {})["lstrip"] = True
    tok, (cls, sep) = Tokenizer.from_str(json.dumps(d)), (special.get("cls_token"), special.get("sep_token"))
    if tok.post_processor is None and cls and sep:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, config.cls_token_id), (sep, config.sep_token_id)])
    hf_config = dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=config.max_position_embeddings,
                     clean_up_tokenization_spaces=False, **special)
    return {"tokenizer.json": tok.to_str(pretty=True), "tokenizer_config.json": json.dumps(hf_config, indent=2),
            "special_tokens_map.json": json.dumps(special, indent=2)}
