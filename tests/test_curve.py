"""studies/study_curve.py and studies/study_figure.py: the decision rules committed with the length/capacity
protocol and with the freeze/transplant/third-size protocol, and the figures they read from the files the
protocols' commands write (synthetic files here, in the real layouts)."""

import json
import os
import subprocess
import sys

import pytest

import finetune
from conftest import ROOT
from studies import study_curve

NAMES = ["a", "b"]  # two tasks: every layout as with eight, and an exact sign-flip test over few units


def log(root, name, records):
    """<root>/<name>/log.jsonl as detour.py writes it, one JSON record a line."""
    os.makedirs(os.path.join(root, name), exist_ok=True)
    with open(os.path.join(root, name, "log.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def units(center, n):
    """n (task × replicate) differences in F1 (fractions) around `center`, spread ±0.005: `center` 0.02 gives a
    gain (the 95% interval above 0), 0 cannot tell, -0.02 a deficit."""
    return [center + 0.005 * (i % 3 - 1) for i in range(n)]


def write_grid(path, arms, reps):
    """A results.json as finetune.run writes it: arms {label: offsets of its (task, replicate) units from 0.5},
    the first arm compared with the second by finetune.compare itself."""
    scores = {}
    for label, offsets in arms.items():
        means = {n: [0.5 + x for x in offsets[i * reps:(i + 1) * reps]] for i, n in enumerate(NAMES)}
        scores[label] = {n: dict(mean=sum(m) / reps, replicate_means=m) for n, m in means.items()}
        scores[label]["average"] = dict(mean=sum(sum(m) / reps for m in means.values()) / len(NAMES))
    res = dict(checkpoints=list(arms), tasks=[dict(name=n) for n in NAMES], scores=scores)
    finetune.compare(res, NAMES, *list(arms)[:2], samples=200)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f)


def chain(root, stem, reps, loss):
    """The Phase-1 runs <stem>-r<k> and their decays, each with its last validation record."""
    for r in reps:
        log(root, f"{stem}-r{r}", [dict(step=1, loss=9.0), dict(step=2, val_loss=loss + 0.3, val_unigram=6.6,
                                                                 val_acc=0.3)])
        log(root, f"{stem}-r{r}-decay", [dict(step=1, val_loss=loss, val_unigram=6.6, val_acc=0.4)])


def make_point(root, name, center, margin=3.0):
    """Every file of a point: its θ0's log (`margin` nats below the unigram), both twins' runs and its grid."""
    pt = study_curve.POINTS[name]
    log(root, pt.theta, [dict(step=1, val_loss=7.0 - margin, val_unigram=7.0, val_acc=0.3)])
    chain(root, pt.prefix + "clm", pt.replicates, 3.8)
    chain(root, pt.prefix + "mlm", pt.replicates, 3.0)
    n = len(NAMES) * len(pt.replicates)
    write_grid(os.path.join(root, pt.grid, "results.json"), {"clm": units(center, n), "mlm": [0.0] * n},
               len(pt.replicates))


def make_freeze(root, layer, center):
    """The freeze-L runs at t1000 (replicates 1-3) and their grid against the MLM twin."""
    chain(root, f"t1000-clm-freeze{layer}", (1, 2, 3), 3.9)
    write_grid(os.path.join(root, f"ft8-t1000-freeze{layer}", "results.json"),
               {f"freeze{layer}": units(center, 6), "mlm": [0.0] * 6}, 3)


def make_transplant(root, report, clm, hybrid):
    """A transplant report: the CLM arm, the hybrid arm, the MLM arm (studies/analysis.transplant's order), probed."""
    write_grid(os.path.join(root, "tp-t1000", report + ".json"),
               {"clm": units(clm, 6), "hybrid": units(hybrid, 6), "mlm": [0.0] * 6}, 3)


def point(d, lo, hi):
    return dict(d=d, ci=[lo, hi], p=0.5, detectable=1.0, gap=0.5)


@pytest.mark.parametrize("s250, s1000, s4000, want", [
    (point(-3, -4, -2), point(-1, -2, 0.5), point(1, 0.2, 2), "flips"),
    (point(-3, -4, -2), point(-1, -2, 0.5), point(-0.5, -1.5, 0.5), "vanishes"),
    (point(-3, -4, -2.5), point(-2, -3, -1), point(-1, -1.5, -0.5), "shrinks"),
    (point(-1, -1.5, -0.5), point(-2, -3, -1), point(-1.2, -1.6, -0.8), "neither"),  # D does not rise
    (point(-3, -4, -1), point(-2, -3, -1), point(-1, -1.5, -0.5), "neither"),  # the intervals overlap
])
def test_length_rules(s250, s1000, s4000, want):
    line, capacity = study_curve.rules(dict(s250=s250, s1000=s1000, s4000=s4000))
    assert line.startswith("- Length: the deficit " + want)
    assert capacity == "- Capacity: needs s1000 and t1000; missing t1000."


@pytest.mark.parametrize("small, tiny, want", [
    (point(0, -0.5, 0.5), point(-2, -3, -1), "helps the detour"),
    (point(-2, -3, -1), point(0, -0.5, 0.5), "hurts the detour"),
    (point(-1, -2, 0), point(-1.5, -2.5, -0.5), "cannot tell"),
])
def test_capacity_rule(small, tiny, want):
    length, line = study_curve.rules(dict(s1000=small, t1000=tiny))
    assert want in line
    assert length == "- Length: needs s250, s1000 and s4000; missing s250, s4000."


def test_a_point_is_read_from_its_files_and_a_missing_one_is_named(tmp_path):
    log(tmp_path, "theta0-mlm-decay", [dict(step=1, val_loss=4.0, val_unigram=7.0, val_acc=0.3)])
    for arm, loss in (("clm", 3.8), ("mlm", 3.0)):
        chain(tmp_path, arm, (1, 2, 3), loss)
    os.makedirs(tmp_path / "ft8-s1000")
    names = ["a", "b"]
    (tmp_path / "ft8-s1000" / "results.json").write_text(json.dumps(dict(
        tasks=[dict(name=n) for n in names], difference=dict(a=-0.01, b=0.002, average=-0.004),
        ci95=dict(a=[-0.03, 0.01], b=[-0.01, 0.014], average=[-0.012, 0.004]), units=[0.0] * 6,
        p_sign_flip=0.8, p_bootstrap=0.8, detectable_difference=0.011)))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "studies", "study_curve.py"), "--out_dir", str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    assert "| s1000 | small | 1,000 | -0.4 [-1.2, +0.4] | cannot tell | 0.800 | 1.1 | +0.80 nats |" in out
    assert "| CLM | 4.10 / 4.10 / 4.10 (unigram 6.60) | 3.80 / 3.80 / 3.80 (unigram 6.60) |" in out
    assert "missing: twins, ft8 results" in out  # s250: nothing yet; θ0 is shared with s1000
    assert "| point | a | b |\n|---|---|---|\n| s1000 | -1.0 [-3.0, +1.0] | +0.2 [-1.0, +1.4] |" in out
    assert "- Length: needs s250, s1000 and s4000; missing s250, s4000." in out
    assert (tmp_path / "curve.md").read_text() == out[:-1]  # print adds the final newline
    data = json.loads((tmp_path / "curve.json").read_text())  # the same numbers, for the figure
    assert data["points"]["s1000"]["d"] == pytest.approx(-0.4) and data["points"]["s1000"]["verdict"] == "cannot tell"
    assert data["missing_points"]["s250"] == ["twins", "ft8 results"]


