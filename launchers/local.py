"""Run a Python program on N local ranks: ``python launchers/local.py -n 2 -- -m leviathan_pretrain.train ...``.

Each rank is ``python <args>`` with the usual rank variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``), in its own process group.

- Signals: SIGTERM and SIGUSR1 are forwarded to every rank (the trainer finishes its step, checkpoints and
  exits 75). The first Ctrl-C (SIGINT) is forwarded as SIGTERM (a clean, checkpointed stop); a second one
  kills every rank.
- Failure: when a rank exits with a non-zero code, the others get ``--grace`` seconds (they are usually
  blocked in a collective with the dead rank), then their whole process groups are killed.
- Exit code: 0 if every rank succeeded; else the first failing rank's code (a rank killed by signal S
  gives 128 + S, as a shell reports it). 75 from the trainer means "stopped with a checkpoint, re-run".
"""

from __future__ import annotations

import argparse
import sys

from launchers.local_ranks import Launcher
from leviathan_pretrain.parallel.ports import free_port  # torch-free: the launcher starts in milliseconds


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python launchers/local.py",
        description=__doc__.split("\n")[0],
        epilog="example: python launchers/local.py -n 2 -- -m leviathan_pretrain.train "
        "--config configs/tiny-cpu-lev.yaml parallel.tensor_parallel=2",
    )
    ap.add_argument("-n", "--nprocs", type=int, default=2, help="number of ranks (default 2)")
    ap.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
    ap.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds the other ranks get after one fails, before they are killed (default 30)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS per rank when not set in the environment (default: cores / n)",
    )
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then the arguments to python, e.g. -m module ...")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    ns = ap.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    if not args:
        ap.error("nothing to run: give the python arguments after --, e.g. -- -m leviathan_pretrain.train --help")
    if ns.nprocs < 1:
        ap.error("-n must be >= 1")
    return Launcher(ns.nprocs, args, ns.master_port or free_port(), ns.grace, ns.threads).run()


if __name__ == "__main__":
    sys.exit(main())
