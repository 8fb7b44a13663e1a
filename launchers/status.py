"""``python -m launchers.slurm status RUN_DIR`` (also ``python -m launchers.status RUN_DIR``): where a SLURM run
stands, from its run directory alone.

For one run directory: the newest job's SLURM state (``squeue``, else ``scontrol show job``; SLURM forgets finished
jobs after MinJobAge), the earlier jobs, the latest complete checkpoint (``<checkpoint.dir>/latest``), the last
``train/loss``, ``perf/tokens_per_s`` and ``valid/loss`` from the TensorBoard events, and the tail of the job's
log. For a sweep directory (no records of its own, runs in its subdirectories): one line per run. ``--json``
prints the same as one JSON object. The report is :mod:`launchers.run_status`'s.

Torch-free: the config loader and TensorBoard's reader are imported when used.
"""

from __future__ import annotations

import argparse
import json
import sys

from common import cli
from launchers.run_status import StatusError, collect_any, format_run, format_sweep


def build_parser(prog: str = "python -m launchers.slurm status") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Where a SLURM run stands: job state, latest checkpoint, last metrics, log tail. For a sweep "
        "directory (runs in its subdirectories): one line per run.",
        epilog=f"example: {prog} runs/gpt-125m --lines 50",
    )
    cli.add_run(
        p,
        "the same as RUN_DIR",
        dest="run_dir",
        required=True,
        positional_help="the run's directory (train.out_dir), or a sweep directory",
    )
    p.add_argument("--lines", type=int, default=20, metavar="N", help="log lines to show (default 20)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    return p


def main(argv: list[str] | None = None) -> int:
    return cli.run_main(_status, build_parser().parse_args(argv), errors=(StatusError,))


def _status(args) -> int:
    info = collect_any(args.run_dir, max(0, args.lines))
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(format_sweep(info) if "sweep" in info else format_run(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