# ----------------------------------------------------------------------------------------
# The freeze/transplant/third-size protocol
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("t1000, frozen, want", [
    (0.02, (0.0, 0.02, 0.02), "the gain lives in layer 0 (D_0 cannot tell;"),
    (0.02, (0.02, -0.02, 0.02), "the gain lives in layer 1 (D_1 deficit;"),
    (0.02, (0.02, 0.02, 0.02), "no single layer carries it"),
    (0.02, (0.0, 0.0, 0.02), "cannot tell (D_0 cannot tell, D_1 cannot tell, D_2 gain)"),
    (0.0, (0.0, 0.02, 0.02), "cannot tell: no gain to remove"),  # the precondition fails
])
def test_freeze_rule_from_the_grids(tmp_path, t1000, frozen, want):
    make_point(tmp_path, "t1000", t1000)
    for layer, center in enumerate(frozen):
        make_freeze(tmp_path, layer, center)
    lines, data = study_curve.collect(str(tmp_path))
    assert data["freeze"]["verdict"].startswith(want)
    assert f"- Freeze during CLM at t1000: {data['freeze']['verdict']}" in lines
    assert [data["freeze"]["layers"][L]["d"] for L in (0, 1, 2)] == pytest.approx([100 * c for c in frozen])
    assert data["freeze"]["missing"] == []
    assert "| CLM, layer 2 frozen | 4.20 / 4.20 / 4.20 (unigram 6.60) | 3.90 / 3.90 / 3.90 (unigram 6.60) |" in \
        "\n".join(lines)


