"""bench/gpu_ab.py on a CPU: its --cpu_smoke (every variant at toy sizes, checked against the baseline, no graph
break, at most one recompile), that its checks catch planted bugs, its stand-in for the varlen kernel, and how it
picks the best flags. The GPU figures themselves need a GPU (docs/gpu.md)."""
import json

import pytest
import torch
import torch.nn as nn

import detour
from bench import gpu_ab as ab
from bench.fixtures import per_document_varlen


def originals():
    import torch.nn.attention.varlen as varlen
    return (detour.LinearCrossEntropy, detour.rope_cos_sin, detour.Layer.forward, detour.ModernBERT.forward,
            detour.Attention.forward, detour.Embeddings.forward, nn.LayerNorm.forward, varlen.varlen_attn)


def test_cpu_smoke_runs_every_variant_and_checks_it(tmp_path):
    """The smoke's variants (each flag alone, regional in both phases, "best") against the reference of their phase:
    the loss, the gradient norm and each parameter's gradient within gpu_ab.TOL (measured at most 2.3e-2, for bf16;
    1.3e-2 otherwise), no graph break, each graph of the first step recompiled at most once after it (the spans made
    dynamic); the floors, the speed rows and a profile whose kernel classes and idle time add up to the profiled step.
    "best" depends on this machine's timings: any union of flags that passed alone must pass. Afterwards detour is
    as it was."""
    before = originals()
    out = tmp_path / "ab.json"
    assert ab.main(["--cpu_smoke", "--out", str(out)]) == 0
    assert originals() == before  # every patch undone
    summary = json.loads(out.read_text())
    rows = {r["variant"]: r for r in summary["rows"]}
    ran = [r for r in summary["rows"] if r["status"] != "skip"]
    assert [r["spec"] for r in summary["rows"]] == ab.SMOKE_VARIANTS.split(",")
    assert summary["ok"] and all(r["status"] == "ok" for r in ran), [(r["variant"], r["detail"]) for r in ran]
    assert {"baseline", "eager", "regional", "bf16", "rope", "loss:64", "micro:4", "clm", "clm+regional"} <= set(rows)
    for r in ran:
        assert r["graph_breaks"] == 0 and r["recompiles_per_graph"] <= 1, r
        assert all(r[f"{k}_rel"] <= r[f"{k}_bound"] for k in ("loss", "grad_norm", "grads")), r
        assert set(r["speed"]) == {"study", "long"} and all(s["tok_s"] > 0 for s in r["speed"].values())
        assert r["profile_ms"]["gemm"] > 0 and sum(r["profile_ms"].values()) >= r["profile_wall_ms"] * 0.999
    assert rows["eager"]["graphs"] == 0 and rows["baseline"]["graphs"] >= 1
    assert rows["bf16"]["grads_rel"] > 0  # the bf16 stream was on: its roundings differ from the baseline's
    floors = summary["floors"]
    assert all(v > 0 for v in floors["parts"].values())
    assert set(floors["steps"]) == {f"{p} {k}" for p in ("mlm", "clm") for k in ("study", "long")}


def test_planted_bugs_fail_the_run(tmp_path, monkeypatch):
    """Two bugs a variant could have, planted: the fused loss treating padding slots as real (its gradient and loss then
    count the head's padding rows), and RoPE without its sign (rotate-half's -x2 lost), which moves the loss by only
    3.5e-6 at these weights but the attention projections' gradients by 0.76. The run fails, naming both rows."""
    monkeypatch.setattr(ab, "may_have_padding", lambda n: False)
    monkeypatch.setattr(ab, "rope_tables", ab.rope_cos_sin)  # detour's tables: the sign not folded into sin
    out = tmp_path / "ab.json"
    assert ab.main(["--cpu_smoke", "--variants", "baseline,loss,rope", "--rows", "study", "--out", str(out)]) == 1
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["baseline"]["status"] == "ok"
    assert rows["loss"]["status"] == "FAIL" and "loss: relative difference" in rows["loss"]["detail"]
    assert rows["rope"]["status"] == "FAIL" and "grads: relative difference" in rows["rope"]["detail"]
    assert rows["rope"]["loss_rel"] <= ab.TOL["same"]["loss"]  # the loss alone would not have caught it


@pytest.mark.parametrize("window,causal", [(None, False), (None, True), (5, False), (5, True)])
def test_varlen_reference_follows_the_kernels_documentation(window, causal):
    """The smoke's traceable stand-in for varlen_attn against test_gpu_path's per-document reference (one SDPA call per
    span): spans of 1 to 17 tokens, both layer kinds, causal or not. fp32, the same pairs: 1e-6."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 1, 9, 26, 30, 47], dtype=torch.int32)
    q, k, v = (torch.randn(47, 2, 8, generator=g) for _ in range(3))
    left = -1 if window is None else window
    size = (left, 0 if causal else left)
    longest = int(cu.diff().max())
    got = ab.varlen_reference(q, k, v, cu, cu, longest, longest, window_size=size)
    assert (got - per_document_varlen(q, k, v, cu, cu, longest, longest, window_size=size)).abs().max() <= 1e-6


def test_best_takes_the_fastest_mode_and_each_flag_that_beat_its_parent():
    """best_flags: the fastest of today's modes measured (regional here), and a flag where the variant with it is faster
    than the same flags without it, per flag the larger gain (loss:4096 over loss); a flag without a measured parent,
    and CLM rows, ignored. Without the whole-model row the modes measured still decide."""
    def row(flags, tok_s):
        return dict(flags=flags, speed=dict(study=dict(tok_s=tok_s)))
    rows = [row({}, 100), row({"regional": None}, 110), row({"eager": None}, 60),
            row({"regional": None, "bf16": None}, 121), row({"regional": None, "rope": None}, 100),
            row({"regional": None, "loss": None}, 115), row({"regional": None, "loss": 4096}, 120),
            row({"micro": 8, "bf16": None}, 500),  # no parent measured: ignored
            row({"clm": None}, 50), row({"clm": None, "rope": None}, 90)]  # CLM rows: ignored
    assert ab.best_flags(rows) == {"regional": None, "bf16": None, "loss": 4096}
    assert ab.variant_name(ab.best_flags(rows)) == "bf16+loss:4096+regional"
    assert ab.best_flags(rows[1:]) == ab.best_flags(rows)
    assert ab.best_flags([row({}, 100), row({"eager": None}, 120), row({"rope": None}, 90)]) == {"eager": None}


def test_parse_variant_rejects_what_it_cannot_run():
    assert ab.parse_variant("regional+loss:4096+micro:4", 8) == {"regional": None, "loss": 4096, "micro": 4}
    assert ab.parse_variant("baseline", 8) == {} and ab.parse_variant("best+clm", 8) == {"best": None, "clm": None}
    for bad in ("micro", "micro:3", "loss:0", "rope:2", "flash", "eager+regional"):
        with pytest.raises(ValueError):
            ab.parse_variant(bad, 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu_ab would run for real")
def test_without_cuda_it_is_one_line_and_exit_0(capsys):
    assert ab.main([]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("gpu_ab: no CUDA device here")
