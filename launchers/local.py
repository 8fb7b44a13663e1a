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
import os
import signal
import subprocess
import sys
import time

from common.exit_codes import EXIT_REQUEUE
from leviathan_pretrain.parallel.ports import free_port  # torch-free: the launcher starts in milliseconds


def exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


class Launcher:
    def __init__(self, nprocs: int, args: list[str], port: int, grace: float, threads: int | None):
        self.nprocs, self.args, self.port, self.grace, self.threads = nprocs, args, port, grace, threads
        self.procs: list[subprocess.Popen] = []
        self.interrupts = 0

    def env(self, rank: int) -> dict:
        e = dict(os.environ)
        e.update(
            RANK=str(rank),
            WORLD_SIZE=str(self.nprocs),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(self.nprocs),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.port),
        )
        if "OMP_NUM_THREADS" not in os.environ:
            e["OMP_NUM_THREADS"] = str(self.threads or max(1, (os.cpu_count() or 1) // self.nprocs))
        for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
            e.pop(k, None)  # we are the launcher now: no outer launcher's rank may leak into discovery
        return e

    def forward(self, signum, frame=None) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                print("[launcher] second interrupt: killing all ranks", file=sys.stderr, flush=True)
                self.kill_all()
                return
            signum = signal.SIGTERM
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def run(self) -> int:
        for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(s, self.forward)
        try:
            for rank in range(self.nprocs):
                self.procs.append(
                    subprocess.Popen([sys.executable, *self.args], env=self.env(rank), start_new_session=True)
                )
            first_fail, fail_time = None, None
            while any(p.poll() is None for p in self.procs):
                for rank, p in enumerate(self.procs):
                    rc = p.poll()
                    if rc not in (None, 0) and first_fail is None:
                        first_fail, fail_time = rank, time.monotonic()
                        stopped = exit_code(rc) == EXIT_REQUEUE  # a clean stop with a checkpoint (Ctrl-C, SIGTERM)
                        print(
                            f"[launcher] rank {rank} stopped with a checkpoint (exit {EXIT_REQUEUE}: run the same "
                            "command to resume); waiting for the others"
                            if stopped
                            else f"[launcher] rank {rank} exited with code {exit_code(rc)}; stopping the others "
                            f"within {self.grace:.0f} s",
                            file=sys.stderr,
                            flush=True,
                        )
                if first_fail is not None and time.monotonic() - fail_time > self.grace:
                    self.kill_all()
                    break
                time.sleep(0.1)
        finally:
            self.kill_all()
        codes = [exit_code(p.returncode if p.returncode is not None else -signal.SIGKILL) for p in self.procs]
        if first_fail is not None:
            return codes[first_fail]
        return next((c for c in codes if c != 0), 0)


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
