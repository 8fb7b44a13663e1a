#!/usr/bin/env bash
# The small-scale reproduction of the paper's comparison (docs/results-small.md), with the project's own commands:
#
#   bash benchmarks/repro_small.sh [--out DIR] [--launcher auto|slurm|local] [--corpus DIR] [--wikitext FILE]
#                                  [--runs "NAME ..."] [--records DIR|none] [--only-recorded] [--dry]
#
# 1. corpus: python -m data_prep.make_corpus (Github / PythonDocs / Dictionary in the Pile's jsonl format; byte-
#    identical to shared/tools/make-minipile), or --corpus DIR (an existing make_corpus output);
# 2. a 16k SentencePiece BPE tokenizer (data_prep.train_tokenizer), shards per source (--split-by-set, blended by
#    size in training) and the validation split (data_prep.tokenize);
# 3. the runs (RUNS below: six variants on one body, two second seeds, the three follow-up questions, and the
#    runs without LEV's common mode (also at spec sizes, a second seed, 3x tokens) and at equal total
#    parameters), each on
#    2 CPU ranks (DP=2): through `python -m launchers.slurm sweep`/`submit` when a SLURM cluster answers (sinfo)
#    and --launcher is not local, else through launchers/local.py;
# 4. python -m leviathan_pretrain.evaluate on the runs without a report, in one process (validation ppl, frequency
#    buckets, WikiText-103 zero-shot; a report per run, its evaluation time in timings.tsv from the report),
# 5. python -m leviathan_pretrain.compare over all runs (TIED the baseline) into OUT/compare/.
#
# Resumable: a finished run (checkpoint at its last step) is not trained again, an interrupted one resumes from its
# last checkpoint (the trainer's own resume), an existing report is not recomputed; so the study can be carried
# across work periods by running the same command. Wall times per phase are appended to OUT/timings.tsv.
# Records (--records, default results/small/runs; none with --dry): each run trained and evaluated here is saved
# there (benchmarks/study_records.py: its config, training log, report and timings, no checkpoints; commit them), and
# a run with a record made with the same settings is restored from it instead of trained: the study survives a work
# period whose machine (and OUT) is gone. --records none: neither. --only-recorded: the selection is the runs with a
# record or trained in OUT; nothing is trained (the page from what exists).
# --dry: two steps per run on one rank (the same global batch, accumulated), a small evaluation, into OUT (default
# runs/repro-small-dry): the pipeline end to end in minutes (tests/test_repro_small.py runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

OUT="" LAUNCHER=auto CORPUS="" DRY=0 ONLY="" RECORDS=default ONLY_RECORDED=0
WIKITEXT="$REPO/../shared/data/wikitext-103-test.raw"
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }  # the header comment
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --launcher) LAUNCHER="$2"; shift 2 ;;
    --corpus) CORPUS="$2"; shift 2 ;;
    --wikitext) WIKITEXT="$2"; shift 2 ;;
    --runs) ONLY="$2"; shift 2 ;;
    --records) RECORDS="$2"; shift 2 ;;
    --only-recorded) ONLY_RECORDED=1; shift ;;
    --dry) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$LAUNCHER" in auto|slurm|local) ;; *) echo "error: --launcher: auto, slurm or local, got $LAUNCHER" >&2; exit 2 ;; esac
[ -n "$OUT" ] || { [ "$DRY" = 1 ] && OUT=runs/repro-small-dry || OUT=runs/repro-small; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ "$RECORDS" = default ]; then [ "$DRY" = 1 ] && RECORDS=none || RECORDS="$REPO/results/small/runs"; fi
if [ "$RECORDS" != none ]; then mkdir -p "$RECORDS"; RECORDS=$(cd "$RECORDS" && pwd); fi
[ "$ONLY_RECORDED" = 0 ] || [ "$RECORDS" != none ] || { echo "error: --only-recorded needs --records" >&2; exit 2; }
. .venv/bin/activate
export PYTHONUNBUFFERED=1
say() { echo "[repro] $(date -u +%FT%TZ) $*"; }
timing() { printf '%s\t%s\t%s\t%s\n' "$(date -u +%FT%TZ)" "$1" "$2" "$3" >> "$OUT/timings.tsv"; }

