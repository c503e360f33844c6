# The settings and helpers that the CPU studies share (studies/*.sh source this file; it runs nothing itself).
# Every helper skips what is already done, so a study script run again after a stop loses at most the runs that
# were in flight: a chain is done once its decay has written hf/config.json, a grid once it has written
# results.json, and an unfinished grid keeps its finished cells.
#
#   GENERAL   a general-English corpus, one paragraph per line (docs/data.md: general_en_combined.txt)
#   BIO       the Crichton et al. (2017) collection laid out as docs/data.md says (corpus.txt, ner/, cls/)
#   OUT       where the runs go (default out/bio); every run's wall time is appended to $OUT/times.txt
# Only the studies on real text need GENERAL and BIO: they call need_corpora (prepare_data does too).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."   # the repository root: the commands below name paths from there
GENERAL=${GENERAL:-}; BIO=${BIO:-}
N=$BIO/ner
need_corpora() {
  : "${GENERAL:?set GENERAL to the general-English corpus (docs/data.md)}"
  : "${BIO:?set BIO to the biomedical collection directory (docs/data.md)}"
}
OUT=${OUT:-out/bio}
mkdir -p "$OUT"

# Phase-1 twins from a θ0 on bio text: fresh AdamW, 20-step warmup, constant peak 5e-4 (θ0's was 1e-3), 1,000
# optimizer steps of 8 x 128 tokens; the decay that follows is 10% of them unless a study says otherwise.
T0="--data_dir data/general --preset small --seq_len 128 --batch_size 32 --global_batch_size 32 --learning_rate 1e-3 --warmup_tokens 100000 --eval_interval 200 --eval_tokens 65536 --ckpt_interval 500 --progress false"
TW="--data_dir data/bio --init_from $OUT/theta0-mlm-decay/hf --seq_len 128 --batch_size 8 --global_batch_size 8 --learning_rate 5e-4 --warmup_tokens 20480 --max_tokens 1024000 --eval_interval 250 --eval_tokens 65536 --progress false"
TT="${TW/theta0-mlm-decay/tiny-theta0-mlm-decay}"      # the same twins from the tiny θ0
TMW="${TW/theta0-mlm-decay/medium-theta0-mlm-decay}"   # ... and from the medium θ0
# Pretraining replicates: replicate k differs in its seed (initialization of new parts, masks) and data order.
R1="--seed 17 --data_seed 42"; R2="--seed 18 --data_seed 43"; R3="--seed 19 --data_seed 44"
R4="--seed 20 --data_seed 45"; R5="--seed 21 --data_seed 46"
P="OMP_NUM_THREADS=1 python detour.py"                 # one thread per process: two runs side by side on 2 cores
# Downstream on all 8 tasks: 1,000 training examples (a fixed subset), 500 dev / 500 test, 4 epochs, lr 5e-4, 3 seeds.
TASKS="bc5cdr_chem=ner:$N/BC5CDR-chem-IOB,bc5cdr_disease=ner:$N/BC5CDR-disease-IOB,ncbi_disease=ner:$N/NCBI-disease-IOB,bc2gm=ner:$N/BC2GM-IOB"
TASKS8="$TASKS,linnaeus=ner:$N/linnaeus-IOB,bionlp13cg=ner:$N/BioNLP13CG-IOB,gad=cls:$BIO/cls/GAD,hoc=multilabel:$BIO/cls/HoC"
F8="OMP_NUM_THREADS=1 python finetune.py --tasks $TASKS8 --seeds 3 --ner_epochs 4 --epochs 4 --learning_rate 5e-4 --max_train 1000 --max_eval 500 --progress false"

