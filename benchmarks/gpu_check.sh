#!/usr/bin/env bash
# GPU check: one short run on one GPU (<= 9 minutes, installs included) answering, side by side:
#   1. correctness first, on this GPU: the training loss's Liger kernel against our fused loss and Liger's own fused
#      linear cross entropy (benchmarks/bench_loss.py), LEV's Triton spline kernel against the torch path and LEV's
#      input layer per kernel (benchmarks/profile_lev_gpu.py), model.compile against eager, losses and every
#      gradient in fp32 and bf16 plus 5 trainer steps (benchmarks/check_compile.py): each check-*.json;
#   2. per scale (400M, 1.2B), TIED and LEV through the real trainer (leviathan_pretrain.train, bf16, ZeRO 1) at the
#      new defaults + CANDIDATE (the options whose check is in this run): tokens/s, TFLOP/s, MFU, peak memory
#      (torch.cuda.max_memory_allocated) vs plan/planner.py, LEV/TIED;
#   3. per scale, benchmarks/bench_step.py's four contestants on the same batches in rotating order: (A) ours at
#      the old defaults (OLD), (B) ours at the new defaults + CANDIDATE, (C) Hugging Face Llama eager, (D) Hugging
#      Face Llama + Liger (RMSNorm, SwiGLU, RoPE, fused linear CE in our number of chunks) + torch.compile; with a
#      forward/backward/step breakdown, each one's memory, the host syncs and profile of one LEV step (first
#      scale) and a memory snapshot of one step of ours at its peak (last scale: plan/planner.py's transient term).
# Never part of CI or of a test's numbers (the tests run --dry only, for the script's logic).
#
# Device tool, after `bash benchmarks/gpu_wheels.sh` here (DeepSpeed, megatron-core, liger-kernel, pydantic, hjson
# wheels for the GPU machine's Python 3.12 into .whl/):
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=570, kind="nvidia-h200")
# Expected ~500 s on an H200 (the 2026-12-04 sections' times plus the new ones, estimated); what does not fit BUDGET
# is skipped and recorded, for a second run with SECTIONS / SCALES (e.g. SCALES=1.2b SECTIONS=step).
# It writes into $OUT (the tool's return folder; else runs/gpu_check): gpu_check.log (every section's whole
# output), summary.md, summary.json (per scale: ours_over_ref, ours_over_liger, ours_over_old, lev_over_tied, MFU,
# each against the step-speed goals) and the .gpu_check-output marker. Shards, runs and checkpoints go to a temporary
# folder it creates and deletes (KEEP_WORK=1 keeps it).
# A run the docs cite is committed as it came back under results/gpu-runs/<date>/<n>-<what>/ (results/README.md).
#
#   bash benchmarks/gpu_check.sh          one CUDA GPU; python3 (never the CPU .venv) + .whl/ installed into
#                                         /tmp/site with pip --no-index --no-deps
#   bash benchmarks/gpu_check.sh --dry    CPU, tiny shapes, .venv's python, Triton's interpreter: the same sections,
#                                         to check the script (compile is skipped there: minutes on a CPU)
#
# Each section is time-boxed (`timeout`), its whole output goes to the log, and a failed or timed-out section is
# recorded without losing the others; once BUDGET seconds are spent the rest are skipped, and say so. Exit status
# 1 when a section failed or timed out (the summary says which), 2 on a usage / OUT error.
# Environment: OUT, BUDGET (510; dry 900), SCALES ("400m 1.2b"; dry "tiny-cpu"), STEPS (per run: 13 at 400M, 10 at
# 1.2B, the first 5 untimed; dry 4), PAIRS (rounds of bench_step, 4; dry 2), EXTRA (more key=value overrides for every run), CANDIDATE (the
# options measured as new defaults in B and the trainer runs before they become defaults; default
# "model.compile=true"), OLD (the overrides that give the old defaults, A), STEP_EXTRA (more overrides for
# bench_step's B alone), SECTIONS (which of "checks train step" run, in that order; default all; the others are
# recorded as skipped: a second run on what the first left out), KEEP_WORK.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
case "${1:-}" in
  --dry) DRY=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [--dry]   (environment: OUT BUDGET SCALES STEPS PAIRS EXTRA" \
       "CANDIDATE OLD STEP_EXTRA SECTIONS KEEP_WORK)" >&2
     exit 2 ;;
esac
ALL_SECTIONS="checks train step"
SECTIONS="${SECTIONS:-$ALL_SECTIONS}"
for s in $SECTIONS; do
  case " $ALL_SECTIONS " in
    *" $s "*) ;;
    *) echo "error: SECTIONS: unknown section '$s' (known: $ALL_SECTIONS)" >&2; exit 2 ;;
  esac