def test_freeze_needs_every_grid_and_names_what_is_missing(tmp_path):
    make_point(tmp_path, "t1000", 0.02)
    make_freeze(tmp_path, 0, 0.0)
    make_freeze(tmp_path, 1, 0.02)
    lines, data = study_curve.collect(str(tmp_path))
    assert data["freeze"]["verdict"] == "needs every freeze grid; missing layer 2."
    assert "missing: out/bio/ft8-t1000-freeze2/results.json" in lines
    assert "missing: out/bio/t1000-clm-freeze2-r{1,2,3}[-decay]/log.jsonl" in lines


@pytest.mark.parametrize("hybrid, want, share", [(0.01, "transplants", 1 / 3), (0.0, "does not transplant", 0.0)])
def test_transplant_rule_from_the_probe_reports(tmp_path, hybrid, want, share):
    # CLM 3 points ahead of the MLM twin; results.json's own difference (CLM − hybrid) is not the one wanted
    make_transplant(tmp_path, "transplant-0", 0.03, hybrid)
    lines, data = study_curve.collect(str(tmp_path))
    t = data["transplant"]["variants"]["layer 0"]
    assert t["verdict"] == want and t["units"] == 6
    assert t["d"] == pytest.approx(100 * hybrid) and t["gap"] == pytest.approx(3.0) and t["share"] == pytest.approx(share)
    assert [t["d"], *t["ci"]] == pytest.approx(finetune.mean_interval([100 * u for u in units(hybrid, 6)]))
    assert f"- Transplant, layer 0: {want} (hybrid − MLM twin {study_curve.interval(t['d'], t['ci'])} probe F1)." in lines
    assert "- Transplant, embeddings + layer 0: missing." in lines
    assert "missing: out/bio/tp-t1000/transplant-embeddings_0.json" in lines


@pytest.mark.parametrize("tiny, small, medium, want", [
    (0.03, 0.015, 0.0, "the gain falls with capacity"),
    (0.0, 0.015, 0.03, "the gain rises with capacity"),
    (0.01, 0.02, 0.0, "cannot tell (D tiny +1.0, small +2.0, medium +0.0; D is not monotone in size)"),
    (0.012, 0.01, 0.008, "cannot tell (D tiny +1.2, small +1.0, medium +0.8; the tiny and medium intervals overlap)"),
])
def test_capacity_across_three_sizes(tmp_path, tiny, small, medium, want):
    for name, center in (("t1000 (5 reps)", tiny), ("s1000 (5 reps)", small), ("m1000", medium)):
        make_point(tmp_path, name, center)
    lines, data = study_curve.collect(str(tmp_path))
    assert data["capacity3"].startswith(want)
    assert ("- Capacity across three sizes (tiny, small, medium at 1,000 steps; this protocol's rule): "
            + data["capacity3"]) in lines
    assert "- Capacity: needs s1000 and t1000; missing s1000, t1000." in lines  # the first protocol's rule, as it was
    five = data["points"]["t1000 (5 reps)"]
    assert five["units"] == 10 and five["replicates"] == 5
    realized = 100 * finetune.detectable_difference(units(tiny, 10))
    assert f"realized detectable difference {realized:.1f} points." in "\n".join(lines)
    assert "| CLM | 4.10 / 4.10 / 4.10 / 4.10 / 4.10 (unigram 6.60) |" in "\n".join(lines)


