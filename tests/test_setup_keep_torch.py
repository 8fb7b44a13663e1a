"""scripts/setup.sh --keep-torch: a cluster's venv that already has a torch (its CUDA build) gets every other pin
and keeps that torch, for real: a fresh venv, torch put into it (a copy of the pinned one, :func:`site_torch`) and
marked as the site's build (its dist-info INSTALLER rewritten, which a reinstall would replace), then the set-up
script."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def setup(venv: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "LEVIATHAN_VENV": str(venv)}
    return subprocess.run(
        ["bash", "scripts/setup.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def site_torch(venv: Path) -> None:
    """Torch into ``venv`` as a site's build: the pinned torch of the interpreter running the tests (scripts/setup.sh's
    .venv) with the packages it needs to import (its requirements, theirs), copied whole with their dist-info (what pip
    reads as "installed") and their bytecode: what ``pip install torch==2.13.0`` leaves, in seconds of I/O instead of
    pip's minute of unpacking and byte-compiling. Copied, never linked: the test rewrites two of torch's files."""
    from importlib import metadata

    from packaging.requirements import Requirement

    (dest,) = glob.glob(str(venv / "lib" / "python3.*" / "site-packages"))
    todo, seen, paths = ["torch"], set(), set()
    while todo:
        dist = metadata.distribution(todo.pop())
        name = dist.metadata["Name"].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        site = Path(dist.locate_file(""))
        # its top-level files and folders (the bin/ scripts, outside site-packages, are left out); one the new venv
        # has already (its setuptools) is left to pip, which upgrades it as it would have
        tops = {f.parts[0] for f in dist.files or () if f.parts[0] != ".."}
        if not any((Path(dest) / t).exists() for t in tops if not t.endswith(".dist-info")):
            paths |= {site / t for t in tops}
        required = (Requirement(r) for r in dist.requires or ())
        todo += [r.name for r in required if r.marker is None or r.marker.evaluate({"extra": ""})]  # not extras
    subprocess.run(["cp", "-a", *sorted(map(str, paths)), dest], check=True, timeout=300)


def installer(venv: Path) -> str:
    (path,) = glob.glob(str(venv / "lib" / "python3.*" / "site-packages" / "torch-*.dist-info" / "INSTALLER"))
    return Path(path).read_text().strip()


def test_refusals_name_the_fix(tmp_path):
    missing = setup(tmp_path / "nope", "--keep-torch")
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "--system-site-packages" in missing.stderr
    assert not (tmp_path / "nope").exists()  # nothing created
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    bare = setup(tmp_path / "bare", "--keep-torch")
    assert bare.returncode == 2 and "no torch is importable" in bare.stderr, bare.stderr
    bad = setup(tmp_path / "bare", "--bogus")
    assert bad.returncode == 2 and "unknown option --bogus" in bad.stderr


def test_keep_torch_installs_the_rest_and_never_replaces_torch(tmp_path):
    venv = tmp_path / "cluster-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    site_torch(venv)  # the site's build
    (marker,) = glob.glob(str(venv / "lib" / "python3.*" / "site-packages" / "torch-*.dist-info" / "INSTALLER"))
    Path(marker).write_text("site-cuda-build\n")  # what a reinstall by pip would overwrite with "pip"

    run = setup(venv, "--keep-torch", "--runtime")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "keeping torch 2.13.0" in run.stdout and "(kept)" in run.stdout, run.stdout
    assert installer(venv) == "site-cuda-build"  # the same torch files, never reinstalled
    check = "import megatron.core, deepspeed, sentencepiece, tensorboard, leviathan_pretrain.config; print('ok')"
    out = subprocess.run([py, "-c", check], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]

    again = setup(venv, "--keep-torch", "--runtime", timeout=120)  # idempotent: nothing to install
    assert again.returncode == 0 and "installing" not in again.stdout, again.stdout + again.stderr

    # A torch older than any this stack ran on is refused before pip runs.
    (version,) = glob.glob(str(venv / "lib" / "python3.*" / "site-packages" / "torch" / "version.py"))
    text = Path(version).read_text()
    Path(version).write_text(text.replace("__version__ = '2.13.0", "__version__ = '2.10.0"))
    old = setup(venv, "--keep-torch", timeout=120)
    assert old.returncode == 2 and "torch 2.10.0+cpu is older than 2.11" in old.stderr, old.stdout + old.stderr
    assert installer(venv) == "site-cuda-build"