# ---------------------------------------------------------------- the study's settings
STEPS=720           # x 16 sequences x 256 tokens = 2.95M tokens per run: ~1.1 s/step on 2 cores, ~14 min a run
LONG_STEPS=2160     # the "does LEV cross TIED later" pair: 3x the tokens
VOCAB=16000
EVAL_TOKENS=400000  # validation tokens scored per run (whole documents)
SAVE=120
if [ "$DRY" = 1 ]; then STEPS=2 LONG_STEPS=2 EVAL_TOKENS=3000 SAVE=2; fi
# the body every run shares (configs/tiny-cpu-*.yaml: hidden 256, 4 layers, 4 heads, seq 256), DP=2, one data order
BODY=(model.vocab_size=$VOCAB train.micro_batch_size=8 train.global_batch_size=16 optim.warmup_steps=60
      train.eval_interval=60 train.eval_iters=10 checkpoint.save_interval=$SAVE checkpoint.keep_last=2
      logging.log_interval=50 data.seed=1234 train.seed=1234)
# --dry: the same body at 2 x 2 sequences a step (the study's 8 x 2 only makes two steps slower, not more checked)
[ "$DRY" = 1 ] && BODY+=(train.micro_batch_size=2 train.global_batch_size=4 train.eval_interval=2 train.eval_iters=1
                         optim.warmup_steps=1 logging.log_interval=1)