rep() { local r=$1; eval echo "\$R$r"; }                # the seed flags of replicate $1
# One run's wall time; a failed run logs none and returns its status (also where set -e is off, e.g. after ||).
timed() { local s; s=$(date +%s); "$@" || return; echo "$(( $(date +%s) - s )) s  $*" >> "$OUT/times.txt"; }
# waitall PID...: wait for each background job and fail if any failed (a bare `wait` returns 0 whatever they did,
# and a grid run after a failed pretraining run would skip the missing checkpoint and report without it).
waitall() { local rc=0 p; for p in "$@"; do wait "$p" || rc=1; done; return $rc; }
# two_at_a_time "CMD"...: the shell commands two at a time (a pair side by side, then the next pair).
two_at_a_time() { local a; while [ $# -gt 0 ]; do
  if [ $# = 1 ]; then eval "$1"; return; fi
  eval "$1" & a=$!; eval "$2" & waitall $a $! || return; shift 2; done; }
done_run() { [ -f "$OUT/$1/hf/config.json" ]; }          # a run is finished once it has exported its weights

# The two corpora: a tokenizer trained on general text only; the bio corpus is cut with that tokenizer (the domain
# shift is the point).
prepare_data() {
  need_corpora
  [ -f data/general/meta.json ] || timed python data/prepare.py --input "$GENERAL" --name general --group_tokens 200 --val_fraction 0.02
  [ -f data/bio/meta.json ] || timed python data/prepare.py --input "$BIO/corpus.txt" --name bio --group_tokens 200 --val_fraction 0.02 --tokenizer data/general/tokenizer.json
}

# θ0, a general encoder of preset $1 (small | tiny | medium): MLM 30% on 8M general tokens, lr 1e-3, then an MLM-15%
# decay of 10%; two threads (it runs alone). -> $OUT/<prefix>theta0-mlm-decay
theta0() {
  local prefix=""; [ "$1" = small ] || prefix="$1-"
  done_run "${prefix}theta0-mlm-decay" || timed sh -c "OMP_NUM_THREADS=2 python detour.py --phase mlm ${T0/small/$1} --max_tokens 8000000 --out_dir $OUT/${prefix}theta0-mlm --overwrite true && OMP_NUM_THREADS=2 python detour.py --phase decay --init_from $OUT/${prefix}theta0-mlm --overwrite true"
}

# chain PHASE "FLAGS" NAME: Phase 1 into $OUT/NAME, then its 10% decay into $OUT/NAME-decay.
chain() { done_run "$3-decay" || timed sh -c "$P --phase $1 $2 --out_dir $OUT/$3 --overwrite true && $P --phase decay --init_from $OUT/$3 --overwrite true"; }
# decay_of NAME RATIO SUFFIX: another decay of the Phase-1 run $OUT/NAME, RATIO of its tokens, into $OUT/NAME-SUFFIX.
decay_of() { done_run "$1-$3" || timed sh -c "$P --phase decay --init_from $OUT/$1 --decay_ratio $2 --out_dir $OUT/$1-$3 --overwrite true"; }
# pair PREFIX "FLAGS" k ["MORE"]: the twins of replicate k side by side, $OUT/PREFIX{clm,mlm}-rk and their decays;
# MORE goes after the seed flags (FLAGS, seeds, MORE: the order the studies' commands were first run with).
pair() { local a f="$2 $(rep "$3")${4:+ $4}"; chain clm "$f" "$1clm-r$3" & a=$!; chain mlm "$f" "$1mlm-r$3" & waitall $a $!; }

# arms STEM SUFFIX k...: "A1+A2+..,B1+B2+.." for finetune.py, the CLM arm first: $OUT/STEMclm-rk-SUFFIX.
arms() { local stem=$1 suffix=$2 a="" b="" k; shift 2
  for k in "$@"; do a="$a+$OUT/${stem}clm-r$k-$suffix"; b="$b+$OUT/${stem}mlm-r$k-$suffix"; done
  echo "${a#+},${b#+}"; }
# share FROM TO: grid TO reuses grid FROM's cells (a cell is one checkpoint x task x seed; the same cell is the same run).
share() { mkdir -p "$OUT/$1/cells" "$OUT/$2" && ln -sfn "../$1/cells" "$OUT/$2/cells"; }
# grid_done GRID: the grid $OUT/GRID has written its report.
grid_done() { [ -f "$OUT/$1/results.json" ]; }
# ft2 CKPTS GRID: the 8-task grid of CKPTS in $OUT/GRID by two processes that share its cells (each ends with the report).
ft2() { local a; grid_done "$2" && return
  timed sh -c "$F8 --ckpts $1 --out_dir $OUT/$2" & a=$!; timed sh -c "$F8 --ckpts $1 --out_dir $OUT/$2" & waitall $a $!; }
# grid "F" CKPTS GRID [FLAGS]: one process runs the grid of CKPTS in $OUT/GRID with the fine-tuning command F.
grid() { grid_done "$3" || timed sh -c "$1 --ckpts $2 --out_dir $OUT/$3${4:+ $4}"; }
# cka A B C NAME: linear CKA per layer, d(A, B) against the seed-noise control d(B, C), on NCBI-disease test sentences.
cka() {
  [ -f "$OUT/ncbi_test.txt" ] || { awk 'NF{printf "%s ", $1; next} {print ""}' "$N/NCBI-disease-IOB/test.tsv" > "$OUT/ncbi_test.txt.tmp" &&
    mv "$OUT/ncbi_test.txt.tmp" "$OUT/ncbi_test.txt"; }   # via .tmp: a failed awk leaves no empty file to skip on
  [ -f "$OUT/$4/cka.json" ] || python studies/analysis.py --analysis cka --ckpts "$OUT/$1,$OUT/$2,$OUT/$3" --texts "$OUT/ncbi_test.txt" --out_dir "$OUT/$4"
}
