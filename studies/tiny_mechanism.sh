#!/usr/bin/env bash
# The mechanism at the tiny point (docs/studies/tiny-mechanism.md): at t1000, both twins decayed for 2.5%, 10%, 20%,
# 50% and 100% of their Phase-1 tokens, and one layer frozen during CLM, each with five pretraining replicates.
# Usage: GENERAL=path/to/general_en_combined.txt BIO=path/to/bio bash studies/tiny_mechanism.sh
# About 4.5 hours on an idle 2-core machine; run it again after a stop: finished runs and cells are skipped.
source "$(dirname "$0")/common.sh"

# 1. The data, the tiny θ0 and the t1000 twins with their 10% decay (replicates 1-5), as the earlier studies made them.
prepare_data
theta0 tiny
for k in 1 2 3 4 5; do pair t1000- "$TT" $k; done
# 2. The t1000 table first (replicates 1-3: it must reproduce the earlier studies' digits), then replicates 1-5:
#    D at the 10% decay. Every grid of this study shares one pool of cells, so a checkpoint is fine-tuned once.
ft2 "$(arms t1000- decay 1 2 3)" ft8-t1000
share ft8-t1000 ft8-t1000-r5 && ft2 "$(arms t1000- decay 1 2 3 4 5)" ft8-t1000-r5
# 3. The other decay lengths, from the same Phase-1 checkpoints (the AdamW state kept, the schedule restarted):
#    2.5% = 25 steps, 20% = 200, 50% = 500, 100% = 1,000; two runs side by side.
runs=(); for k in 1 2 3 4 5; do for L in 2.5:0.025 20:0.2 50:0.5 100:1.0; do for arm in clm mlm; do
  runs+=("decay_of t1000-$arm-r$k ${L#*:} decay${L%%:*}")
done; done; done
two_at_a_time "${runs[@]}"
# 4. One layer frozen during CLM, then the twins' 10% decay with every layer training (replicates 1-5).
runs=(); for k in 1 2 3 4 5; do for L in 0 1 2; do
  runs+=("chain clm \"\$TT \$(rep $k) --freeze_layers $L\" t1000-clm-freeze$L-r$k")
done; done
two_at_a_time "${runs[@]}"
# 5. Downstream, in the order of the questions: D at 100%, the freezes, then 20%, 50% and 2.5%.
grid_length() { share ft8-t1000 "ft8-t1000-decay$1" && ft2 "$(arms t1000- "decay$1" 1 2 3 4 5)" "ft8-t1000-decay$1"; }
freeze_arm() { local a="" k; for k in 1 2 3 4 5; do a="$a+$OUT/t1000-clm-freeze$1-r$k-decay"; done; echo "${a#+},${2#*,}"; }
grid_length 100
for L in 0 1 2; do share ft8-t1000 "ft8-t1000-freeze$L-r5" && ft2 "$(freeze_arm $L "$(arms t1000- decay 1 2 3 4 5)")" "ft8-t1000-freeze$L-r5"; done
for L in 20 50 2.5; do grid_length $L; done
# 6. Each arm after 10% against the same arm after every other length: no new cell, only the paired statistics.
for arm in clm mlm; do for L in 2.5 20 50 100; do
  ten="$(arms t1000- decay 1 2 3 4 5)"; other="$(arms t1000- "decay$L" 1 2 3 4 5)"
  [ $arm = clm ] && pick="${ten%%,*},${other%%,*}" || pick="${ten#*,},${other#*,}"
  share ft8-t1000 "ft8-t1000-$arm-10v$L" && grid "$F8" "$pick" "ft8-t1000-$arm-10v$L"
done; done
# 7. The imprint after every decay length (A = CLM r1, B = MLM r1, C = MLM r2, each after that decay), the report
#    and the figure.
cka t1000-clm-r1-decay t1000-mlm-r1-decay t1000-mlm-r2-decay cka-t1000
for L in 2.5 20 50 100; do cka "t1000-clm-r1-decay$L" "t1000-mlm-r1-decay$L" "t1000-mlm-r2-decay$L" "cka-t1000-decay$L"; done
python studies/tiny_mechanism.py --out_dir "$OUT" --png "$OUT/tiny-mechanism.png"
