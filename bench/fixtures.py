"""Helpers that the tests and the bench scripts share: toy training data and a reference for the varlen kernel.
Import as `from bench.fixtures import ...` with the repository root on sys.path (`python -m pytest` from the root puts
it there; a bench script run as a file adds it)."""
import json
import os

import numpy as np
import torch


def write_tiny_data(directory, n_train_docs=600, n_val_docs=40, vocab=256, seed=0):
    """A packed stream of learnable toy documents ([CLS] arithmetic sequence [SEP]) with a
    meta.json like data/prepare.py writes; no tokenizer needed for training."""
    rng = np.random.default_rng(seed)

    def stream(n_docs):
        out = []
        for _ in range(n_docs):
            a, d, length = rng.integers(5, vocab - 56), rng.integers(1, 4), rng.integers(10, 120)
            out += [2] + [5 + (a + d * i) % (vocab - 56) for i in range(length)] + [3]
        return np.array(out, dtype=np.uint16)

    os.makedirs(directory, exist_ok=True)
    stream(n_train_docs).tofile(os.path.join(directory, "train.bin"))
    stream(n_val_docs).tofile(os.path.join(directory, "val.bin"))
    meta = dict(vocab_size=vocab, dtype="uint16", pad_token_id=0, unk_token_id=1, cls_token_id=2,
                sep_token_id=3, mask_token_id=4, eos_token_id=3, tokenizer="tokenizer.json")
    with open(os.path.join(directory, "meta.json"), "w") as f:
        json.dump(meta, f)
    return directory


def per_document_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, -1)):
    """A reference for torch.nn.attention.varlen.varlen_attn, written from its documentation: on
    (tokens, H, D) tensors, attention inside each sequence [cu[i], cu[i+1]), key j seen by query i
    when i - left <= j <= i + right (-1: unbounded). One SDPA call per document, on the CPU."""
    assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and max_q == max_k == cu_q.diff().max()
    left, right = window_size
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None, :]
        ok = ((left < 0) | (j >= i - left)) & ((right < 0) | (j <= i + right))
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (q, k, v)), attn_mask=ok).transpose(0, 1)
    return out
