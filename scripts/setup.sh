#!/usr/bin/env bash
# Idempotent set-up: Debian packages, a virtual environment in .venv, pinned Python packages,
# the project in editable mode. Safe to re-run; does nothing that is already done.
#   scripts/setup.sh          runtime + test requirements
#   scripts/setup.sh --runtime  runtime requirements only
set -euo pipefail
cd "$(dirname "$0")/.."

REQ=requirements-test.txt
[ "${1:-}" = "--runtime" ] && REQ=requirements.txt

# Debian packages: Open MPI (mpi4py, multi-node preprocessing); the Python docs and the GCIDE
# dictionary (the multi-source test corpus, see data_prep/make_corpus.py); SLURM and munge (the tests start a
# private single-node cluster: tests/slurm_cluster.py; on a real cluster the site's SLURM is used). One apt
# call: Open MPI (libpmix) is in place before any slurmd starts, or `srun --mpi=pmix` hangs.
APT_PKGS="libopenmpi-dev openmpi-bin python3.11-doc dict-gcide"
[ "$REQ" = requirements-test.txt ] && APT_PKGS="$APT_PKGS slurm-wlm munge"
missing=""
for p in $APT_PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "[setup] installing Debian packages:$missing"
  $SUDO apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends $missing >/dev/null
fi

PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  for c in python3.11 python3; do command -v "$c" >/dev/null && { PYTHON="$c"; break; }; done
fi
[ -d .venv ] || { echo "[setup] creating .venv with $PYTHON"; "$PYTHON" -m venv .venv; }

stamp=".venv/.setup-$(cat requirements.txt requirements-test.txt pyproject.toml | sha256sum | cut -c1-16)-$(basename $REQ .txt)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing Python packages from $REQ"
  .venv/bin/python -m pip install -q --disable-pip-version-check -r "$REQ" 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import torch, megatron.core, deepspeed, sentencepiece, mpi4py" 2>/dev/null \
    || { echo "[setup] import check failed" >&2; exit 1; }
  rm -f .venv/.setup-*
  touch "$stamp"
fi
echo "[setup] ok: $(.venv/bin/python --version), torch $(.venv/bin/python -c 'import torch;print(torch.__version__)' 2>/dev/null)"
