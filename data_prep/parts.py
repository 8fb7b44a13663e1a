"""Resumable runs: one partial shard per input file in a work directory, then one merge.

Layout (default work dir ``PREFIX.work``, next to the outputs so renames stay on one filesystem)::

    PREFIX.work/part-00000/       input 0: shard-all.{bin,idx,counts.npy} (or shard-<set>.* with
                 part.json        --split-by-set) and part.json (stats, input sha256, fingerprint)
    PREFIX.work/part-00001.tmp/   an input being tokenized (renamed to part-00001/ when complete)
    PREFIX.work/merged/           merge output, renamed to the final names at the very end

A part is **reused** on a re-run when its ``part.json`` fingerprint (tokenizer sha256, dtype, options)
matches, its files are all there with the recorded sizes, and the input file's sha256 still matches.
Anything else is redone. Final names appear only at the end, by ``os.replace``: every ``.bin`` first,
then ``.counts.npy``, then the manifest, then every ``.idx`` (an ``.idx`` present means its ``.bin`` is
complete). Then the work dir is removed (``--keep-work`` keeps it).
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_prep import __version__
from data_prep.cli import UserError, log, sha256_file, write_json_atomic
from data_prep.pipeline import FileTokenizer, Tokenizer, set_slug
from data_prep.shards import merge_shards

MAX_EXAMPLES = 20


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
    options: dict                     # what goes into the fingerprint and the manifest
    overwrite: bool = False
    keep_work: bool = False
    command: list = field(default_factory=list)
    progress_interval: float = 30.0
    show_progress: bool = True
    ranks: int = 1
    chunk_bytes: int = 0              # cut long documents for encoding (0: never); output unchanged

    def fingerprint(self) -> str:
        fp = {"version": __version__, "tokenizer_sha256": self.tok.sha256, "dtype": self.dtype.name,
              "split_by_set": self.split_by_set, "eod_id": self.tok.eod_id, **self.options}
        return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()


def existing_outputs(prefix: str) -> list[str]:
    names = [prefix + s for s in (".bin", ".idx", ".counts.npy", ".manifest.json")]
    found = [n for n in names if os.path.exists(n)]
    esc = glob.escape(prefix)
    found += sorted(glob.glob(esc + ".*.idx") + glob.glob(esc + ".*.bin"))
    return found


class WorkLock:
    """An exclusive flock on WORK/lock: one run per output prefix at a time (released if killed)."""

    def __init__(self, work_dir: Path):
        self.path = Path(work_dir) / "lock"
        self.fd = None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
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
    ft = FileTokenizer(job.tok, job.dtype, workers=job.workers, split_by_set=job.split_by_set,
                       reader_kwargs=job.reader_kwargs, progress=progress, chunk_bytes=job.chunk_bytes)
    meta = ft.run(path, str(tmp))
    for info in meta["shards"].values():
        info["sizes"] = {ext: (tmp / (info["file"] + ext)).stat().st_size
                         for ext in (".bin", ".idx", ".counts.npy")}
    meta["fingerprint"] = job.fingerprint()
    write_json_atomic(tmp / "part.json", meta)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    meta["reused"] = False
    log(f"done {path}: {meta['documents']:,} docs, {meta['tokens']:,} tokens in {meta['elapsed_s']:.1f} s")
    return meta


def _sum_dicts(dicts) -> dict:
    tot: Counter = Counter()
    for d in dicts:
        tot.update(d)
    return dict(sorted(tot.items()))


def finalize(job: Job, metas: list, t_start: float) -> dict:
    """Merge the parts (input order) into the final prefix(es), write the manifest, clean up."""
    merged = job.work_dir / "merged"
    shutil.rmtree(merged, ignore_errors=True)
    merged.mkdir(parents=True)
    keys = [""] if not job.split_by_set else sorted({k for m in metas for k in m["shards"]})
    if not any(m["shards"] for m in metas):
        raise UserError("no documents to write: every record was skipped or filtered out "
                        f"(skipped: {_sum_dicts(m['skipped'] for m in metas)}, "
                        f"filtered: {_sum_dicts(m['filtered_sets'] for m in metas)})")
    outputs, used = [], set()
    for key in keys:
        parts = [str(part_dir(job, i) / m["shards"][key]["file"]) for i, m in enumerate(metas)
                 if key in m["shards"]]
        suffix = "" if key == "" else "." + set_slug(key)
        while suffix and suffix in used:
            suffix += "_"
        used.add(suffix)
        final = job.out_prefix + suffix
        tmp = str(merged / ("out" + suffix))
        info = merge_shards(parts, tmp, job.dtype, job.tok.vocab_size)
        outputs.append({"set": key or None, "prefix": final, "tmp": tmp, **info})
    total_counts = None
    if job.split_by_set:
        total_counts = np.zeros(job.tok.vocab_size, np.int64)
        for o in outputs:
            total_counts += np.load(o["tmp"] + ".counts.npy")
        np.save(str(merged / "total.counts.npy"), total_counts)

    sets: dict = {}
    for m in metas:
        for name, s in m["sets"].items():
            t = sets.setdefault(name, {"documents": 0, "tokens": 0, "text_bytes": 0})
            for k in t:
                t[k] += s[k]
    examples = [e for m in metas for e in m["skipped_examples"]][:MAX_EXAMPLES]
    manifest = {
        "format": "leviathan-data-prep-manifest/1",
        "data_prep_version": __version__,
        "command": job.command,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tokenizer": job.tok.describe(),
        "dtype": job.dtype.name,
        "eod_id": job.tok.eod_id,
        "options": {**job.options, "split_by_set": job.split_by_set},
        "documents": sum(o["documents"] for o in outputs),
        "tokens": sum(o["tokens"] for o in outputs),
        "tokens_note": "tokens include one EOD (eos) token per document",
        "text_bytes": sum(m["text_bytes"] for m in metas),
        "records": sum(m["records"] for m in metas),
        "sets": dict(sorted(sets.items())),
        "skipped": _sum_dicts(m["skipped"] for m in metas),
        "filtered_sets": _sum_dicts(m["filtered_sets"] for m in metas),
        "skipped_examples": examples,
        "documents_with_u2581": sum(m.get("u2581_docs", 0) for m in metas),
        "u2581_note": "SentencePiece decodes U+2581 as a space: these documents do not decode back exactly",
        "inputs": [{k: m[k] for k in ("path", "bytes", "sha256", "records", "documents", "tokens",
                                      "text_bytes", "skipped", "filtered_sets", "reused", "elapsed_s")}
                   for m in metas],
        "outputs": [{"set": o["set"], "prefix": o["prefix"], "documents": o["documents"], "tokens": o["tokens"],
                     "bin": o["prefix"] + ".bin", "idx": o["prefix"] + ".idx",
                     "counts": o["prefix"] + ".counts.npy"} for o in outputs],
        "counts": job.out_prefix + ".counts.npy",
        "manifest": job.out_prefix + ".manifest.json",
        "workers": job.workers,
        "encode_chunk_bytes": job.chunk_bytes,
        "ranks": job.ranks,
        "elapsed_s": round(time.monotonic() - t_start, 3),
    }
    write_json_atomic(merged / "manifest.json", manifest)

    old = []
    if job.overwrite and os.path.exists(job.out_prefix + ".manifest.json"):
        try:
            prev = json.loads(Path(job.out_prefix + ".manifest.json").read_text())
            old = [f for o in prev.get("outputs", []) for f in (o.get("bin"), o.get("idx"), o.get("counts"))]
        except (OSError, ValueError):
            pass
    new = {o["prefix"] + e for o in outputs for e in (".bin", ".idx", ".counts.npy")}
    for f in old:
        if f and f not in new and os.path.exists(f):
            os.unlink(f)
    # final names, .idx last: an .idx under its final name means the pair is complete
    for o in outputs:
        os.replace(o["tmp"] + ".bin", o["prefix"] + ".bin")
    for o in outputs:
        if o["prefix"] != job.out_prefix or total_counts is None:
            os.replace(o["tmp"] + ".counts.npy", o["prefix"] + ".counts.npy")
    if total_counts is not None:
        os.replace(str(merged / "total.counts.npy"), job.out_prefix + ".counts.npy")
    os.replace(merged / "manifest.json", job.out_prefix + ".manifest.json")
    for o in outputs:
        os.replace(o["tmp"] + ".idx", o["prefix"] + ".idx")
    if not job.keep_work:
        shutil.rmtree(job.work_dir, ignore_errors=True)
    return manifest
