"""A submission's files in the run directory and its ``sbatch`` call: the ``RUN/slurm/<stamp>/`` folder (script,
resolved config), ``sbatch --parsable``, and the record of each submitted job."""

from __future__ import annotations

import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from common.fileio import write_bytes_atomic
from launchers import records
from launchers.sbatch import Launch
from leviathan_pretrain.config import to_dict


def stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%f")


def job_dir(run_dir: Path, cfg=None) -> tuple[Path, Path | None]:
    """A new ``RUN/slurm/<stamp>/`` (+ the resolved ``config.yaml``, atomically): ours to remove if sbatch fails."""
    import yaml

    d = run_dir / records.SLURM_DIR / stamp()
    d.mkdir(parents=True)
    config = None
    if cfg is not None:
        config = d / "config.yaml"
        write_bytes_atomic(config, yaml.safe_dump(to_dict(cfg), sort_keys=False).encode())
    return d, config


def write_script(d: Path, script: str) -> Path:
    path = d / "job.sbatch"
    write_bytes_atomic(path, script.encode())
    return path


def run_sbatch(script: Path, dependency: str | None = None) -> str:
    cmd = ["sbatch", "--parsable"] + ([f"--dependency=afterok:{dependency}"] if dependency else []) + [str(script)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        shutil.rmtree(script.parent, ignore_errors=True)  # the stamp folder we just created; nothing was queued
        raise SbatchFailed(p.stderr.strip() or f"sbatch exited with {p.returncode}")
    return p.stdout.strip().split(";")[0]


class SbatchFailed(Exception):
    """``sbatch`` refused the job (the message is its stderr)."""


def record(run_dir: Path, job_id: str, kind: str, script: Path, config: Path | None, log: str, launch: Launch):
    records.append_record(
        run_dir,
        {
            "job_id": job_id,
            "kind": kind,
            "submitted": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "script": str(script),
            "config": str(config) if config else None,
            "log": log,
            "argv": sys.argv,
            "launch": launch.launch,
            "max_requeues": launch.max_requeues,
        },
    )
