"""studies/analysis.py (CKA, weight drift, transplants) on tiny random models built here."""
import json
import math
import os
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

import detour
import finetune as ft
from studies import analysis as an
from test_finetune import FAST, WORDS, fast, make_ckpt, make_task_dir, one_thread, write  # noqa: F401 (fixtures)


def make_texts(path, n_lines=40, seed=0):
    """Held-out-like text: every line two sentences of random words."""
    rng = random.Random(seed)
    sentence = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) + " ."
    return write(path, "".join(f"{sentence()} {sentence()}\n" for _ in range(n_lines)))


def params(path):
    return dict(detour.load_hf(detour.hf_dir(path)).named_parameters())


@pytest.fixture
def settings():
    """The fast test protocol with the analysis' own options."""
    return an.Analysis(**FAST)


# ----------------------------------------------------------------------------------------
# linear CKA
# ----------------------------------------------------------------------------------------
def test_cka_properties():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 8)), rng.normal(size=(200, 5))
    y = np.hstack([y, x[:, :3] + 0.5 * rng.normal(size=(200, 3))])  # related to x, but not the same
    assert an.linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)
    q, _ = np.linalg.qr(rng.normal(size=(8, 8)))  # a random orthogonal matrix
    assert an.linear_cka(x @ q, y) == pytest.approx(an.linear_cka(x, y), abs=1e-12)   # rotation
    assert an.linear_cka(3.7 * x, y) == pytest.approx(an.linear_cka(x, y), abs=1e-12)  # isotropic scale
    assert an.linear_cka(x @ q * 0.01, x) == pytest.approx(1.0, abs=1e-12)
    assert 0.1 < an.linear_cka(x, y) < 0.9
    # independent features, n >> d: E[CKA] is about sqrt(p q) / n = 8 / 5000
    a, b = rng.normal(size=(5000, 8)), rng.normal(size=(5000, 8))
    assert an.linear_cka(a, b) < 0.01
    # a column offset changes nothing: columns are centered
    assert an.linear_cka(x + 5.0, y) == pytest.approx(an.linear_cka(x, y), abs=1e-12)