@pytest.mark.parametrize("margin, want", [(2.6, "2.60 nats below; meets the guard"),
                                          (2.4, "2.40 nats below; fails the guard: the protocol reruns this θ0 "
                                                "at lr 5e-4")])
def test_the_medium_theta0_guard(tmp_path, margin, want):
    log(tmp_path, "medium-theta0-mlm-decay", [dict(step=1, val_loss=7.0 - margin, val_unigram=7.0, val_acc=0.3)])
    lines, data = study_curve.collect(str(tmp_path))
    assert any(line.startswith("- θ0 guard (medium): MLM-15% loss") and want in line for line in lines)
    assert data["theta0_guard"]["meets"] is (margin >= 2.5)


def test_every_missing_input_is_listed_as_missing(tmp_path):
    lines, data = study_curve.collect(str(tmp_path))
    for name in ("m1000", "t1000 (5 reps)", "s1000 (5 reps)"):
        assert data["missing_points"][name] == ["θ0", "twins", "ft8 results"]
    assert data["verdicts"] == [
        "- θ0 guard (medium): missing out/bio/medium-theta0-mlm-decay/log.jsonl.",
        "- Freeze during CLM at t1000: needs t1000 (its D is the precondition); missing t1000.",
        "- Transplant, layer 0: missing.", "- Transplant, embeddings + layer 0: missing.",
        "- Capacity across three sizes (tiny, small, medium at 1,000 steps; this protocol's rule): needs "
        "t1000 (5 reps), s1000 (5 reps), m1000; missing t1000 (5 reps), s1000 (5 reps), m1000."]
    assert "- t1000, replicates 1-5: missing (see its section above)." in lines
    assert "missing: out/bio/tp-t1000/transplant-0.json" in lines


