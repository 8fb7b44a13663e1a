#!/usr/bin/env bash
# Runs the test suite inside .venv (set up by scripts/setup.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# One private, reused JIT-extension cache for DeepSpeed's ops, built once per run before the tests.
export TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions"
export LEVIATHAN_TEST_CACHE="$PWD/.cache/tests"
mkdir -p "$TORCH_EXTENSIONS_DIR" "$LEVIATHAN_TEST_CACHE"
exec python -m pytest "$@"