def test_cka_by_hand():
    # X = [0, 1, 2]' -> centered [-1, 0, 1]'; Y = [[0, 0], [1, 0], [0, 1]] -> centered
    # [[-1/3, -1/3], [2/3, -1/3], [-1/3, 2/3]] (column means 1/3).
    # Y'X = [1/3 + 0 - 1/3, 1/3 + 0 + 2/3] = [0, 1]            -> ||Y'X||^2 = 1
    # X'X = [2]                                                 -> ||X'X|| = 2
    # Y'Y = [[2/3, -1/3], [-1/3, 2/3]]                          -> ||Y'Y|| = sqrt(10/9) = sqrt(10)/3
    # CKA = 1 / (2 sqrt(10) / 3) = 3 / (2 sqrt(10)) = 0.4743416...
    x = [[0.0], [1.0], [2.0]]
    y = [[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]
    assert an.linear_cka(x, y) == pytest.approx(3 / (2 * math.sqrt(10)), abs=1e-12)
    assert an.linear_cka(x, y) == pytest.approx(0.4743416, abs=1e-7)
    assert an.linear_cka(y, x) == pytest.approx(an.linear_cka(x, y), abs=1e-12)  # symmetric


def test_sentences_chunks_and_padding(tmp_path, settings):
    path, tok = make_ckpt(tmp_path / "m")
    t = write(tmp_path / "t.txt", "the patient took aspirin . was given warfarin daily .\n\n"
                                  + " ".join(["metformin"] * 40) + "\n")
    p = replace(settings, max_len=24)
    ex = an.text_examples(p, tok, t)
    long = tok.encode(" ".join(["metformin"] * 40), add_special_tokens=False).ids
    assert ex[0]["ids"] == [2] + tok.encode("the patient took aspirin .", add_special_tokens=False).ids + [3]
    assert len(ex) == 2 + math.ceil(len(long) / 22) > 3 and all(len(e["ids"]) <= 24 for e in ex)
    assert [i for e in ex[2:] for i in e["ids"][1:-1]] == long  # the chunks cover the long text
    # pooling excludes padding: an example alone and padded in a batch pool the same
    model, _ = detour.load_encoder(path)
    alone = an.layer_features(p, model, ex[:1])
    batched = an.layer_features(p, model, ex)
    assert len(alone) == 3 and alone[0].shape == (1, 32) and batched[0].shape == (len(ex), 32)
    for a, b in zip(alone, batched):
        assert a.dtype == np.float64 and np.allclose(a[0], b[0], atol=1e-5)


# ----------------------------------------------------------------------------------------
# the three modes
# ----------------------------------------------------------------------------------------
def test_cka_divergence_table(tmp_path, settings):
    p = replace(settings, out_dir=str(tmp_path / "out"))
    a, _ = make_ckpt(tmp_path / "a", seed=0)
    b, _ = make_ckpt(tmp_path / "b", seed=1)
    t = make_texts(tmp_path / "texts.txt")
    same = an.cka_divergence(p, [a, a], t)
    assert [r["layer"] for r in same["rows"]] == ["embeddings", "layer 0", "layer 1"]
    assert all(r["d_ab"] == pytest.approx(0.0, abs=1e-9) for r in same["rows"]) and "r" not in same["rows"][0]
    res = an.cka_divergence(p, [a, b, a], t)  # C = A: the "seed noise" d(B, C) is d(A, B), r = 1
    assert res["n_texts"] == 80 and res["checkpoints"] == dict(A=a, B=b, C=a)
    for r in res["rows"]:
        assert 0 < r["d_ab"] <= 1 and r["d_bc"] == pytest.approx(r["d_ab"]) and r["r"] == pytest.approx(1.0)
    saved = json.load(open(tmp_path / "out" / "cka.json"))
    md = open(tmp_path / "out" / "cka.md").read()
    assert saved["rows"] == res["rows"] and "| layer 1 |" in md and "r = d(A, B) / d(B, C)" in md


def test_cka_needs_three_sentences_that_differ(tmp_path, settings):
    """One sentence made d = 0.0 at every layer (centered features are 0: CKA is 0/0, and max(0, 1 - nan) = 0);
    two make CKA 1 whatever the checkpoints. Both are refused, naming the minimum; so is an undefined CKA."""
    p = replace(settings, out_dir=str(tmp_path / "out"))
    a, _ = make_ckpt(tmp_path / "a", seed=0)
    b, _ = make_ckpt(tmp_path / "b", seed=1)
    rng = np.random.default_rng(0)
    assert math.isnan(an.linear_cka(rng.normal(size=(1, 4)), rng.normal(size=(1, 4))))
    assert an.linear_cka(rng.normal(size=(2, 4)), rng.normal(size=(2, 4))) == pytest.approx(1.0)
    assert an.linear_cka(rng.normal(size=(3, 4)), rng.normal(size=(3, 4))) < 1 - 1e-6
    for n in (1, 2):
        texts = write(tmp_path / f"t{n}.txt", "".join(f"the patient took {w} .\n" for w in WORDS[:n]))
        with pytest.raises(SystemExit, match=f"holds {n} sentences; CKA needs at least 3"):
            an.cka_divergence(p, [a, b], texts)
    same = write(tmp_path / "same.txt", "the patient took aspirin .\n" * 3)  # every feature the same
    with pytest.raises(SystemExit, match="CKA at the embeddings of .* is undefined"):
        an.cka_divergence(p, [a, b], same)
    assert not os.path.exists(tmp_path / "out")


def test_drift_is_zero_except_where_perturbed(tmp_path):
    proto = an.Analysis(out_dir=str(tmp_path / "out"))
    a, _ = make_ckpt(tmp_path / "a", seed=0)
    model = detour.load_hf(a)
    parts, tensors = an.weight_drift(model, model)
    assert all(v == 0 for v in parts.values()) and len(parts) == 2 + 2 * 2
    assert tensors["decoder.bias"] is None and tensors["model.layers.0.attn.Wo.weight"] == 0  # 0 at init
    moved = detour.load_hf(a)
    layer = moved.model.layers[1]
    with torch.no_grad():
        for p in [*layer.mlp.parameters(), layer.mlp_norm.weight]:
            p.mul_(1.5)  # every MLP tensor of layer 1 grows by half: drift exactly 0.5
    detour.save_hf(moved, str(tmp_path / "moved"))
    res = an.drift(proto, [str(tmp_path / "moved"), a])
    assert res["layers"][1]["mlp"] == pytest.approx(0.5)
    assert res["tensors"]["model.layers.1.mlp_norm.weight"] == pytest.approx(0.5)
    assert res["embeddings"] == res["head"] == res["layers"][0]["attn"] == res["layers"][0]["mlp"] == 0
    assert res["layers"][1]["attn"] == 0  # mlp_norm is MLP; attn_norm and attention untouched
    md = open(tmp_path / "out" / "drift.md").read()
    assert "layer  1 attn 0.0000" in md and "mlp 0.5000 " + "█" * 24 in md
    assert an.bar(0.5, 1.0, width=4) == "██  " and an.bar(1 / 8, 1.0, width=4) == "▌   "
    with pytest.raises(SystemExit, match="same architecture"):
        an.drift(proto, [a, str(_wider(tmp_path / "wide"))])


def _wider(directory):
    model = detour.ModernBERT(detour.Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        local_attention=16, max_position_embeddings=128, pad_token_id=0, unk_token_id=1, cls_token_id=2,
        sep_token_id=3, mask_token_id=4))
    detour.save_hf(model, str(directory))
    return directory


