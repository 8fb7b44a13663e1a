#!/usr/bin/env bash
# The main job on an embedded default corpus; see README "Demo".
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
exec python -m leviathan_pretrain.demo --out runs/demo "$@"
