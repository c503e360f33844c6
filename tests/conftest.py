import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "data"))
# One thread, here and in every subprocess a test starts: the bitwise resume tests compare two
# processes, and multi-threaded CPU reductions are not guaranteed to sum in the same order
# across processes (seen failing with 2 threads); the tiny test models are faster on one anyway.
os.environ["OMP_NUM_THREADS"] = "1"

import torch

torch.set_num_threads(1)

import json

import numpy as np
import pytest


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


@pytest.fixture
def tiny_data(tmp_path):
    return write_tiny_data(str(tmp_path / "data"))


# Small, fast training settings shared by the training tests.
TINY_RUN = ["--preset", "tiny", "--seq_len", "64", "--batch_size", "4", "--global_batch_size", "8",
            "--learning_rate", "3e-3", "--warmup_tokens", "1024", "--progress", "false",
            "--eval_interval", "4", "--eval_tokens", "1024", "--log_interval", "1", "--grad_clip", "1.0"]
