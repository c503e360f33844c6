#!/usr/bin/env bash
# θ0, the general encoder that detour.py continues by default (--init_from out/theta0/hf), standing in
# for ModernBERT-base: the `tiny` preset trained from scratch with MLM at 30% on 4M tokens of the
# generated general corpus (data/world/general, from python data/prepare.py), then its MLM-15% decay, as
# ModernBERT was pretrained and then decayed. The studies' θ0 recipe (studies/common.sh T0): 32 x 128
# tokens a step, peak lr 1e-3 (the twins continue it at 5e-4).
# Usage: bash runs/theta0.sh [OPTIONS]   (after python data/prepare.py; one process)
#   OPTIONS: more detour.py options for θ0's MLM run (e.g. --max_tokens 40960 for a toy θ0);
#   DATA (default data/world) and OUT (default out): where the corpora are and where θ0 goes.
# Run it again at any time: a finished run is not run again, a stopped one continues (--autoresume).
set -euo pipefail
cd "$(dirname "$0")/.."   # the repository root: the default paths are from there
DATA=${DATA:-data/world}; OUT=${OUT:-out}
if [ ! -f "$DATA/general/meta.json" ]; then
  echo "error: $DATA/general/meta.json not found; run python data/prepare.py first" >&2
  exit 1
fi
P="torchrun --standalone --nproc_per_node=1 detour.py"
$P --phase mlm --init_from scratch --preset tiny --data_dir "$DATA/general" --max_tokens 4096000 \
  --batch_size 32 --global_batch_size 32 --learning_rate 1e-3 --warmup_tokens 100000 --eval_interval 200 \
  --ckpt_interval 500 --out_dir "$OUT/theta0-mlm" --autoresume true "$@"
$P --phase decay --init_from "$OUT/theta0-mlm" --out_dir "$OUT/theta0" --autoresume true
