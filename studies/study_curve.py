"""The report of two study protocols (not a test): "Where the detour starts to pay" (Phase-1 length and capacity,
docs/studies/where-it-pays.md) and "Why the detour pays where it pays" (freeze, transplant, a third size, five
replicates, docs/studies/why-it-pays.md). Reads what their commands wrote under out/bio/ and prints every point's
figures, the summary table, the freeze, transplant and three-size analyses, and the verdicts of the decision rules
each protocol committed before any score, applied mechanically.

    python studies/study_curve.py                 # -> stdout, out/bio/curve.md and out/bio/curve.json
    python studies/study_curve.py --out_dir out/bio

A point or analysis whose files are not all there yet is listed as missing, not guessed.
"""

import argparse
import collections
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a file (python studies/x.py), not imported: the repository root, for detour and bench
    sys.path.insert(0, ROOT)
import finetune  # noqa: E402  (the study's own statistics: t interval, sign flip)
from studies import gather  # noqa: E402  (the log reader every study report shares)

# A point: its twins are out/bio/<prefix>{clm,mlm}-r<k>[-decay], its 8-task grid out/bio/<grid>/results.json
# and its CKA out/bio/<cka>/cka.json (None: the CKA belongs to the 3-replicate row of the same twins).
Point = collections.namedtuple("Point", "preset steps prefix theta grid replicates cka")
R3, R5 = (1, 2, 3), (1, 2, 3, 4, 5)
POINTS = {
    "s250": Point("small", 250, "s250-", "theta0-mlm-decay", "ft8-s250", R3, "cka-s250"),
    "s1000": Point("small", 1000, "", "theta0-mlm-decay", "ft8-s1000", R3, "cka"),
    "s4000": Point("small", 4000, "s4000-", "theta0-mlm-decay", "ft8-s4000", R3, "cka-s4000"),
    "t1000": Point("tiny", 1000, "t1000-", "tiny-theta0-mlm-decay", "ft8-t1000", R3, "cka-t1000"),
    # the second protocol: a third size, and replicates 4-5 of two points in grids of their own
    "m1000": Point("medium", 1000, "m1000-", "medium-theta0-mlm-decay", "ft8-m1000", R3, "cka-m1000"),
    "t1000 (5 reps)": Point("tiny", 1000, "t1000-", "tiny-theta0-mlm-decay", "ft8-t1000-r5", R5, None),
    "s1000 (5 reps)": Point("small", 1000, "", "theta0-mlm-decay", "ft8-s1000-r5", R5, None),
}
THETA_GUARD = 2.5  # nats the medium θ0 must end below its unigram (the tiny θ0: 2.55); else rerun at lr 5e-4
FREEZE_LAYERS = (0, 1, 2)  # every layer of the tiny preset, one frozen per run
TRANSPLANTS = {"layer 0": "transplant-0", "embeddings + layer 0": "transplant-embeddings_0"}  # variant -> report
CAPACITY3 = ("t1000 (5 reps)", "s1000 (5 reps)", "m1000")  # tiny, small, medium at 1,000 steps


# ----------------------------------------------------------------------------------------
# Reading: every number comes from a file a protocol command writes; None where it is not there
# ----------------------------------------------------------------------------------------
def last_eval(run_dir):
    """The last log.jsonl record with a validation loss (gather's reader): (loss, unigram CE of the same targets,
    accuracy), or None."""
    r = gather.last_eval(run_dir)
    return (r["val_loss"], r["val_unigram"], r.get("val_acc")) if r else None


def chain_losses(out, stem, reps):
    """{"phase1": [...], "decay": [...]} of the runs <stem>-r<k> and their decays (last_eval per replicate),
    or None when one of them is missing."""
    got = {phase: [last_eval(os.path.join(out, f"{stem}-r{r}{suffix}")) for r in reps]
           for phase, suffix in (("phase1", ""), ("decay", "-decay"))}
    return None if any(None in runs for runs in got.values()) else got


def losses(out, prefix, reps):
    """{arm: chain_losses} of both twins of a point, or None when a run is missing."""
    got = {arm: chain_losses(out, prefix + arm, reps) for arm in ("clm", "mlm")}
    return None if None in got.values() else got


def read_json(out, *parts):
    path = os.path.join(out, *parts)
    return json.load(open(path)) if os.path.isfile(path) else None


