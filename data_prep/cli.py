"""Shared command-line plumbing: one-line user errors, logging, atomic writes, checksums."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path


class UserError(Exception):
    """A problem the user can fix (bad argument, missing or unreadable input, existing output).

    Command-line entry points print it as one line and exit with status 2, never as a traceback.
    """


_T0 = time.monotonic()
_PREFIX = "data_prep"


def set_log_prefix(prefix: str) -> None:
    global _PREFIX
    _PREFIX = prefix


_BAR = None          # an active tqdm bar: log lines are printed above it


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
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr, flush=True)
        return 130
    return int(rc or 0)


def sha256_file(path: str | os.PathLike, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write JSON to ``path`` via a temporary name and ``os.replace`` (never a half-written file)."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
