"""Small file helpers shared by data_prep and the trainer: checksums and atomic (temp name + rename) writes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def sha256_file(path: str | os.PathLike, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def write_bytes_atomic(path: str | os.PathLike, data: bytes, sync_dir: bool = False) -> None:
    """Write ``data`` to ``path`` via ``<name>.tmp<pid>``, fsync and ``os.replace`` (never a half-written file);
    ``sync_dir``: also fsync the directory, so the rename itself survives a crash (commit points)."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    if sync_dir:
        fsync_path(path.parent)


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory: its entries, e.g. a rename, survive a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike) -> dict:
    """A JSON object from ``path``; ``{}`` when it is missing, unreadable or not a JSON object (the callers' records
    are rebuilt or taken as absent then)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as JSON (indent 1, UTF-8, keys in their order, newline-terminated) atomically."""
    write_bytes_atomic(path, (json.dumps(obj, indent=1, ensure_ascii=False, sort_keys=False) + "\n").encode())
