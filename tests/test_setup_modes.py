"""scripts/setup.sh's two modes: ``make test`` installs runtime + test requirements, ``make demo`` (``--runtime``) the
runtime ones alone. The test set includes the runtime set, so a ``make demo`` after a ``make test`` installs
nothing (and a ``make test`` after it does not reinstall either)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _pins_stamp(venv: Path, mode: str) -> Path:
    """The stamp setup.sh writes after installing: the pins' hash (requirements and pyproject) and the mode."""
    digest = hashlib.sha256(b"".join((REPO / f).read_bytes() for f in ("requirements.txt", "requirements-test.txt",
                                                                         "pyproject.toml"))).hexdigest()  # fmt: skip
    return venv / f".setup-{digest[:16]}-{mode}"


def _setup(venv: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LEVIATHAN_VENV": str(venv)}
    return subprocess.run(
        ["bash", "scripts/setup.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_a_runtime_setup_after_a_full_one_installs_nothing(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    full = _pins_stamp(venv, "requirements-test")
    full.touch()  # what a finished `make setup` leaves (its test vocabularies too)
    (venv / "test-assets").mkdir()
    (venv / "test-assets" / ".ok-1").touch()
    runtime = _setup(venv, "--runtime")
    assert runtime.returncode == 0, runtime.stderr
    assert "installing Python packages" not in runtime.stdout and "[setup] ok" in runtime.stdout
    again = _setup(venv)  # and `make test` afterwards: still nothing to install
    assert again.returncode == 0, again.stderr
    assert "installing Python packages" not in again.stdout and full.exists()
