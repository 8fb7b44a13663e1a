"""What ``launchers.slurm`` keeps in a run directory, and the one place that reads and writes it.

Layout of a run directory ``RUN`` (the trainer's ``train.out_dir``; ``checkpoints/``, ``tensorboard/`` and
``train_log.jsonl`` are the trainer's own)::

    RUN/slurm/jobs.jsonl            one JSON record per submission (appended; never rewritten)
    RUN/slurm/<stamp>/job.sbatch    the script as submitted
    RUN/slurm/<stamp>/config.yaml   the resolved config the job trains with (requeues re-read this copy)
    RUN/logs/<job-name>-<job id>.out   the job's stdout + stderr (requeues append to it)

A record: ``{"job_id": "1234" (or "1234_0" for an array element), "kind": "train" | "prep", "submitted": ISO
time, "script": path, "config": path, "log": path, "argv": [...], "launch": "torchrun" | "srun" | "deepspeed",
"max_requeues": N}``. Paths are absolute.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from leviathan_pretrain.rundir.layout import SLURM as SLURM_DIR

JOBS = "jobs.jsonl"


def jobs_file(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / SLURM_DIR / JOBS


def append_record(run_dir: str | os.PathLike, record: dict) -> None:
    """Append one record (one ``write`` of one line, then fsync: a crash leaves whole lines only)."""
    path = jobs_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_records(run_dir: str | os.PathLike) -> list[dict]:
    """Every record of ``run_dir``, oldest first ([] when it has none); an unreadable line is skipped."""
    path = jobs_file(run_dir)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "job_id" in rec:
            out.append(rec)
    return out
