"""The side jobs of ``launchers.slurm pipeline``: the preprocessing (MPI ``data_prep.tokenize``) and evaluation
jobs' resources, log pattern and script."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from launchers import sbatch
from launchers.job_spec import Refused, Request
from launchers.sbatch import Launch, Resources


@dataclass(frozen=True)
class Stage:
    """One side job of the pipeline: what it asks SLURM for, its ``--output`` pattern and its sbatch script."""

    resources: Resources
    log: str
    script: str


def _split(opt: str, text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as e:
        raise Refused(f"{opt}: cannot split {text!r} into arguments ({e})") from None


def _resources(req: Request, kind: str, **given) -> Resources:
    """A side job's resources: ``given``, and the training job's account, QoS and extra ``#SBATCH`` options."""
    job_name = f"lev-{kind}-{Path(req.config).stem}"
    return Resources(account=req.account, qos=req.qos, job_name=job_name, sbatch_args=list(req.sbatch_arg), **given)


def _has_option(args: list[str], *names: str) -> bool:
    """Whether ``args`` give one of the options ``names`` (``--name VALUE`` or ``--name=VALUE``)."""
    return any(a.split("=", 1)[0] in names for a in args if a.startswith("--"))


def prep_stage(req: Request, run_dir: Path, launch: Launch) -> Stage:
    """The preprocessing job: ``data_prep.tokenize --mpi`` with the ``--prep`` arguments."""
    args = _split("--prep", req.prep)
    if not _has_option(args, "--out", "--output-prefix"):
        raise Refused("--prep: give data_prep.tokenize's arguments, including --out")
    res = _resources(
        req,
        "prep",
        nodes=req.prep_nodes,
        gpus_per_node=0,
        tasks_per_node=req.prep_tasks_per_node,
        cpus_per_rank=req.prep_cpus,
        partition=req.prep_partition or req.partition,
        time=req.prep_time,
    )
    log = sbatch.log_pattern(run_dir, res.job_name)
    return Stage(res, log, sbatch.prep_script(res, launch, args, log))


def eval_stage(req: Request, run_dir: Path, launch: Launch) -> Stage:
    """The evaluation job: ``leviathan_pretrain.evaluate`` of the run with the ``--eval`` arguments."""
    args = _split("--eval", req.eval)
    if _has_option(args, "--run", "--run-dir"):
        raise Refused("--eval: the run directory is the pipeline's own; leave out --run")
    gpus = 1 if req.gpus_per_node else 0
    res = _resources(
        req,
        "eval",
        nodes=1,
        gpus_per_node=gpus,
        tasks_per_node=1,
        cpus_per_rank=req.eval_cpus or (8 if gpus else 2),
        partition=req.partition,
        time=req.eval_time,
        constraint=req.constraint,
    )
    log = sbatch.log_pattern(run_dir, res.job_name)
    return Stage(res, log, sbatch.eval_script(res, launch, str(run_dir), args, log))
