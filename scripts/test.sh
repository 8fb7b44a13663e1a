#!/usr/bin/env bash
# Runs the test suite inside .venv (set up by scripts/setup.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# One private, reused JIT-extension cache for DeepSpeed's ops, built once per run before the tests.
export TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions"
export LEVIATHAN_TEST_CACHE="$PWD/.cache/tests"
mkdir -p "$TORCH_EXTENSIONS_DIR" "$LEVIATHAN_TEST_CACHE"
# Every test's seconds (conftest.py records them), summarized at the end: where the time goes (tests/durations.py)
export LEVIATHAN_TEST_DURATIONS="$PWD/.cache/test-durations.tsv"
: > "$LEVIATHAN_TEST_DURATIONS"
# The project's bytecode, compiled once (under a second): where PYTHONDONTWRITEBYTECODE is set (this machine kind's
# image sets it) no process writes it, so every test process, rank and SLURM job compiled what it imported again
# (0.5 CPU-s of a trainer rank's 4.2, measured). Stale files are recompiled (source mtime and size).
python -m compileall -q -j 0 common data_prep leviathan_pretrain launchers tests benchmarks >/dev/null
# Two tiers (tests/tiers.py): "fast" (in-process unit tests, one process, no subprocess allowed) and "integration"
# (multi-process, SLURM, training runs, the tools as processes). LEVIATHAN_TEST_TIER: fast | integration | all
# (default: fast, then integration; `make test-fast`, `make test-integration`, `make test`).
tier="${LEVIATHAN_TEST_TIER:-all}"
case "$tier" in fast|integration|all) ;; *) echo "[test] LEVIATHAN_TEST_TIER=$tier: use fast, integration or all" >&2; exit 2 ;; esac

fast() {
  echo "[test] fast tier (in-process unit tests)"
  LEVIATHAN_TEST_TIER=fast python -m pytest -n 0 -m "not integration" "$@"
}

# Warm-up: JIT-build DeepSpeed's CPU communication op (deepspeed_shm_comm, 30-90 s on 2 cores) once, before the
# integration tier, so that no test pays for it and no two test processes build it concurrently. A no-op when it is
# cached. With both tiers it builds beside the fast tier, which runs on one core.
warm_up() {
  DS_ACCELERATOR=cpu python - <<'PY'
import time
t = time.time()
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
ShareMemCommBuilder().load(verbose=False)
print(f"[test] DeepSpeed CPU op deepspeed_shm_comm ready ({time.time() - t:.0f} s)", flush=True)
PY
}
warm_pid=""

integration() {
  if [ -n "$warm_pid" ]; then wait "$warm_pid"; else warm_up; fi \
    || { echo "[test] DeepSpeed CPU op build failed" >&2; return 1; }
  # Two test processes (pytest-xdist; LEVIATHAN_TEST_WORKERS, 0 = none): one would leave a core idle while a test
  # waits (on ranks, on SLURM); a third gains nothing on two cores (measured: 1,430 s against 1,400 s, the cores
  # 99% busy). Which tests share a process: tests/conftest.py (pytest_xdist_make_scheduler).
  echo "[test] integration tier"
  python -m pytest -n "${LEVIATHAN_TEST_WORKERS:-2}" -m integration "$@"
}

# pytest's 5 = "no tests selected" (e.g. PYTEST_ARGS naming one fast file): fine in "all" if the other tier ran
rc_fast=5 rc_int=5 walls=()
t=$SECONDS
if [ "$tier" = all ]; then warm_up & warm_pid=$!; fi
if [ "$tier" != integration ]; then fast "$@" && rc_fast=0 || rc_fast=$?; walls+=("fast $((SECONDS - t)) s"); fi
t=$SECONDS
if [ "$tier" != fast ]; then  # also after a fast failure: all of it
  integration "$@" && rc_int=0 || rc_int=$?
  walls+=("integration $((SECONDS - t)) s")
fi
if [ "$tier" = all ] && [ "$rc_fast" -eq 5 ] && [ "$rc_int" -eq 0 ]; then rc_fast=0; fi
if [ "$tier" = all ] && [ "$rc_int" -eq 5 ] && [ "$rc_fast" -eq 0 ]; then rc_int=0; fi
python tests/durations.py "$LEVIATHAN_TEST_DURATIONS" || true  # the summary, also after a failure
echo "[test] wall time per tier: $(IFS=,; echo "${walls[*]}" | sed 's/,/, /g')"
[ "$tier" = fast ] && exit "$rc_fast"
[ "$tier" = integration ] && exit "$rc_int"
[ "$rc_fast" -ne 0 ] && exit "$rc_fast"
exit "$rc_int"