def test_the_figure_is_drawn_from_what_there_is(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from studies import study_figure
    for name, center in (("t1000", 0.02), ("t1000 (5 reps)", 0.02), ("m1000", 0.0)):
        make_point(tmp_path, name, center)
    for layer in (0, 1, 2):
        make_freeze(tmp_path, layer, 0.01 * layer)
    make_transplant(tmp_path, "transplant-0", 0.03, 0.01)
    for cka, scale in (("cka-t1000", 3.0), ("cka-m1000", 1.5)):
        os.makedirs(tmp_path / cka)
        (tmp_path / cka / "cka.json").write_text(json.dumps(dict(rows=[
            dict(layer=layer, d_ab=0.01, d_bc=0.01 / scale, r=scale) for layer in ("embeddings", "layer 0", "layer 1")])))
    png = tmp_path / "fig" / "study.png"
    study_figure.main(["--out_dir", str(tmp_path), "--png", str(png)])
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "skipped: point s250: missing θ0, twins, ft8 results" in out
    assert "skipped: transplant embeddings + layer 0: missing out/bio/tp-t1000/transplant-embeddings_0.json" in out
    assert "skipped: freeze" not in out and f"written to {png}" in out
    assert "CKA r = d(CLM r1, MLM r1) / d(MLM r1, MLM r2): embeddings 1.50, layer 0 1.50, layer 1 1.50" in \
        "\n".join(study_curve.collect(str(tmp_path))[0])  # m1000's CKA, read from cka-m1000
    study_figure.main(["--out_dir", str(tmp_path / "empty"), "--png", str(tmp_path / "none.png")])
    assert "nothing to draw yet" in capsys.readouterr().out and not (tmp_path / "none.png").exists()


# ----------------------------------------------------------------------------------------
# studies/tiny_mechanism.py: the decay-length rules and the freeze rule with five replicates
# ----------------------------------------------------------------------------------------
def make_tiny_mechanism(root, D, arms_vs10, freeze):
    """Every file of the tiny-mechanism study: per decay length its runs' logs and its D grid (CLM arm offset by
    D[length]), the arm-vs-10% grids (arms_vs10[arm][length]: the 10% arm's offset), the freeze runs and grids."""
    from studies import tiny_mechanism as tm
    n = len(NAMES) * 5
    for length, suffix in tm.LENGTHS.items():
        for arm, k in ((a, k) for a in ("clm", "mlm") for k in range(1, 6)):
            log(root, f"t1000-{arm}-r{k}-{suffix}", [dict(step=1, val_loss=4.6 if arm == "clm" else 3.7,
                                                          val_unigram=6.6, val_acc=0.3)])
        if length in D:
            write_grid(os.path.join(root, tm.d_grid(length), "results.json"),
                       {"clm": units(D[length], n), "mlm": [0.0] * n}, 5)
    for arm, by_length in arms_vs10.items():
        for length, center in by_length.items():
            write_grid(os.path.join(root, tm.arm_grid(arm, length), "results.json"),
                       {f"{arm}10": units(center, n), f"{arm}{length}": [0.0] * n}, 5)
    for layer, center in freeze.items():
        chain(root, f"t1000-clm-freeze{layer}", range(1, 6), 4.7)
        write_grid(os.path.join(root, f"ft8-t1000-freeze{layer}-r5", "results.json"),
                   {f"freeze{layer}": units(center, n), "mlm": [0.0] * n}, 5)


def test_tiny_mechanism_rules_from_the_files(tmp_path):
    """The committed rules, applied to files in the study's layout: the gain persists where D's interval is above 0,
    fades when D falls from 10% to 100% and D(100%) lies below D(10%), 10% is best for an arm only if every paired
    interval is above 0; the freeze rule needs the unfrozen gain and one layer alone losing it."""
    from studies import tiny_mechanism as tm
    others = ("2.5%", "20%", "50%", "100%")
    make_tiny_mechanism(tmp_path, {"2.5%": 0.0, "10%": 0.02, "20%": 0.015, "50%": 0.01, "100%": -0.01},
                        {"clm": dict.fromkeys(others, 0.01), "mlm": {**dict.fromkeys(others, 0.01), "100%": 0.0}},
                        {0: 0.0, 1: 0.02, 2: 0.02})
    lines, data = tm.collect(str(tmp_path))
    verdicts = "\n".join(data["verdicts"])
    assert "- The gain at 10%: persists" in verdicts and "- The gain at 50%: persists" in verdicts
    assert "- The gain at 2.5%: does not persist" in verdicts and "- The gain at 100%: does not persist" in verdicts
    assert "- Fades: fades (D falls monotonically from 10% to 100%: yes;" in verdicts
    assert "- 10% is best for the CLM twin: yes" in verdicts
    assert "- 10% is best for the MLM twin: cannot tell (" in verdicts
    assert "- Freeze during CLM, five replicates: the gain lives in layer 0" in verdicts
    table = "\n".join(lines)
    assert "| 10% | 100 | 52.0 | 50.0 | +2.0 [+1.6, +2.3] | gain |" in table and "4.60 / 3.70 (6.60)" in table
    # D rising again at 100%: no fading; a freeze grid missing: the rule says what it needs
    make_tiny_mechanism(tmp_path, {"100%": 0.012}, {}, {})
    os.remove(tmp_path / "ft8-t1000-freeze2-r5" / "results.json")
    lines, data = tm.collect(str(tmp_path))
    assert any(v.startswith("- Fades: cannot tell whether it fades") for v in data["verdicts"])
    assert data["verdicts"][-1] == "- Freeze during CLM, five replicates: needs every freeze grid; missing layer 2."
    assert "missing: out/bio/ft8-t1000-freeze2-r5/results.json" in lines


def test_tiny_mechanism_names_what_is_missing_and_draws_what_there_is(tmp_path):
    from studies import tiny_mechanism as tm
    lines, data = tm.collect(str(tmp_path))
    assert "- Fades: needs D at 10%, 20%, 50% and 100%; missing." in data["verdicts"]
    assert "- Freeze during CLM, five replicates: needs t1000 (its D is the precondition); missing t1000." in data["verdicts"]
    assert "missing: out/bio/ft8-t1000-r5/results.json" in lines
    pytest.importorskip("matplotlib")
    make_tiny_mechanism(tmp_path, {"10%": 0.02, "100%": 0.01}, {}, {})
    png = tmp_path / "tiny-mechanism.png"
    tm.figure(tm.collect(str(tmp_path))[1], str(png))
    assert png.stat().st_size > 10_000
