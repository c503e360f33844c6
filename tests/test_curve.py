"""tests/study_curve.py: the decision rules committed with the length/capacity protocol, and the
figures it reads from the files the protocol's commands write (synthetic files here)."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import study_curve  # noqa: E402


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
    def log(name, records):
        os.makedirs(tmp_path / name, exist_ok=True)
        (tmp_path / name / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    log("theta0-mlm-decay", [dict(step=1, val_loss=4.0, val_unigram=7.0, val_acc=0.3)])
    for arm, loss in (("clm", 3.8), ("mlm", 3.0)):
        for r in (1, 2, 3):
            log(f"{arm}-r{r}", [dict(step=1, loss=9.0), dict(step=2, val_loss=loss + 0.3, val_unigram=6.6, val_acc=0.3)])
            log(f"{arm}-r{r}-decay", [dict(step=1, val_loss=loss, val_unigram=6.6, val_acc=0.4)])
    os.makedirs(tmp_path / "ft8-s1000")
    names = ["a", "b"]
    (tmp_path / "ft8-s1000" / "results.json").write_text(json.dumps(dict(
        tasks=[dict(name=n) for n in names], difference=dict(a=-0.01, b=0.002, average=-0.004),
        ci95=dict(a=[-0.03, 0.01], b=[-0.01, 0.014], average=[-0.012, 0.004]), units=[0.0] * 6,
        p_sign_flip=0.8, p_bootstrap=0.8, detectable_difference=0.011)))
    out = subprocess.run([sys.executable, os.path.join(HERE, "study_curve.py"), "--out_dir", str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    assert "| s1000 | small | 1,000 | -0.4 [-1.2, +0.4] | cannot tell | 0.800 | 1.1 | +0.80 nats |" in out
    assert "| CLM | 4.10 / 4.10 / 4.10 (unigram 6.60) | 3.80 / 3.80 / 3.80 (unigram 6.60) |" in out
    assert "missing: twins, ft8 results" in out  # s250: nothing yet; θ0 is shared with s1000
    assert "| point | a | b |\n|---|---|---|\n| s1000 | -1.0 [-3.0, +1.0] | +0.2 [-1.0, +1.4] |" in out
    assert "- Length: needs s250, s1000 and s4000; missing s250, s4000." in out
    assert (tmp_path / "curve.md").read_text() == out[:-1]  # print adds the final newline
