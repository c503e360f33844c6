#!/usr/bin/env bash
# The studies on the generated default data, from scratch (docs/studies/from-scratch.md; withdrawn as evidence,
# kept as a worked example of finetune.py and its analyses): the quick start's CLM and MLM twins, a second
# pretraining replicate of each, the downstream comparison, then why: CKA against a seed-noise control, weight
# drift, layer transplants, freeze interventions and a decay-ratio sweep. One thread per process, as its tables
# were made; everything in detour.py's and finetune.py's default directories under out/ (no corpus to give).
# Usage: bash studies/from_scratch.sh
# About an hour on an idle 2-core machine, two runs side by side (estimated: only the quick start's runs and the
# first finetune.py were timed, 5 and 4 minutes). Run it again after a stop: finished runs, grids and analyses are
# skipped. Report: out/from_scratch.md.
OUT=out   # the runs are detour.py's default out_dirs (out/<phase>, <init_from>-decay); times go to out/times.txt
source "$(dirname "$0")/common.sh"

# The generated corpus (data/default), then one thread for everything (the tables' setting).
[ -f data/default/meta.json ] || timed python data/prepare.py
export OMP_NUM_THREADS=1
P="torchrun --standalone --nproc_per_node=1 detour.py"
# The twins: replicate 1 is the quick start's out/clm and out/mlm (seed 17, data seed 42, the defaults);
# replicate 2 has another initialization and data order.
two_at_a_time 'chain clm "" clm' 'chain mlm "" mlm'
two_at_a_time 'chain clm "--seed 18 --data_seed 43" clm-r2' 'chain mlm "--seed 18 --data_seed 43" mlm-r2'
# The CKA seed-noise control: an MLM twin from the same initialization (out/mlm/init), another seed. Beside it the
# freeze interventions: layers 0-1 (the lowest third) or 2-3 (the middle third) frozen during CLM, then a plain
# decay; and out/clm's decay with layers 0-1 frozen.
two_at_a_time 'chain mlm "--init_from out/mlm/init --seed 18" mlm-s18' \
  'chain clm "--freeze_layers 0-1" clm-freeze-low' 'chain clm "--freeze_layers 2-3" clm-freeze-mid' \
  'done_run clm-decay-freeze-low ||
   timed sh -c "$P --phase decay --init_from out/clm --freeze_layers 0-1 --out_dir out/clm-decay-freeze-low --overwrite true"'
# The decay-ratio sweep: 2.5%, 10%, 20%, 50% of the Phase-1 tokens, each in its own out_dir.
RATIOS="0.025 0.1 0.2 0.5"
decays=(); for r in $RATIOS; do for a in clm mlm; do decays+=("decay_of $a $r decay-$r"); done; done
two_at_a_time "${decays[@]}"
# Downstream on the default tasks (ner, notes, needle): the twins first (it builds the tasks), then the rest two at
# a time. ft REPORT ARGS...: finetune.py ARGS unless out/REPORT is there.
ft() { [ -f "out/$1" ] || timed python finetune.py "${@:2}"; }
an() { [ -f "out/$1" ] || timed python studies/analysis.py "${@:2}"; }  # the analyses
ft finetune/results.json --ckpts out/clm-decay+out/clm-r2-decay,out/mlm-decay+out/mlm-r2-decay
grids=("ft finetune/freeze/results.json --ckpts out/clm-decay,out/clm-freeze-low-decay,out/clm-freeze-mid-decay,\
out/clm-decay-freeze-low,out/mlm-decay --out_dir out/finetune/freeze")
for r in $RATIOS; do
  grids+=("ft finetune/decay-$r/results.json --ckpts out/clm-decay-$r,out/mlm-decay-$r --out_dir out/finetune/decay-$r")
done
two_at_a_time "${grids[@]}"
# Why: CKA per layer on data/default/val.txt, C = the seed-noise control (cka-s18), and C = the MLM replicate 2
# (out/analysis/cka, which the section cites but gave no command for: another initialization, so no such control).
for c in s18 r2; do n=cka-$c; [ $c = r2 ] && n=cka
  an analysis/$n/cka.json --analysis cka --ckpts out/clm-decay,out/mlm-decay,out/mlm-$c-decay --out_dir out/analysis/$n
done
# Weight drift of each Phase 1 from the twins' shared initialization.
for a in clm mlm; do
  an analysis/drift-$a/drift.json --analysis drift --ckpts out/$a,out/mlm/init --out_dir out/analysis/drift-$a
done
# Transplants: a layer group of the CLM twin into the MLM twin, linear-probed next to both (they share the parents'
# probe cells).
for g in 0-1 2-3 4-5 attn mlp; do
  an analysis/clm-into-mlm/transplant-$g.json --analysis transplant --ckpts out/clm-decay,out/mlm-decay --layers $g \
    --out_dir out/analysis/clm-into-mlm
done
# The report: every run's last validation losses, then every table as the runs wrote it.
runs=(); for r in clm mlm clm-r2 mlm-r2 mlm-s18 clm-freeze-low clm-freeze-mid; do runs+=("out/$r" "out/$r-decay"); done
runs+=(out/clm-decay-freeze-low); for r in $RATIOS; do runs+=("out/clm-decay-$r" "out/mlm-decay-$r"); done
reports=(out/finetune/results.md out/analysis/{cka-s18,cka}/cka.md out/analysis/drift-{clm,mlm}/drift.md
  out/analysis/clm-into-mlm/transplant-{0-1,2-3,4-5,attn,mlp}.md out/finetune/freeze/results.md)
for r in $RATIOS; do reports+=("out/finetune/decay-$r/results.md"); done
python studies/gather.py out/from_scratch.md "Studies on the generated default data (from scratch)" \
  --runs "${runs[@]}" --reports "${reports[@]}"
