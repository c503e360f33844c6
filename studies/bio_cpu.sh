#!/usr/bin/env bash
# The detour on real biomedical text at CPU scale (docs/studies/bio-cpu.md): the small θ0, its CLM and MLM twins
# on bio text (replicates 1-3), a freeze pair during CLM, a 50% decay pair, four NER tasks downstream, CKA, drift.
# Usage: GENERAL=path/to/general_en_combined.txt BIO=path/to/bio bash studies/bio_cpu.sh
# About 1.6 hours on an idle 2-core machine (θ0 13 minutes, the rest 82); run it again after a stop: finished runs
# and grids are skipped, an unfinished grid keeps its cells. Report: $OUT/bio_cpu.md (default out/bio).
source "$(dirname "$0")/common.sh"
need_corpora

# 0-1. The two corpora and θ0 (MLM 30% on 8M general tokens, then an MLM-15% decay of 10%).
prepare_data
theta0 small
# 2. The twins from θ0, 1,000 Phase-1 steps and a 10% decay; replicates 2, 3: other seed and data order.
for k in 1 2 3; do pair "" "$TW" $k; done
# The freeze pair during CLM (replicate 1): the lowest third (layers 0-1 of 6) against the middle third (2-3).
chain clm "$TW $R1 --freeze_layers 0-1" clm-freeze-low & a=$!
chain clm "$TW $R1 --freeze_layers 2-3" clm-freeze-mid & waitall $a $!
# The decay-length pair (replicate 1): 50% of Phase 1 instead of 10%.
decay_of clm-r1 0.5 decay50 & a=$!; decay_of mlm-r1 0.5 decay50 & waitall $a $!
# 3. Downstream: 4 NER tasks, 1,000 training sentences (a fixed subset), 500 dev / 500 test, 4 epochs, lr 5e-4,
#    3 seeds (no --epochs: NER only). Two processes: the twins' grid beside the three small ones.
F="OMP_NUM_THREADS=1 python finetune.py --tasks $TASKS --seeds 3 --ner_epochs 4 --learning_rate 5e-4 --max_train 1000 --max_eval 500 --progress false"
grid "$F" "$(arms "" decay 1 2 3)" ft-twins & a=$!
{ grid "$F" "$OUT/theta0-mlm-decay" ft-theta0 &&
  grid "$F" "$OUT/clm-freeze-mid-decay,$OUT/clm-freeze-low-decay" ft-freeze &&
  grid "$F" "$OUT/clm-r1-decay50,$OUT/mlm-r1-decay50" ft-decay50; } & waitall $a $!
# 4. Why: CKA d(A, B) per layer with the seed-noise control C = the MLM twin's replicate 2; weight drift from θ0.
cka clm-r1-decay mlm-r1-decay mlm-r2-decay cka
for a in clm mlm; do
  [ -f "$OUT/drift-$a/drift.json" ] ||
    python studies/analysis.py --analysis drift --ckpts "$OUT/$a-r1-decay,$OUT/theta0-mlm-decay" --out_dir "$OUT/drift-$a"
done
# The report: every run's last validation losses, then the grids, CKA and drift as they wrote them.
runs=("$OUT/theta0-mlm-decay")
for a in clm mlm; do for k in 1 2 3; do runs+=("$OUT/$a-r$k" "$OUT/$a-r$k-decay"); done; done
runs+=("$OUT/clm-freeze-low-decay" "$OUT/clm-freeze-mid-decay" "$OUT/clm-r1-decay50" "$OUT/mlm-r1-decay50")
reports=("$OUT"/{ft-twins,ft-theta0,ft-freeze,ft-decay50}/results.md "$OUT/cka/cka.md" "$OUT"/drift-{clm,mlm}/drift.md)
python studies/gather.py "$OUT/bio_cpu.md" "The detour on real biomedical text (CPU scale)" --runs "${runs[@]}" \
  --reports "${reports[@]}"
