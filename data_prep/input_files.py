"""Which input files a run reads, and how: glob expansion in order (refusing missing, unreadable or directory
inputs) and the ``jsonl`` / ``text`` / ``parquet`` format and zstd or gzip compression of each file."""

from __future__ import annotations

import glob
import os

from common.cli import UserError


def expand_inputs(patterns: list[str]) -> list[str]:
    """Expand globs in order (each pattern's matches sorted); a pattern matching nothing is an error."""
    out, seen = [], set()
    for pat in patterns:
        if glob.has_magic(pat):
            matches = sorted(p for p in glob.glob(pat, recursive=True) if os.path.isfile(p))
            if not matches:
                raise UserError(f"input pattern matches no file: {pat}")
        else:
            if not os.path.exists(pat):
                raise UserError(f"input file not found: {pat}")
            if os.path.isdir(pat):
                raise UserError(f"input is a directory (give files or a glob like {pat}/*.jsonl.zst): {pat}")
            matches = [pat]
        for m in matches:
            key = os.path.realpath(m)
            if key not in seen:
                seen.add(key)
                out.append(m)
    for p in out:
        if not os.access(p, os.R_OK):
            raise UserError(f"input file is not readable: {p}")
    return out


COMPRESSIONS = {".zst": "zst", ".gz": "gz"}  # file name suffix -> the reader's decompressor (data_prep/sources.py)
FORMATS = ("jsonl", "text", "parquet")  # --format, besides auto
JSONL = (".jsonl", ".json", ".ndjson")


def input_format(path: str, fmt: str = "auto") -> tuple[str, str]:
    """(``jsonl`` | ``text`` | ``parquet``, compression: ``zst`` | ``gz`` | ``""``) from ``--format`` and the file
    name (auto: ``*.parquet`` is Parquet, ``*.jsonl|json|ndjson`` jsonl, anything else plain text)."""
    suffix = next((s for s in COMPRESSIONS if path.endswith(s)), "")
    compressed = COMPRESSIONS.get(suffix, "")
    base = path[: -len(suffix)] if suffix else path
    if fmt == "auto":
        fmt = "parquet" if base.endswith(".parquet") else "jsonl" if base.endswith(JSONL) else "text"
    if fmt not in FORMATS:
        raise UserError(f"unknown --format {fmt!r}; choose auto, {', '.join(FORMATS)}")
    if fmt == "parquet" and compressed:
        raise UserError(f"{path}: a Parquet file compresses its own pages; give it without .zst/.gz (decompress it)")
    return fmt, compressed