def comparison(res):
    """The first-minus-second-arm statistics finetune.compare wrote into a results.json, in F1 points."""
    names, ci = [t["name"] for t in res["tasks"]], [100 * c for c in res["ci95"]["average"]]
    return dict(d=100 * res["difference"]["average"], ci=ci, verdict=verdict(ci), p=res["p_sign_flip"],
                p_bootstrap=res["p_bootstrap"], detectable=100 * res["detectable_difference"], units=len(res["units"]),
                tasks={n: (100 * res["difference"][n], *(100 * c for c in res["ci95"][n])) for n in names})


# ----------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------
def verdict(ci):
    return "deficit" if ci[1] < 0 else "gain" if ci[0] > 0 else "cannot tell"


def interval(d, ci):
    return f"{d:+.1f} [{ci[0]:+.1f}, {ci[1]:+.1f}]"


def loss_table(first, rows, reps):
    """Markdown: one row per (label, chain_losses), each loss next to the unigram CE of the same targets."""
    lines = [f"| {first} | Phase 1, replicates {'/'.join(map(str, reps))} (its own objective) | after the decay "
             "(MLM 15%) | accuracy after decay |", "|---|---|---|---|"]
    for label, chain in rows:
        p1, dec = chain["phase1"], chain["decay"]
        lines.append(f"| {label} | {' / '.join(f'{x[0]:.2f}' for x in p1)} (unigram {p1[0][1]:.2f}) "
                     f"| {' / '.join(f'{x[0]:.2f}' for x in dec)} (unigram {dec[0][1]:.2f}) "
                     f"| {' / '.join(f'{100 * x[2]:.1f}%' for x in dec)} |")
    return lines


# ----------------------------------------------------------------------------------------
# The points
# ----------------------------------------------------------------------------------------
def point_report(out, name):
    """(markdown lines, summary dict, missing parts) of one point; the summary is None while parts are missing."""
    pt = POINTS[name]
    lines = [f"## {name}: {pt.preset} preset, {pt.steps:,} Phase-1 steps, θ0 = out/bio/{pt.theta}", ""]
    theta0, got = last_eval(os.path.join(out, pt.theta)), losses(out, pt.prefix, pt.replicates)
    res = read_json(out, pt.grid, "results.json")
    missing = [w for w, x in (("θ0", theta0), ("twins", got), ("ft8 results", res)) if x is None]
    if missing:
        return lines + ["missing: " + ", ".join(missing), ""], None, missing
    lines += [f"θ0 MLM-15% validation loss on general text {theta0[0]:.2f} vs unigram {theta0[1]:.2f} "
              f"({100 * theta0[2]:.1f}% of masked tokens right).", ""]
    lines += loss_table("twin", [("CLM", got["clm"]), ("MLM", got["mlm"])], pt.replicates)
    s = dict(comparison(res), preset=pt.preset, steps=pt.steps, replicates=len(pt.replicates), theta0=theta0,
             losses=got, cka=None)
    s["gap"] = (sum(x[0] for x in got["clm"]["decay"]) - sum(x[0] for x in got["mlm"]["decay"])) / len(pt.replicates)
    names = list(s["tasks"])
    lines += ["", f"Per-task difference, detour − MLM (F1 points, 95% t interval over the {len(pt.replicates)} "
              "replicates):", "", "| " + " | ".join(names + ["average"]) + " |", "|" + "---|" * (len(names) + 1),
              "| " + " | ".join(interval(s["tasks"][n][0], s["tasks"][n][1:]) for n in names)
              + f" | {interval(s['d'], s['ci'])} |", "",
              f"{s['units']} units; sign-flip p = {finetune.format_p(s['p'])}, " + (
                  "no bootstrap p below 8 units" if s["p_bootstrap"] is None else
                  f"bootstrap p = {finetune.format_p(s['p_bootstrap'])}") + f", detectable difference {s['detectable']:.1f} "
              f"points (out/bio/{pt.grid}/results.md).", ""]
    cka = read_json(out, pt.cka, "cka.json") if pt.cka else None
    if cka:
        s["cka"] = [dict(layer=r["layer"], r=r["r"]) for r in cka["rows"] if r.get("r") is not None]
        lines += ["CKA r = d(CLM r1, MLM r1) / d(MLM r1, MLM r2): " + ", ".join(
            f"{r['layer']} {r['r']:.2f}" for r in s["cka"]), ""]
    return lines, s, []