done
wanted() { case " $SECTIONS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# The keys that restore the old defaults (A): the loss without Liger's kernel, LEV's torch
# spline path with fp32 GEMMs, DeepSpeed's accumulation at the end of backward, torch.unique on the device, one
# pageable copy per tensor (and each step's batch read at its start: bench_step.py prepares its batches ahead anyway).
OLD_DEFAULTS="model.loss_impl=fused model.lev.kernel=torch model.lev.gemm_dtype=fp32 parallel.immediate_grad_update=false data.unique_ids=device data.packed_transfer=false data.prefetch=false"
OLD="${OLD-$OLD_DEFAULTS}"
CANDIDATE="${CANDIDATE-model.compile=true}"
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
  export TRITON_INTERPRET=1  # the Triton kernels (Liger's, LEV's) on the CPU: slow, exact
  BUDGET="${BUDGET:-900}" SCALES="${SCALES:-tiny-cpu}"
  DEV=(parallel.device=cpu parallel.backend=gloo)
  CANDIDATE_RUN=""  # model.compile on a CPU takes minutes: the dry run checks the script, not compile
  STEP_PAIRS=2 STEP_WARMUP=1  # Liger's kernels under the interpreter: ~10 s a tiny step
else
  PY=python3  # the machine's own Python (torch + CUDA + triton); the wheels add what it lacks
  export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}" DS_ACCELERATOR=cuda
  BUDGET="${BUDGET:-510}" SCALES="${SCALES:-400m 1.2b}"
  DEV=(parallel.device=cuda parallel.backend=nccl)
  CANDIDATE_RUN="$CANDIDATE"
  STEP_PAIRS=4 STEP_WARMUP=2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RESERVE=20  # seconds kept for the summary
echo "OLD (A): $OLD" >> "$LOG"
echo "CANDIDATE (B and the trainer runs): ${CANDIDATE_RUN:-none}" >> "$LOG"

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
  grep -E '^\[train\] step .*(tok/s|finished)|OURS/|^  (ours|old|ref|liger) |LEV/TIED|host syncs|check.*(ok|FAILED)|^(Traceback|[A-Za-z.]*Error)|error:' \
    "$WORK/$name.log" | tail -n 14
  say "$name: $state in $((SECONDS - t))s"
  return $rc
}

# ---- 0. the Python packages
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
for name in ("deepspeed", "megatron.core", "transformers", "pydantic", "triton", "liger_kernel"):
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
# A key OLD names that this checkout does not know fails A alone, loudly, before anything else: drop A, keep B-D.
OLD_OK=1
if [ -n "$OLD" ] && ! "$PY" -c "import sys; from leviathan_pretrain.config import load_config; load_config(sys.argv[1], sys.argv[2:])" \
  configs/400m-lev.yaml $OLD >> "$LOG" 2>&1; then
  say "error: OLD='$OLD' does not load (see the log): the step comparison runs without (A)"
  OLD_OK=0
fi

