"""Process groups: rank discovery, torch.distributed + megatron-core parallel_state, device, seeding.

One code path for every launcher and machine:
- rank variables from torchrun / the ``deepspeed`` launcher (``RANK``, ``WORLD_SIZE``, ...), from SLURM
  (``SLURM_PROCID``, ``SLURM_NTASKS``, ...), from MPI (mpi4py discovery under ``mpirun``/``srun --mpi``),
  or a single local process;
- ``gloo`` + CPU + fp32 here, ``nccl`` + CUDA (+ bf16) on GPU clusters, chosen by
  :class:`~leviathan_pretrain.config.ParallelConfig` (``auto`` picks from the hardware);
- megatron-core's ``parallel_state`` owns the TP x PP x DP groups; :class:`DeepSpeedMPU` presents them to
  DeepSpeed so that ZeRO partitions over the data-parallel group only.
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from torch.distributed.distributed_c10d import _set_pg_timeout, _world

from leviathan_pretrain.config import ConfigError, ParallelConfig
from leviathan_pretrain.config.parallel import accumulation_steps, batch_problem
from leviathan_pretrain.model.settings import resolve_device
from leviathan_pretrain.parallel.ports import free_port

MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def expand_hostlist(spec: str) -> list[str]:
    """SLURM's compressed host list -> host names, in order (what ``scontrol show hostnames`` prints):
    ``gpu[01-03,7],login1`` -> gpu01 gpu02 gpu03 gpu7 login1; several bracket groups multiply out
    (``r[1-2]n[1-2]``); zero padding follows the lower bound."""
    items, depth, cur = [], 0, ""
    for ch in spec.strip():
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += (ch == "[") - (ch == "]")
        if depth < 0:
            raise ValueError(f"bad SLURM host list {spec!r}")
        cur += ch
    if depth:
        raise ValueError(f"bad SLURM host list {spec!r}")
    items.append(cur)
    hosts = []
    for item in filter(None, (i.strip() for i in items)):
        names = [""]
        rest = item
        while rest:
            lb = rest.find("[")
            if lb < 0:
                names = [n + rest for n in names]
                break
            rb = rest.index("]", lb)
            expanded = []
            for part in rest[lb + 1 : rb].split(","):
                lo, _, hi = part.partition("-")
                if not lo.isdigit() or (hi and not hi.isdigit()):
                    raise ValueError(f"bad SLURM host list {spec!r}")
                expanded += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi or lo) + 1)]
            names = [n + rest[:lb] + e for n in names for e in expanded]
            rest = rest[rb + 1 :]
        hosts += names
    return hosts


def first_slurm_host(environ=os.environ) -> str | None:
    """The first node of this job step (else of the job): where SLURM puts task 0."""
    spec = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    return expand_hostlist(spec)[0] if spec else None


def _mpi_rank0_address(environ, names: list[str]) -> str:
    """Where rank 0 listens, agreed over MPI without resolving our own hostname (``gethostbyname(gethostname())``
    is often 127.0.1.1 on cluster nodes): loopback when every rank is on one node; else the job's first SLURM
    node when rank 0 runs there; else rank 0's processor name, which the other nodes resolve themselves."""
    if len(set(names)) == 1:
        return "127.0.0.1"
    first = first_slurm_host(environ)
    if first is not None and first.split(".")[0] == names[0].split(".")[0]:
        return first
    return names[0]


def discover_rank_env(environ=os.environ) -> dict:
    """Fill RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from whatever launched us."""
    env = {}
    if "RANK" in environ and "WORLD_SIZE" in environ:
        env["LOCAL_RANK"] = environ.get("LOCAL_RANK", environ["RANK"])
    elif "SLURM_PROCID" in environ and int(environ.get("SLURM_NTASKS", "1")) > 1:
        env["RANK"] = environ["SLURM_PROCID"]
        env["WORLD_SIZE"] = environ["SLURM_NTASKS"]
        env["LOCAL_RANK"] = environ.get("SLURM_LOCALID", "0")
        if "MASTER_ADDR" not in environ:
            first = first_slurm_host(environ)
            if first is None:
                raise RuntimeError(
                    "running under srun with several tasks but neither MASTER_ADDR nor "
                    "SLURM_JOB_NODELIST is set; launch through launchers/ or export the first "
                    "node's address as MASTER_ADDR"
                )
            env["MASTER_ADDR"] = first
        env.setdefault(
            "MASTER_PORT", environ.get("MASTER_PORT", str(29500 + int(environ.get("SLURM_JOB_ID", "0")) % 20000))
        )
    elif any(v in environ for v in MPI_RANK_VARS):
        from mpi4py import MPI  # only under an MPI launcher

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        names = comm.allgather(MPI.Get_processor_name())
        addr = environ.get("MASTER_ADDR") or comm.bcast(
            _mpi_rank0_address(environ, names) if rank == 0 else None, root=0
        )
        port = comm.bcast(environ.get("MASTER_PORT") or (str(free_port()) if rank == 0 else None), root=0)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(size),
            LOCAL_RANK=str(names[:rank].count(names[rank])),
            MASTER_ADDR=addr,
            MASTER_PORT=port,
        )
    else:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if "MASTER_ADDR" not in environ and "MASTER_ADDR" not in env:
        env["MASTER_ADDR"] = "127.0.0.1"
    if "MASTER_PORT" not in environ and "MASTER_PORT" not in env:
        if int(env.get("WORLD_SIZE", environ.get("WORLD_SIZE", "1"))) > 1:
            raise RuntimeError("MASTER_PORT is not set for a multi-process run")
        env["MASTER_PORT"] = str(free_port())
    return env


