"""One tokenize run, the same for one process and for ``--mpi`` (data_prep/comm.py says which):

* every rank builds the job (validating the arguments); rank 0 creates and marks the work dir (or refuses
  one that is not data_prep's) and takes its lock. A failure on any rank stops all ranks before work starts;
* input files are assigned to ranks by size (largest first to the least-loaded rank, ties to the lower
  rank) - deterministic, the same on every rank; with one process it has them all;
* each rank tokenizes its files into its own part directories (``part-NNNNN`` under the work dir,
  resumable: data_prep/parts.py);
* rank 0 merges the parts **in input order** into the final prefix and writes the one manifest
  (data_prep/outputs.py). Document order is input order, so the bytes equal a one-process run's.

Under MPI the work dir (``PREFIX.work``, or ``DIR/<prefix basename>.data_prep-work`` with ``--work-dir DIR``)
must be on a filesystem every rank sees.
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack, closing
from typing import Callable

from data_prep.comm import Comm
from data_prep.console import log
from data_prep.manifest import Manifest
from data_prep.outputs import finalize
from data_prep.parts import Job, run_part
from data_prep.progress import Progress
from data_prep.workdir import WorkLock


def assign_files(sizes: list[int], ranks: int) -> list[int]:
    """Rank of each file: largest file first to the least-loaded rank (ties: lower rank)."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += max(sizes[i], 1)
    return owner


def run_job(make_job: Callable[[], Job], comm: Comm) -> Manifest | None:
    """Build the job on every rank, tokenize, merge on rank 0; the manifest on rank 0, None elsewhere.

    Errors end the run as ``comm`` says: they propagate with one process, under MPI every rank raises
    :class:`data_prep.comm.RanksFailed`."""
    with ExitStack() as stack:
        # rank 0 holds the lock before any rank writes: all_ranks returns once every rank has set up
        job = comm.all_ranks(lambda: _set_up(make_job, comm, stack))
        t0 = time.monotonic()  # the manifest's elapsed_s: from here (after setting up) to the end
        return comm.gather_to_root(
            lambda: _tokenize_my_files(job, comm),
            lambda metas: finalize(job, _in_input_order(metas, len(job.inputs)), t0),
        )


def _set_up(make_job: Callable[[], Job], comm: Comm, stack: ExitStack) -> Job:
    job = make_job()
    job.ranks = comm.size
    if comm.rank == 0:
        stack.enter_context(WorkLock(job.work_dir, job.out_prefix))  # creates and marks the work dir
    return job


def _tokenize_my_files(job: Job, comm: Comm) -> dict[int, dict]:
    """This rank's parts: {input index: part.json record}."""
    owner = assign_files([os.path.getsize(p) for p in job.inputs], comm.size)
    mine = [i for i, r in enumerate(owner) if r == comm.rank]
    named = {}
    if comm.ranked:
        log(f"{len(mine)} of {len(job.inputs)} input file(s): {[job.inputs[i] for i in mine]}")
        named = {"label": f"rank {comm.rank}", "force_plain": comm.rank != 0}  # only rank 0 draws a bar
    progress = Progress(
        sum(os.path.getsize(job.inputs[i]) for i in mine),
        enabled=job.show_progress,
        interval=job.progress_interval,
        **named,
    )
    with closing(progress):
        return {i: run_part(job, i, progress) for i in mine}


def _in_input_order(per_rank: list[dict[int, dict]], n: int) -> list[dict]:
    merged: dict[int, dict] = {}
    for metas in per_rank:
        merged.update(metas)
    return [merged[i] for i in range(n)]
