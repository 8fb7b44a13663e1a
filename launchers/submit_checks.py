"""The checks before anything is queued: the config (with the run directory as ``train.out_dir``), its data,
device and plan against the job's resources, ``sbatch`` on PATH, and no live job of the same run."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

from launchers import records
from launchers.job_spec import Job, Refused
from launchers.sbatch import Resources
from leviathan_pretrain.config import ConfigError, load_config


def load(config: str, overrides: tuple[str, ...], run_dir: Path):
    """The validated config with ``train.out_dir`` = the run directory (a new config: the loaded one is kept)."""
    try:
        cfg = load_config(config, list(overrides))
    except ConfigError as e:
        raise Refused(str(e)) from None
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(run_dir)))


def check_data(cfg, config: str) -> None:
    if not cfg.data.prefixes:
        raise Refused(f"{config}: data.prefixes: empty; set data.prefixes=[PREFIX,...] (megatron-core shards)")
    for prefix in [*cfg.data.prefixes, *(cfg.data.valid_prefixes or [])]:
        for ext in (".bin", ".idx"):
            if not Path(prefix + ext).is_file():
                raise Refused(
                    f"{config}: data.prefixes: {prefix}{ext} does not exist (paths are relative to {os.getcwd()})"
                )


def check_device(cfg, res: Resources) -> None:
    dev = cfg.parallel.device
    if res.gpus_per_node and dev == "cpu":
        raise Refused(
            f"parallel.device: cpu, but --gpus-per-node {res.gpus_per_node} asks for GPUs; "
            "set parallel.device=auto or --gpus-per-node 0"
        )
    if not res.gpus_per_node and dev == "cuda":
        raise Refused("parallel.device: cuda, but --gpus-per-node 0; give --gpus-per-node or parallel.device=cpu")


def make_plan(cfg, job: Job):
    from leviathan_pretrain.plan.planner import format_plan, make_plan

    res = job.resources
    gpu = res.gpus_per_node > 0
    plan = make_plan(cfg, res.nodes, res.ranks_per_node, "gpu" if gpu else "cpu", job.gpu_mem_gb if gpu else None)
    problems = [p for p in plan.problems if not (job.skip_memory_check and p.startswith("--gpu-mem-gb"))]
    return plan, format_plan(plan), problems


def prepared(job: Job, config: str, run_dir: Path, need_data: bool = True):
    """``(config, plan text)`` of ``config`` trained in ``run_dir`` by ``job``, or :class:`Refused`."""
    cfg = load(config, job.overrides, run_dir)
    check_device(cfg, job.resources)
    if need_data:
        check_data(cfg, config)
    plan, text, problems = make_plan(cfg, job)
    if problems:
        raise Refused(f"{config}: the plan cannot work (see problem: below):\n{text}")
    return cfg, text


def active_jobs(run_dir: Path) -> list[str]:
    """Job ids recorded for ``run_dir`` that SLURM still has queued or running."""
    ids = [r["job_id"] for r in records.read_records(run_dir) if r.get("kind") == "train"]
    if not ids:
        return []
    p = subprocess.run(["squeue", "-h", "-o", "%i %T", "-j", ",".join(ids)], capture_output=True, text=True, timeout=30)
    live = []
    for line in p.stdout.splitlines():
        job, _, state = line.partition(" ")
        if state in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUE_HOLD"):
            live.append(job)
    return live


def need_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise Refused("sbatch: not found on PATH; run this on a SLURM login node (or use --dry-run)")
