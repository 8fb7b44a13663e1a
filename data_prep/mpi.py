"""``--mpi``: the same tokenize command under ``mpirun`` / ``srun --mpi=pmix``, one process per rank.

* every rank validates the arguments; any rank's failure stops all ranks before work starts
  (``allgather``), so no rank waits forever in a collective;
* input files are assigned to ranks by size (largest first to the least-loaded rank, ties to the
  lower rank) - deterministic, the same on every rank;
* each rank tokenizes its files into its own part directories (``part-NNNNN`` under the shared work
  dir; resumable exactly as in a single-process run);
* rank 0 gathers the part summaries, merges the parts **in input order** into the final prefix and
  writes the one manifest. Document order is input order, so the bytes equal a one-process run's.

The work dir (``PREFIX.work``, or ``DIR/<prefix basename>.data_prep-work`` with ``--work-dir DIR``) must
be on a filesystem every rank sees. Rank 0 creates and marks it (or refuses a directory that is not
data_prep's) and takes its lock before any rank writes there; see data_prep/parts.py.
"""
from __future__ import annotations

import sys
import time
import traceback

from data_prep.cli import UserError, log, set_log_prefix


def assign_files(sizes: list[int], ranks: int) -> list[int]:
    """Rank of each file: largest file first to the least-loaded rank (ties: lower rank)."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += max(sizes[i], 1)
    return owner


def _err(e: BaseException) -> str:
    if isinstance(e, UserError):
        return str(e)
    traceback.print_exc()
    return f"{type(e).__name__}: {e}"


def run_mpi(make_job) -> int:
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise UserError(f"--mpi needs mpi4py and an MPI library ({e})") from None
    import os

    from data_prep.parts import WorkLock, finalize, run_part
    from data_prep.progress import Progress
    from data_prep.tokenize import summary

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    set_log_prefix(f"data_prep.tokenize rank {rank}/{size}")
    t0 = time.monotonic()
    job, lock, err = None, None, None
    try:
        job = make_job()
        job.ranks = size
        if rank == 0:
            lock = WorkLock(job.work_dir, job.out_prefix).__enter__()     # creates and marks the work dir
    except BaseException as e:
        err = _err(e)
    errs = comm.allgather(err)
    try:
        if any(errs):
            if rank == 0:
                first = next(e for e in errs if e)
                print(f"error: {first}", flush=True, file=sys.stderr)
            return 2
        comm.Barrier()                      # rank 0 holds the lock before anyone writes
        owner = assign_files([os.path.getsize(p) for p in job.inputs], size)
        mine = [i for i, r in enumerate(owner) if r == rank]
        log(f"{len(mine)} of {len(job.inputs)} input file(s): {[job.inputs[i] for i in mine]}")
        metas, err = {}, None
        prog = Progress(sum(os.path.getsize(job.inputs[i]) for i in mine),
                        enabled=job.show_progress, interval=job.progress_interval,
                        label=f"rank {rank}", force_plain=rank != 0)
        try:
            for i in mine:
                metas[i] = run_part(job, i, prog)
        except BaseException as e:
            err = _err(e)
        finally:
            prog.close()
        gathered = comm.gather((err, metas), root=0)
        result = None
        if rank == 0:
            errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e]
            if errors:
                result = ("error", "; ".join(errors))
            else:
                allm = {}
                for _, m in gathered:
                    allm.update(m)
                try:
                    manifest = finalize(job, [allm[i] for i in range(len(job.inputs))], t0)
                    result = ("ok", summary(manifest))
                except BaseException as e:
                    result = ("error", _err(e))
        result = comm.bcast(result, root=0)
        if result[0] == "error":
            if rank == 0:
                print(f"error: {result[1]}", flush=True, file=sys.stderr)
            return 2
        if rank == 0:
            log(result[1])
        return 0
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)
