"""The report of the tiny-mechanism study (docs/studies/tiny-mechanism.md; run by studies/tiny_mechanism.sh): at
t1000, the MLM decay at five lengths (2.5% to 100% of the Phase-1 tokens) after both twins, and one layer frozen
during CLM, each with five pretraining replicates. Reads what the study script wrote under out/bio and prints the
tables and the verdicts of the rules fixed before any score, applied mechanically; a part whose files are not all
there yet is listed as missing, not guessed.

    python studies/tiny_mechanism.py                       # -> stdout, out/bio/tiny-mechanism.md and .json
    python studies/tiny_mechanism.py --png docs/tiny-mechanism.png   # and the figure (needs matplotlib)
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a file (python studies/x.py), not imported: the repository root, for detour and bench
    sys.path.insert(0, ROOT)
import finetune  # noqa: E402  (the statistics: t interval, sign flip)
from studies.study_curve import (R5, chain_losses, comparison, freeze_rule, interval, last_eval,  # noqa: E402
                                 read_json, write_report)

# decay length (share of the Phase-1 tokens) -> the suffix of its runs: out/bio/t1000-{clm,mlm}-r<k>-<suffix>
LENGTHS = {"2.5%": "decay2.5", "10%": "decay", "20%": "decay20", "50%": "decay50", "100%": "decay100"}
FREEZE_LAYERS = (0, 1, 2)  # every layer of the tiny preset, one frozen per run


def d_grid(length):
    """The 8-task grid of both twins after a decay of `length` (replicates 1-5): CLM twin first."""
    return "ft8-t1000-r5" if length == "10%" else f"ft8-t1000-{LENGTHS[length]}"


def arm_grid(arm, length):
    """The grid that pairs one arm after the 10% decay (first) with the same arm after `length` (second)."""
    return f"ft8-t1000-{arm}-10v{LENGTHS[length].removeprefix('decay')}"


def cka_dir(length):
    return "cka-t1000" if length == "10%" else f"cka-t1000-{LENGTHS[length]}"


def decay_losses(out):
    """{length: {arm: [(loss, unigram, accuracy) per replicate]}} of every decay run there is."""
    got = {}
    for length, suffix in LENGTHS.items():
        runs = {arm: [last_eval(os.path.join(out, f"t1000-{arm}-r{k}-{suffix}")) for k in R5] for arm in ("clm", "mlm")}
        if not any(None in r for r in runs.values()):
            got[length] = runs
    return got


def length_section(out):
    """D(L) and each arm's average F1 per decay length, the arm-vs-10% intervals, the losses; -> (lines, data)."""
    lines = ["## The decay length (t1000, replicates 1-5, 8 tasks × 3 fine-tuning seeds)", ""]
    losses, D, arms, missing = decay_losses(out), {}, {}, []
    for length in LENGTHS:
        res = read_json(out, d_grid(length), "results.json")
        if res is None:
            missing.append(f"{d_grid(length)}/results.json")
            continue
        D[length] = comparison(res)
        clm, mlm = res["checkpoints"][:2]
        arms[length] = {arm: 100 * res["scores"][label]["average"]["mean"] for arm, label in (("clm", clm), ("mlm", mlm))}
    vs10 = {arm: {} for arm in ("clm", "mlm")}
    for arm in vs10:
        for length in LENGTHS:
            if length != "10%":
                res = read_json(out, arm_grid(arm, length), "results.json")
                if res is None:
                    missing.append(f"{arm_grid(arm, length)}/results.json")
                else:
                    vs10[arm][length] = comparison(res)
    lines += ["| decay (share of Phase 1) | decay steps | CLM twin, average F1 | MLM twin, average F1 | D = CLM − MLM "
              "[95% CI] | verdict | sign-flip p | detectable | MLM-15% loss after the decay, CLM / MLM twin (unigram) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for length in LENGTHS:
        steps = round(float(length[:-1]) / 100 * 1000)
        loss = losses.get(length)
        loss_text = (f"{sum(x[0] for x in loss['clm']) / 5:.2f} / {sum(x[0] for x in loss['mlm']) / 5:.2f} "
                     f"({loss['clm'][0][1]:.2f})" if loss else "missing")
        if length in D:
            s, a = D[length], arms[length]
            lines.append(f"| {length} | {steps} | {a['clm']:.1f} | {a['mlm']:.1f} | {interval(s['d'], s['ci'])} "
                         f"| {s['verdict']} | {finetune.format_p(s['p'])} | {s['detectable']:.1f} | {loss_text} |")
        else:
            lines.append(f"| {length} | {steps} | missing | missing | missing | | | | {loss_text} |")
    lines += ["", "Losses: replicate means of the last validation record (MLM 15%), next to the unigram cross-entropy "
              "of the same targets.", "", "Each arm after the 10% decay minus the same arm after another length "
              "(average F1, 95% t interval over the 40 task × replicate units):", "",
              "| arm | " + " | ".join(f"10% − {L}" for L in LENGTHS if L != "10%") + " |", "|---|---|---|---|---|"]
    for arm in vs10:
        lines.append(f"| {arm.upper()} twin | " + " | ".join(
            interval(vs10[arm][L]["d"], vs10[arm][L]["ci"]) if L in vs10[arm] else "missing"
            for L in LENGTHS if L != "10%") + " |")
    lines += [""] + [f"missing: out/bio/{m}" for m in missing] + [""]
    return lines, dict(D=D, arms=arms, vs10=vs10, losses=losses, missing=missing)


def length_rules(data):
    """The decay-length rules, fixed before any score (docs/studies/tiny-mechanism.md)."""
    D, vs10, out = data["D"], data["vs10"], []
    for length in LENGTHS:
        out.append(f"- The gain at {length}: " + (
            ("persists" if D[length]["ci"][0] > 0 else "does not persist (cannot tell or a deficit: interval "
             f"{interval(D[length]['d'], D[length]['ci'])})") if length in D else "missing."))
    longer = ("10%", "20%", "50%", "100%")
    if any(L not in D for L in longer):
        out.append("- Fades: needs D at 10%, 20%, 50% and 100%; missing.")
    else:
        falls = all(D[a]["d"] > D[b]["d"] for a, b in zip(longer, longer[1:]))
        below = D["100%"]["ci"][1] < D["10%"]["d"]
        word = "fades" if falls and below else "cannot tell whether it fades"
        out.append(f"- Fades: {word} (D falls monotonically from 10% to 100%: {'yes' if falls else 'no'}; D(100%)'s "
                   f"interval below D(10%)'s point estimate {D['10%']['d']:+.1f}: {'yes' if below else 'no'}).")
    for arm in ("clm", "mlm"):
        others = [L for L in LENGTHS if L != "10%"]
        if any(L not in vs10[arm] for L in others):
            out.append(f"- 10% is best for the {arm.upper()} twin: needs every arm-vs-10% grid; missing.")
            continue
        best = all(vs10[arm][L]["ci"][0] > 0 for L in others)
        out.append(f"- 10% is best for the {arm.upper()} twin: " + ("yes (above every other length, each paired "
                   "interval above 0)." if best else "cannot tell (" + ", ".join(
                       f"10% − {L} {interval(vs10[arm][L]['d'], vs10[arm][L]['ci'])}" for L in others) + ")."))
    return out


def freeze_section(out, unfrozen):
    """D_L = freeze-L detour − MLM twin with five replicates, its runs' losses and the committed freeze rule."""
    lines = ["## One layer frozen during CLM (t1000, replicates 1-5; the decay trains every layer)", ""]
    chains = {L: chain_losses(out, f"t1000-clm-freeze{L}", R5) for L in FREEZE_LAYERS}
    grids = {L: read_json(out, f"ft8-t1000-freeze{L}-r5", "results.json") for L in FREEZE_LAYERS}
    layers = {L: comparison(r) for L, r in grids.items() if r}
    missing = [f"t1000-clm-freeze{L}-r{{1..5}}[-decay]" for L, c in chains.items() if c is None]
    missing += [f"ft8-t1000-freeze{L}-r5/results.json" for L, r in grids.items() if r is None]
    lines += ["| frozen during CLM | Phase 1, next token, replicate mean | after the decay, MLM 15% (unigram) "
              "| D_L = freeze-L detour − MLM twin [95% CI] | verdict | sign-flip p | detectable |",
              "|---|---|---|---|---|---|---|"]
    if unfrozen:
        lines.append(f"| none (the CLM twin) | | | {interval(unfrozen['d'], unfrozen['ci'])} | {unfrozen['verdict']} "
                     f"| {finetune.format_p(unfrozen['p'])} | {unfrozen['detectable']:.1f} |")
    for L in FREEZE_LAYERS:
        c, s = chains[L], layers.get(L)
        loss = (f"{sum(x[0] for x in c['phase1']) / 5:.2f} | {sum(x[0] for x in c['decay']) / 5:.2f} "
                f"({c['decay'][0][1]:.2f})" if c else "missing | missing")
        stats = (f"{interval(s['d'], s['ci'])} | {s['verdict']} | {finetune.format_p(s['p'])} | {s['detectable']:.1f}"
                 if s else "missing | | |")
        lines.append(f"| layer {L} | {loss} | {stats} |")
    rule = freeze_rule(unfrozen, layers)
    lines += [""] + [f"missing: out/bio/{m}" for m in missing] + [""]
    return lines, dict(layers=layers, losses=chains, missing=missing, verdict=rule)


def cka_section(out):
    """CKA r per layer after each decay length: d(CLM r1, MLM r1) / d(MLM r1, MLM r2), both after that decay."""
    rows = {L: read_json(out, cka_dir(L), "cka.json") for L in LENGTHS}
    got = {L: [(r["layer"], r["r"]) for r in c["rows"] if r.get("r") is not None] for L, c in rows.items() if c}
    lines = ["## The imprint after each decay length: CKA r per layer (seed-noise control: MLM r1 vs r2)", ""]
    if got:
        names = [name for name, _ in next(iter(got.values()))]
        lines += ["| decay | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        lines += [f"| {L} | " + " | ".join(f"{r:.2f}" for _, r in got[L]) + " |" for L in got]
        lines += ["", "r > 1: the twins differ by more than two MLM seeds do at that layer (one text sample, one "
                  "pair of replicates per length: descriptive)."]
    lines += [f"missing: out/bio/{cka_dir(L)}/cka.json" for L in LENGTHS if L not in got] + [""]
    return lines, got


def collect(out):
    length_lines, length = length_section(out)
    freeze_lines, freeze = freeze_section(out, length["D"].get("10%"))
    cka_lines, cka = cka_section(out)
    verdicts = length_rules(length) + [f"- Freeze during CLM, five replicates: {freeze['verdict']}"]
    lines = ["# The mechanism at the tiny point: decay length and the freeze with five replicates", ""]
    lines += length_lines + cka_lines + freeze_lines + ["## Verdicts of the rules fixed before any score", ""]
    return lines + verdicts, dict(length=length, freeze=freeze, cka=cka, verdicts=verdicts)


def figure(data, png):
    """D(L) with its interval against the decay length (left), both arms' average F1 against it (right)."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: the figure needs matplotlib; pip install matplotlib (the report itself does not)")
    D, arms = data["length"]["D"], data["length"]["arms"]
    xs = [L for L in LENGTHS if L in D]
    order = sorted(xs, key=lambda L: float(L[:-1]))
    pos = [float(L[:-1]) for L in order]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.errorbar(pos, [D[L]["d"] for L in order], capsize=3, fmt="o-", color="black",
                  yerr=[[D[L]["d"] - D[L]["ci"][0] for L in order], [D[L]["ci"][1] - D[L]["d"] for L in order]])
    left.axhline(0, color="grey", lw=0.8)
    left.set(xscale="log", xlabel="MLM decay, % of Phase-1 tokens", ylabel="D = CLM − MLM twin, average F1",
             title="the detour's gain after each decay (95% CI)")
    for arm, colour in (("clm", "tab:red"), ("mlm", "tab:blue")):
        right.plot(pos, [arms[L][arm] for L in order], "o-", color=colour, label=f"{arm.upper()} twin")
    right.set(xscale="log", xlabel="MLM decay, % of Phase-1 tokens", ylabel="average F1 (8 tasks)",
              title="each twin's score")
    right.legend()
    for ax in (left, right):
        ax.set_xticks(pos, order)
    fig.suptitle("t1000 (tiny preset, 1,000 Phase-1 steps), 5 pretraining replicates × 8 tasks × 3 seeds")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out_dir", default="out/bio")
    ap.add_argument("--png", default="", help="also draw the figure into this file (needs matplotlib)")
    args = ap.parse_args()
    lines, data = collect(args.out_dir)
    write_report(args.out_dir, "tiny-mechanism", lines, data)
    if args.png:
        figure(data, args.png)


if __name__ == "__main__":
    main()
