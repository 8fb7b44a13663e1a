"""The work directory of a tokenize run: where it is, when it is ours, cleaning it up, one run at a time.

The default work dir is ``PREFIX.work``, next to the outputs so renames stay on one filesystem. With
``--work-dir DIR`` it is ``DIR/<prefix basename>.data_prep-work``: DIR itself is never written to nor deleted.
The work dir is ours only when it carries ``.data_prep-work.json`` (naming the output prefix): we create and
mark it (or mark an empty directory we find there); a non-empty directory without the marker, or one marked
for another prefix, is refused. Cleaning up removes only the entries we write (``lock``, ``part-NNNNN[.tmp]``,
``merged``, the marker) and the directory if we created it. What goes inside: data_prep/parts.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from pathlib import Path

from common.cli import UserError
from common.fileio import write_json_atomic
from data_prep.console import log

WORK_MARKER = ".data_prep-work.json"
WORK_SUFFIX = ".data_prep-work"  # --work-dir DIR: DIR/<prefix basename>.data_prep-work
_OUR_WORK_ENTRY = re.compile(r"lock|merged|part-\d{5}(\.tmp)?|" + re.escape(WORK_MARKER) + r"\.tmp\d+")


def work_dir_for(prefix: str, work_dir_option: str | None) -> Path:
    """``PREFIX.work``, or ``DIR/<prefix basename>.data_prep-work`` with ``--work-dir DIR``."""
    if work_dir_option:
        return Path(work_dir_option) / (os.path.basename(prefix) + WORK_SUFFIX)
    return Path(prefix + ".work")


def _read_marker(work_dir: Path) -> dict | None:
    try:
        m = json.loads((Path(work_dir) / WORK_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("format") == "leviathan-data-prep-work/1" else None


def claim_work_dir(work_dir: Path, prefix: str) -> None:
    """Create and mark the work dir, or check that an existing one is ours and for ``prefix``.

    A new directory is made under a temporary name with the marker inside, then renamed into place;
    an existing empty one is marked (and left in place at clean-up); anything else unmarked is refused."""
    work_dir = Path(work_dir)
    mine = os.path.realpath(prefix)
    marker = {
        "format": "leviathan-data-prep-work/1",
        "output_prefix": mine,
        "created_dir": True,
        "note": "data_prep.tokenize work files; removed after a successful run (--keep-work keeps them)",
    }
    if not os.path.lexists(work_dir):
        try:
            work_dir.parent.mkdir(parents=True, exist_ok=True)
            tmp = work_dir.with_name(f"{work_dir.name}.new{os.getpid()}")
            tmp.mkdir()
        except OSError as e:
            raise UserError(f"cannot create work directory {work_dir}: {e.strerror}") from None
        write_json_atomic(tmp / WORK_MARKER, marker)
        try:
            os.rename(tmp, work_dir)
        except OSError:  # created meanwhile (another run): inspect it below
            os.unlink(tmp / WORK_MARKER)
            tmp.rmdir()
    if not work_dir.is_dir():
        raise UserError(f"work directory {work_dir} is not a directory; pass --work-dir DIR to work elsewhere")
    found = _read_marker(work_dir)
    if found is None:
        if any(work_dir.iterdir()):
            raise UserError(
                f"{work_dir} exists, is not empty and is not a data_prep work directory (no "
                f"{WORK_MARKER}): refusing to use it; move its files away, or pass --work-dir DIR "
                f"(work files then go to DIR/{os.path.basename(prefix)}{WORK_SUFFIX})"
            )
        write_json_atomic(work_dir / WORK_MARKER, {**marker, "created_dir": False})
    elif found.get("output_prefix") != mine:
        raise UserError(
            f"work directory {work_dir} belongs to output prefix {found.get('output_prefix')}, "
            f"not {mine}: pass another --work-dir (or remove {work_dir} if that run is over)"
        )


def remove_work_dir(work_dir: Path) -> None:
    """Remove what data_prep wrote in its (marked) work dir; the directory too if we created it."""
    work_dir = Path(work_dir)
    marker = _read_marker(work_dir)
    if marker is None:
        log(f"note: not removing {work_dir}: it has no {WORK_MARKER}")
        return
    for entry in os.scandir(work_dir):
        if _OUR_WORK_ENTRY.fullmatch(entry.name):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass
    left = sorted(n for n in os.listdir(work_dir) if n != WORK_MARKER)
    if left:
        log(f"note: kept {work_dir} (with {left[0]}{' and more' if len(left) > 1 else ''}): data_prep did not write it")
        return
    os.unlink(work_dir / WORK_MARKER)
    if marker.get("created_dir", True):
        try:
            work_dir.rmdir()
        except OSError:
            pass


class WorkLock:
    """Claims the work dir (:func:`claim_work_dir`), then an exclusive flock on WORK/lock: one run per
    output prefix at a time (released if killed)."""

    def __init__(self, work_dir: Path, prefix: str):
        self.path = Path(work_dir) / "lock"
        self.prefix = prefix
        self.fd = None

    def __enter__(self):
        claim_work_dir(self.path.parent, self.prefix)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise UserError(f"another data_prep run is using {self.path.parent} (lock held)") from None
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
