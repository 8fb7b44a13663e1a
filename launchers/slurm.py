"""Submit training to SLURM in one command: ``python -m launchers.slurm {submit,sweep,pipeline,status} ...``.

- ``submit``: validate the config and the geometry (plan + memory estimate), render an sbatch script, save it and
  the resolved config in the run directory, ``sbatch --parsable`` it; print the job id, log and TensorBoard paths.
- ``sweep``: one job array, one config (variant) per element, each with its own run directory.
- ``pipeline``: preprocessing (an MPI job running ``data_prep.tokenize --mpi``) then training, linked with
  ``--dependency=afterok``.
- ``status RUN_DIR``: job state, requeues, latest checkpoint, last loss and tokens/s, the log tail.

Preemption and time limits: the job asks for SIGUSR1 ``--signal-lead`` seconds before its limit; every rank
checkpoints and exits 75; the job script requeues itself (``scontrol requeue``) up to ``--max-requeues`` times and
the requeued job resumes from the latest checkpoint. Full reference: docs/launchers.md.
Exit codes: 0 submitted (or printed, with --dry-run); 2 refused (config, geometry, memory, paths); 1 sbatch failed.
"""

from __future__ import annotations

import sys

from common.cli import run_main
from launchers import status
from launchers.job_files import SbatchFailed
from launchers.job_spec import Refused, Request
from launchers.sbatch import ScriptError
from launchers.slurm_args import parse
from launchers.submit import cmd_pipeline, cmd_submit, cmd_sweep
from leviathan_pretrain.config import ConfigError


def cmd_status(run_dir: str, lines: int, json: bool) -> int:
    return status.main([run_dir, "--lines", str(lines)] + (["--json"] if json else []))


def main(argv=None) -> int:
    # ScriptError: a path an sbatch script cannot carry
    return run_main(_command, parse(argv, __doc__), errors=(Refused, ConfigError, ScriptError))


def _command(ns) -> int:
    handler = {"submit": cmd_submit, "sweep": cmd_sweep, "pipeline": cmd_pipeline}
    try:
        if ns.command == "status":
            return cmd_status(ns.run_dir, ns.lines, ns.json)
        return handler[ns.command](Request.of(ns))
    except SbatchFailed as e:
        print(f"error: sbatch refused the job: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
