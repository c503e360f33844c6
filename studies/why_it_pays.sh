#!/usr/bin/env bash
# Why the detour pays where it pays (docs/studies/why-it-pays.md): at t1000, one layer frozen during CLM and the
# transplant of the CLM twin's layer 0 (with and without the embeddings); replicates 4-5 at t1000 and s1000; a third
# size, medium (m1000); then the report with the protocol's verdicts and the figure.
# Usage: GENERAL=path/to/general_en_combined.txt BIO=path/to/bio bash studies/why_it_pays.sh
# About 5.2 hours on a 2-core machine (the wall times of a run beside other work, so an upper bound; ft8-m1000
# alone 2.3 hours), plus about 2 hours for what it builds on where that is missing (the data, both θ0s, the t1000
# and s1000 twins of replicates 1-3 and their grids: studies/where_it_pays.sh makes the same runs).
# Run it again after a stop: finished runs and grids are skipped, an unfinished grid keeps its cells.
# Report: $OUT/curve.md and curve.json, figure $OUT/study.png (default out/bio); docs/study.png is this figure:
# refresh it with python studies/study_figure.py --out_dir out/bio --png docs/study.png
source "$(dirname "$0")/common.sh"
need_corpora

# What this study builds on, as studies/where_it_pays.sh makes it: the data, both θ0s, the t1000 and s1000 twins
# (replicates 1-3) and their 8-task grids, whose cells the grids below reuse.
prepare_data
theta0 tiny
for k in 1 2 3; do pair t1000- "$TT" $k; done
ft2 "$(arms t1000- decay 1 2 3)" ft8-t1000
# 1. The mechanism at t1000: nine freeze runs (layer L frozen during CLM, then the twins' decay), two at a time.
freeze() { chain clm "$TT $(rep "$2") --freeze_layers $1" "t1000-clm-freeze$1-r$2"; }   # freeze LAYER k
runs=(); for L in 0 1 2; do for k in 1 2 3; do runs+=("freeze $L $k"); done; done
two_at_a_time "${runs[@]}"
# ... the t1000 replicates 4-5 ...
for k in 4 5; do pair t1000- "$TT" $k; done
# ... D_L per frozen layer: that layer's freeze runs against the MLM twins (replicates 1-3) ...
fz() { local a="" k m; m=$(arms t1000- decay 1 2 3)
  for k in 1 2 3; do a="$a+$OUT/t1000-clm-freeze$1-r$k-decay"; done; echo "${a#+},${m#*,}"; }
for L in 0 1 2; do share ft8-t1000 "ft8-t1000-freeze$L" && ft2 "$(fz $L)" "ft8-t1000-freeze$L"; done
# ... the transplants (linear probes; the two variants share the twins' probe cells; the second pass is a no-op
#     once both have reported: the grid waits for a cell another process holds; $F8 with studies/analysis.py, less
#     the fine-tuning epochs and lr, which a probe does not use and analysis.py refuses) ...
TP="${F8/finetune.py/studies/analysis.py}"
TP="${TP/ --ner_epochs 4 --epochs 4 --learning_rate 5e-4/} --analysis transplant --ckpts $(arms t1000- decay 1 2 3) --out_dir $OUT/tp-t1000"
tp() { [ -f "$OUT/tp-t1000/transplant-${1/,/_}.json" ] || timed sh -c "$TP --layers $1"; }
tp 0 & a=$!; tp embeddings,0 & waitall $a $!
for v in 0 embeddings,0; do tp $v; done
# ... and t1000 on five replicates.
share ft8-t1000 ft8-t1000-r5 && ft2 "$(arms t1000- decay 1 2 3 4 5)" ft8-t1000-r5
# 3. s1000 on five replicates: the small θ0, replicates 1-3 (studies/bio_cpu.sh's twins) and their grid, then 4-5.
theta0 small
for k in 1 2 3 4 5; do pair "" "$TW" $k; done
ft2 "$(arms "" decay 1 2 3)" ft8-s1000
share ft8-s1000 ft8-s1000-r5 && ft2 "$(arms "" decay 1 2 3 4 5)" ft8-s1000-r5
# 2. The medium point: its θ0 (8M general MLM tokens, lr 1e-3, two threads) and its decay ...
theta0 medium
# ... the guard fixed before any score: it must end at least 2.5 nats below its unigram, else the protocol reruns
#     it at lr 5e-4 before any twin (it met the guard; the rerun is not scripted).
guard='import json, sys; r = [json.loads(l) for l in open(sys.argv[1]) if "val_loss" in l][-1]
sys.exit(r["val_unigram"] - r["val_loss"] < 2.5)'
python -c "$guard" "$OUT/medium-theta0-mlm-decay/log.jsonl" ||
  { echo "the medium θ0 misses its guard: rerun it at --learning_rate 5e-4 (see the protocol)" >&2; exit 1; }
# ... three replicates of twins, the 8 tasks, CKA (A = CLM r1, B = MLM r1, C = MLM r2).
for k in 1 2 3; do pair m1000- "$TMW" $k; done
ft2 "$(arms m1000- decay 1 2 3)" ft8-m1000
cka m1000-clm-r1-decay m1000-mlm-r1-decay m1000-mlm-r2-decay cka-m1000
# 4. The report and the figure (every point and intervention whose files are there).
python studies/study_curve.py --out_dir "$OUT"
python studies/study_figure.py --out_dir "$OUT" --png "$OUT/study.png"
