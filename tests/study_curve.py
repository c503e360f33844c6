"""The length and capacity curve of README's "Where the detour starts to pay" (not a test): reads
what the protocol's commands wrote under out/bio/ and prints every point's figures, the summary
table and the verdicts of the decision rules committed with the protocol before any score.

    python tests/study_curve.py                 # -> stdout and out/bio/curve.md
    python tests/study_curve.py --out_dir out/bio

A point whose runs are not all there yet is listed as missing, not guessed.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import finetune  # noqa: E402  (the study's own statistics: t interval, sign flip)

# point -> (preset, Phase-1 steps, prefix of its twins' directories, its theta0)
POINTS = {"s250": ("small", 250, "s250-", "theta0-mlm-decay"), "s1000": ("small", 1000, "", "theta0-mlm-decay"),
          "s4000": ("small", 4000, "s4000-", "theta0-mlm-decay"),
          "t1000": ("tiny", 1000, "t1000-", "tiny-theta0-mlm-decay")}
REPLICATES = (1, 2, 3)


def last_eval(run_dir):
    """The last log.jsonl record with a validation loss: (loss, unigram CE of the same targets, accuracy)."""
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.isfile(path):
        return None
    evals = [r for r in map(json.loads, open(path)) if "val_loss" in r]
    return (evals[-1]["val_loss"], evals[-1]["val_unigram"], evals[-1].get("val_acc")) if evals else None


def losses(out, prefix):
    """{(arm, phase): [(loss, unigram, acc) per replicate]} or None when a run is missing."""
    got = {}
    for arm in ("clm", "mlm"):
        for phase, suffix in (("phase1", ""), ("decay", "-decay")):
            got[arm, phase] = [last_eval(os.path.join(out, f"{prefix}{arm}-r{r}{suffix}")) for r in REPLICATES]
            if None in got[arm, phase]:
                return None
    return got


def verdict(ci):
    return "deficit" if ci[1] < 0 else "gain" if ci[0] > 0 else "cannot tell"


def point_report(out, name):
    """(markdown lines, summary dict) of one point, or (lines saying what is missing, None)."""
    preset, steps, prefix, theta = POINTS[name]
    lines = [f"## {name}: {preset} preset, {steps:,} Phase-1 steps, θ0 = out/bio/{theta}", ""]
    theta0, got = last_eval(os.path.join(out, theta)), losses(out, prefix)
    res_path = os.path.join(out, f"ft8-{name}", "results.json")
    if theta0 is None or got is None or not os.path.isfile(res_path):
        return lines + ["missing: " + ", ".join(w for w, ok in (("θ0", theta0), ("twins", got),
                                                             ("ft8 results", os.path.isfile(res_path))) if not ok), ""], None
    lines += [f"θ0 MLM-15% validation loss on general text {theta0[0]:.2f} vs unigram {theta0[1]:.2f} "
              f"({100 * theta0[2]:.1f}% of masked tokens right).", "",
              "| twin | Phase 1, replicates 1/2/3 (its own objective) | after the decay (MLM 15%) | accuracy after decay |",
              "|---|---|---|---|"]
    for arm in ("clm", "mlm"):
        p1, dec = got[arm, "phase1"], got[arm, "decay"]
        lines.append(f"| {arm.upper()} | {' / '.join(f'{x[0]:.2f}' for x in p1)} (unigram {p1[0][1]:.2f}) "
                     f"| {' / '.join(f'{x[0]:.2f}' for x in dec)} (unigram {dec[0][1]:.2f}) "
                     f"| {' / '.join(f'{100 * x[2]:.1f}%' for x in dec)} |")
    res = json.load(open(res_path))
    names = [t["name"] for t in res["tasks"]]
    lines += ["", "Per-task difference, detour − MLM (F1 points, 95% t interval over the 3 replicates):", "",
              "| " + " | ".join(names + ["average"]) + " |", "|" + "---|" * (len(names) + 1),
              "| " + " | ".join(f"{100 * res['difference'][n]:+.1f} [{100 * res['ci95'][n][0]:+.1f}, "
                                f"{100 * res['ci95'][n][1]:+.1f}]" for n in names + ["average"]) + " |", "",
              f"{len(res['units'])} units; sign-flip p = {finetune.format_p(res['p_sign_flip'])}, bootstrap p = "
              f"{finetune.format_p(res['p_bootstrap'])}, detectable difference {100 * res['detectable_difference']:.1f} "
              f"points (out/bio/ft8-{name}/results.md).", ""]
    cka_path = os.path.join(out, "cka" if name == "s1000" else f"cka-{name}", "cka.json")
    if os.path.isfile(cka_path):
        rows = json.load(open(cka_path))["rows"]
        lines += ["CKA r = d(CLM r1, MLM r1) / d(MLM r1, MLM r2): " + ", ".join(
            f"{r['layer']} {r['r']:.2f}" for r in rows if r.get("r") is not None), ""]
    gap = (sum(x[0] for x in got["clm", "decay"]) - sum(x[0] for x in got["mlm", "decay"])) / len(REPLICATES)
    return lines, dict(d=100 * res["difference"]["average"], ci=[100 * c for c in res["ci95"]["average"]],
                       p=res["p_sign_flip"], detectable=100 * res["detectable_difference"], gap=gap,
                       tasks={n: (100 * res["difference"][n], *(100 * c for c in res["ci95"][n])) for n in names})


def rules(s):
    """The decision rules as committed with the protocol, applied to the points that exist."""
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out_dir", default="out/bio")
    args = ap.parse_args()
    lines, summary = ["# Phase-1 length and capacity: every point", ""], {}
    for name in POINTS:
        part, s = point_report(args.out_dir, name)
        lines += part
        if s:
            summary[name] = s
    lines += ["## Summary", "", "| point | preset | Phase-1 steps | D = detour − MLM, average F1 [95% CI] | at the point "
              "| sign-flip p | detectable | decayed MLM loss, CLM − MLM twin |", "|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        preset, steps = POINTS[name][:2]
        lines.append(f"| {name} | {preset} | {steps:,} | {s['d']:+.1f} [{s['ci'][0]:+.1f}, {s['ci'][1]:+.1f}] "
                     f"| {verdict(s['ci'])} | {finetune.format_p(s['p'])} | {s['detectable']:.1f} | {s['gap']:+.2f} nats |")
    tasks = list(dict.fromkeys(t for s in summary.values() for t in s["tasks"]))
    lines += ["", "Per-task differences at every point, detour − MLM (F1 points, 95% t interval over the replicates):",
              "", "| point | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for name, s in summary.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{s['tasks'][t][0]:+.1f} [{s['tasks'][t][1]:+.1f}, {s['tasks'][t][2]:+.1f}]" if t in s["tasks"] else ""
            for t in tasks) + " |")
    lines += [""] + rules(summary)
    text = "\n".join(lines) + "\n"
    print(text)
    if os.path.isdir(args.out_dir):
        finetune.detour.atomic_write(os.path.join(args.out_dir, "curve.md"), lambda f: f.write(text.encode("utf-8")))


if __name__ == "__main__":
    main()