def select_device(pcfg: ParallelConfig, local_rank: int = 0) -> torch.device:
    """This rank's device (:func:`~leviathan_pretrain.model.settings.resolve_device`), made current on GPU."""
    if resolve_device(pcfg.device).type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("parallel.device: cuda requested but torch.cuda.is_available() is False")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_gpu_only_options(pcfg: ParallelConfig, device: torch.device) -> None:
    """GPU-only options stay in the config but fail clearly where they cannot run."""
    if device.type != "cuda":
        if pcfg.precision == "fp16":
            raise ConfigError(
                "parallel.precision: fp16 needs CUDA (DeepSpeed's CPU path has no fp16); use fp32 or bf16 on CPU"
            )
        if pcfg.backend == "nccl":
            raise ConfigError("parallel.backend: nccl needs CUDA; use gloo or auto on CPU")


def launch_hint(world: int, model_parallel: int, argv: list[str] | None = None) -> str:
    """What to type when ``world`` ranks cannot hold TP x PP = ``model_parallel``: one process gets the local
    launcher's command line (this process's own arguments after ``--``), a launched job a rank count."""
    ranks = -(-world // model_parallel) * model_parallel  # the next multiple of TP x PP
    if world > 1:
        return f"launch a multiple of {model_parallel} ranks, e.g. {ranks}"

    args = list(argv if argv is not None else sys.orig_argv[1:])
    if "-m" not in args and not any(a.endswith(".py") for a in args):
        args = ["-m", "leviathan_pretrain.train", "--config", "FILE", "key=value..."]  # not a python command line
    return f"run {ranks} ranks: python launchers/local.py -n {ranks} -- {shlex.join(args)}"


def init_distributed(pcfg: ParallelConfig) -> DistEnv:
    """Initialise torch.distributed and megatron-core's TP/PP/DP groups; idempotent (a call with another
    TP/PP layout rebuilds megatron-core's groups).

    Two timeouts: the world group starts with ``parallel.init_timeout_minutes`` (start-up checks, megatron's
    index build barrier: rank 0 may work alone there for a long time at Pile scale); megatron-core's TP/PP/DP
    groups, which carry every training step's collectives, time out after ``parallel.timeout_minutes`` (a hung
    rank or a cut network fails the job then). Once set-up is done the trainer sets every group, the world group
    (the per-step stop vote) included, to ``timeout_minutes`` (:func:`set_group_timeouts`), and to
    ``init_timeout_minutes`` for the length of a checkpoint save."""
    for k, v in discover_rank_env().items():
        os.environ.setdefault(k, v)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = select_device(pcfg, local_rank)
    check_gpu_only_options(pcfg, device)
    backend = pcfg.backend if pcfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    model_parallel = pcfg.tensor_parallel * pcfg.pipeline_parallel
    if world % model_parallel:
        raise ConfigError(
            f"parallel: world size {world} is not divisible by tensor_parallel x pipeline_parallel "
            f"= {pcfg.tensor_parallel} x {pcfg.pipeline_parallel}; {launch_hint(world, model_parallel)}"
        )
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world,
            timeout=timedelta(minutes=pcfg.init_timeout_minutes),
            device_id=device if device.type == "cuda" else None,
        )

    if ps.model_parallel_is_initialized() and (
        ps.get_tensor_model_parallel_world_size() != pcfg.tensor_parallel
        or ps.get_pipeline_model_parallel_world_size() != pcfg.pipeline_parallel
    ):
        ps.destroy_model_parallel()  # a new layout in the same process (e.g. several runs per test launch)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=pcfg.tensor_parallel,
            pipeline_model_parallel_size=pcfg.pipeline_parallel,
            distributed_timeout_minutes=pcfg.timeout_minutes,  # a timedelta's minutes: fractions hold
            create_gloo_process_groups=device.type == "cuda",
        )
    return DistEnv(rank, world, local_rank, device, backend)


