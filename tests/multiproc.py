"""Run a Python entry point on N local ranks (gloo), with a hard timeout and no process left behind.

``run_ranks(["-m", "pkg.module", "arg"], nprocs=2, timeout=120)`` starts N interpreters with the usual
rank variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), each in its own process
session, and waits. A hang or one rank dying while the others wait in a collective is a failure: the
whole group is killed and :class:`RanksFailed` carries every rank's output.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from leviathan_pretrain.parallel.ports import free_port

REPO = Path(__file__).resolve().parents[1]


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    output: str


class RanksFailed(AssertionError):
    pass


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def base_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


def run_python(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python ARGS`` as one process in the repository, with :func:`base_env` (plus ``env``); output captured
    as text."""
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=base_env(env), capture_output=True, text=True, timeout=timeout
    )


def run_ranks(
    args: list[str],
    nprocs: int = 2,
    timeout: float = 180.0,
    env: dict | None = None,
    cwd: str | Path | None = None,
    check: bool = True,
    grace: float = 20.0,
) -> list[RankResult]:
    """Run ``python *args`` on ``nprocs`` ranks; fail (and kill all) on timeout or if any rank fails.

    ``grace``: once one rank exits non-zero, how long the others may take to finish before being
    killed (they are usually blocked in a collective with the dead rank)."""
    port = free_port()
    procs, logs = [], []
    try:
        for rank in range(nprocs):
            log = tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            e = base_env(env)
            e.update(
                RANK=str(rank),
                WORLD_SIZE=str(nprocs),
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, *args],
                    env=e,
                    cwd=cwd or REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        first_failure = None
        timed_out = False
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if first_failure is None and any(p.poll() not in (None, 0) for p in procs):
                first_failure = now
            if now > deadline or (first_failure is not None and now - first_failure > grace):
                timed_out = now > deadline
                break
            time.sleep(0.1)
    finally:
        _kill(procs)
    results = []
    for rank, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        results.append(RankResult(rank, p.returncode, log.read()))
        log.close()
    if check and (timed_out or any(r.returncode != 0 for r in results)):
        what = f"timed out after {timeout:.0f} s" if timed_out else "a rank failed"
        detail = "\n".join(f"--- rank {r.rank} (rc={r.returncode}) ---\n{r.output[-6000:]}" for r in results)
        raise RanksFailed(f"{' '.join(args)}: {what}\n{detail}")
    return results


RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def one_rank_world(parallel):
    """This test process as a world of one (``init_distributed(parallel)``), with the rank variables cleared
    for it and restored afterwards."""
    from leviathan_pretrain.parallel.groups import destroy_distributed, init_distributed

    saved = {k: os.environ.get(k) for k in RANK_VARS}
    for k in RANK_VARS:
        os.environ.pop(k, None)
    try:
        yield init_distributed(parallel)
    finally:
        destroy_distributed()
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def no_cuda_touch(monkeypatch, available: bool = False) -> None:
    """``torch.cuda.is_available()`` answers ``available``; any other CUDA query fails the test (a GPU path
    checked on the CPU must decide from the configured device, not by asking CUDA)."""
    import torch
    import torch._dynamo  # noqa: F401  (its first import looks torch's functions up by name, torch.cuda's among them:
    # done here, before they are replaced, or a compile the test triggers (megatron-core's fused functions compile at
    # their first call) leaves dynamo half imported for every later test of this process)

    def touched(*a, **k):
        raise AssertionError("touched CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    for name in ("current_device", "device_count", "set_device", "_lazy_init", "init"):
        monkeypatch.setattr(torch.cuda, name, touched)
