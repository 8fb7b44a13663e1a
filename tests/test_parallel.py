"""Rank discovery and process groups (real gloo collectives on 2 local processes)."""

import json
import shutil
import subprocess
import sys

import pytest

from leviathan_pretrain.config import ConfigError, ParallelConfig
from leviathan_pretrain.parallel.groups import check_gpu_only_options, discover_rank_env
from tests.multiproc import REPO, base_env, run_ranks


def _results(outputs):
    return sorted(
        (json.loads(line[len("RESULT ") :]) for o in outputs for line in o.splitlines() if line.startswith("RESULT ")),
        key=lambda r: r["rank"],
    )


def test_discover_from_torchrun_and_slurm_and_single():
    env = discover_rank_env({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert env == {"LOCAL_RANK": "3"}
    env = discover_rank_env(
        {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "MASTER_ADDR": "node1", "SLURM_JOB_ID": "42"}
    )
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_PORT"]) == ("1", "2", "1", "29542")
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        discover_rank_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    env = discover_rank_env(
        {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[017-018],login1"}
    )
    assert env["MASTER_ADDR"] == "gpu017"  # the first node of the job, not our own name's resolution
    env = discover_rank_env({})
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")


def test_gpu_only_options_fail_clearly_on_cpu():
    import torch

    for kw, key in (({"precision": "fp16"}, "precision"), ({"backend": "nccl"}, "backend")):
        with pytest.raises(ConfigError, match=key):
            check_gpu_only_options(ParallelConfig(**kw), torch.device("cpu"))


@pytest.mark.multiproc
def test_tp2_groups_and_allreduce():
    res = _results(r.output for r in run_ranks(["tests/workers/parallel_smoke.py", "2", "1"], nprocs=2, timeout=120))
    assert [r["rank"] for r in res] == [0, 1]
    for r in res:
        assert (r["tp_size"], r["dp_size"], r["pp_size"], r["backend"], r["device"]) == (2, 1, 1, "gloo", "cpu")
        assert r["tp_sum"] == 3.0
        # start-up work on rank 0 (index builds) waits on the world group; the training steps' groups time out
        assert (r["world_timeout_s"], r["tp_timeout_s"], r["dp_timeout_s"]) == (45 * 60, 3 * 60, 3 * 60)
    assert [r["tp_rank"] for r in res] == [0, 1]


@pytest.mark.multiproc
def test_mpi_discovery_under_mpirun():
    mpirun = shutil.which("mpirun")
    assert mpirun, "Open MPI (mpirun) is required; scripts/setup.sh installs it"
    env = base_env()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [
            mpirun,
            "--allow-run-as-root",
            "--oversubscribe",
            "-n",
            "2",
            sys.executable,
            "tests/workers/parallel_smoke.py",
            "1",
            "1",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = _results([proc.stdout])
    assert [(r["rank"], r["world"], r["dp_size"], r["tp_sum"]) for r in res] == [(0, 2, 2, 1.0), (1, 2, 2, 2.0)]


def test_slurm_hostlist_expansion():
    from leviathan_pretrain.parallel.groups import expand_hostlist

    assert expand_hostlist("gpu[01-03,7],login1") == ["gpu01", "gpu02", "gpu03", "gpu7", "login1"]
    assert expand_hostlist("n1") == ["n1"]
    assert expand_hostlist("r[1-2]n[08-09]-ib") == ["r1n08-ib", "r1n09-ib", "r2n08-ib", "r2n09-ib"]
    assert expand_hostlist("a[9-11]") == ["a9", "a10", "a11"]
    for bad in ("gpu[01-03", "gpu[a-b]", "x]"):
        with pytest.raises(ValueError, match="bad SLURM host list"):
            expand_hostlist(bad)


def test_mpi_master_address_never_resolves_our_own_hostname():
    """One node: loopback. Several: the job's first SLURM node when rank 0 is there, else rank 0's processor
    name (resolved by the other nodes) - never gethostbyname(gethostname()), often 127.0.1.1 on clusters."""
    from leviathan_pretrain.parallel.groups import _mpi_rank0_address

    assert _mpi_rank0_address({}, ["n1", "n1"]) == "127.0.0.1"
    assert _mpi_rank0_address({"SLURM_JOB_NODELIST": "n[1-2]"}, ["n1.cluster", "n2.cluster"]) == "n1"
    assert _mpi_rank0_address({"SLURM_JOB_NODELIST": "n[1-2]"}, ["n2", "n1"]) == "n2"
    assert _mpi_rank0_address({}, ["hostA", "hostB"]) == "hostA"
