"""The machine a process runs on, in one line: what a run's training log records in its ``layout`` record (each
segment of a resumed run its own), so that a time printed from a run names the machine it was measured on, even
when the page is written elsewhere (benchmarks/results_small.py). Torch-free unless the device is a GPU."""

from __future__ import annotations

import os
import platform
from importlib import metadata


def _first(path: str, key: str) -> str | None:
    try:
        with open(path) as fh:
            return next((x.split(":", 1)[1].strip() for x in fh if x.startswith(key)), None)
    except OSError:
        return None


def cores() -> int:
    """The cores this process may run on (a SLURM step's share, not the node's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 0


def describe(device_type: str = "cpu") -> str:
    """E.g. ``2 cores (AMD EPYC), 23 GiB, Linux-6.18...-glibc2.36, Python 3.11.7, torch 2.13.0+cpu, no GPU``."""
    cpu = _first("/proc/cpuinfo", "model name") or platform.processor() or "?"
    mem = _first("/proc/meminfo", "MemTotal")
    try:
        torch = f"torch {metadata.version('torch')}"
    except metadata.PackageNotFoundError:
        torch = "no torch"
    gpu = "no GPU"
    if device_type == "cuda":
        import torch as th

        gpu = f"{th.cuda.device_count()} x {th.cuda.get_device_name(0)}"
    size = f", {int(mem.split()[0]) // 2**20} GiB" if mem else ""
    return f"{cores()} cores ({cpu}){size}, {platform.platform()}, Python {platform.python_version()}, {torch}, {gpu}"