SPEC_LEV=(model.lev.seed_dim=128 model.lev.heads=8 model.lev.knots=16 model.lev.rank=64)  # docs/lev.md defaults
# LEV's depth at equal total parameters to UNTIED (the paper's v1 protocol, configs/README.md) at this vocabulary: the
# nearer of the two depths that bracket UNTIED's total (configs/tiny-cpu-lev-iso.yaml is the same at its 8k vocabulary)
ISO_LAYERS=$(python -m leviathan_pretrain.params --config configs/tiny-cpu-lev.yaml --iso-to configs/tiny-cpu-untied.yaml \
    --json model.vocab_size=$VOCAB | python -c 'import json, sys; i = json.load(sys.stdin); t = i["target"]
print(min((g for g in (i["below"], i["above"]) if g), key=lambda g: abs(g["total"] - t))["num_layers"])')
# name | config | steps | extra overrides
RUNS=(
  "sweep/tiny-cpu-tied|tied|$STEPS|"
  "sweep/tiny-cpu-untied|untied|$STEPS|"
  "sweep/tiny-cpu-albert|albert|$STEPS|"
  "sweep/tiny-cpu-lev|lev|$STEPS|"
  "sweep/tiny-cpu-flat_mlp|flat_mlp|$STEPS|"
  "sweep/tiny-cpu-factored_mlp|factored_mlp|$STEPS|"
  "tied-seed2|tied|$STEPS|train.seed=1235"
  "lev-seed2|lev|$STEPS|train.seed=1235"
  "lev-spec|lev|$STEPS|${SPEC_LEV[*]}"
  "lev-lr3|lev|$STEPS|optim.lev_lr_mult=3"
  "lev-lr10|lev|$STEPS|optim.lev_lr_mult=10"
  "tied-long|tied|$LONG_STEPS|"
  "lev-long|lev|$LONG_STEPS|"
  # LEV without its common mode at init (model.lev.center, model.lev.out_init_std: docs/lev.md), and at equal total
  # parameters to UNTIED by depth at the study's vocabulary (ISO_LAYERS above)
  "lev-center|lev|$STEPS|model.lev.center=true"
  "lev-match|lev|$STEPS|model.lev.out_init_std=match"
  "lev-center-match|lev|$STEPS|model.lev.center=true model.lev.out_init_std=match"
  "lev-iso|lev|$STEPS|model.num_layers=$ISO_LAYERS"
  # centring (the better of the two options at tiny sizes: docs/lev.md, "What they do at small scale") at the spec's sizes,
  # at the second seed, and at 3x the tokens (against tied-long)
  "lev-spec-center|lev|$STEPS|${SPEC_LEV[*]} model.lev.center=true"
  "lev-center-seed2|lev|$STEPS|model.lev.center=true train.seed=1235"
  "lev-center-long|lev|$LONG_STEPS|model.lev.center=true"
  # the rank cap: LEV's table has rank <= heads x rank (64 at these sizes, below hidden 256: docs/lev.md); centred
  # with rank 64 (h x r = 256, the same d_seed; +0.15M input parameters) separates the cap from LEV's size
  "lev-center-r64|lev|$STEPS|model.lev.center=true model.lev.rank=64"
)

# ---------------------------------------------------------------- 1-2. data
DATA="$OUT/data"
mkdir -p "$DATA"
if [ -z "$CORPUS" ]; then
  CORPUS="$DATA/corpus"
  if [ ! -f "$CORPUS/.data_prep-corpus.json" ]; then
    say "corpus -> $CORPUS"; t=$SECONDS
    python -m data_prep.make_corpus --out "$CORPUS"
    timing data corpus $((SECONDS - t))
  fi
fi
TOK="$DATA/tokenizer/tokenizer.model"
if [ ! -f "$TOK" ]; then
  say "tokenizer (BPE $VOCAB) -> $TOK"; t=$SECONDS
  python -m data_prep.train_tokenizer --input "$CORPUS/train/*.jsonl.zst" --vocab-size $VOCAB \
      --sample-bytes $([ "$DRY" = 1 ] && echo 2 || echo 24) --out "$DATA/tokenizer"
  timing data tokenizer $((SECONDS - t))
fi
if [ ! -f "$DATA/shards/train.manifest.json" ]; then
  say "shards per source -> $DATA/shards/train.<set>"; t=$SECONDS
  python -m data_prep.tokenize --input "$CORPUS/train/*.jsonl.zst" --tokenizer "$TOK" \
      --out "$DATA/shards/train" --split-by-set --workers 2
  timing data shards $((SECONDS - t))
fi
if [ ! -f "$DATA/shards/val.manifest.json" ]; then
  python -m data_prep.tokenize --input "$CORPUS/val.jsonl.zst" --tokenizer "$TOK" --out "$DATA/shards/val" \
      --workers 2
fi
SETS=$(ls "$DATA"/shards/train.*.idx 2>/dev/null | sed 's/\.idx$//' | paste -sd, -)
[ -n "$SETS" ] || { echo "error: no per-source shards under $DATA/shards" >&2; exit 1; }
DATA_ARGS=("data.prefixes=[$SETS]" "data.valid_prefixes=[$DATA/shards/val]" "data.tokenizer=$TOK")
say "training data: $SETS (blended by size); validation $DATA/shards/val"

WIKI_ARGS=()
if [ -f "$WIKITEXT" ]; then
  if [ "$DRY" = 1 ]; then  # the first article only
    awk '/^ = [^=].* = $/ && ++heads > 1 {exit} {print}' "$WIKITEXT" > "$OUT/wikitext-first-article.raw"
    WIKITEXT="$OUT/wikitext-first-article.raw"
  fi
  WIKI_ARGS=(--wikitext "$WIKITEXT")
else
  say "no WikiText file at $WIKITEXT: zero-shot WikiText skipped (give --wikitext FILE)"
fi

# ---------------------------------------------------------------- 3. training
selected() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }
# trained here to its last step, or restored from its record (record.json: benchmarks/study_records.py)
trained() { [ "$(cat "$OUT/runs/$1/checkpoints/latest" 2>/dev/null)" = "global_step$2" ]; }
done_run() { trained "$@" || [ -f "$OUT/runs/$1/record.json" ]; }
record() {  # save|restore name spec
  python benchmarks/study_records.py "$1" --records "$RECORDS" --run "$OUT/runs/$2" --name "$2" --spec "$3" \
      --timings "$OUT/timings.tsv"
}
if [ "$ONLY_RECORDED" = 1 ]; then  # the selection: the runs with a record or trained here
  ONLY=""
  for spec in "${RUNS[@]}"; do
    IFS='|' read -r name variant steps extra <<< "$spec"
    if [ -f "$RECORDS/$name/record.json" ] || done_run "$name" "$steps"; then ONLY+=" $name"; fi
  done
  [ -n "$ONLY" ] || { echo "error: --only-recorded: no run has a record in $RECORDS or is trained in $OUT" >&2; exit 1; }
  say "--only-recorded: ${ONLY# }"
