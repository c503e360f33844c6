"""finetune.py on tiny random models and tiny tasks built here (no ../shared, no data/default)."""
import json
import os
import random
from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import detour
import finetune as ft
from data import tasks, world

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # ids 0..4, as the tiny configs expect
WORDS = ["the", "patient", "took", "aspirin", "metformin", "for", "diabetes", "asthma", "daily",
         "was", "given", "warfarin", "after", "stroke", "and", "felt", "better", "worse"]


def make_tokenizer(path, vocab_size=40):
    """A BPE small enough that the longer words split into several sub-tokens."""
    rng = random.Random(0)
    text = [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(200)]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                      show_progress=False))
    tok.save(str(path))
    return tok


def make_ckpt(directory, seed=0, tokenizer=True):
    """A tiny random ModernBERT in HF format, with its tokenizer.json."""
    os.makedirs(directory, exist_ok=True)
    tok = make_tokenizer(os.path.join(directory, "tokenizer.json")) if tokenizer else None
    torch.manual_seed(seed)
    model = detour.ModernBERT(detour.Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        local_attention=16, max_position_embeddings=128, pad_token_id=0, unk_token_id=1, cls_token_id=2,
        sep_token_id=3, mask_token_id=4))
    detour.save_hf(model, str(directory))
    return str(directory), tok


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def jsonl(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


def make_task_dir(root, kind, n=(24, 8, 8), seed=0):
    """A learnable tiny task of each kind: the label is carried by one word."""
    rng = random.Random(seed)
    for split, count in zip(("train", "dev", "test"), n):
        rows, conll = [], []
        for i in range(count):
            drug = ["aspirin", "metformin", "warfarin"][i % 3]
            words = ["the", "patient", "took", drug, rng.choice(["daily", "after", "for"]), rng.choice(WORDS)]
            if kind == "ner":
                conll.append("\n".join(f"{w}\t{'B-DRUG' if w == drug else 'O'}" for w in words))
            elif kind == "cls":
                rows.append(dict(text=" ".join(words), label=drug, group=["first" if i % 2 else "second"]))
            elif kind == "multilabel":
                rows.append(dict(text=" ".join(words), label=[drug] + (["daily"] if "daily" in words else [])))
            else:
                rows.append(dict(text_a=" ".join(words[:3]), text_b=" ".join(words[3:]),
                                 label=float(["aspirin", "metformin", "warfarin"].index(drug))))
        if kind == "ner":
            write(os.path.join(root, f"{split}.tsv"), "-DOCSTART-\tO\n\n" + "\n\n".join(conll) + "\n")
        else:
            write(os.path.join(root, f"{split}.jsonl"), jsonl(rows))
    return str(root)


def load_task(p, name, kind, path, tokenizer, frozen=False):
    """One task read and checked (tasks.read_task), then encoded for fine-tuning (tasks.encode_task)."""
    return tasks.encode_task(p, tasks.read_task(name, kind, path, frozen), tokenizer)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is many times faster than two on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


FAST = dict(progress=False, batch_size=8, epochs=2, ner_epochs=2, probe_epochs=3, seeds=2,
            learning_rate=1e-3, probe_lr=1e-2, max_len=64, bootstrap_samples=2000)


@pytest.fixture
def fast():
    """A protocol with short, quiet settings for the tests."""
    return ft.Protocol(**FAST)


# ----------------------------------------------------------------------------------------
# entity-level F1 (conlleval / seqeval default semantics)
# ----------------------------------------------------------------------------------------
def test_entity_spans_rules():
    assert tasks.entity_spans(["I-X", "I-X", "O"]) == [("X", 0, 1)]          # I- without B- starts one
    assert tasks.entity_spans(["B-X", "B-X"]) == [("X", 0, 0), ("X", 1, 1)]  # adjacent: two entities
    assert tasks.entity_spans(["O", "B-X", "I-X"]) == [("X", 1, 2)]          # closed at the end
    assert tasks.entity_spans(["B-X", "I-Y", "I-Y"]) == [("X", 0, 0), ("Y", 1, 2)]
    assert tasks.entity_spans(["O", "O"]) == []


def test_entity_f1_hand_made():
    gold = [["B-DRUG", "I-DRUG", "O", "B-DOSE"], ["O", "B-DISEASE"]]
    assert tasks.entity_f1(gold, gold) == (1.0, 1.0, 1.0)
    # I-X without B-X equals B-X I-X in the default (non-strict) mode
    assert tasks.entity_f1([["B-X", "I-X"]], [["I-X", "I-X"]]) == (1.0, 1.0, 1.0)
    # B-X B-X is two entities; one merged prediction matches neither
    assert tasks.entity_f1([["B-X", "B-X"]], [["B-X", "I-X"]]) == (0.0, 0.0, 0.0)
    # right span, wrong type: wrong
    assert tasks.entity_f1([["B-DRUG", "O"]], [["B-DOSE", "O"]]) == (0.0, 0.0, 0.0)
    # empty predictions: nothing predicted, nothing found
    assert tasks.entity_f1(gold, [["O"] * 4, ["O"] * 2]) == (0.0, 0.0, 0.0)
    # one of two predictions right, one of three gold entities found
    p, r, f1 = tasks.entity_f1(gold, [["B-DRUG", "I-DRUG", "O", "O"], ["B-DISEASE", "O"]])
    assert (p, r) == (0.5, pytest.approx(1 / 3)) and f1 == pytest.approx(0.4)
    # a boundary error at the sentence end
    assert tasks.entity_f1([["O", "B-X", "I-X"]], [["O", "B-X", "O"]])[2] == 0.0


def test_other_metrics_by_hand():
    m = tasks.cls_metrics([0, 0, 1, 2], [0, 1, 1, 2])
    assert m["accuracy"] == 0.75
    assert m["macro_f1"] == pytest.approx((2 / 3 + 2 / 3 + 1) / 3)
    m = tasks.multilabel_metrics([[1, 0], [1, 1]], [[1, 1], [0, 1]])
    assert m["micro_f1"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
    assert m["macro_f1"] == pytest.approx((2 / 3 + 2 / 3) / 2)
    assert tasks.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert tasks.pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert list(tasks.ranks([10, 20, 20, 30])) == [1, 2.5, 2.5, 4]
    m = tasks.regression_metrics([1, 2, 3, 4], [1, 4, 9, 16])
    assert m["spearman"] == pytest.approx(1.0) and m["pearson"] < 1.0


def test_paired_bootstrap():
    a = [0.8, 0.7, 0.9, 0.85, 0.75, 0.8]
    assert ft.paired_bootstrap(a, a) == 1.0                        # no difference: no evidence
    # always better: the floor 1/(samples + 1), never 0
    assert ft.paired_bootstrap([x + 0.05 for x in a], a, samples=999) == pytest.approx(1 / 1000)
    noisy = [x + d for x, d in zip(a, [0.02, 0.03, -0.01, 0.04, 0.02, 0.01])]
    p = ft.paired_bootstrap(noisy, a)
    assert p < 0.05 and p == ft.paired_bootstrap(noisy, a)         # fixed RNG: reproducible
    assert ft.paired_bootstrap(a, noisy) > 0.95


def test_sign_flip_p_by_hand():
    # 3 positive differences of 3: only the observed sign pattern reaches the observed mean
    assert ft.sign_flip_p([0.01, 0.02, 0.03]) == 1 / 8
    # (+3, -1): patterns (+3,-1) mean 1, (+3,+1) mean 2 reach >= 1; (-3,+1), (-3,-1) do not
    assert ft.sign_flip_p([3.0, -1.0]) == 2 / 4
    assert ft.sign_flip_p([0.0, 0.0]) == 1.0                     # nothing to see: every pattern ties
    assert ft.sign_flip_p([-1.0, -2.0, -3.0]) == 1.0


def test_no_p_prints_below_its_floor():
    for n in (1, 3, 5, 9):
        d = [0.01 * (i + 1) for i in range(n)]                    # the most extreme data: all positive
        assert ft.sign_flip_p(d) == pytest.approx(0.5 ** n)
        assert ft.paired_bootstrap(d, [0.0] * n, samples=500) >= 1 / 501
        for p in (ft.sign_flip_p(d), ft.paired_bootstrap(d, [0.0] * n, samples=500)):
            assert float(ft.format_p(p)) > 0 and ft.format_p(p) != "0.000"


def test_t_quantile_and_interval():
    assert ft.t_quantile(0.975, 1) == pytest.approx(12.706, abs=2e-3)
    assert ft.t_quantile(0.975, 4) == pytest.approx(2.776, abs=2e-3)
    assert ft.t_quantile(0.95, 30) == pytest.approx(1.697, abs=2e-3)
    m, lo, hi = ft.mean_interval([1.0, 2.0, 3.0])
    assert m == 2.0 and hi - m == pytest.approx(4.303 * 1.0 / 3 ** 0.5, abs=1e-2) and m - lo == pytest.approx(hi - m)
    # detectable difference: (t_.95 + t_.80) sd / sqrt(n), shrinking with more units
    assert ft.detectable_difference([1.0, 2.0, 3.0] * 4) < ft.detectable_difference([1.0, 2.0, 3.0])


def compared(reps, n_tasks, seeds=2):
    """results as run() builds and compares them, from made-up scores (the first arm 4 points ahead, plus noise)
    -> (results, results.md's text); no training."""
    names, rng = [f"task{i}" for i in range(n_tasks)], random.Random(0)
    arms = [[f"A{r}" for r in range(reps)], [f"B{r}" for r in range(reps)]]
    result = {(c, n, s): dict(test=dict(main=0.5 + 0.04 * (c[0] == "A") + rng.gauss(0, 0.01)))
              for arm in arms for c in arm for n in names for s in range(seeds)}
    labels = ["+".join(arm) for arm in arms]
    results = dict(checkpoints=labels, seeds=list(range(seeds)), tasks=[
        dict(name=n, kind="cls", main="f1", probe=False) for n in names],
        scores={label: ft.arm_scores(ft.Protocol(seeds=seeds), arm, names, result) for label, arm in zip(labels, arms)})
    ft.compare(results, names, *labels, samples=500)
    return results, ft.markdown(results, 500)


def test_one_replicate_prints_no_task_interval_and_few_units_no_bootstrap_p():
    # One pretraining run per arm: a task's interval would be its fine-tuning seeds' (or [d, d] with one seed).
    for seeds in (1, 3):
        res, md = compared(reps=1, n_tasks=3, seeds=seeds)
        assert all(res["ci95"][f"task{i}"] is None for i in range(3)) and res["p_bootstrap"] is None
        assert json.loads(json.dumps(res))["ci95"]["task0"] is None                   # results.json: null
        row = next(line for line in md.splitlines() if line.startswith("| difference"))
        cells = row.strip("| ").split(" | ")[1:]
        assert [c.split(" ", 1)[1] for c in cells[:3]] == ["[n/a (1 replicate)]"] * 3, row
        lo, hi = res["ci95"]["average"]  # the average's: over the 3 task units
        assert lo < res["difference"]["average"] < hi and cells[3] == (
            f"{100 * res['difference']['average']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]")
        assert "exact sign-flip p = 0.125 (floor 1/2^3 = 0.125) (no bootstrap p below 8 units). 95% CI per task: " \
               "none, one pretraining run per arm" in md and "paired bootstrap p" not in md
    res, md = compared(reps=1, n_tasks=1)  # one unit in all: no interval for the average either
    assert res["ci95"] == {"task0": None, "average": None} and "[n/a (1 unit)] |" in md
    # Two replicates: every task has an interval; 3 tasks are 6 units, still no bootstrap p; 4 tasks are 8.
    res, md = compared(reps=2, n_tasks=3)
    assert all(lo < hi for lo, hi in res["ci95"].values()) and "n/a" not in md and res["p_bootstrap"] is None
    assert "(floor 1/2^6 = 0.016) (no bootstrap p below 8 units). 95% CI per task: t interval over the replicates" in md
    res, md = compared(reps=2, n_tasks=4)
    assert res["p_bootstrap"] == ft.paired_bootstrap(res["units"], [0.0] * 8, 500) and "n/a" not in md
    assert (f"(floor 1/2^8 = 0.0039); paired bootstrap p = {ft.format_p(res['p_bootstrap'])} (500 resamples, "
            "anti-conservative for few units). 95% CI per task: t interval over the replicates (pretraining and "
            "fine-tuning noise); for the average, over the units.") in md


# ----------------------------------------------------------------------------------------
# readers and their errors
# ----------------------------------------------------------------------------------------
def test_read_conll(tmp_path):
    p = write(tmp_path / "train.tsv", "-DOCSTART- O\n\nAspirin\tB-DRUG\n5 B-DOSE\nmg I-DOSE\n\n\nok\tO\n")
    sents = tasks.read_conll(p)
    assert [s["words"] for s in sents] == [["Aspirin", "5", "mg"], ["ok"]]
    assert sents[0]["tags"] == ["B-DRUG", "B-DOSE", "I-DOSE"] and sents[1]["lines"] == [8]
    bad = write(tmp_path / "bad.tsv", "a\tO\nlonely\n")
    with pytest.raises(SystemExit, match=f"{bad}:2"):
        tasks.read_conll(bad)
    with pytest.raises(SystemExit, match="empty"):
        tasks.read_conll(write(tmp_path / "empty.tsv", "\n\n"))


def test_read_jsonl_and_tsv(tmp_path):
    p = write(tmp_path / "a.jsonl", jsonl([dict(text="x", label="pos"), dict(text_a="q", text_b="h", label=1)]))
    rows = tasks.read_jsonl(p, "cls")
    assert (rows[0]["text"], rows[0]["label"], rows[1]["text_b"], rows[1]["label"]) == ("x", "pos", "h", "1")
    for body, msg in (('{"text": "x", "label": "a"}\n{oops\n', "not valid JSON"),
                      ('{"label": "a"}\n', "missing field `text`"),
                      ('{"text": "x"}\n', "missing field `label`")):
        bad = write(tmp_path / "bad.jsonl", body)
        with pytest.raises(SystemExit, match=f"bad.jsonl:{body.count(chr(10))}: {msg}"):
            tasks.read_jsonl(bad, "cls")
    with pytest.raises(SystemExit, match="bad.jsonl:1: label should be a finite number"):
        tasks.read_jsonl(write(tmp_path / "bad.jsonl", '{"text": "x", "label": "high"}\n'), "regression")
    # a label that is not finite would train on NaN losses and score as a number: refused, JSON and TSV alike
    for value in ("NaN", "Infinity", "-Infinity", "1e999"):
        with pytest.raises(SystemExit, match="bad.jsonl:2: label should be a finite number"):
            tasks.read_jsonl(write(tmp_path / "bad.jsonl", f'{{"text": "x", "label": 1}}\n{{"text": "y", "label": {value}}}\n'),
                             "regression")
        with pytest.raises(SystemExit, match="n.tsv:3: label should be a finite number"):
            tasks.read_tsv(write(tmp_path / "n.tsv", f"sentence\tscore\na\t0.5\nb\t{value}\n"), "regression")
    with pytest.raises(SystemExit, match="empty"):
        tasks.read_jsonl(write(tmp_path / "e.jsonl", ""), "cls")
    # TSV with a header (GAD / HoC layouts)
    t = write(tmp_path / "t.tsv", "index\tsentence\tlabel\n0\tsome text\t1\n")
    assert tasks.read_tsv(t, "cls")[0]["label"] == "1"
    h = write(tmp_path / "h.tsv", "labels\tsentence\tindex\n0_1,1_0,2_1\tsome text\tx\n")
    assert tasks.read_tsv(h, "multilabel")[0]["label"] == ["0", "2"]


def test_unknown_label_and_missing_split(tmp_path):
    _, tok = make_ckpt(tmp_path / "m")
    d = tmp_path / "cls"
    write(d / "train.jsonl", jsonl([dict(text="a", label="x"), dict(text="b", label="y")]))
    write(d / "dev.jsonl", jsonl([dict(text="a", label="x"), dict(text="b", label="z")]))
    with pytest.raises(SystemExit, match="no test split"):
        load_task(ft.Protocol(), "t", "cls", str(d), tok)
    write(d / "test.jsonl", jsonl([dict(text="a", label="x")]))
    with pytest.raises(SystemExit, match=r"dev.jsonl:2: label 'z' does not occur in the training split"):
        load_task(ft.Protocol(), "t", "cls", str(d), tok)
    n = tmp_path / "ner"
    write(n / "train.tsv", "a\tB-X\nb\tO\n")
    write(n / "devel.tsv", "a\tB-X\n\nb\tB-Y\n")
    write(n / "test.tsv", "a\tO\n")
    with pytest.raises(SystemExit, match=r"devel.tsv:3: tag 'B-Y'"):
        load_task(ft.Protocol(), "n", "ner", str(n), tok)


def test_parse_tasks():
    assert tasks.parse_tasks("chem=ner:a/b,gad=cls+probe:c", "data/tasks") == [("chem", "ner", "a/b", False, 0),
                                                              ("gad", "cls", "c", True, 0)]
    # a task's own max length: path@N (a path may hold @ elsewhere)
    assert tasks.parse_tasks("p=multilabel:x@y/z@4096,q=cls:x@y", "d") == [("p", "multilabel", "x@y/z", False, 4096),
                                                                          ("q", "cls", "x@y", False, 0)]
    with pytest.raises(SystemExit, match="task p: max length @2 must be >= 3"):
        tasks.parse_tasks("p=cls:x@2", "d")
    assert [t[0] for t in tasks.parse_tasks("default", "data/tasks")] == ["ner", "notes", "needle"]
    for bad in ("chem", "chem=ner", "x=span:a", "a=cls:x,a=ner:y", "average=cls:x"):
        with pytest.raises(SystemExit, match="error:"):
            tasks.parse_tasks(bad, "data/tasks")


# ----------------------------------------------------------------------------------------
# encoding
# ----------------------------------------------------------------------------------------
def test_first_subtoken_alignment(tmp_path):
    tok, proto = make_tokenizer(tmp_path / "tok.json"), ft.Protocol()
    words = ["the", "patient", "took", "metformin", "for", "diabetes"]
    tags = [0, 0, 0, 7, 0, 8]
    ids, target, mapped, cut = tasks.encode_words(proto, tok, words, tags)
    pieces = [tok.encode(w, add_special_tokens=False).ids for w in words]
    assert max(len(p) for p in pieces) > 1, "the test tokenizer should split some words"
    assert ids == [2] + [i for p in pieces for i in p] + [3]
    want = [detour.IGNORE]
    for p, t in zip(pieces, tags):
        want += [t] + [detour.IGNORE] * (len(p) - 1)  # the first sub-token carries the word's tag
    assert target == want + [detour.IGNORE] and mapped == [True] * 6 and not cut
    # truncation: words past max_len get no token and are predicted O
    proto = replace(proto, max_len=2 + len(pieces[0]) + len(pieces[1]))
    ids, target, mapped, cut = tasks.encode_words(proto, tok, words, tags)
    assert cut and mapped == [True, True, False, False, False, False] and len(ids) == proto.max_len


def test_encode_pairs_truncate_the_haystack(tmp_path):
    tok = make_tokenizer(tmp_path / "tok.json")
    a = tok.encode("the patient", add_special_tokens=False).ids
    p = ft.Protocol(max_len=len(a) + 5)  # room for the query and 2 haystack tokens
    ids, cut = tasks.encode(p, tok, "the patient", "the the the the the the the")
    assert cut and len(ids) == p.max_len and ids[:len(a) + 2] == [2] + a + [3] and ids[-1] == 3


# ----------------------------------------------------------------------------------------
# heads and training
# ----------------------------------------------------------------------------------------
def test_load_encoder_checks(tmp_path):
    path, _ = make_ckpt(tmp_path / "run" / "hf")
    model, tok = detour.load_encoder(str(tmp_path / "run"))  # a detour out_dir: uses out_dir/hf
    assert tok.token_to_id("[CLS]") == model.config.cls_token_id
    os.remove(os.path.join(path, "tokenizer.json"))
    with pytest.raises(SystemExit, match="tokenizer.json not found"):
        detour.load_encoder(path)
    bad = Tokenizer(models.WordLevel({"[CLS]": 0, "[PAD]": 1, "[SEP]": 3, "[UNK]": 2}, unk_token="[UNK]"))
    bad.save(os.path.join(path, "tokenizer.json"))
    with pytest.raises(SystemExit, match=r"maps \[CLS\] to 0 but the model's config says 2"):
        detour.load_encoder(path)
    with pytest.raises(SystemExit, match="not a checkpoint"):
        detour.load_encoder(str(tmp_path))


@pytest.mark.parametrize("kind", ["cls", "multilabel", "regression", "ner"])
def test_each_head_trains(kind, tmp_path, fast):
    p = replace(fast, epochs=3, ner_epochs=3)
    path, _ = make_ckpt(tmp_path / "m")
    model, tok = detour.load_encoder(path)
    task = load_task(p, kind, kind, make_task_dir(tmp_path / kind, kind), tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = ft.finetune_one(p, model, task, seed=0)
    assert r["losses"][-1] < r["losses"][0]
    assert set(r) == {"dev", "test", "epoch", "losses", "predictions"} and 1 <= r["epoch"] <= 3
    assert kind == "regression" or 0 <= r["test"]["main"] <= 1  # Pearson may be negative
    assert r["test"]["main"] == r["test"][tasks.KINDS[kind].main]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # a copy was trained
    if kind == "cls":
        assert ft.finetune_one(p, model, task, seed=0)["test"] == r["test"]          # same seed, same run


def test_probe_trains_only_the_head(tmp_path, fast):
    p = replace(fast, probe_epochs=4)
    path, _ = make_ckpt(tmp_path / "m")
    model, tok = detour.load_encoder(path)
    task = load_task(p, "c", "cls", make_task_dir(tmp_path / "c", "cls"), tok, frozen=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    feats = ft.probe_features(p, model, task)
    assert len(feats["train"]) == len(task["train"]) and feats["train"][0].shape == (32,)
    r = ft.finetune_one(p, model, task, seed=1, feats=feats)
    assert r["losses"][-1] < r["losses"][0]
    assert set(r["test"]["groups"]) == {"second", "first"}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    ner = load_task(p, "n", "ner", make_task_dir(tmp_path / "n", "ner"), tok, frozen=True)
    r = ft.finetune_one(p, model, ner, seed=0)
    assert r["losses"][-1] < r["losses"][0] and 0 <= r["test"]["f1"] <= 1


# ----------------------------------------------------------------------------------------
# the comparison, end to end
# ----------------------------------------------------------------------------------------
def test_two_checkpoints_end_to_end(tmp_path, fast):
    p = replace(fast, out_dir=str(tmp_path / "results"))
    a, _ = make_ckpt(tmp_path / "clm", seed=0)
    b, _ = make_ckpt(tmp_path / "mlm", seed=1)
    spec = (f"drugs=cls:{make_task_dir(tmp_path / 'c', 'cls', n=(16, 8, 8))},"
            f"ents=ner:{make_task_dir(tmp_path / 'n', 'ner', n=(16, 8, 8))},"
            f"pairs=regression+probe:{make_task_dir(tmp_path / 'r', 'regression', n=(16, 8, 8))}")
    results = ft.run(p, [a, b], spec)
    md = open(tmp_path / "results" / "results.md").read()
    saved = json.load(open(tmp_path / "results" / "results.json"))
    assert "| difference (first − second arm) [95% CI] |" in md and "sign-flip p = " in md and "drugs: test accuracy by group" in md
    assert saved["checkpoints"] == [a, b] and 1 / 8 <= saved["p_sign_flip"] <= 1   # 3 tasks x 1 replicate
    for ckpt in (a, b):
        for t in ("drugs", "ents", "pairs"):
            assert [r["seed"] for r in saved["scores"][ckpt][t]["runs"]] == [0, 1]
        assert len(saved["scores"][ckpt]["average"]["per_run"]) == 2
    d = results["difference"]["drugs"]
    assert d == pytest.approx(results["scores"][a]["drugs"]["mean"] - results["scores"][b]["drugs"]["mean"])


def test_replicates_are_the_unit_of_the_test(tmp_path, fast):
    """--ckpts A1+A2,B1+B2: each arm's replicates are fine-tuned alike; the test's units are the
    (task x replicate) seed-averaged differences, so 1 task x 2 replicates -> 2 units."""
    p = replace(fast, out_dir=str(tmp_path / "results"))
    a1, a2, b1, b2 = (make_ckpt(tmp_path / n, seed=s)[0] for n, s in (("a1", 0), ("a2", 1), ("b1", 2), ("b2", 3)))
    spec = f"drugs=cls:{make_task_dir(tmp_path / 'c', 'cls', n=(16, 8, 8))}"
    res = ft.run(p, [f"{a1}+{a2}", f"{b1}+{b2}"], spec)
    A, B = res["scores"][f"{a1}+{a2}"]["drugs"], res["scores"][f"{b1}+{b2}"]["drugs"]
    assert [(r["replicate"], r["seed"]) for r in A["runs"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    want = [x - y for x, y in zip(A["replicate_means"], B["replicate_means"])]
    assert res["units"] == pytest.approx(want) and len(res["units"]) == 2
    assert res["p_sign_flip"] == ft.sign_flip_p(want) and res["p_sign_flip"] >= 0.25
    lo, hi = res["ci95"]["drugs"]
    assert lo <= res["difference"]["drugs"] <= hi
    md = open(tmp_path / "results" / "results.md").read()
    assert f"| · replicate 2: {b2} |" in md                 # each replicate's seed-averaged row


def hf_task_pair(tmp_path, hf_class, pooling="mean", **kw):
    """Our TaskModel and transformers' task model from one HF directory, same classifier."""
    transformers = pytest.importorskip("transformers")
    path, _ = make_ckpt(tmp_path / "ck", seed=3)
    ours = detour.load_hf(path)
    with torch.no_grad():  # non-trivial head norm and bias, so the head's every parameter matters
        for n, p in ours.named_parameters():
            if "norm" in n or "bias" in n:
                p.add_(0.1 * torch.randn_like(p))
    detour.save_hf(ours, path)
    ref = getattr(transformers, hf_class).from_pretrained(path, num_labels=5, attn_implementation="sdpa", **kw)
    tm = ft.TaskModel(detour.load_hf(path), 5, per_token=hf_class.endswith("TokenClassification"),
                      pooling=pooling, dropout=0.0)
    tm.classifier.load_state_dict(ref.classifier.state_dict())
    ids = torch.randint(5, 96, (3, 21), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 15:], mask[2, 20:] = 0, 0  # padding present
    ids[mask == 0] = 0
    return tm.eval(), ref.eval(), ids, mask


def test_token_logits_equal_ModernBertForTokenClassification(tmp_path):
    tm, ref, ids, mask = hf_task_pair(tmp_path, "ModernBertForTokenClassification")
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        target = torch.where(mask.bool(), 0, detour.IGNORE)  # every real token is labeled
        got = tm(tm.features(ids, mask, target))
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("pool", ["mean", "cls"])
def test_sequence_logits_equal_ModernBertForSequenceClassification(pool, tmp_path):
    tm, ref, ids, mask = hf_task_pair(tmp_path, "ModernBertForSequenceClassification", pooling=pool,
                                      classifier_pooling=pool)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        got = tm(tm.features(ids, mask))
    assert (got - want).abs().max().item() < 1e-4


def test_default_tasks_are_built_and_read_back(tmp_path):
    p = ft.Protocol(tasks_dir=str(tmp_path / "tasks"), pretrain_dir=str(tmp_path / "pre"), ner_sizes="6,3,3",
                    notes_sizes="4,2,2", needle_per_cell="2,2,2", needle_lengths="20,40")
    # a sentence the "pretraining corpus" holds must not become a task example
    words, _ = world.sentence(random.Random(p.task_seed * 10))
    write(tmp_path / "pre" / "val.txt", "Some document . " + " ".join(words) + " More text .\n")
    assert tasks.pretraining_text(p.pretrain_dir).startswith("Some document")
    write(tmp_path / "pre" / "meta.json", json.dumps(dict(source="generated:world.corpus(3, 7)")))
    assert world.corpus(3, 7)[2] in tasks.pretraining_text(p.pretrain_dir)  # generated corpora are regenerated
    root = tasks.build_default_tasks(p)
    ner = os.path.join(root, "ner")
    mtime = os.path.getmtime(os.path.join(ner, "train.tsv"))
    assert tasks.build_default_tasks(p) == root and os.path.getmtime(os.path.join(ner, "train.tsv")) == mtime  # once
    sents = [s for split in ("train", "dev", "test") for s in tasks.read_conll(os.path.join(ner, f"{split}.tsv"))]
    texts = [" ".join(s["words"]) for s in sents]
    assert len(sents) == 12 and len(set(texts)) == 12 and " ".join(words) not in texts
    notes = tasks.read_jsonl(os.path.join(root, "notes", "train.jsonl"), "cls")
    assert len(notes) == 4 and all(n["label"] in world.NOTE_TYPES for n in notes)
    needle = tasks.read_jsonl(os.path.join(root, "needle", "test.jsonl"), "cls")
    assert len(needle) == 2 * 3 * 2 and {n["label"] for n in needle} == {"present", "absent"}
    for n in needle:
        assert (n["text"] in n["text_b"]) == (n["label"] == "present")
        assert n["groups"][0] in ("start", "middle", "end") and n["groups"][1] in ("20 words", "40 words")
    start = [n for n in needle if n["groups"][0] == "start" and n["label"] == "present"][0]
    assert start["text_b"].startswith(start["text"])


def test_main_errors(tmp_path):
    with pytest.raises(SystemExit, match="unknown option --nope"):
        ft.main(["--nope", "1"])
    with pytest.raises(SystemExit, match="no checkpoint found"):
        ft.main(["--ckpts", str(tmp_path / "a") + "," + str(tmp_path / "b")])


def test_max_train_and_max_eval_take_a_fixed_subset(tmp_path):
    path, _ = make_ckpt(tmp_path / "m")
    _, tok = detour.load_encoder(path)
    d = make_task_dir(tmp_path / "ner", "ner", n=(24, 8, 8))
    full = load_task(ft.Protocol(), "ner", "ner", d, tok)
    p = ft.Protocol(max_train=10, max_eval=5)
    a, b = load_task(p, "ner", "ner", d, tok), load_task(p, "ner", "ner", d, tok)
    assert (len(a["train"]), len(a["dev"]), len(a["test"])) == (10, 5, 5)
    assert [x["ids"] for x in a["train"]] == [x["ids"] for x in b["train"]]      # the same subset each time
    assert all(x["ids"] in [y["ids"] for y in full["train"]] for x in a["train"])


# ----------------------------------------------------------------------------------------
# no silent wrong result: a diverged run, one checkpoint twice, two cells in one file
# ----------------------------------------------------------------------------------------
def test_a_diverged_run_is_an_error_not_a_score(tmp_path, fast):
    path, _ = make_ckpt(tmp_path / "m")
    model, tok = detour.load_encoder(path)
    task = load_task(fast, "r", "regression", make_task_dir(tmp_path / "r", "regression"), tok)
    task["train"][0]["y"] = float("nan")  # past the readers' check, as a NaN from anywhere else would be
    with pytest.raises(SystemExit, match="r: the training loss is nan at epoch 1, step"):
        ft.finetune_one(fast, model, task, seed=0)
    head = ft.TaskModel(model, 1, False, "mean", 0.0)
    with torch.no_grad():
        head.classifier.weight.fill_(float("nan"))  # the weights a diverged run leaves
    with pytest.raises(SystemExit, match="task r: predictions on dev are not finite"):
        ft.evaluate(fast, head, task, "dev", None, torch.device("cpu"))


def test_one_checkpoint_named_twice_or_two_cells_in_one_file_are_errors(tmp_path, fast):
    a, _ = make_ckpt(tmp_path / "x" / "a")
    os.symlink(a, tmp_path / "link")
    # the X,X/ passed the check: both arms wrote one cell and the grid never completed
    for twice in ([a, a + "/"], [a, str(tmp_path / "link")], [a, str(tmp_path / "x" / "." / "a")], [f"{a}+{a}//"]):
        with pytest.raises(SystemExit, match="a checkpoint is listed twice in .*; list each once"):
            ft.arms_of(twice)
    b, _ = make_ckpt(tmp_path / "x_a", seed=1)  # another checkpoint, whose cells' directory name is a's
    spec = f"drugs=cls:{make_task_dir(tmp_path / 'c', 'cls', n=(16, 8, 8))}"
    with pytest.raises(SystemExit, match="drugs would share the cell file .*; rename a checkpoint directory or task"):
        ft.run(replace(fast, out_dir=str(tmp_path / "out")), [a, b], spec)
    assert not os.path.exists(tmp_path / "out")  # refused before anything trained


def test_the_papers_protocols_as_presets(capsys):
    p, given = ft.protocol_of(["--protocol", "paper-en", "--epochs", "3"])
    assert (p.learning_rate, p.batch_size, p.epochs, p.ner_epochs, p.warmup_ratio, p.max_len, p.pooling) == (
        5e-5, 16, 3, 20, 0.0, 8192, "mean")  # --epochs given: it wins
    assert ft.seed_list(p) == [42, 43, 44, 45, 46] and p.selection == "cls=weighted_f1,multilabel=weighted_f1"
    assert "protocol paper-en: learning_rate 5e-05" in capsys.readouterr().out
    assert ft.cpu_default(p, given) == p  # on a CPU too: a preset's fields are not shortened
    p, given = ft.protocol_of(["--protocol", "paper-fr"])
    assert (p.learning_rate, p.batch_size, p.epochs, p.warmup_ratio, p.seeds, p.max_len, p.pooling, p.pos_weight,
            p.ner_mode, p.selection) == (2e-5, 4, 15, 0.1, 9, 2048, "cls", "auto", "strict",
                                         "cls=weighted_f1,multilabel=micro_f1")
    p, given = ft.protocol_of([])  # no preset: the defaults, and on a CPU the CPU default, as before
    assert (p.protocol, p.first_seed, p.selection, p.ner_mode) == ("", 0, "", "default")
    if ft.get_device(p).type == "cpu":
        assert (ft.cpu_default(p, given).epochs, ft.cpu_default(p, given).seeds) == (3, 3)


def test_a_task_of_its_own_length(tmp_path):
    _, tok = make_ckpt(tmp_path / "m")
    d = make_task_dir(tmp_path / "c", "cls")
    task = tasks.encode_task(ft.Protocol(max_len=64), tasks.read_task("c", "cls", d, max_len=5), tok)
    assert max(len(ex["ids"]) for ex in task["train"]) == 5 and task["max_len"] == 5
