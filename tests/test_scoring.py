"""data/tasks.py's metrics against the references the papers' harnesses call (seqeval for entities, scikit-learn for
classification F1, scipy for correlations), on generated adversarial cases; then scoring from kept predictions:
a finished grid scored again in another scoring equals the grid trained in it."""
import json
import os
import random
import warnings
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats
from seqeval import metrics as seqeval
from seqeval.metrics.sequence_labeling import get_entities
from seqeval.scheme import IOB2, IOBES, Tokens
from sklearn.metrics import accuracy_score, f1_score

import finetune as ft
from data import tasks
from test_finetune import FAST, make_ckpt, make_task_dir, one_thread, write  # noqa: F401 (a fixture)

SCHEME = {"IOB2": IOB2, "IOBES": IOBES}


def sentences(rng, prefixes, n=400, longest=9):
    """Random tag sequences over `prefixes`, two types (one with a hyphen, as B-gene-protein): every adversarial
    pattern shows up (I- after O, a type change inside an entity, B- never closed by E-, E- alone, empty sentences)."""
    def tag():
        prefix = rng.choice(prefixes)
        return "O" if prefix == "O" else f"{prefix}-{rng.choice(['X', 'gene-protein'])}"
    return [[tag() for _ in range(rng.randint(0, longest))] for _ in range(n)]


