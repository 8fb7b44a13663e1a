"""Resumable runs: one partial shard per input file in the work directory (data_prep/workdir.py).

Layout::

    WORK/part-00000/       input 0: shard-all.{bin,idx,counts.npy} (or shard-<set>.* with
         part.json         --split-by-set) and part.json (stats, input sha256, fingerprint)
    WORK/part-00001.tmp/   an input being tokenized (renamed to part-00001/ when complete)
    WORK/merged/           merge output (data_prep/outputs.py), renamed to the final names at the very end

A part is **reused** on a re-run when its ``part.json`` fingerprint (tokenizer fingerprint, dtype, options)
matches, its files are all there with the recorded sizes, and the input file's sha256 still matches.
Anything else is redone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.fileio import sha256_file, write_json_atomic
from data_prep import __version__
from data_prep.console import log, per_file
from data_prep.file_tokenizer import FileTokenizer
from data_prep.tokenizer import Tokenizer


@dataclass
class Job:
    inputs: list
    tok: Tokenizer
    dtype: np.dtype
    out_prefix: str
    work_dir: Path
    workers: int
    split_by_set: bool
    reader_kwargs: dict
    options: dict  # what goes into the fingerprint and the manifest
    overwrite: bool = False
    keep_work: bool = False
    command: list = field(default_factory=list)
    progress_interval: float = 30.0
    show_progress: bool = True
    ranks: int = 1
    chunk_bytes: int = 0  # cut long documents for encoding (0: never); output unchanged

    def fingerprint(self) -> str:
        fp = {
            "version": __version__,
            "tokenizer_sha256": self.tok.fingerprint,  # the file sha256 for SentencePiece, as before
            "dtype": self.dtype.name,
            "split_by_set": self.split_by_set,
            "eod_id": self.tok.eod_id,
            **self.options,
        }
        return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()


def part_dir(job: Job, i: int) -> Path:
    return job.work_dir / f"part-{i:05d}"


def _files_intact(d: Path, meta: dict) -> bool:
    for info in meta.get("shards", {}).values():
        for ext, size in info.get("sizes", {}).items():
            p = d / (info["file"] + ext)
            if not p.is_file() or p.stat().st_size != size:
                return False
    return True


def load_reusable(job: Job, i: int) -> dict | None:
    d = part_dir(job, i)
    try:
        meta = json.loads((d / "part.json").read_text())
    except (OSError, ValueError):
        return None
    path = job.inputs[i]
    if meta.get("fingerprint") != job.fingerprint() or meta.get("bytes") != os.path.getsize(path):
        return None
    if not _files_intact(d, meta) or sha256_file(path) != meta.get("sha256"):
        return None
    return meta


def run_part(job: Job, i: int, progress=None) -> dict:
    """Tokenize input ``i`` into its part directory (or reuse a matching one); returns part.json."""
    path = job.inputs[i]
    meta = load_reusable(job, i)
    if meta is not None:
        log(f"reusing {part_dir(job, i)} for {path} (input checksum and settings match)")
        meta["reused"] = True
        return meta
    final = part_dir(job, i)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ft = FileTokenizer(
        job.tok,
        job.dtype,
        workers=job.workers,
        split_by_set=job.split_by_set,
        reader_kwargs=job.reader_kwargs,
        progress=progress,
        chunk_bytes=job.chunk_bytes,
    )
    meta = ft.run(path, str(tmp))
    for info in meta["shards"].values():
        info["sizes"] = {ext: (tmp / (info["file"] + ext)).stat().st_size for ext in (".bin", ".idx", ".counts.npy")}
    meta["fingerprint"] = job.fingerprint()
    write_json_atomic(tmp / "part.json", meta)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    meta["reused"] = False
    if per_file(i, len(job.inputs)):
        counts = f"{meta['documents']:,} docs, {meta['tokens']:,} tokens in {meta['elapsed_s']:.1f} s"
        log(f"done {path} ({i + 1}/{len(job.inputs)}): {counts}")
    return meta