fi
use_slurm=0
if [ "$LAUNCHER" != local ] && command -v sinfo >/dev/null && sinfo -h >/dev/null 2>&1; then use_slurm=1; fi
if [ "$LAUNCHER" = slurm ] && [ $use_slurm = 0 ]; then echo "error: --launcher slurm: no SLURM cluster answers" >&2; exit 2; fi
say "launcher: $([ $use_slurm = 1 ] && echo 'SLURM (python -m launchers.slurm)' || echo 'local (launchers/local.py)')"
RANKS=$([ "$DRY" = 1 ] && echo 1 || echo 2)  # --dry checks the pipeline: one rank a run
CPU=(--nodes 1 --gpus-per-node 0 --tasks-per-node $RANKS --launch srun)

train_local() {  # name variant steps extra...
  local name=$1 variant=$2 steps=$3; shift 3
  python launchers/local.py -n $RANKS -- -m leviathan_pretrain.train --config "configs/tiny-cpu-$variant.yaml" \
      "${BODY[@]}" "${DATA_ARGS[@]}" "train.steps=$steps" "train.out_dir=$OUT/runs/$name" "$@"
}

JOBS=()
submit() {  # python -m launchers.slurm ... ; remembers the job id
  local out
  out=$(python -m launchers.slurm "$@") || { echo "$out"; exit 1; }
  echo "$out" | grep -E "submitted|log:" || true
  JOBS+=("$(echo "$out" | sed -n 's/^submitted job\( array\)\? \([0-9]*\).*/\2/p' | head -1)")
}

pending=()
for spec in "${RUNS[@]}"; do
  IFS='|' read -r name variant steps extra <<< "$spec"
  selected "$name" || continue
  if done_run "$name" "$steps"; then say "$name: trained ($steps steps), skipped"; continue; fi
  if [ "$RECORDS" != none ]; then
    rc=0; record restore "$name" "$spec" || rc=$?
    [ $rc = 0 ] && continue
    [ $rc = 3 ] || [ $rc = 4 ] || exit $rc
  fi
  [ "$ONLY_RECORDED" = 0 ] || { echo "error: --only-recorded: $name is neither restored nor trained" >&2; exit 1; }
  pending+=("$spec")
