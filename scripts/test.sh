#!/usr/bin/env bash
# Runs the test suite inside .venv (set up by scripts/setup.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# One private, reused JIT-extension cache for DeepSpeed's ops, built once per run before the tests.
export TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions"
export LEVIATHAN_TEST_CACHE="$PWD/.cache/tests"
mkdir -p "$TORCH_EXTENSIONS_DIR" "$LEVIATHAN_TEST_CACHE"
# Warm-up: JIT-build DeepSpeed's CPU communication op (deepspeed_shm_comm, 45-90 s on 2 cores) once, here,
# so that no test pays for it and no two test processes build it concurrently. A no-op when it is cached.
DS_ACCELERATOR=cpu python - <<'PY' || { echo "[test] DeepSpeed CPU op build failed" >&2; exit 1; }
import time
t = time.time()
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
ShareMemCommBuilder().load(verbose=False)
print(f"[test] DeepSpeed CPU op deepspeed_shm_comm ready ({time.time() - t:.0f} s)", flush=True)
PY
# Two test processes (pytest-xdist; LEVIATHAN_TEST_WORKERS, 0 = none): the tests' own processes leave about 45% of
# two cores idle (ranks waiting on each other, imports on one core). Which tests share a process: tests/conftest.py
# (pytest_xdist_make_scheduler).
exec python -m pytest -n "${LEVIATHAN_TEST_WORKERS:-2}" "$@"
