#!/usr/bin/env bash
# Where the detour starts to pay: Phase-1 length and capacity (docs/studies/where-it-pays.md). Points s250, s1000,
# s4000 (small preset, 250/1,000/4,000 Phase-1 steps) and t1000 (tiny preset, 1,000 steps), three replicates each,
# eight tasks downstream, CKA per point; then the report with the protocol's verdicts and the four-task check.
# Usage: GENERAL=path/to/general_en_combined.txt BIO=path/to/bio bash studies/where_it_pays.sh
# About 4.3 hours on an idle 2-core machine (θ0s 18 minutes, twins 1.2 hours, grids 2.8 hours; s4000 alone 1.6
# hours); run it again after a stop: finished runs and grids are skipped, an unfinished grid keeps its cells.
# Report: $OUT/curve.md and curve.json (default out/bio). The s1000 twins and their CKA are studies/bio_cpu.sh's
# (the same commands): whichever script runs first makes them, the other skips them.
source "$(dirname "$0")/common.sh"
need_corpora

# The data, the small θ0 and s1000 = the twins of studies/bio_cpu.sh (replicates 1-3).
prepare_data
theta0 small
for k in 1 2 3; do pair "" "$TW" $k; done
# s250 and s4000: only the Phase-1 length changes (s4000 also evaluates every 1,000 steps, not every 250).
for k in 1 2 3; do
  pair s250- "$TW" $k "--max_tokens 256000"
  pair s4000- "$TW" $k "--max_tokens 4096000 --eval_interval 1000"
done
# t1000: the tiny θ0 (the small θ0's recipe, only the shape changes), then its twins.
theta0 tiny
for k in 1 2 3; do pair t1000- "$TT" $k; done
# Downstream on the 8 tasks, each grid by two processes: every point, then both θ0s.
for pt in "" s250- s4000- t1000-; do g=${pt%-}; ft2 "$(arms "$pt" decay 1 2 3)" "ft8-${g:-s1000}"; done
ft2 "$OUT/theta0-mlm-decay,$OUT/tiny-theta0-mlm-decay" ft8-theta0
# CKA per point: A = CLM r1, B = MLM r1, C = MLM r2 (s1000's is studies/bio_cpu.sh's out/bio/cka).
cka clm-r1-decay mlm-r1-decay mlm-r2-decay cka
for pt in s250- s4000- t1000-; do cka "${pt}clm-r1-decay" "${pt}mlm-r1-decay" "${pt}mlm-r2-decay" "cka-${pt%-}"; done
# The report: every point's figures, the summary table and the rules' verdicts -> $OUT/curve.md, curve.json.
python studies/study_curve.py --out_dir "$OUT"
# The check: the four-task table of studies/bio_cpu.sh from the same cells (its four NER tasks, seeds and runs):
# no new cell, the report only.
share ft8-s1000 ft8-s1000-ner4
grid "${F8/--tasks $TASKS8/--tasks $TASKS}" "$(arms "" decay 1 2 3)" ft8-s1000-ner4 "--merge true"
