"""What a ``launchers.slurm`` command asks for, read once from its command line: the frozen :class:`Request`,
and the validated :class:`Job` (sbatch resources, launch, plan checks) that the submission steps are given."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from launchers.sbatch import Launch, Resources


class Refused(Exception):
    """A submission refused before ``sbatch``: the message names the key or option and what to change."""


@dataclass(frozen=True)
class Request:
    """The options of a ``submit`` / ``sweep`` / ``pipeline`` command line, as given (checked when a
    :class:`Job` is made of them); options another command lacks are None (their defaults are the parser's:
    launchers/slurm_args.py, the one place)."""

    command: str
    config: str | None = None  # submit, pipeline
    configs: tuple[str, ...] = ()  # sweep
    overrides: tuple[str, ...] = ()
    run_dir: str | None = None
    # resources (sbatch)
    nodes: int | None = None
    gpus_per_node: int | None = None
    tasks_per_node: int | None = None
    cpus_per_rank: int | None = None
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    qos: str | None = None
    constraint: str | None = None
    mem: str | None = None
    mail_user: str | None = None
    mail_type: str | None = None
    exclusive: bool = False
    job_name: str | None = None
    sbatch_arg: tuple[str, ...] = ()
    # launch
    launch: str | None = None
    env: tuple[str, ...] = ()
    prologue: str | None = None
    python: str | None = None
    signal_lead: int | None = None
    max_requeues: int | None = None
    gpu_mem_gb: float | None = None
    skip_memory_check: bool = False
    dry_run: bool = False
    # pipeline: the preprocessing and evaluation jobs
    prep: str | None = None
    prep_nodes: int | None = None
    prep_tasks_per_node: int | None = None
    prep_cpus: int | None = None
    prep_time: str | None = None
    prep_partition: str | None = None
    eval: str | None = None
    eval_time: str | None = None
    eval_cpus: int | None = None

    @classmethod
    def of(cls, ns: argparse.Namespace) -> Request:
        """The request of a parsed command line (lists become tuples)."""
        values = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        for name in ("configs", "overrides", "sbatch_arg", "env"):
            if name in values:
                values[name] = tuple(values[name] or ())
        return cls(**values)


@dataclass(frozen=True)
class Job:
    """A training job as SLURM runs it (``resources``, ``launch``) and as its plan is checked before submission."""

    resources: Resources
    launch: Launch
    overrides: tuple[str, ...]
    gpu_mem_gb: float
    skip_memory_check: bool
    dry_run: bool


def resources(req: Request, job_name: str) -> Resources:
    """The sbatch resources of ``req``; ``job_name`` unless ``--job-name`` names the job."""
    for opt in ("nodes", "gpus_per_node", "tasks_per_node", "cpus_per_rank"):
        v = getattr(req, opt)
        if v is not None and v < (0 if opt == "gpus_per_node" else 1):
            raise Refused(f"--{opt.replace('_', '-')}: must be >= {0 if opt == 'gpus_per_node' else 1}, got {v}")
    return Resources(
        nodes=req.nodes,
        gpus_per_node=req.gpus_per_node,
        tasks_per_node=req.tasks_per_node,
        cpus_per_rank=req.cpus_per_rank,
        partition=req.partition,
        account=req.account,
        time=req.time,
        qos=req.qos,
        constraint=req.constraint,
        exclusive=req.exclusive,
        mem=req.mem,
        mail_user=req.mail_user,
        mail_type=req.mail_type,
        job_name=req.job_name or job_name,
        sbatch_args=list(req.sbatch_arg),
    )


def launch_of(req: Request) -> Launch:
    """How the training job of ``req`` runs (from the submit directory)."""
    env = {}
    for item in req.env:
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise Refused(f"--env {item!r}: expected KEY=VALUE with KEY a shell variable name")
        env[key] = value
    if req.signal_lead < 1:
        raise Refused("--signal-lead: must be >= 1 second")
    if req.max_requeues < 0:
        raise Refused("--max-requeues: must be >= 0")
    return Launch(
        launch=req.launch,
        python=req.python,
        workdir=os.getcwd(),
        env=env,
        signal_lead=req.signal_lead,
        max_requeues=req.max_requeues,
        prologue=req.prologue,
    )


def job_of(req: Request, job_name: str, launch: Launch | None = None) -> Job:
    """The checked :class:`Job` of ``req`` (resources first, then ``launch`` unless it was already made)."""
    res = resources(req, job_name)
    launch = launch if launch is not None else launch_of(req)
    return Job(res, launch, req.overrides, req.gpu_mem_gb, req.skip_memory_check, req.dry_run)
