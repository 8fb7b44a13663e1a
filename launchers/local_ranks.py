"""N local ranks of one Python program (what ``python launchers/local.py`` runs): :class:`Launcher` starts each rank
with the rank variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``,
``MASTER_PORT``) in its own process group, forwards SIGTERM and SIGUSR1 to every rank (the first SIGINT as
SIGTERM, a second kills them all), gives the others ``grace`` seconds once one fails, then kills their process
groups, and returns the first failing rank's code (128 + S for a signal S; 75 "stopped with a checkpoint").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from common.exit_codes import EXIT_REQUEUE


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