done
if [ ${#pending[@]} -gt 0 ]; then
  t=$SECONDS
  if [ $use_slurm = 1 ]; then
    sweep=()
    for spec in "${pending[@]}"; do
      IFS='|' read -r name variant steps extra <<< "$spec"
      # shellcheck disable=SC2086  # extra: space-separated overrides
      if [[ $name == sweep/* ]]; then sweep+=("configs/tiny-cpu-$variant.yaml"); else
        say "$name: submitting"
        submit submit --config "configs/tiny-cpu-$variant.yaml" "${CPU[@]}" --run "$OUT/runs/$name" \
            --job-name "repro-$name" "${BODY[@]}" "${DATA_ARGS[@]}" "train.steps=$steps" $extra
      fi
    done
    if [ ${#sweep[@]} -gt 0 ]; then
      say "the variants' sweep: ${sweep[*]}"
      submit sweep --configs "${sweep[@]}" "${CPU[@]}" --run "$OUT/runs/sweep" --job-name repro-sweep \
          "${BODY[@]}" "${DATA_ARGS[@]}" "train.steps=$STEPS"
    fi
    say "waiting for SLURM jobs ${JOBS[*]} (python -m launchers.slurm status $OUT/runs/sweep)"
    while [ -n "$(squeue -h -j "$(IFS=,; echo "${JOBS[*]}")" 2>/dev/null)" ]; do sleep 5; done
    timing train "slurm:${#pending[@]}-runs" $((SECONDS - t))
  else
    for spec in "${pending[@]}"; do
      IFS='|' read -r name variant steps extra <<< "$spec"
      say "$name: training ($variant, $steps steps${extra:+, $extra})"; t=$SECONDS
      # shellcheck disable=SC2086
      train_local "$name" "$variant" "$steps" $extra || { rc=$?; timing train "$name" $((SECONDS - t)); exit $rc; }
      timing train "$name" $((SECONDS - t))
    done
  fi
  for spec in "${pending[@]}"; do
    IFS='|' read -r name variant steps extra <<< "$spec"
    done_run "$name" "$steps" || { echo "error: $name did not finish ($OUT/runs/$name; its logs)" >&2; exit 1; }
  done
fi

# ---------------------------------------------------------------- 4-5. evaluation and comparison
runs=() todo=() names=() reports=()
for spec in "${RUNS[@]}"; do
  IFS='|' read -r name variant steps extra <<< "$spec"
  selected "$name" || continue
  runs+=("$OUT/runs/$name")
  report="$OUT/runs/$name/eval/global_step$steps.json"
  if [ ! -f "$report" ]; then todo+=("$OUT/runs/$name"); names+=("$name"); reports+=("$report"); fi
done
if [ ${#todo[@]} -gt 0 ]; then  # one process for all (the libraries load once); a report per run
  say "evaluating ${#todo[@]} run(s): ${names[*]}"; t=$SECONDS
  log="$OUT/eval-console-$(date -u +%Y%m%dT%H%M%SZ).txt"
  rc=0
  python -m leviathan_pretrain.evaluate --run "${todo[@]}" --max-tokens $EVAL_TOKENS "${WIKI_ARGS[@]}" --quiet \
      > "$log" 2>&1 || rc=$?
  for i in "${!todo[@]}"; do  # each evaluated run's own time, from its report (also when a later run failed)
    [ -f "${reports[$i]}" ] || continue
    timing eval "${names[$i]}" "$(python -c 'import json, sys; print(round(json.load(open(sys.argv[1]))["seconds"]))' \
        "${reports[$i]}")"
  done
  timing eval-process "${#todo[@]}-runs" $((SECONDS - t))
  if [ $rc != 0 ]; then
    tail -20 "$log"; echo "error: evaluation failed ($log; the runs evaluated before it keep their reports)" >&2; exit 1
  fi
fi
if [ "$RECORDS" != none ]; then  # every selected run trained and evaluated here, into its record
  for spec in "${RUNS[@]}"; do
    IFS='|' read -r name variant steps extra <<< "$spec"
    if selected "$name" && trained "$name" "$steps" && [ -f "$OUT/runs/$name/eval/global_step$steps.json" ]; then
      record save "$name" "$spec"
    fi
  done
fi
say "comparing ${#runs[@]} runs -> $OUT/compare"
BASE=()
selected sweep/tiny-cpu-tied && BASE=(--baseline "$OUT/runs/sweep/tiny-cpu-tied")
python -m leviathan_pretrain.compare "${runs[@]}" "${BASE[@]}" --out "$OUT/compare"
say "done: $OUT/compare/comparison.md; wall times in $OUT/timings.tsv"
[ -z "$ONLY" ] || [ "$ONLY_RECORDED" = 1 ] || say "the comparison holds the ${#runs[@]} run(s) of --runs only; all that" \
    "are trained or recorded: --only-recorded"
