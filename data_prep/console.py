"""data_prep's console: ``[data_prep]`` log lines (above a progress bar, data_prep/progress.py), which input files
get a line of their own, and the human-readable sizes and counts those lines print. The one-line errors and
``run_main`` every command shares are in common/cli.py."""

from __future__ import annotations

import sys

_PREFIX = "data_prep"


def set_log_prefix(prefix: str) -> None:
    global _PREFIX
    _PREFIX = prefix


_BAR = None  # an active tqdm bar: log lines are printed above it


def set_active_bar(bar) -> None:
    global _BAR
    _BAR = bar


def log(msg: str) -> None:
    line = f"[{_PREFIX}] {msg}"
    if _BAR is not None:
        _BAR.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)


def per_file(i: int, n: int, first: int = 5) -> bool:
    """Whether input file ``i`` of ``n`` gets its own log line: the first ``first``, then about every tenth of the
    rest, and the last (a folder of thousands of files does not flood the terminal; the summary counts them all)."""
    return i < first or i == n - 1 or (i + 1) % max(1, n // 10) == 0


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000.0
    return f"{n:.1f} TB"


def human_count(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} G"
    if n >= 1e6:
        return f"{n / 1e6:.2f} M"
    if n >= 1e3:
        return f"{n / 1e3:.1f} k"
    return f"{int(n)}"
