"""The per-node command of a ``--launch torchrun`` SLURM job: torchrun itself, with two changes for SLURM.

    python -m launchers.torchrun_node [torchrun's arguments]   (e.g. --nnodes 2 --nproc-per-node 8 ...)

- **The workers' exit code passes through.** torchrun exits 1 whatever its workers exited with; the job script
  must see the trainer's 75 ("stopped with a checkpoint: requeue me"). This runs torchrun's own
  ``torch.distributed.run.run`` and exits with the first failed worker's code (128 + S for a signal S).
- **Its code stands.** Once the workers are done, a SIGTERM (``srun --kill-on-bad-exit=1`` cancelling the step
  because another node's task already exited 75) no longer turns this task's exit into "Terminated" (143).
- **SIGUSR1 is the workers' business.** SLURM's warning signal (``--signal=USR1@LEAD``) reaches every process of
  the step, torchrun's agent included, where its default action would kill the agent and its workers with it.
  The agent ignores it; the workers install the trainer's handler (checkpoint, exit 75). SIGTERM keeps torchrun's
  own handling (forwarded to the workers).

The per-task rank variables of ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``, ...) describe the agent, not the
workers, and are removed so that nothing below mistakes a node index for a rank.
"""

from __future__ import annotations

import os
import signal
import sys

SRUN_TASK_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NPROCS", "PMI_RANK", "PMIX_RANK")


def main(argv=None) -> int:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # inherited as "ignored" until the trainer installs its handler
    for var in SRUN_TASK_VARS:
        os.environ.pop(var, None)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    parser.prog = "python -m launchers.torchrun_node"
    args = parser.parse_args(argv)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
        print(f"[torchrun_node] worker {rank} exited with code {code}", file=sys.stderr, flush=True)
        return keep(code or 1)
    return keep(0)


def keep(code: int) -> int:
    """Exit with ``code`` even if a SIGTERM comes now: ``srun --kill-on-bad-exit=1`` cancels the step as soon as
    another node's task exits non-zero (a 75 too), and a SIGTERM during the interpreter's exit would make this task
    "Terminated" (143), which srun reports as the step's code instead of our 75."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(main())
