"""The study in one PNG (not a test): left, D = detour − MLM twin with its 95% interval for every point and
intervention (a forest plot); right, CKA r per layer per point. The numbers are study_curve's, read from the
same files under out/bio (the ones curve.json holds); a part whose files are missing is skipped with a note.

    python studies/study_figure.py                          # -> out/bio/study.png
    python studies/study_figure.py --out_dir out/bio --png PATH
"""

import argparse
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only: no display on the study machines
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a file (python studies/x.py), not imported: the repository root, for detour and bench
    sys.path.insert(0, ROOT)
from studies import study_curve  # noqa: E402


def forest_rows(data):
    """(label, D, [lo, hi], colour) top to bottom: the points, then the freeze runs, then the transplant hybrids
    (probe F1, not fine-tuned F1); and a note for each one that is missing."""
    freeze, hybrids = data["freeze"]["layers"], data["transplant"]["variants"]
    wanted = [(data["points"].get(name), name, "black",
               f"point {name}: missing {', '.join(data['missing_points'].get(name, []))}") for name in study_curve.POINTS]
    wanted += [(freeze.get(L), f"t1000, layer {L} frozen during CLM", "tab:blue",
                f"freeze layer {L}: missing out/bio/ft8-t1000-freeze{L}/results.json") for L in study_curve.FREEZE_LAYERS]
    wanted += [(hybrids.get(v), f"t1000 hybrid: MLM + CLM's {v} (probe F1)", "tab:orange",
                f"transplant {v}: missing out/bio/tp-t1000/{report}.json") for v, report in study_curve.TRANSPLANTS.items()]
    rows = [(f"{label} ({s['units']} units)", s["d"], s["ci"], colour) for s, label, colour, _ in wanted if s]
    return rows, [note for s, _, _, note in wanted if not s]


def forest(ax, rows):
    """D with its interval per row, a zero line, and the numbers beside each row."""
    for y, (label, d, ci, colour) in enumerate(reversed(rows)):
        ax.errorbar(d, y, xerr=[[d - ci[0]], [ci[1] - d]], fmt="o", color=colour, capsize=3)
        ax.annotate(study_curve.interval(d, ci), (ci[1], y), xytext=(4, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.axvline(0, color="grey", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(rows)), [r[0] for r in reversed(rows)], fontsize=8)
    ax.set_xlabel("D = arm − MLM twin: average F1 points (hybrids: probe F1), 95% t interval")
    ax.set_title("D per point and intervention")
    lo, hi = ax.get_xlim()
    ax.set_xlim(lo, hi + 0.3 * (hi - lo))  # room for the numbers right of the intervals


def cka_panel(ax, data):
    """CKA r = d(CLM r1, MLM r1) / d(MLM r1, MLM r2) per layer, one line per point; r = 1 is seed noise."""
    curves = {name: s["cka"] for name, s in data["points"].items() if s.get("cka")}
    for name, rows in curves.items():
        ax.plot(range(len(rows)), [r["r"] for r in rows], marker="o", label=name)
    ax.axhline(1, color="grey", linestyle="--", linewidth=1)
    deepest = max(curves.values(), key=len)
    ax.set_xticks(range(len(deepest)), ["emb." if r["layer"] == "embeddings" else r["layer"].replace("layer ", "")
                                        for r in deepest])
    values = [r["r"] for rows in curves.values() for r in rows] + [1.0]
    if max(values) / min(values) > 10:  # a log axis only when the ratios span more than a decade
        ax.set_yscale("log")
    ax.set_xlabel("layer (embeddings, then the output of layer i)")
    ax.set_ylabel("CKA r (twins' distance / seed noise)")
    ax.set_title("CKA r per layer")
    ax.legend(fontsize=8)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out_dir", default="out/bio")
    ap.add_argument("--png", default=None, help="default: <out_dir>/study.png")
    args = ap.parse_args(argv)
    png = args.png or os.path.join(args.out_dir, "study.png")
    data = study_curve.collect(args.out_dir)[1]
    rows, notes = forest_rows(data)
    has_cka = any(s.get("cka") for s in data["points"].values())
    if not has_cka:
        notes.append("CKA: no point has its cka.json")
    for note in notes:
        print(f"skipped: {note}")
    if not rows and not has_cka:
        return print("nothing to draw yet")
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, max(4.0, 0.4 * len(rows) + 1.5)),
                                      gridspec_kw=dict(width_ratios=[3, 2]))
    if rows:
        forest(left, rows)
    else:
        left.set_axis_off()  # the notes on stdout say why
    if has_cka:
        cka_panel(right, data)
    else:
        right.set_axis_off()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=120)
    print(f"written to {png}")


if __name__ == "__main__":
    main()