def test_transplant_takes_exactly_the_group(tmp_path):
    a, _ = make_ckpt(tmp_path / "a", seed=0)
    b, _ = make_ckpt(tmp_path / "b", seed=1)
    donor, recipient = detour.load_hf(a), detour.load_hf(b)
    pa, pb = dict(donor.named_parameters()), dict(recipient.named_parameters())
    for spec, from_a in (("0-0", lambda n: n.startswith("model.layers.0.")),
                         ("attn", lambda n: ".attn." in n or ".attn_norm." in n),
                         ("mlp", lambda n: ".mlp." in n or ".mlp_norm." in n),
                         ("embeddings", lambda n: n.startswith("model.embeddings.")),
                         ("embeddings,0", lambda n: n.startswith(("model.embeddings.", "model.layers.0.")))):
        hybrid = an.transplant_model(donor, recipient, spec)
        for name, p in hybrid.named_parameters():
            assert torch.equal(p, (pa if from_a(name) else pb)[name]), (spec, name)
        assert sum(from_a(n) for n in pa) == len(an.group_names(recipient, spec)) > 0
    assert torch.equal(hybrid.decoder.weight, pa["model.embeddings.tok_embeddings.weight"])  # still tied
    assert all(torch.equal(p, pb[n]) for n, p in recipient.named_parameters())  # the recipient is untouched
    for bad in ("2-3", "x", "", "x,embeddings"):
        with pytest.raises(SystemExit, match="--layers"):
            an.group_names(recipient, bad)


# the fast settings on the command line, except those the CPU default decides when they are not given, and the
# bootstrap's (a transplant of one task has too few units for one: the option would not act, and is refused)
QUICK = [f"--{k}={v}" for k, v in FAST.items() if k not in ft.CPU_DEFAULTS + ("bootstrap_samples",)]

def test_cli_modes_end_to_end(tmp_path):
    a, _ = make_ckpt(tmp_path / "a", seed=0)
    b, _ = make_ckpt(tmp_path / "b" / "hf", seed=1)  # a detour out_dir: b/hf
    b = str(tmp_path / "b")
    out = str(tmp_path / "out")
    common = ["--ckpts", f"{a},{b}", "--out_dir", out]
    an.main(["--analysis", "cka", "--texts", make_texts(tmp_path / "t.txt"), "--batch_size=8", "--max_len=64", *common])
    an.main(["--analysis", "drift", *common])
    task = make_task_dir(tmp_path / "c", "cls", n=(16, 8, 8))
    res = an.main(["--analysis", "transplant", "--layers", "0-0", "--tasks", f"drugs=cls:{task}",
                   "--seeds", "1", *common, *QUICK])
    for name in ("cka", "drift", "transplant-0-0"):
        assert os.path.exists(os.path.join(out, name + ".md")) and os.path.exists(os.path.join(out, name + ".json"))
    hybrid = os.path.join(out, "transplant-0-0")
    # probed through a copy of the protocol: nothing global is set, so nothing needs restoring
    assert res["checkpoints"] == [a, hybrid, b] and res["protocol"]["probe"] is True and ft.Protocol().probe is False
    assert all(r["probe"] for r in res["tasks"]) and "layers 0-0 from" in open(hybrid + ".md").read()
    model, tok = detour.load_encoder(hybrid)  # the hybrid is an HF dir with the tokenizer
    pa, pb = params(a), params(b)
    for name, p in model.named_parameters():
        assert torch.equal(p, (pa if name.startswith("model.layers.0.") else pb)[name]), name
    with pytest.raises(SystemExit, match="--analysis 'nope' must be one of cka "):
        an.main(["--analysis", "nope"])
    with pytest.raises(SystemExit, match="--analysis '' must be one of"):  # no fine-tuning here
        an.main(["--ckpts", f"{a},{b}"])
    with pytest.raises(SystemExit, match="unknown option --analysis"):  # finetune.py only fine-tunes
        ft.main(["--analysis", "cka"])
    with pytest.raises(SystemExit, match="needs --layers"):
        an.main(["--analysis", "transplant", "--layers", "", *common])
    with pytest.raises(SystemExit, match="needs --ckpts CHECKPOINT,INIT"):
        an.main(["--analysis", "drift", "--ckpts", a])


def test_transplant_per_replicate_pair(tmp_path):
    """A1+A2,B1+B2: one hybrid per replicate pair (layers from A_k, the rest from B_k), probed as an arm."""
    a1, a2, b1, b2 = (str(make_ckpt(tmp_path / n, seed=s)[0]) for s, n in enumerate(("a1", "a2", "b1", "b2")))
    out, task = str(tmp_path / "out"), make_task_dir(tmp_path / "c", "cls", n=(16, 8, 8))
    res = an.main(["--analysis", "transplant", "--layers", "embeddings,0", "--tasks", f"drugs=cls:{task}",
                   "--seeds", "1", "--ckpts", f"{a1}+{a2},{b1}+{b2}", "--out_dir", out, *QUICK])
    hybrids = [os.path.join(out, "transplant-embeddings_0", r) for r in ("r1", "r2")]
    assert res["checkpoints"] == [f"{a1}+{a2}", "+".join(hybrids), f"{b1}+{b2}"]
    for hybrid, a, b in zip(hybrids, (a1, a2), (b1, b2)):
        pa, pb = params(a), params(b)
        for name, p in detour.load_encoder(hybrid)[0].named_parameters():
            assert torch.equal(p, (pa if name.startswith(("model.embeddings.", "model.layers.0.")) else pb)[name]), name
