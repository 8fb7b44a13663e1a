#!/usr/bin/env bash
# GPU check (issue 19): one short run on one GPU (<= 8 minutes, installs included) answering, side by side:
#   - 400M and 1.2B, TIED vs LEV through the real trainer (leviathan_pretrain.train, bf16, ZeRO 1): tokens/s,
#     TFLOP/s, MFU, peak memory (torch.cuda.max_memory_allocated) vs plan.py's estimate;
#   - the stack vs bare PyTorch of the same shape (benchmarks/bench_step.py: build_engine + train_step against HF
#     LlamaForCausalLM, SDPA, bf16, fused AdamW, the same micro-batches), as a ratio;
#   - the LEV input path's host syncs and a profile of one 400M LEV step (bench_step.py --probe-config);
#   - LEV's input layer alone (benchmarks/profile_lev_gpu.py, when present: chunk budget, the sync's cost);
#   - a variant with the GPU-only options model.compile=true model.activation_fusion=true (400M LEV; skipped,
#     and logged, when this checkout does not know a key).
# Never part of CI or of a test's numbers (the test runs --dry only, for the script's logic).
#
# Device tool, after `bash benchmarks/gpu_wheels.sh` here (DeepSpeed, megatron-core, pydantic, hjson wheels
# for the GPU machine's Python 3.12 into .whl/, ~8 MiB):
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
# It writes into $OUT (the tool's return folder; else runs/gpu_check): gpu_check.log (every section's whole
# output), summary.md, summary.json and the .gpu_check-output marker. Shards, runs and checkpoints go to a
# temporary folder it creates and deletes (KEEP_WORK=1 keeps it).
#
#   bash benchmarks/gpu_check.sh          one CUDA GPU; python3 (never the CPU .venv) + .whl/ installed into
#                                         /tmp/site with pip --no-index --no-deps
#   bash benchmarks/gpu_check.sh --dry    CPU, tiny shapes, .venv's python: the same sections, to check the script
#
# Each section is time-boxed (`timeout`), its whole output goes to the log, and a failed or timed-out section is
# recorded without losing the others; once BUDGET seconds are spent the rest are skipped, and say so. Exit status
# 1 when a section failed or timed out (the summary says which), 2 on a usage / OUT error.
# Environment: OUT, BUDGET (450; dry 600), SCALES ("400m 1.2b"; dry "tiny-cpu"), STEPS (per run: 20 at 400M,
# 12 at 1.2B; dry 6; the first check's 1.2B runs took 400M's 20 by mistake), EXTRA (more key=value overrides for
# every run), STEP_EXTRA (more overrides for bench_step's "ours" alone, e.g. model.loss_chunk_tokens=2048),
# SECTIONS (which of "train step variant lev-input" run, in that order; default all; the others are recorded as
# skipped: a second run on what the first left out), KEEP_WORK.
# The full default run needs ~430 s on an H200 (the first one: BUDGET 450 left out variant and lev-input).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
case "${1:-}" in
  --dry) DRY=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [--dry]   (environment: OUT BUDGET SCALES STEPS EXTRA STEP_EXTRA" \
       "SECTIONS KEEP_WORK)" >&2
     exit 2 ;;
esac
ALL_SECTIONS="train step variant lev-input"
SECTIONS="${SECTIONS:-$ALL_SECTIONS}"
for s in $SECTIONS; do
  case " $ALL_SECTIONS " in
    *" $s "*) ;;
    *) echo "error: SECTIONS: unknown section '$s' (known: $ALL_SECTIONS)" >&2; exit 2 ;;
  esac
