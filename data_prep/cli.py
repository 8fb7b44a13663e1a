"""Shared command-line plumbing: one-line user errors, log lines (above a progress bar), run_main, and the
human-readable sizes and counts those lines print. File helpers are in data_prep/fileio.py."""

from __future__ import annotations

import sys

from data_prep import options as cli


class UserError(Exception):
    """A problem the user can fix (bad argument, missing or unreadable input, existing output).

    Command-line entry points print it as one line and exit with status 2, never as a traceback.
    """


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


def run_main(main, argv=None) -> int:
    """Run ``main(argv)``; :class:`UserError` and Ctrl-C become a one-line message and exit code
    (:func:`data_prep.options.run_main`)."""
    return cli.run_main(main, argv, errors=(UserError,))


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
