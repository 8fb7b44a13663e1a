#!/usr/bin/env bash
# Wheels for benchmarks/gpu_check.sh, downloaded HERE (a machine with network) into .whl/ (ignored by git).
# The GPU machine has no network; its python3 is 3.12 with torch 2.11+cu130, transformers, tensorboard, numpy,
# einops, ninja, msgpack, psutil, py-cpuinfo, tqdm, pyyaml, packaging, mpi4py, but no DeepSpeed, megatron-core,
# hjson, pydantic (pydantic-core, annotated-types, typing-inspection) and maybe an older typing-extensions
# (pydantic 2.14 needs >= 4.16), and no liger-kernel (pure Python; its triton is the machine's, 3.6 with torch 2.11).
# gpu_check.sh installs exactly these there with
# `pip install --no-index --no-deps --target`, so the list below is the whole set, one version of each:
#   - megatron-core, DeepSpeed: the versions pinned in requirements.txt; liger-kernel: requirements-test.txt's;
#   - the rest: the versions the CPU .venv runs the tests with (pip show there), else the fallbacks below.
# DeepSpeed 0.19.8 is an sdist: it is built here into a pure-Python wheel with no prebuilt ops
# (DS_BUILD_OPS=0; ops are JIT-built at first use, and the trainer uses none: torch's own AdamW).
#
#   bash benchmarks/gpu_wheels.sh        writes .whl/*.whl and prints the total size of what travels
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
PY="${PYTHON:-}"
[ -z "$PY" ] && { [ -x .venv/bin/python ] && PY=.venv/bin/python || PY=python3; }
pin() {  # requirements.txt's (else requirements-test.txt's) pin of $1
  grep -h -i -E "^$1==" requirements.txt requirements-test.txt | head -1 | cut -d= -f3
}
have() {  # the version the CPU venv has of $1, else $2
  "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null || echo "$2"
}
MEGATRON=$(pin megatron-core)
DEEPSPEED=$(pin deepspeed)
LIGER=$(pin liger-kernel)
[ -n "$MEGATRON" ] && [ -n "$DEEPSPEED" ] && [ -n "$LIGER" ] ||
  { echo "error: no megatron-core/deepspeed/liger-kernel pin in requirements*.txt" >&2; exit 1; }
BINARY=(
  "megatron-core==$MEGATRON"
  "liger-kernel==$LIGER"
  "pydantic-core==$(have pydantic-core 2.50.5)"
  "pydantic==$(have pydantic 2.14.4)"
  "annotated-types==$(have annotated-types 0.8.0)"
  "typing-inspection==$(have typing-inspection 0.4.5)"
  "typing-extensions==$(have typing-extensions 4.16.0)"
  "hjson==$(have hjson 3.1.0)"
)
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # only wheels, in our own ignored folder: one version of each, never two
echo "[gpu_wheels] downloading (py3.12, manylinux x86_64): ${BINARY[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST" "${BINARY[@]}"
echo "[gpu_wheels] building deepspeed==$DEEPSPEED (pure Python, DS_BUILD_OPS=0)"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "deepspeed==$DEEPSPEED"
for w in "$DEST"/deepspeed-*.whl; do
  case "$w" in *-py3-none-any.whl) ;; *) echo "error: $w is not a pure-Python wheel" >&2; exit 1 ;; esac
  if unzip -l "$w" | grep -q '\.so$'; then echo "error: $w holds prebuilt ops" >&2; exit 1; fi
done
n=$(ls "$DEST"/*.whl | wc -l)
[ "$n" -eq $((${#BINARY[@]} + 1)) ] || { echo "error: expected $((${#BINARY[@]} + 1)) wheels in $DEST, found $n" >&2; exit 1; }
ls -l "$DEST"
whl=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "[gpu_wheels] $n wheels: $((whl / 1024)) KiB; with the working tree that travels ($((tree / 1024)) KiB):" \
  "$(((whl + tree) / 1048576)) MiB of the 64 MiB limit"
[ $((whl + tree)) -lt $((64 * 1048576)) ] || { echo "error: over the 64 MiB the GPU machine accepts" >&2; exit 1; }