done
wanted() { case " $SECTIONS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
OUT="${OUT:-runs/gpu_check}"
# Never delete what this script did not create: OUT is replaced only when it carries our marker.
if [ -e "$OUT" ] && [ ! -f "$OUT/.gpu_check-output" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
  echo "error: $OUT exists and was not written by gpu_check.sh (no .gpu_check-output marker); set OUT to another path" >&2
  exit 2
fi
[ -f "$OUT/.gpu_check-output" ] && rm -rf "$OUT"
mkdir -p "$OUT" && touch "$OUT/.gpu_check-output"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")  # ours alone: created here, deleted at exit
[ -n "${KEEP_WORK:-}" ] || trap 'rm -rf "$WORK"' EXIT
: > "$LOG"
T0=$SECONDS
echo "gpu_check.sh $* | $(date -u +%FT%TZ) | $(git rev-parse --short HEAD 2>/dev/null || echo 'no git') | $(hostname)" >> "$LOG"
export PYTHONUNBUFFERED=1
if [ "$DRY" = 1 ]; then
  PY=python3; [ -x .venv/bin/python ] && PY="$PWD/.venv/bin/python"
  export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}" DS_ACCELERATOR=cpu
  BUDGET="${BUDGET:-600}" SCALES="${SCALES:-tiny-cpu}"
  DEV=(parallel.device=cpu parallel.backend=gloo)
else
  PY=python3  # the machine's own Python (torch + CUDA); the wheels add what it lacks
  export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}" DS_ACCELERATOR=cuda
  BUDGET="${BUDGET:-450}" SCALES="${SCALES:-400m 1.2b}"
  DEV=(parallel.device=cuda parallel.backend=nccl)
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RESERVE=20  # seconds kept for the summary

say() { echo "[gpu_check] $*" | tee -a "$LOG"; }
not_wanted() {  # not_wanted NAME: a section left out by SECTIONS, recorded as such
  say "$1: skipped (not in SECTIONS=$SECTIONS)"
  printf '%s\tskipped (SECTIONS)\t0\n' "$1" >> "$WORK/sections.tsv"
}

# section NAME CAP CMD...: CMD time-boxed to min(CAP, what is left of BUDGET), its output in $WORK/NAME.log and
# appended to the log, its state in $WORK/sections.tsv; the key lines echoed. Returns CMD's status.
section() {
  local name=$1 cap=$2 left rc t state
  shift 2
  left=$((BUDGET - (SECONDS - T0) - RESERVE))
  SKIPPED=0
  if [ "$left" -lt 15 ]; then
    SKIPPED=1
    say "$name: skipped, ${BUDGET}s budget spent"
    printf '%s\tskipped (budget)\t0\n' "$name" >> "$WORK/sections.tsv"
    return 125
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  say "$name: start (timeout ${cap}s, $((SECONDS - T0))s elapsed)"
  echo "\$ $*" >> "$LOG"
  t=$SECONDS
  timeout -k 10 "$cap" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  cat "$WORK/$name.log" >> "$LOG"
  case $rc in 0) state=ok ;; 124 | 137) state="timed out (${cap}s)" ;; *) state="failed (exit $rc)" ;; esac
  printf '%s\t%s\t%s\n' "$name" "$state" "$((SECONDS - t))" >> "$WORK/sections.tsv"
  grep -E '^\[train\] step .*(tok/s|finished)|OURS/REF|^  (ours|ref) |LEV/TIED|host syncs|^(Traceback|[A-Za-z.]*Error)|error:' \
    "$WORK/$name.log" | tail -n 12
  say "$name: $state in $((SECONDS - t))s"
  return $rc
}

# ---- 1. the Python packages
install() {
  if [ "$DRY" = 1 ]; then
    echo "dry: $PY (no install)"
  elif ls .whl/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
      return 1
  else
    echo "no .whl/ here: run 'bash benchmarks/gpu_wheels.sh' where there is network and carry .whl"
  fi
  "$PY" - << 'EOF'
import importlib, importlib.util, os, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
for name in ("deepspeed", "megatron.core", "transformers", "pydantic"):
    if os.environ["DRY"] == "1":  # the other sections import them anyway; here only whether they are there
        print(name, "found" if importlib.util.find_spec(name) else "MISSING")
    else:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "?"), mod.__file__)
