"""Shared command-line plumbing: one-line user errors, log lines (above a progress bar), run_main, and the
human-readable sizes and counts those lines print. File helpers are in data_prep/fileio.py."""

from __future__ import annotations

import sys

from leviathan_pretrain.exit_codes import EXIT_BAD_INPUT


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


def run_main(main, argv=None) -> int:
    """Run ``main(argv)``; turn :class:`UserError` and Ctrl-C into a one-line message and exit code."""
    try:
        rc = main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr, flush=True)
        return 130
    return int(rc or 0)


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
