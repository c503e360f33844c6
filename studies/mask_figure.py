"""The flag in one picture (not a test): the four attention patterns of one packed window, drawn from detour.may_attend.

Rows: a global layer (every key of the window) and a local layer (a sliding window); columns: bidirectional (MLM, the
decay) and causal (the detour's Phase 1). The window packs three documents, each closed by [SEP]; no query attends
across a [SEP]. Every pixel is may_attend's answer for that (query, key) pair, with the model's own window
(Config.local_attention // 2 keys on each side), so the picture is the code's rule, not a drawing of it.

    python studies/mask_figure.py --png docs/mask.png
"""
import argparse
import os
import sys

if __package__ in (None, ""):  # run as a file: the repository root holds detour.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import detour


def masks(doc_lengths, window):
    """{(layer kind, mode): (T, T) bool} for one row packing documents of these lengths, each ending in [SEP]."""
    sep = 3                                              # any id: only where it sits matters
    idx = torch.full((1, sum(doc_lengths)), 7)
    idx[0, torch.tensor(doc_lengths).cumsum(0) - 1] = sep
    doc_ids, T = detour.document_ids(idx, sep), idx.shape[1]
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    out = {}
    for kind, w in (("global", None), ("local", window)):
        for mode, causal in (("bidirectional", False), ("causal", True)):
            out[kind, mode] = detour.may_attend(0, q, k, T, causal, w, doc_ids=doc_ids)
    return out, doc_ids[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--png", default="docs/mask.png")
    ap.add_argument("--docs", default="150,70,36", help="the packed documents' lengths in tokens, [SEP] included")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError:
        sys.exit("error: this figure needs matplotlib; pip install matplotlib")
    lengths = [int(x) for x in args.docs.split(",")]
    window = detour.Config().local_attention // 2        # 64: a local token sees 64 keys on each side
    m, doc_ids = masks(lengths, window)
    T, ends = sum(lengths), [e - 0.5 for e in torch.tensor(lengths).cumsum(0).tolist()[:-1]]
    fig, axes = plt.subplots(2, 2, figsize=(8, 8.4), constrained_layout=True)
    cmap = ListedColormap(["#f4f4f4", "#2b6cb0"])
    for r, kind in enumerate(("global", "local")):
        for c, mode in enumerate(("bidirectional", "causal")):
            ax = axes[r, c]
            ax.imshow(m[kind, mode].int().numpy(), cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
            for e in ends:                               # the [SEP] that closes each document but the last
                ax.axhline(e, color="#c53030", lw=0.7)
                ax.axvline(e, color="#c53030", lw=0.7)
            what = "every key" if kind == "global" else f"keys within ±{window}"
            phase = "MLM and the decay" if mode == "bidirectional" else "the detour (--phase clm)"
            ax.set_title(f"{kind} layer, {mode}\n{what}; {phase}", fontsize=9)
            ax.set_xlabel("key position", fontsize=8)
            ax.set_ylabel("query position", fontsize=8)
            ax.tick_params(labelsize=7)
    fig.suptitle(f"detour.may_attend on one packed window of {T} tokens: documents of {', '.join(map(str, lengths))} "
                 "tokens\n(blue: may attend; red lines: after each [SEP], where no attention crosses)", fontsize=10)
    os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png} ({T} tokens, {len(lengths)} documents, local window ±{window})")


if __name__ == "__main__":
    main()