EOF
}
[ "$DRY" = 1 ] || export PYTHONPATH="/tmp/site:$PYTHONPATH"
export DRY PY
export -f install  # `timeout` runs programs, not functions: the section runs it as `bash -c install`
if [ "$DRY" = 0 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >> "$LOG" 2>&1
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'error: no CUDA GPU (use --dry on CPU)')" ||
    exit 1
fi
section install 90 bash -c install || say "error: the packages do not import (see the log); the sections that need them will fail"

# ---- per-scale settings: micro-batch, global batch (accumulation 4), steps
plan_scale() {  # plan_scale SCALE -> MICRO GLOBAL RUN_STEPS WARMUP SHAPE[] (STEPS, the caller's, stays as given)
  SHAPE=()
  case $1 in
    400m) MICRO=16 RUN_STEPS="${STEPS_400M:-${STEPS:-20}}" ;;
    1.2b) MICRO=8 RUN_STEPS="${STEPS_12B:-${STEPS:-12}}" ;;
    tiny-cpu)
      MICRO=2 RUN_STEPS="${STEPS:-6}"
      SHAPE=(model.vocab_size=512 model.hidden_size=64 model.num_layers=2 model.seq_length=64 model.lev.seed_dim=16
             model.lev.rank=8) ;;
    *) MICRO=8 RUN_STEPS="${STEPS:-15}" ;;
  esac
  GLOBAL=$((4 * MICRO))
  WARMUP=$([ "$DRY" = 1 ] && echo 2 || echo 5)
}
common() {  # the overrides of every run at this scale
  COMMON=("${DEV[@]}" "${SHAPE[@]}" parallel.precision=bf16 parallel.zero_stage=1 parallel.tensor_parallel=1
          parallel.pipeline_parallel=1 train.micro_batch_size="$MICRO" train.global_batch_size="$GLOBAL"
          ${EXTRA:-})
}

# ---- 2. one synthetic Zipf shard (the vocabulary of the first scale's config; 1.2B and 400M share it)
read -r FIRST _ <<< "$SCALES"
plan_scale "$FIRST"
common
TOKENS=$(( (RUN_STEPS + 10) * GLOBAL * 513 * 12 / 10 + 20000 ))
if wanted train || wanted variant; then  # the step bench and lev-input make their own tokens
  section shard 90 "$PY" benchmarks/bench_train.py --lev "configs/$FIRST-lev.yaml" --write-shard "$WORK/data/zipf" \
    --tokens "$TOKENS" "${COMMON[@]}"
else
  not_wanted shard
fi
SHARD="$WORK/data/zipf"

RUNS=() ATTACH=()
train() {  # train NAME CONFIG [overrides...]: one trainer run into $WORK/NAME (console log $WORK/NAME.log)
  local name=$1 config=$2 cap=$3
  shift 3
  section "$name" "$cap" "$PY" -m leviathan_pretrain.train --config "$config" "${COMMON[@]}" "$@" \
    "data.prefixes=[$SHARD]" data.split=98,1,1 "train.out_dir=$WORK/$name" train.steps="$RUN_STEPS" \
    train.eval_interval=0 logging.log_interval=5 logging.tensorboard=false checkpoint.save_interval=1000000 \
    checkpoint.resume=false
  # the summary reads runs that started (a failed one is reported with its error); one skipped for the budget
  # never existed and is only in the sections table
  [ "$SKIPPED" = 1 ] || RUNS+=("$WORK/$name")
  rm -rf "$WORK/$name/checkpoints"  # the final checkpoint (GBs at 1.2B): ours, and not needed
}

