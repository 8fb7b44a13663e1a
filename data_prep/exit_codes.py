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

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_REQUEUE = 75
EXIT_PEER_LOST = 76
