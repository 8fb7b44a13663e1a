"""The processes of a tokenize run, for data_prep/runner.py: :class:`LocalComm` (one process) or
:class:`MpiComm` (``--mpi``: one process per rank under ``mpirun`` / ``srun --mpi=pmix``).

A communicator runs a step and says how its failures end the run. With one process an error simply
propagates. Under MPI every rank's failure is shared (``allgather`` / ``gather`` + ``bcast``), so no rank
waits forever in a collective, and every rank raises :class:`RanksFailed` with one message, which
rank 0 alone prints.
"""

from __future__ import annotations

import traceback
from typing import Callable, Protocol, TypeVar

from common.cli import UserError

T = TypeVar("T")


class RanksFailed(Exception):
    """A step failed on some rank (under MPI); every rank raises it, with the message to print once."""


class Comm(Protocol):
    rank: int
    size: int
    ranked: bool  # log lines and progress name the rank

    def all_ranks(self, step: Callable[[], T]) -> T:
        """Run ``step`` on every rank; return its result once every rank has run it."""

    def gather_to_root(self, step: Callable[[], T], on_root: Callable[[list[T]], object]):
        """Run ``step`` on every rank, then ``on_root`` on rank 0 with the results in rank order; its result on
        rank 0, None elsewhere."""


class LocalComm:
    """One process: rank 0 of 1; a step's error propagates as it is."""

    rank, size, ranked = 0, 1, False

    def all_ranks(self, step: Callable[[], T]) -> T:
        return step()

    def gather_to_root(self, step: Callable[[], T], on_root: Callable[[list[T]], object]):
        return on_root([step()])


def _describe(e: BaseException) -> str:
    """A failure as one line; a traceback too (on this rank's stderr) unless it is a :class:`UserError`."""
    if isinstance(e, UserError):
        return str(e)
    traceback.print_exc()
    return f"{type(e).__name__}: {e}"


def _attempt(step: Callable[[], T]) -> tuple[str | None, T | None]:
    try:
        return None, step()
    except BaseException as e:
        return _describe(e), None


class MpiComm:
    """``MPI.COMM_WORLD``."""

    ranked = True

    def __init__(self):
        # lazy: importing mpi4py.MPI initialises MPI (~0.3 s here), which a one-process run must not do
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise UserError(f"--mpi needs mpi4py and an MPI library ({e})") from None
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def all_ranks(self, step: Callable[[], T]) -> T:
        """Run ``step`` on every rank; if it failed on any, all raise :class:`RanksFailed` (the first rank's
        error). Returns only once every rank has finished the step (``allgather``)."""
        err, value = _attempt(step)
        errs = self.comm.allgather(err)
        if any(errs):
            raise RanksFailed(next(e for e in errs if e))
        return value

    def gather_to_root(self, step: Callable[[], T], on_root: Callable[[list[T]], object]):
        """Run ``step`` on every rank, then ``on_root`` (rank 0) on the results in rank order; returns its result
        on rank 0 and None elsewhere. A failure anywhere ("rank R: ..." for the steps) makes all raise
        :class:`RanksFailed`."""
        err, value = _attempt(step)
        gathered = self.comm.gather((err, value), root=0)
        result, outcome = None, None
        if self.rank == 0:
            errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e]
            if errors:
                outcome = "; ".join(errors)
            else:
                outcome, result = _attempt(lambda: on_root([v for _, v in gathered]))
        outcome = self.comm.bcast(outcome, root=0)
        if outcome:
            raise RanksFailed(outcome)
        return result