# ---- 3. per scale: TIED and LEV through the trainer, then ours vs bare PyTorch (+ the probe at the first scale)
for SCALE in $SCALES; do
  plan_scale "$SCALE"
  common
  CAP=$([ "$SCALE" = 1.2b ] && echo 150 || echo 120)
  if wanted train; then
    train "$SCALE-tied" "configs/$SCALE-tied.yaml" "$CAP"
    train "$SCALE-lev" "configs/$SCALE-lev.yaml" "$CAP"
  else
    not_wanted "$SCALE-tied"
    not_wanted "$SCALE-lev"
  fi
  if ! wanted step; then
    not_wanted "step-$SCALE"
    continue
  fi
  PROBE=()  # the LEV input path (first scale): host syncs and a profile of one step, in the same process
  [ "$SCALE" = "$FIRST" ] && PROBE=(--probe-config "configs/$SCALE-lev.yaml")
  ATTACH+=("$WORK/step-$SCALE.json")
  # shellcheck disable=SC2086  # STEP_EXTRA: key=value words, split on purpose
  section "step-$SCALE" 120 "$PY" benchmarks/bench_step.py --config "configs/$SCALE-tied.yaml" --pairs "${PAIRS:-6}" \
    --warmup 2 --breakdown --breakdown-pairs 2 "${PROBE[@]}" --json "$WORK/step-$SCALE.json" "${COMMON[@]}" \
    ${STEP_EXTRA:-}
done

# ---- 4. the GPU-only options (another helper's keys): skipped, logged, when this checkout does not know them
plan_scale "$FIRST"
common
VARIANT=(model.compile=true model.activation_fusion=true)
if ! wanted variant; then
  not_wanted variant
elif ! "$PY" -c "import sys; from leviathan_pretrain.config import load_config; load_config(sys.argv[1], sys.argv[2:])" \
  "configs/$FIRST-lev.yaml" "${VARIANT[@]}" >> "$LOG" 2>&1; then
  say "variant: skipped, this checkout does not accept ${VARIANT[*]} (see the log)"
  printf 'variant\tskipped (unknown key)\t0\n' >> "$WORK/sections.tsv"
elif [ "$DRY" = 1 ]; then
  say "variant: keys accepted; dry: not trained (torch.compile on a CPU takes minutes)"
  printf 'variant\tskipped (dry)\t0\n' >> "$WORK/sections.tsv"
else
  train "${FIRST}_compile_fusion-lev" "configs/$FIRST-lev.yaml" 150 "${VARIANT[@]}"
fi

# ---- 5. LEV's input layer alone (benchmarks/profile_lev_gpu.py, another helper's: chunk budget, the sync's cost)
if ! wanted lev-input; then
  not_wanted lev-input
elif [ ! -f benchmarks/profile_lev_gpu.py ]; then
  printf 'lev-input\tskipped (no profile_lev_gpu.py)\t0\n' >> "$WORK/sections.tsv"
elif [ "$DRY" = 1 ]; then
  say "lev-input: dry: not run (GPU shapes; its own --device cpu smoke test is its author's)"
  printf 'lev-input\tskipped (dry)\t0\n' >> "$WORK/sections.tsv"
else
  section lev-input 60 "$PY" benchmarks/profile_lev_gpu.py --scale "$FIRST" --reps 10
fi

# ---- 6. the summary (not time-boxed by BUDGET)
plan_scale "$FIRST"
say "summary ($((SECONDS - T0))s elapsed)"
"$PY" benchmarks/bench_train.py --summarize "${RUNS[@]}" --warmup "$WARMUP" --attach "$WORK/sections.tsv" \
  "${ATTACH[@]}" --json "$OUT/summary.json" --md "$OUT/summary.md" 2>&1 | tee -a "$LOG"
[ -f "$OUT/summary.md" ] && cat "$OUT/summary.md"
say "done in $((SECONDS - T0))s: $OUT/gpu_check.log, $OUT/summary.md, $OUT/summary.json"
# exit 1 when a section failed or timed out (its numbers are missing; the others' are in the summary)
awk -F'\t' '$2 !~ /^(ok|skipped)/ { bad = 1 } END { exit bad }' "$WORK/sections.tsv"