def set_group_timeouts(minutes: float) -> None:
    """This rank's timeout for the collectives of every process group it belongs to, from now on (local: no
    collective): the world group, megatron-core's TP/PP/DP groups and any DeepSpeed made (its pipeline groups
    start with torch's 30-minute gloo default). torch's ``_set_pg_timeout``, which megatron-core's
    ``update_pg_timeout`` wraps with a barrier and an unconditional ``torch.cuda.synchronize()`` (it fails on a
    CPU-only build)."""
    for group in list(_world.pg_map):
        try:
            _set_pg_timeout(timedelta(minutes=minutes), group)
        except ValueError:  # not a member (never registered as one, but be safe)
            pass


@dataclass(frozen=True)
class ParallelDims:
    """This rank's place in the TP x PP x DP grid (megatron-core's groups), and the batch arithmetic that
    follows from it (torchtitan's ``ParallelDims``). Build it with :func:`parallel_dims` after
    :func:`init_distributed`."""

    rank: int
    world: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    gas: int  # gradient accumulation steps: global batch / (micro batch x DP)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def writer(self) -> bool:
        """The one rank that logs (TensorBoard, console, train_log.jsonl): last stage, TP 0, DP 0."""
        return self.last_stage and self.tp_rank == 0 and self.dp_rank == 0


def parallel_dims(micro_batch_size: int, global_batch_size: int) -> ParallelDims:
    """The grid of the initialised groups; the global batch must split into micro-batches x DP."""
    dp = ps.get_data_parallel_world_size()
    problem = batch_problem(global_batch_size, micro_batch_size, dp)
    if problem:
        raise ConfigError(problem)
    return ParallelDims(
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=dp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        gas=accumulation_steps(global_batch_size, micro_batch_size, dp),
    )


def seed_everything(seed: int, device: torch.device) -> None:
    """Megatron's convention: the seed differs per pipeline stage, equal across TP and DP ranks.

    On the CPU weights come from full master tensors (``use_cpu_initialization``), so TP shards equal the
    TP=1 weights; on GPU megatron-core's CUDA RNG tracker is seeded too (its per-shard initialisation on the
    device, and dropout)."""

    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


@contextlib.contextmanager
def one_process_group():
    """A 1-process gloo group (file store: no port) for single-process tools (megatron-core's blends, evaluation,
    export), unless one exists already; destroyed on exit if it was made here."""
    if dist.is_initialized():
        yield
        return
    tmp = tempfile.mkdtemp(prefix="leviathan-pg-")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)


def destroy_distributed(barrier: bool = True) -> None:
    """Tear down cleanly (a live gloo thread can abort the interpreter at exit). ``barrier=False`` on error
    paths: a peer that is gone, or stuck elsewhere, must not keep this rank waiting."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


class DeepSpeedMPU:
    """megatron-core's groups in the interface DeepSpeed's ``mpu`` argument expects.

    DeepSpeed's "model parallel" is megatron-core's *tensor* parallel (pipeline stages are handled by
    DeepSpeed's own engine), so ZeRO partitions over the data-parallel group only and gradient clipping
    counts tensor-parallel shards once (it reads megatron-core's ``tensor_model_parallel`` attribute)."""

    def __init__(self):
        self.ps = ps

    def get_model_parallel_world_size(self):
        return self.ps.get_tensor_model_parallel_world_size()

    def get_model_parallel_rank(self):
        return self.ps.get_tensor_model_parallel_rank()

    def get_model_parallel_group(self):
        return self.ps.get_tensor_model_parallel_group()

    # the names DeepSpeed's universal-checkpoint loader asks for
    def get_tensor_model_parallel_world_size(self):
        return self.ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_rank(self):
        return self.ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_group(self):
        return self.ps.get_tensor_model_parallel_group()

    def get_data_parallel_world_size(self):
        return self.ps.get_data_parallel_world_size()

    def get_data_parallel_rank(self):
        return self.ps.get_data_parallel_rank()

    def get_data_parallel_group(self):
        return self.ps.get_data_parallel_group()

    def get_pipeline_model_parallel_world_size(self):
        return self.ps.get_pipeline_model_parallel_world_size()

    def get_pipeline_model_parallel_rank(self):
        return self.ps.get_pipeline_model_parallel_rank()

    def get_pipeline_model_parallel_group(self):
        return self.ps.get_pipeline_model_parallel_group()