def quiet(fn, *args, **kw):
    """seqeval and scikit-learn warn on 0/0 (their zero_division, 0 here too)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


# ----------------------------------------------------------------------------------------
# entities: seqeval's default mode (any scheme) and its strict mode (IOB2, IOBES)
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefixes", ["OBI", "OBIES", "OIE", "OS"])
def test_default_mode_entities_are_seqevals(prefixes):
    for tags in sentences(random.Random(prefixes), prefixes):
        assert tasks.entity_spans(tags) == quiet(get_entities, tags), tags


@pytest.mark.parametrize("scheme", ["IOB2", "IOBES"])
def test_strict_mode_entities_are_seqevals(scheme):
    for tags in sentences(random.Random(scheme), "O" + tasks.SCHEMES[scheme]):
        want = [(e.tag, e.start, e.end - 1) for e in Tokens(tags, SCHEME[scheme]).entities]  # seqeval's end: after
        assert tasks.strict_spans(tags, scheme) == want, tags


@pytest.mark.parametrize("scheme,mode", [("IOB2", "default"), ("IOB2", "strict"), ("IOBES", "default"),
                                         ("IOBES", "strict")])
def test_entity_f1_is_seqevals(scheme, mode):
    rng = random.Random(scheme + mode)
    prefixes = "O" + tasks.SCHEMES[scheme]
    for trial in range(30):
        gold = sentences(rng, prefixes, n=rng.choice([1, 5, 40]))
        pred = [[t if rng.random() < 0.6 else rng.choice(s or ["O"]) for t in s] for s in gold]  # near misses
        if trial == 0:
            pred = [["O"] * len(s) for s in gold]  # nothing predicted
        kw = dict(mode="strict", scheme=SCHEME[scheme]) if mode == "strict" else {}
        want = [quiet(fn, gold, pred, **kw) for fn in (seqeval.precision_score, seqeval.recall_score,
                                                       seqeval.f1_score)]
        assert tasks.entity_f1(gold, pred, mode, scheme) == pytest.approx(want, abs=1e-12)


def test_the_two_modes_differ_where_the_scheme_is_broken():
    """I- after O starts an entity in the default mode only; an IOBES B- never closed is one there only."""
    gold = [["B-X", "I-X", "O"], ["S-X", "O"]]
    assert tasks.entity_f1(gold, [["O", "I-X", "O"], ["S-X", "O"]], "default", "IOB2") == (0.5, 0.5, 0.5)
    assert tasks.entity_f1([["B-X", "I-X"]], [["I-X", "I-X"]], "default") == (1.0, 1.0, 1.0)
    assert tasks.entity_f1([["B-X", "I-X"]], [["I-X", "I-X"]], "strict", "IOB2") == (0.0, 0.0, 0.0)
    assert tasks.entity_f1([["B-X", "E-X"]], [["B-X", "O"]], "default", "IOBES")[0] == 0.0  # (X, 0, 0): wrong span
    assert tasks.entity_f1([["B-X", "E-X"]], [["B-X", "O"]], "strict", "IOBES") == (0.0, 0.0, 0.0)  # no entity
    # IOBES read as such: the case, S- and E- scored 0 when read as O
    assert tasks.entity_f1([["S-X", "B-Y", "E-Y"]], [["S-X", "B-Y", "E-Y"]], "default") == (1.0, 1.0, 1.0)


def test_a_tag_of_no_scheme_is_refused_and_the_scheme_is_read_from_the_tags(tmp_path):
    def task(text):
        for split in ("train", "dev", "test"):
            write(tmp_path / "t" / f"{split}.tsv", text)
        return tasks.read_task("t", "ner", str(tmp_path / "t"))
    assert task("a\tB-X\nb\tI-X\n")["scheme"] == "IOB2"
    assert task("a\tB-X\nb\tE-X\n\nc\tS-X\n")["scheme"] == "IOBES"
    for bad in ("U-X", "L-X", "X", "B_X", "B-", "b-X"):
        with pytest.raises(SystemExit, match=f"train.tsv:2: tag '{bad}' is neither O nor"):
            task(f"a\tO\nb\t{bad}\n")
    broken = task("a\tB-X\n\nb\tO\nc\tI-X\n")  # an I- after O in dev: strict scoring would drop that gold entity
    with pytest.raises(SystemExit, match="dev.tsv:3: this sentence's gold tags are not valid IOB2"):
        tasks.check_strict(broken)


# ----------------------------------------------------------------------------------------
# classification: scikit-learn's F1 averages; correlations: scipy's
# ----------------------------------------------------------------------------------------
def test_cls_metrics_are_sklearns():
    rng = np.random.default_rng(0)
    cases = [(rng.integers(0, k, n), rng.integers(0, k + extra, n)) for k in (1, 2, 5) for extra in (0, 2)
             for n in (1, 3, 50)]
    cases += [([0, 0, 0], [1, 1, 1]), ([2, 2], [2, 2]), ([0, 1, 2, 3], [3, 2, 1, 0])]
    for gold, pred in cases:
        m = tasks.cls_metrics(gold, pred)
        assert m["macro_f1"] == pytest.approx(quiet(f1_score, gold, pred, average="macro", zero_division=0))
        assert m["weighted_f1"] == pytest.approx(quiet(f1_score, gold, pred, average="weighted", zero_division=0))
        assert m["accuracy"] == pytest.approx(accuracy_score(gold, pred))


def test_multilabel_metrics_are_sklearns():
    rng = np.random.default_rng(1)
    cases = [(rng.random((n, k)) < p, rng.random((n, k)) < q) for n in (1, 4, 60) for k in (1, 3, 10)
             for p, q in ((0.3, 0.3), (0.0, 0.5), (0.5, 0.0), (0.9, 0.1))]
    for gold, pred in cases:
        m = tasks.multilabel_metrics(gold, pred)
        for average in ("micro", "macro", "weighted"):
            if gold.shape[1] == 1:  # sklearn reads one column as a binary task: the F1 of its 1s, each average
                want = quiet(f1_score, gold[:, 0], pred[:, 0], zero_division=0)
            else:
                want = quiet(f1_score, gold.astype(int), pred.astype(int), average=average, zero_division=0)
            assert m[f"{average}_f1"] == pytest.approx(want), (average, gold, pred)


def test_correlations_are_scipys_and_nothing_not_finite_scores():
    rng = np.random.default_rng(2)
    for n in (3, 10, 200):
        gold = rng.normal(size=n)
        for pred in (gold + rng.normal(size=n), np.round(rng.normal(size=n)), -gold, np.repeat(gold[:1], n - 1).tolist()
                     + [gold[1]]):
            m = tasks.regression_metrics(gold, pred)
            assert m["pearson"] == pytest.approx(stats.pearsonr(gold, pred)[0], abs=1e-12)
            assert m["spearman"] == pytest.approx(stats.spearmanr(gold, pred)[0], abs=1e-12)
    # a prediction that is not finite gets no score (the NaN scored Pearson 0.0, a finite number)
    for bad in (np.nan, np.inf):
        m = tasks.regression_metrics([1.0, 2.0, 3.0], [1.0, bad, 2.0])
        assert all(np.isnan(v) for v in m.values()) and np.isnan(quiet(stats.pearsonr, [1, 2, 3], [1, bad, 2])[0])
    # a constant side: scipy says nan; here 0.0, documented, so that such an epoch stays comparable
    assert tasks.pearson([1.0, 2.0, 3.0], [5.0, 5.0, 5.0]) == 0.0


# ----------------------------------------------------------------------------------------
# scoring from kept predictions: the grid scored again equals the grid trained in that scoring
# ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    root = tmp_path_factory.mktemp("rescore")
    ckpts = [make_ckpt(root / "a", seed=0)[0], make_ckpt(root / "b", seed=1)[0]]
    spec = (f"drugs=cls:{make_task_dir(root / 'c', 'cls', n=(16, 8, 8))},"
            f"ents=ner:{make_task_dir(root / 'n', 'ner', n=(16, 8, 8))},"
            f"both=multilabel:{make_task_dir(root / 'm', 'multilabel', n=(16, 8, 8))}")
    p = replace(ft.Protocol(**FAST), epochs=3, ner_epochs=3, out_dir=str(root / "made"))
    return dict(root=root, ckpts=ckpts, spec=spec, p=p, made=ft.run(p, ckpts, spec))


@pytest.mark.parametrize("scoring", [dict(ner_mode="strict"), dict(selection="cls=weighted_f1,multilabel=macro_f1"),
                                     dict(ner_mode="strict", selection="cls=accuracy")])
def test_a_grid_scored_again_equals_the_grid_trained_in_that_scoring(grid, scoring, capsys):
    p = replace(grid["p"], **scoring)
    again = ft.run(replace(p, merge=True), grid["ckpts"], grid["spec"])  # the cells made in the default scoring
    assert "cells made in another scoring" in capsys.readouterr().out
    trained = ft.run(replace(p, out_dir=str(grid["root"] / json.dumps(scoring).replace('"', "_"))), grid["ckpts"],
                     grid["spec"])
    assert json.dumps(again) == json.dumps(trained)
    assert [t["scoring"] for t in again["tasks"]] != [t["scoring"] for t in grid["made"]["tasks"]]


def test_the_same_scoring_gives_the_saved_result_and_a_cell_without_predictions_cannot_change(grid, capsys):
    p = replace(grid["p"], merge=True)
    assert json.dumps(ft.run(p, grid["ckpts"], grid["spec"])) == json.dumps(grid["made"])
    assert "scored again" not in capsys.readouterr().out
    cell = ft.grid_cells(p, ft.arms_of(grid["ckpts"]), tasks.parse_tasks(grid["spec"], p.tasks_dir))[0]
    kept = ft.read_kept(cell, cell["scoring"])  # what a rescoring reads: the saved result again
    saved = json.load(open(cell["file"]))
    assert dict(tasks.score("cls", kept, cell["scoring"]), losses=saved["result"]["losses"]) == saved["result"]
    assert kept["dev"]["pred"].shape == (3, 8) and kept["labels"] == cell["read"]["labels"]
    preds = cell["preds"]
    moved = preds + ".moved"
    os.rename(preds, moved)
    try:
        with pytest.raises(SystemExit, match="and .*preds.npz is not there .* score as it was made, or delete the"):
            ft.run(replace(p, selection="cls=weighted_f1"), grid["ckpts"], grid["spec"])
        write(preds, "not a zip")  # torn or overwritten: one line naming it
        with pytest.raises(SystemExit, match="preds.npz is unreadable .*; delete it and .*seed0.json to run the"):
            ft.run(replace(p, selection="cls=weighted_f1"), grid["ckpts"], grid["spec"])
    finally:
        os.replace(moved, preds)
