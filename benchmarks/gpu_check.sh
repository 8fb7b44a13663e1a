#!/usr/bin/env bash
# GPU check: train the 400M LEV and TIED configs for ~100 steps in bf16 on one GPU, then report tokens/s,
# TFLOP/s and MFU of each and the LEV/TIED ratio. Never part of CI.
#
#   benchmarks/gpu_check.sh          one CUDA GPU (MFU against the GPU's datasheet bf16 peak, trainer/metrics.py)
#   benchmarks/gpu_check.sh --dry    the same steps on CPU with tiny shapes: checks the script itself
#
# It uses only code paths the CPU tests run (megatron-core GPTModel under deepspeed.initialize, ZeRO-1,
# SDPA attention, the single-tensor AdamW, synthetic megatron-core shards) plus the GPU switches
# parallel.device=cuda parallel.backend=nccl parallel.precision=bf16 (bf16 is also what --dry runs).
# Environment: STEPS (100), MICRO (16), GLOBAL (64; the paper's 512 only adds accumulation steps),
# OUT (runs/gpu_check), EXTRA (more key=value overrides for both runs).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-runs/gpu_check}"
if [ "${1:-}" = "--dry" ]; then
  SCALE=tiny-cpu STEPS="${STEPS:-6}" WARMUP=2
  COMMON=(parallel.device=cpu parallel.backend=gloo model.vocab_size=512 model.hidden_size=64 model.num_layers=2
          model.seq_length=64 model.lev.seed_dim=16 model.lev.rank=8 train.micro_batch_size="${MICRO:-2}"
          train.global_batch_size="${GLOBAL:-4}")
  TOKENS=60000
elif [ -n "${1:-}" ]; then
  echo "usage: benchmarks/gpu_check.sh [--dry]   (environment: STEPS MICRO GLOBAL OUT EXTRA)" >&2; exit 2
else
  python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'error: no CUDA GPU (use --dry on CPU)')"
  SCALE=400m STEPS="${STEPS:-100}" WARMUP=10
  COMMON=(parallel.device=cuda parallel.backend=nccl model.attention_backend=sdpa
          train.micro_batch_size="${MICRO:-16}" train.global_batch_size="${GLOBAL:-64}")
  TOKENS=$(( (STEPS + 5) * ${GLOBAL:-64} * 513 ))
fi
COMMON+=(parallel.precision=bf16 parallel.zero_stage=1 parallel.tensor_parallel=1 parallel.pipeline_parallel=1
         train.steps="$STEPS" train.eval_interval=0 logging.log_interval=10 checkpoint.save_interval=1000000
         checkpoint.resume=false data.split=98,1,1 ${EXTRA:-})
# Never delete what this script did not create: OUT is replaced only when it carries our marker.
if [ -e "$OUT" ] && [ ! -f "$OUT/.gpu_check-output" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
  echo "error: $OUT exists and was not written by gpu_check.sh (no .gpu_check-output marker); set OUT to another path" >&2
  exit 2
fi
rm -rf "$OUT"
mkdir -p "$OUT/data"
touch "$OUT/.gpu_check-output"
echo "[gpu_check] writing a synthetic Zipf shard ($TOKENS tokens) for configs/$SCALE-lev.yaml"
python benchmarks/bench_train.py --lev "configs/$SCALE-lev.yaml" --write-shard "$OUT/data/zipf" --tokens "$TOKENS" \
  "${COMMON[@]}" >/dev/null
for variant in tied lev; do
  echo "[gpu_check] training configs/$SCALE-$variant.yaml for $STEPS steps"
  python -m leviathan_pretrain.train --config "configs/$SCALE-$variant.yaml" "${COMMON[@]}" \
    "data.prefixes=[$OUT/data/zipf]" "train.out_dir=$OUT/$variant" 2>&1 | grep -E "^\[train\]|error" || true
  test -f "$OUT/$variant/checkpoints/latest" || { echo "[gpu_check] error: the $variant run did not finish" >&2; exit 1; }
done
python benchmarks/bench_train.py --summarize "$OUT/tied" "$OUT/lev" --warmup "$WARMUP"
