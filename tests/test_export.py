"""The HF export is a complete transformers checkpoint (fill-mask pipeline, task heads, the
tokenizer gives prepare.py's ids), and the end-of-phase samples are deterministic."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import detour
from data import prepare

TINY = ["--init_from", "scratch", "--preset", "tiny", "--seq_len", "64", "--batch_size", "4", "--global_batch_size", "8", "--progress", "false",
        "--eval_interval", "4", "--eval_tokens", "512", "--warmup_tokens", "512", "--learning_rate", "3e-3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """data/prepare.py on 300 generated documents, a tiny clm run on it and its decay."""
    root = str(tmp_path_factory.mktemp("export"))
    data, clm = os.path.join(root, "data"), os.path.join(root, "clm")
    prepare.main(["--register", "bio", "--n_docs", "300", "--vocab_size", "512", "--val_fraction", "0.05", "--out_dir", data])
    detour.main(["--data_dir", data, "--out_dir", clm, "--max_tokens", "4096", *TINY])
    detour.main(["--phase", "decay", "--init_from", clm, "--decay_tokens", "1024", "--progress", "false"])
    return dict(data=data, clm=clm, decay=clm + "-decay")


def test_export_works_in_transformers_pipelines(runs):
    transformers = pytest.importorskip("transformers")
    hf = os.path.join(runs["decay"], "hf")
    assert {"tokenizer_config.json", "special_tokens_map.json", "tokenizer.json"} <= set(os.listdir(hf))
    predictions = transformers.pipeline("fill-mask", model=hf)("The patient was given [MASK] for the pain.")
    assert len(predictions) == 5 and all("token_str" in p for p in predictions)
    for auto in (transformers.AutoModelForTokenClassification, transformers.AutoModelForSequenceClassification):
        model = auto.from_pretrained(hf, num_labels=3)
        assert model(torch.tensor([[2, 100, 3]])).logits.shape[-1] == 3
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    assert (tok.mask_token, tok.cls_token, tok.sep_token, tok.pad_token) == ("[MASK]", "[CLS]", "[SEP]", "[PAD]")
    val = np.fromfile(os.path.join(runs["data"], "val.bin"), dtype=np.uint16).tolist()
    with open(os.path.join(runs["data"], "val.txt")) as f:
        first, second = f.readline().rstrip("\n"), f.readline().rstrip("\n")
    ids = tok(first).input_ids  # [CLS] document [SEP], as prepare.py wrote it
    assert ids == val[:len(ids)] and ids[0] == 2 and ids[-1] == 3
    assert tok(second).input_ids == val[len(ids):len(ids) + len(tok(second).input_ids)]
    assert tok("a [MASK] b").input_ids[1:-1] == [tok("a").input_ids[1], 4, tok(" b").input_ids[1]]


def test_samples_are_printed_and_deterministic(runs, capsys):
    capsys.readouterr()
    model = detour.load_hf(os.path.join(runs["clm"], "hf")).eval()
    ids = np.fromfile(os.path.join(runs["data"], "val.bin"), dtype=np.uint16)[:20].astype(int).tolist()
    state = torch.get_rng_state()
    assert detour.generate(model, ids[:8], 6) == detour.generate(model, ids[:8], 6)
    assert len(detour.generate(model, ids[:8], 6)) == 6
    fills = detour.fill_masks(model, ids, [3, 7, 11])
    assert fills == detour.fill_masks(model, ids, [3, 7, 11]) and len(fills) == 3 and all(len(f) == 3 for f in fills)
    assert torch.equal(state, torch.get_rng_state())  # no random number drawn
    # the runs printed their samples: two greedy continuations after clm, two masked sentences after decay
    out = []
    for phase, extra in (("clm", ["--max_tokens", "1024"]), ("mlm", ["--max_tokens", "1024"])):
        detour.main(["--data_dir", runs["data"], "--out_dir", os.path.join(runs["data"], "..", phase + "2"),
                     "--phase", phase, *extra, *TINY])
        out.append(capsys.readouterr().out)
    assert out[0].count("sample (clm, greedy): ") == 2 and out[1].count("sample (mlm): ") == 2
    assert out[1].count("[MASK]") == 6 and out[1].count("top-3 fills") == 2


def test_quick_start_at_toy_size(tmp_path):
    """The README's quick start, as a user runs it (prepare with no corpus given: the general and the bio corpus;
    runs/theta0.sh; then clm from θ0, then decay, every other constant at its default), shrunk to a toy corpus and
    budget: the defaults fit together, and the CLM run scores θ0 on the bio text before its first step."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    data, clm = str(tmp_path / "data"), str(tmp_path / "clm")
    budget = 10 * detour.DEFAULTS["global_batch_size"] * detour.DEFAULTS["seq_len"]  # ten optimizer steps
    theta0 = dict(DATA=data, OUT=str(tmp_path))  # runs/theta0.sh's paths; ten steps of θ0's MLM, one of its decay
    commands = [["data/prepare.py", "--n_docs", "200", "--val_fraction", "0.05", "--out_dir", data],
                ["runs/theta0.sh", "--max_tokens", "40960"],
                ["detour.py", "--phase", "clm", "--data_dir", os.path.join(data, "bio"), "--init_from",
                 str(tmp_path / "theta0" / "hf"), "--out_dir", clm, "--max_tokens", str(budget)],
                ["detour.py", "--phase", "decay", "--init_from", clm]]
    outputs = []
    for argv in commands:
        launcher = ["bash"] if argv[0].endswith(".sh") else [sys.executable]
        done = subprocess.run([*launcher, *argv], cwd=root, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **theta0})
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(done.stdout)
    for run, phase in ((clm, "clm"), (clm + "-decay", "decay")):
        with open(os.path.join(run, "log.jsonl")) as f:
            last = [json.loads(line) for line in f][-1]
        assert {"val_loss", "val_acc", "val_unigram"} <= set(last)  # every loss next to its unigram
        assert os.path.exists(os.path.join(run, "hf", "model.safetensors"))
    assert outputs[2].count("sample (clm, greedy): ") == 2 and outputs[3].count("top-3 fills") == 2
    with open(os.path.join(clm, "log.jsonl")) as f:
        start = json.loads(f.readline())  # θ0 on the bio text, scored as the decays are, beside its unigram
    assert set(start) == {"step", "tokens", "start_val_loss", "start_val_acc", "start_val_unigram"}
    assert start["step"] == 0 and f"{start['start_val_loss']:.4f} (unigram" in outputs[2]
