import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # `python -m pytest` puts it on sys.path
# One thread, here and in every subprocess a test starts: the bitwise resume tests compare two
# processes, and multi-threaded CPU reductions are not guaranteed to sum in the same order
# across processes (seen failing with 2 threads); the tiny test models are faster on one anyway.
os.environ["OMP_NUM_THREADS"] = "1"

import torch

torch.set_num_threads(1)

import pytest

from bench.fixtures import write_tiny_data


@pytest.fixture
def tiny_data(tmp_path):
    return write_tiny_data(str(tmp_path / "data"))


# Small, fast training settings shared by the training tests.
TINY_RUN = ["--init_from", "scratch", "--preset", "tiny", "--seq_len", "64", "--batch_size", "4", "--global_batch_size", "8",
            "--learning_rate", "3e-3", "--warmup_tokens", "1024", "--progress", "false",
            "--eval_interval", "4", "--eval_tokens", "1024", "--log_interval", "1", "--grad_clip", "1.0"]


def without(args, *keys):
    """args less the given --keys and their values: a key that does not act in a run is refused,
    so a run from a checkpoint drops --preset, and a decay drops Phase 1's own keys too."""
    kept = []
    for key, value in zip(args[::2], args[1::2]):
        kept += [] if key in keys else [key, value]
    return kept


# from a checkpoint or an HF directory (the test's --init_from): it brings its shape
TINY_INIT = without(TINY_RUN, "--init_from", "--preset")
# a decay (the test's --init_from): Phase 1's keys do not act
TINY_DECAY = without(TINY_RUN, "--init_from", "--preset", "--warmup_tokens")