def summary_tables(summary):
    """The summary table and the per-task table of every point there is."""
    lines = ["## Summary", "", "| point | preset | Phase-1 steps | D = detour − MLM, average F1 [95% CI] | at the point "
             "| sign-flip p | detectable | decayed MLM loss, CLM − MLM twin |", "|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        preset, steps = POINTS[name][:2]
        lines.append(f"| {name} | {preset} | {steps:,} | {interval(s['d'], s['ci'])} "
                     f"| {verdict(s['ci'])} | {finetune.format_p(s['p'])} | {s['detectable']:.1f} | {s['gap']:+.2f} nats |")
    tasks = list(dict.fromkeys(t for s in summary.values() for t in s["tasks"]))
    lines += ["", "Per-task differences at every point, detour − MLM (F1 points, 95% t interval over the replicates):",
              "", "| point | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for name, s in summary.items():
        lines.append(f"| {name} | " + " | ".join(
            interval(s["tasks"][t][0], s["tasks"][t][1:]) if t in s["tasks"] else "" for t in tasks) + " |")
    return lines


def rules(s):
    """The decision rules of the length/capacity protocol, applied to the points that exist."""
    out = []
    if missing := [k for k in ("s250", "s1000", "s4000") if k not in s]:
        out.append(f"- Length: needs s250, s1000 and s4000; missing {', '.join(missing)}.")
    else:
        d = [s[k]["d"] for k in ("s250", "s1000", "s4000")]
        apart = s["s250"]["ci"][1] < s["s4000"]["ci"][0]
        if verdict(s["s4000"]["ci"]) == "gain":
            length = "flips (s4000 is a gain)"
        elif verdict(s["s4000"]["ci"]) == "cannot tell" and verdict(s["s250"]["ci"]) == "deficit":
            length = "vanishes (s250 a deficit, s4000 cannot tell)"
        elif d[0] < d[1] < d[2] and apart:
            length = "shrinks (D rises with length; the s250 and s4000 intervals do not overlap)"
        else:
            length = "neither (no rule met)"
        out.append(f"- Length: the deficit {length}.")
    if missing := [k for k in ("s1000", "t1000") if k not in s]:
        out.append(f"- Capacity: needs s1000 and t1000; missing {', '.join(missing)}.")
    else:
        a, b = s["s1000"]["ci"], s["t1000"]["ci"]
        cap = ("helps the detour" if a[0] > b[1] else "hurts the detour" if b[0] > a[1]
               else "cannot tell (the intervals overlap)")
        out.append(f"- Capacity (small vs tiny at 1,000 steps): more capacity {cap}.")
    return out


# ----------------------------------------------------------------------------------------
# The second protocol: the medium θ0's guard, five replicates, freeze, transplant, three sizes
# ----------------------------------------------------------------------------------------
def theta0_guard(out):
    """The guard committed for the medium θ0: it must end >= THETA_GUARD nats below its unigram."""
    theta0, path = last_eval(os.path.join(out, POINTS["m1000"].theta)), f"{POINTS['m1000'].theta}/log.jsonl"
    if theta0 is None:
        return [f"- θ0 guard (medium): missing out/bio/{path}."], dict(missing=[path])
    margin = theta0[1] - theta0[0]
    meets = margin >= THETA_GUARD
    rest = ("meets the guard" if meets else "fails the guard: the protocol reruns this θ0 at lr 5e-4 and uses "
            "that run, before any downstream score")
    return [f"- θ0 guard (medium): MLM-15% loss {theta0[0]:.2f} vs unigram {theta0[1]:.2f}, {margin:.2f} nats below; "
            f"{rest} (≥ {THETA_GUARD:.2f} nats below)."], dict(loss=theta0[0], unigram=theta0[1], margin=margin,
                                                             meets=meets)


def replicates_report(summary):
    """The five-replicate rows next to their three-replicate points: the realized detectable difference
    (the protocol projected the three-replicate figure × √(units 3 reps / units 5 reps))."""
    lines = []
    for name in ("t1000", "s1000"):
        five, three = summary.get(f"{name} (5 reps)"), summary.get(name)
        if five is None:
            lines.append(f"- {name}, replicates 1-5: missing (see its section above).")
            continue
        was = (f"; with 3 replicates {three['detectable']:.1f}, projected × √({three['units']}/{five['units']}) = "
               f"{three['detectable'] * (three['units'] / five['units']) ** 0.5:.1f}") if three else ""
        lines.append(f"- {name}, replicates 1-5: D = {interval(five['d'], five['ci'])}, {five['verdict']}, "
                     f"{five['units']} units; realized detectable difference {five['detectable']:.1f} points{was}.")
    return lines


def freeze_rule(t1000, layers):
    """The committed freeze rule. t1000: the unfrozen twins' 3-replicate summary (None: missing); layers:
    {L: summary of D_L = freeze-L detour − MLM twin} for the grids there are."""
    if t1000 is None:
        return "needs t1000 (its D is the precondition); missing t1000."
    if verdict(t1000["ci"]) != "gain":
        return f"cannot tell: no gain to remove (the precondition, t1000's D a gain, fails: {t1000['verdict']})."
    if absent := [str(L) for L in FREEZE_LAYERS if L not in layers]:
        return f"needs every freeze grid; missing layer {', '.join(absent)}."
    said = {L: verdict(layers[L]["ci"]) for L in FREEZE_LAYERS}
    if all(v == "gain" for v in said.values()):
        return "no single layer carries it (every D_L is a gain)."
    # at most one layer can lose the gain while every other keeps it
    for L in FREEZE_LAYERS:
        if said[L] != "gain" and all(said[o] == "gain" for o in FREEZE_LAYERS if o != L):
            return f"the gain lives in layer {L} (D_{L} {said[L]}; freezing each other layer keeps a gain)."
    return "cannot tell (" + ", ".join(f"D_{L} {v}" for L, v in said.items()) + ")."


def freeze_report(out, t1000):
    """Freeze-L detour vs the MLM twin at t1000 (replicates 1-3): the runs' losses, D_L and the rule."""
    lines = ["## Mechanism at t1000: one layer frozen during CLM (replicates 1-3)", ""]
    chains = {L: chain_losses(out, f"t1000-clm-freeze{L}", R3) for L in FREEZE_LAYERS}
    grids = {L: read_json(out, f"ft8-t1000-freeze{L}", "results.json") for L in FREEZE_LAYERS}
    missing = [f"t1000-clm-freeze{L}-r{{1,2,3}}[-decay]/log.jsonl" for L, c in chains.items() if c is None]
    missing += [f"ft8-t1000-freeze{L}/results.json" for L, r in grids.items() if r is None]
    if rows := [(f"CLM, layer {L} frozen", c) for L, c in chains.items() if c]:
        lines += loss_table("run", rows, R3) + [""]
    layers = {L: comparison(r) for L, r in grids.items() if r}
    if layers:
        lines += ["| frozen during CLM | D_L = freeze-L detour − MLM twin, average F1 [95% CI] | verdict "
                  "| sign-flip p | detectable |", "|---|---|---|---|---|"]
        lines += [f"| layer {L} | {interval(s['d'], s['ci'])} | {s['verdict']} | {finetune.format_p(s['p'])} "
                  f"| {s['detectable']:.1f} |" for L, s in layers.items()] + [""]
    pre = (f"Precondition: t1000's D (unfrozen twins, replicates 1-3) = {interval(t1000['d'], t1000['ci'])}, "
           f"{t1000['verdict']}." if t1000 else "Precondition: t1000 missing.")
    lines += [pre] + [f"missing: out/bio/{m}" for m in missing] + [""]
    rule = freeze_rule(t1000, layers)
    return lines, dict(precondition=t1000 and t1000["verdict"], layers=layers, losses=chains, missing=missing,
                       verdict=rule)


def transplant_effect(res):
    """hybrid − MLM twin and CLM − MLM twin, in probe F1 points, from a transplant report (checkpoints: the CLM
    arm, the hybrid arm, the MLM arm, as studies/analysis.transplant orders them): one unit per (task, replicate)."""
    clm, hybrid, mlm = res["checkpoints"]
    names = [t["name"] for t in res["tasks"]]
    units = lambda arm: [100 * (x - y) for n in names for x, y in zip(
        res["scores"][arm][n]["replicate_means"], res["scores"][mlm][n]["replicate_means"])]
    gain, gap = units(hybrid), units(clm)
    d, lo, hi = finetune.mean_interval(gain)
    gap = sum(gap) / len(gap)
    # the share is descriptive, and only means something when the CLM arm is ahead in the probes
    return dict(d=d, ci=[lo, hi], p=finetune.sign_flip_p(gain), units=len(gain), gap=gap,
                share=d / gap if gap > 0 else None, verdict="transplants" if lo > 0 else "does not transplant")


def transplant_report(out):
    """The transplant variants at t1000 (linear probes): hybrid − MLM twin and the rule, per variant."""
    reports = {v: read_json(out, "tp-t1000", name + ".json") for v, name in TRANSPLANTS.items()}
    variants = {v: transplant_effect(res) for v, res in reports.items() if res}
    missing = [f"tp-t1000/{TRANSPLANTS[v]}.json" for v, res in reports.items() if res is None]
    lines = ["## Mechanism at t1000: transplants into the MLM twin (linear probes, replicates 1-3)", ""]
    if variants:
        lines += ["| variant | hybrid − MLM twin, probe F1 [95% CI] | sign-flip p | probed CLM − MLM twin | share "
                  "recovered | verdict |", "|---|---|---|---|---|---|"]
        share = lambda t: "—" if t["share"] is None else f"{100 * t['share']:.0f}%"
        lines += [f"| {v} | {interval(t['d'], t['ci'])} | {finetune.format_p(t['p'])} | {t['gap']:+.1f} "
                  f"| {share(t)} | {t['verdict']} |" for v, t in variants.items()]
        lines += ["", f"Units: the {next(iter(variants.values()))['units']} (task × replicate) pairs; the share "
                  "(hybrid − MLM over CLM − MLM) is descriptive, — where the CLM arm is not ahead."]
    verdicts = [f"- Transplant, {v}: " + (f"{variants[v]['verdict']} (hybrid − MLM twin "
                                         f"{interval(variants[v]['d'], variants[v]['ci'])} probe F1)."
                                         if v in variants else "missing.") for v in TRANSPLANTS]
    return (lines + [f"missing: out/bio/{m}" for m in missing] + [""],
            dict(variants=variants, missing=missing, verdicts=verdicts))


def capacity3_rule(s):
    """The three-size capacity rule of the second protocol, on the points' summaries."""
    if missing := [k for k in CAPACITY3 if k not in s]:
        return f"needs {', '.join(CAPACITY3)}; missing {', '.join(missing)}."
    tiny, small, medium = (s[k] for k in CAPACITY3)
    apart = tiny["ci"][0] > medium["ci"][1] or medium["ci"][0] > tiny["ci"][1]
    falls, rises = tiny["d"] > small["d"] > medium["d"], tiny["d"] < small["d"] < medium["d"]
    ds = f"D tiny {tiny['d']:+.1f}, small {small['d']:+.1f}, medium {medium['d']:+.1f}"
    if apart and (falls or rises):
        return (f"the gain {'falls' if falls else 'rises'} with capacity ({ds}; the tiny and medium intervals "
                "do not overlap).")
    why = [w for w, bad in (("D is not monotone in size", not (falls or rises)),
                            ("the tiny and medium intervals overlap", not apart)) if bad]
    return f"cannot tell ({ds}; {' and '.join(why)})."


# ----------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------
def collect(out):
    """Every section as markdown lines, and the same numbers as one JSON-able dict (curve.json)."""
    lines, summary, missing = ["# Phase-1 length and capacity: every point", ""], {}, {}
    for name in POINTS:
        part, s, absent = point_report(out, name)
        lines += part
        if s:
            summary[name] = s
        else:
            missing[name] = absent
    lines += summary_tables(summary) + [""] + rules(summary)
    guard_lines, guard = theta0_guard(out)
    freeze_lines, freeze = freeze_report(out, summary.get("t1000"))
    transplant_lines, transplant = transplant_report(out)
    capacity = capacity3_rule(summary)
    verdicts = guard_lines + [f"- Freeze during CLM at t1000: {freeze['verdict']}"] + transplant["verdicts"] + [
        f"- Capacity across three sizes (tiny, small, medium at 1,000 steps; this protocol's rule): {capacity}"]
    lines += ["", "# Why the detour pays where it pays: freeze, transplant, a third size, five replicates", "",
              "## Five replicates at t1000 and s1000", ""] + replicates_report(summary) + [""]
    lines += freeze_lines + transplant_lines + ["## Verdicts of this protocol's rules", ""] + verdicts
    data = dict(points=summary, missing_points=missing, theta0_guard=guard, freeze=freeze, transplant=transplant,
                capacity3=capacity, rules=rules(summary), verdicts=verdicts)
    return lines, data


def write_report(out_dir, stem, lines, data):
    """Print the report and, where out_dir exists, write it as <stem>.md and its numbers as <stem>.json."""
    text = "\n".join(lines) + "\n"
    print(text)
    if os.path.isdir(out_dir):
        for name, content in ((f"{stem}.md", text), (f"{stem}.json", json.dumps(data, indent=1))):
            finetune.detour.atomic_write(os.path.join(out_dir, name), lambda f: f.write(content.encode("utf-8")))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out_dir", default="out/bio")
    args = ap.parse_args()
    write_report(args.out_dir, "curve", *collect(args.out_dir))


if __name__ == "__main__":
    main()
