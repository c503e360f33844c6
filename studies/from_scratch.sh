#!/usr/bin/env bash
# The studies on the generated default data, from scratch (docs/studies/from-scratch.md; withdrawn as evidence,
# kept as a worked example of finetune.py and its analyses): the quick start's CLM and MLM twins, a second
# pretraining replicate of each, the downstream comparison, then why: CKA against a seed-noise control, weight
# drift, layer transplants, freeze interventions and a decay-ratio sweep. One thread per process, as its tables
# were made. It pins what were detour.py's defaults then (OLD: the generated biomedical corpus alone in
# data/default, the small preset from scratch, 4 x 128 tokens a step, lr 2e-3, 1M tokens; the default is now θ0
# continued) and writes under out/from-scratch (it wrote detour.py's default directories out/clm, ... then).
# Usage: bash studies/from_scratch.sh
# About an hour on an idle 2-core machine, two runs side by side (estimated: only the quick start's runs and the
# first finetune.py were timed, 5 and 4 minutes). Run it again after a stop: finished runs, grids and analyses are
# skipped. Report: out/from-scratch/from_scratch.md.
OUT=out/from-scratch  # every run, grid and analysis; times go to $OUT/times.txt
source "$(dirname "$0")/common.sh"

# The generated biomedical corpus alone (data/default, its own tokenizer), then one thread for everything (the
# tables' setting).
[ -f data/default/meta.json ] || timed python data/prepare.py --register bio
export OMP_NUM_THREADS=1
P="torchrun --standalone --nproc_per_node=1 detour.py"
# detour.py's defaults when these tables were made, for every Phase-1 run (a decay inherits them); FROM: the
# same without the start, for a run that starts from out/mlm/init.
FROM="--data_dir data/default --batch_size 4 --global_batch_size 4 --learning_rate 2e-3 --max_tokens 1000000"
OLD="--init_from scratch --preset small $FROM"
# The twins: replicate 1 was the quick start's out/clm and out/mlm then (seed 17, data seed 42, the defaults);
# replicate 2 has another initialization and data order.
two_at_a_time 'chain clm "$OLD" clm' 'chain mlm "$OLD" mlm'
two_at_a_time 'chain clm "$OLD --seed 18 --data_seed 43" clm-r2' 'chain mlm "$OLD --seed 18 --data_seed 43" mlm-r2'
# The CKA seed-noise control: an MLM twin from the same initialization ($OUT/mlm/init), another seed. Beside it the
# freeze interventions: layers 0-1 (the lowest third) or 2-3 (the middle third) frozen during CLM, then a plain
# decay; and $OUT/clm's decay with layers 0-1 frozen.
two_at_a_time 'chain mlm "$FROM --init_from $OUT/mlm/init --seed 18" mlm-s18' \
  'chain clm "$OLD --freeze_layers 0-1" clm-freeze-low' 'chain clm "$OLD --freeze_layers 2-3" clm-freeze-mid' \
  'done_run clm-decay-freeze-low ||
   timed sh -c "$P --phase decay --init_from $OUT/clm --freeze_layers 0-1 --out_dir $OUT/clm-decay-freeze-low --overwrite true"'
# The decay-ratio sweep: 2.5%, 10%, 20%, 50% of the Phase-1 tokens, each in its own out_dir.
RATIOS="0.025 0.1 0.2 0.5"
decays=(); for r in $RATIOS; do for a in clm mlm; do decays+=("decay_of $a $r decay-$r"); done; done
two_at_a_time "${decays[@]}"
# Downstream on the default tasks (ner, notes, needle): the twins first (it builds the tasks), then the rest two at
# a time. ft REPORT ARGS...: finetune.py ARGS unless $OUT/REPORT is there.
# The default tasks drop text seen in pretraining: here data/default's (--pretrain_dir, wherever it acts).
ft() { [ -f "$OUT/$1" ] || timed python finetune.py "${@:2}" --pretrain_dir data/default; }
an() { [ -f "$OUT/$1" ] || timed python studies/analysis.py "${@:2}"; }  # the analyses
ft finetune/results.json --ckpts $OUT/clm-decay+$OUT/clm-r2-decay,$OUT/mlm-decay+$OUT/mlm-r2-decay --out_dir $OUT/finetune
grids=("ft finetune/freeze/results.json --ckpts $OUT/clm-decay,$OUT/clm-freeze-low-decay,$OUT/clm-freeze-mid-decay,\
$OUT/clm-decay-freeze-low,$OUT/mlm-decay --out_dir $OUT/finetune/freeze")
for r in $RATIOS; do
  grids+=("ft finetune/decay-$r/results.json --ckpts $OUT/clm-decay-$r,$OUT/mlm-decay-$r --out_dir $OUT/finetune/decay-$r")
done
two_at_a_time "${grids[@]}"
# Why: CKA per layer on data/default/val.txt, C = the seed-noise control (cka-s18), and C = the MLM replicate 2
# ($OUT/analysis/cka, which the section cites but gave no command for: another initialization, so no such control).
for c in s18 r2; do n=cka-$c; [ $c = r2 ] && n=cka
  an analysis/$n/cka.json --analysis cka --ckpts $OUT/clm-decay,$OUT/mlm-decay,$OUT/mlm-$c-decay --out_dir $OUT/analysis/$n \
    --pretrain_dir data/default
done
# Weight drift of each Phase 1 from the twins' shared initialization.
for a in clm mlm; do
  an analysis/drift-$a/drift.json --analysis drift --ckpts $OUT/$a,$OUT/mlm/init --out_dir $OUT/analysis/drift-$a
done
# Transplants: a layer group of the CLM twin into the MLM twin, linear-probed next to both (they share the parents'
# probe cells).
for g in 0-1 2-3 4-5 attn mlp; do
  an analysis/clm-into-mlm/transplant-$g.json --analysis transplant --ckpts $OUT/clm-decay,$OUT/mlm-decay --layers $g \
    --out_dir $OUT/analysis/clm-into-mlm --pretrain_dir data/default
done
# The report: every run's last validation losses, then every table as the runs wrote it.
runs=(); for r in clm mlm clm-r2 mlm-r2 mlm-s18 clm-freeze-low clm-freeze-mid; do runs+=("$OUT/$r" "$OUT/$r-decay"); done
runs+=($OUT/clm-decay-freeze-low); for r in $RATIOS; do runs+=("$OUT/clm-decay-$r" "$OUT/mlm-decay-$r"); done
reports=($OUT/finetune/results.md $OUT/analysis/{cka-s18,cka}/cka.md $OUT/analysis/drift-{clm,mlm}/drift.md
  $OUT/analysis/clm-into-mlm/transplant-{0-1,2-3,4-5,attn,mlp}.md $OUT/finetune/freeze/results.md)
for r in $RATIOS; do reports+=("$OUT/finetune/decay-$r/results.md"); done
python studies/gather.py $OUT/from_scratch.md "Studies on the generated default data (from scratch)" \
  --runs "${runs[@]}" --reports "${reports[@]}"
