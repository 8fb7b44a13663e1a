"""The exit codes of every command, in one place (torch-free: the launchers and data_prep read them too).

- ``0``  done
- ``1``  any other error (the trainer: raised on one rank, it ends every rank at once)
- ``2``  bad input: a config key, a file, an option (one ``error:`` line naming it); for the trainer also a run
  directory held by another live trainer, a lost run lock, an unusable checkpoint (the line names the holder or
  the file)
- ``3``  the trainer's divergence guard stopped it (``train.max_bad_steps`` consecutive non-finite steps, a loss or
  gradient-norm spike, a non-finite last step): nothing saved after the last healthy step, ``latest`` names the
  last good checkpoint
- ``75`` the trainer stopped early *with* a checkpoint: SIGTERM/SIGUSR1 (preemption, SLURM's warning before the
  time limit), ``train.exit_at_step`` or ``train.exit_after_minutes``. Re-run the same command to continue; the
  SLURM launcher requeues on this code (75 is ``EX_TEMPFAIL``).
- ``76`` the trainer lost a peer without knowing why: a collective timed out (``parallel.timeout_minutes``: a
  stalled rank, a cut network, a node that died without closing its connections). No checkpoint was written after
  it; the run resumes from the latest complete one. The SLURM launcher requeues on this code too (76 is
  ``EX_PROTOCOL``, "remote error"). A peer whose connection *closed* (its process exited or was killed) makes the
  others exit 1: the peer's own code says why.
"""

import os

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_REQUEUE = 75
EXIT_PEER_LOST = 76

# The SLURM job script's folder for the codes its ranks chose (launchers/sbatch.py): srun reports the highest code of
# its tasks, so a rank that exits 76 (lost a peer) while a stalled one is SIGKILLed after it makes the step 137, and
# the job would not be requeued. A rank that exits 75 or 76 writes its code there first; the script reads them.
STEP_CODES_ENV = "LEV_STEP_CODES"


def record_step_code(code: int) -> None:
    """Write ``code`` (75 or 76) as this rank's file in ``$LEV_STEP_CODES`` (no-op outside a SLURM job; never
    raises: the exit it precedes must happen whatever the file system does)."""
    folder = os.environ.get(STEP_CODES_ENV)
    if not folder or code not in (EXIT_REQUEUE, EXIT_PEER_LOST):
        return
    name = f"rank-{os.environ.get('RANK', '0')}"
    try:
        tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(f"{code}\n")
        os.replace(tmp, os.path.join(folder, name))
    except OSError:
        pass
