"""The per-node command of a ``--launch torchrun`` SLURM job: torchrun itself, with two changes for SLURM.

    python -m launchers.torchrun_node [torchrun's arguments]   (e.g. --nnodes 2 --nproc-per-node 8 ...)

- **The workers' exit code passes through.** torchrun exits 1 whatever its workers exited with; the job script
  must see the trainer's 75 ("stopped with a checkpoint: requeue me"). This runs torchrun's own
  ``torch.distributed.run.run`` and exits with the first failed worker's code (128 + S for a signal S).
- **Its code stands, whatever SIGTERM comes.** ``srun --kill-on-bad-exit=1`` ends every task of the step (one
  SIGTERM to every process) as soon as one node's task exits 75, at any moment of the others' lives. torchrun's own
  SIGTERM handler raises in the agent (exit 1, the workers' code lost), and Python puts back the default action of
  a signal it handled when its interpreter shuts down, where that SIGTERM killed the agent: srun then reported the
  step's code as 143 ("Force Terminated") and the job was not requeued (seen in CI). So SIGTERM is this module's:
  passed on to the workers (a SIGTERM sent to the agent alone still reaches the trainer, which checkpoints and
  exits 75; under SLURM they get it themselves too), the agent keeps waiting for them, and the signal is ignored
  from the moment ``run`` ends, whichever way. One that comes before the workers exist (during the rendezvous)
  reaches nobody; under SLURM the SIGKILL that follows it after ``KillWait`` ends the step.
- **SIGUSR1 is the workers' business.** SLURM's warning signal (``--signal=USR1@LEAD``) reaches every process of
  the step, torchrun's agent included, where its default action would kill the agent and its workers with it.
  The agent ignores it; the workers install the trainer's handler (checkpoint, exit 75). SIGINT, SIGHUP and
  SIGQUIT keep torchrun's own handling (its agent ends the workers).

The per-task rank variables of ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``, ...) describe the agent, not the
workers, and are removed so that nothing below mistakes a node index for a rank.
"""

from __future__ import annotations

import os
import signal
import sys

import psutil

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
    # torchrun installs its handlers when it starts the workers, for the signals of --signals-to-handle
    handled = [s.strip() for s in args.signals_to_handle.split(",")]
    args.signals_to_handle = ",".join(s for s in handled if s and s != "SIGTERM")
    signal.signal(signal.SIGTERM, pass_on_sigterm)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
        print(f"[torchrun_node] worker {rank} exited with code {code}", file=sys.stderr, flush=True)
        return code or 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the code is decided: a SIGTERM now must not change it
    return 0


def pass_on_sigterm(signum, frame) -> None:
    """The agent's SIGTERM handler: send it on to the workers (this process's children) and go on waiting."""
    children = psutil.Process().children()
    for child in children:
        try:
            child.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    global _said
    if not _said:
        _said = True
        print(
            f"[torchrun_node] SIGTERM: passed on to {len(children)} worker(s); waiting for them to exit",
            file=sys.stderr,
            flush=True,
        )


_said = False


if __name__ == "__main__":
    sys.exit(main())
