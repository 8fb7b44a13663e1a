"""Test-only: a checkpoint directory that fills up, end to end (tests/test_ckpt_errors.py).

Run as ``unshare --user --map-root-user --mount python tests/workers/disk_full.py SPEC.json``: in its own mount
namespace it mounts a small tmpfs as the checkpoint directory (it vanishes with the namespace, so every run that
needs it runs here), then runs the tiny 2-rank training (tests/workers/train_faults.py under launchers/local.py):

1. ``full``: checkpoints at steps 2 and 4, then the tmpfs filled just before step 6's checkpoint is written
   (``LEV_TEST_FILL_DISK_AT_SAVE_STEP``): the save fails;
2. ``resume``: the filler removed, the same command again: resumed to the end;
3. ``reference``: the same training uninterrupted, its checkpoints on the ordinary disk.

SPEC: ``{"config", "overrides" (common to all runs), "ckpt_dir" (the mount point), "ref_ckpt_dir", "out_dir",
"ref_out_dir", "fill_file", "size" (tmpfs size), "result" (where this writes its JSON)}``. The result: per run its
exit code and output, and after ``full`` and ``resume`` the checkpoint directory's listing and ``latest``.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def launch(spec: dict, extra: list[str], env: dict | None = None, timeout: float = 240) -> dict:
    args = [sys.executable, "launchers/local.py", "-n", "2", "--grace", "10", "--", "tests/workers/train_faults.py"]
    args += ["--config", spec["config"], *spec["overrides"], *extra]
    t0 = time.monotonic()
    env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    return {"code": proc.returncode, "output": proc.stdout, "seconds": time.monotonic() - t0}


def listing(d: Path) -> dict:
    latest = d / "latest"
    return {
        "files": sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()),
        "latest": latest.read_text() if latest.is_file() else None,
    }


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    ckpt = Path(spec["ckpt_dir"])
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={spec['size']}", "tmpfs", str(ckpt)], check=True)
    mine = [f"train.out_dir={spec['out_dir']}", f"checkpoint.dir={ckpt}"]
    fill = {"LEV_TEST_FILL_DISK_AT_SAVE_STEP": "6", "LEV_TEST_FILL_FILE": spec["fill_file"]}
    out = {"full": launch(spec, mine, fill)}
    out["after_full"] = listing(ckpt)
    Path(spec["fill_file"]).unlink()
    out["resume"] = launch(spec, mine)
    out["after_resume"] = listing(ckpt)
    out["reference"] = launch(spec, [f"train.out_dir={spec['ref_out_dir']}", f"checkpoint.dir={spec['ref_ckpt_dir']}"])
    Path(spec["result"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