# ---- per-scale settings: micro-batch, global batch (accumulation 4), steps
plan_scale() {  # plan_scale SCALE -> MICRO GLOBAL RUN_STEPS WARMUP SHAPE[] (STEPS, the caller's, stays as given)
  SHAPE=()
  case $1 in
    400m) MICRO=16 RUN_STEPS="${STEPS_400M:-${STEPS:-13}}" ;;
    1.2b) MICRO=8 RUN_STEPS="${STEPS_12B:-${STEPS:-10}}" ;;
    tiny-cpu)  # --dry's scale: the script's logic, not speed; Liger's kernels under the interpreter take ~7 s a
      # step at 32 tokens (~20 s at 128), so one sequence of 32
      MICRO=1 RUN_STEPS="${STEPS:-4}"
      SHAPE=(model.vocab_size=512 model.hidden_size=64 model.num_layers=2 model.seq_length=32 model.lev.seed_dim=16
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
read -r FIRST _ <<< "$SCALES"
LAST=${SCALES##* }
CHECKS=()  # the checks' JSONs, attached to the summary

# ---- 1. correctness on this device (and each kernel's time): the loss, LEV's kernel, compile
if wanted checks; then
  plan_scale "$FIRST"
  common
  # the loss at 400M's shape (a micro-batch of 8,192 tokens, D 1,024, V 200,064), LEV's layer at the first scale's
  LOSS_ARGS=(--tokens 8192 --hidden 1024 --vocab 200064 --dtype bf16 --device cuda --reps 20)
  LEV_ARGS=(--scale "$FIRST" --reps 20 --chunk-mib 512)
  [ "$DRY" = 1 ] && LOSS_ARGS=(--dry) LEV_ARGS=(--device cpu --dry)
  CHECKS+=("$WORK/check-loss.json" "$WORK/check-lev.json" "$WORK/check-compile.json")
  section check-loss 120 "$PY" benchmarks/bench_loss.py "${LOSS_ARGS[@]}" --json "$WORK/check-loss.json"
  section check-lev 60 "$PY" benchmarks/profile_lev_gpu.py "${LEV_ARGS[@]}" --json "$WORK/check-lev.json"
  if [ "$DRY" = 1 ]; then
    say "check-compile: dry: not run (torch.compile on a CPU takes minutes; python benchmarks/check_compile.py --dry by hand)"
    printf 'check-compile\tskipped (dry)\t0\n' >> "$WORK/sections.tsv"
  else  # 4 layers: every layer is the same compiled graph, so depth changes nothing of what is checked
    section check-compile 120 "$PY" benchmarks/check_compile.py --config "configs/$FIRST-lev.yaml" \
      --json "$WORK/check-compile.json" "${COMMON[@]}" model.num_layers=4
  fi
else
  not_wanted checks
fi

# ---- 2. one synthetic Zipf shard (the vocabulary of the first scale's config; 1.2B and 400M share it)
plan_scale "$FIRST"
common
TOKENS=$(( (RUN_STEPS + 10) * GLOBAL * 513 * 12 / 10 + 20000 ))
if wanted train; then  # the step bench makes its own tokens
  section shard 90 "$PY" benchmarks/bench_train.py --lev "configs/$FIRST-lev.yaml" --write-shard "$WORK/data/zipf" \
    --tokens "$TOKENS" "${COMMON[@]}"
fi
SHARD="$WORK/data/zipf"

RUNS=() ATTACH=()
train() {  # train NAME CONFIG CAP [overrides...]: one trainer run into $WORK/NAME (console log $WORK/NAME.log)
  local name=$1 config=$2 cap=$3
  shift 3
  # shellcheck disable=SC2086  # CANDIDATE_RUN: key=value words, split on purpose
  section "$name" "$cap" "$PY" -m leviathan_pretrain.train --config "$config" "${COMMON[@]}" $CANDIDATE_RUN "$@" \
    "data.prefixes=[$SHARD]" data.split=98,1,1 "train.out_dir=$WORK/$name" train.steps="$RUN_STEPS" \
    train.eval_interval=0 logging.log_interval=5 logging.tensorboard=false checkpoint.save_interval=1000000 \
    checkpoint.resume=false
  # the summary reads runs that started (a failed one is reported with its error); one skipped for the budget
  # never existed and is only in the sections table
  [ "$SKIPPED" = 1 ] || RUNS+=("$WORK/$name")
  rm -rf "$WORK/$name/checkpoints"  # the final checkpoint (GBs at 1.2B): ours, and not needed
}

# ---- 3. per scale: TIED and LEV through the trainer, then the four contestants (+ probe, memory snapshot)
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
  MORE=()
  [ "$SCALE" = "$FIRST" ] && MORE+=(--probe-config "configs/$SCALE-lev.yaml")  # host syncs + profile of a LEV step
  [ "$SCALE" = "$LAST" ] && [ "$DRY" = 0 ] && MORE+=(--memory-snapshot "$OUT/memory-$SCALE.json")
  [ "$OLD_OK" = 1 ] && [ -n "$OLD" ] && MORE+=(--old "$OLD")
  [ "$DRY" = 1 ] && MORE+=(--liger-eager)  # compile under Triton's interpreter: not on a CPU
  ATTACH+=("$WORK/step-$SCALE.json")
  # shellcheck disable=SC2086  # CANDIDATE_RUN, STEP_EXTRA: key=value words, split on purpose
  section "step-$SCALE" 180 "$PY" benchmarks/bench_step.py --config "configs/$SCALE-tied.yaml" \
    --pairs "${PAIRS:-$STEP_PAIRS}" --warmup "$STEP_WARMUP" --breakdown --breakdown-pairs 1 --liger "${MORE[@]}" \
    --json "$WORK/step-$SCALE.json" "${COMMON[@]}" $CANDIDATE_RUN ${STEP_EXTRA:-}
done

# ---- 4. the summary (not time-boxed by BUDGET)
plan_scale "$FIRST"
say "summary ($((SECONDS - T0))s elapsed)"
"$PY" benchmarks/gpu_summary.py "${RUNS[@]}" --warmup "$WARMUP" --attach "$WORK/sections.tsv" "${CHECKS[@]}" \
  "${ATTACH[@]}" --json "$OUT/summary.json" --md "$OUT/summary.md" 2>&1 | tee -a "$LOG"
[ -f "$OUT/summary.md" ] && cat "$OUT/summary.md"
say "done in $((SECONDS - T0))s: $OUT/gpu_check.log, $OUT/summary.md, $OUT/summary.json"
# exit 1 when a section failed or timed out (its numbers are missing; the others' are in the summary)
awk -F'\t' '$2 !~ /^(ok|skipped)/ { bad = 1 } END { exit bad }' "$WORK/sections.tsv"
