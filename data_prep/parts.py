"""Resumable runs: one partial shard per input file in a work directory, then one merge.

Layout (default work dir ``PREFIX.work``, next to the outputs so renames stay on one filesystem)::

    PREFIX.work/part-00000/       input 0: shard-all.{bin,idx,counts.npy} (or shard-<set>.* with
                 part.json        --split-by-set) and part.json (stats, input sha256, fingerprint)
    PREFIX.work/part-00001.tmp/   an input being tokenized (renamed to part-00001/ when complete)
    PREFIX.work/merged/           merge output, renamed to the final names at the very end

With ``--work-dir DIR`` the work dir is ``DIR/<prefix basename>.data_prep-work``: DIR itself is never
written to nor deleted. The work dir is ours only when it carries ``.data_prep-work.json`` (naming the
output prefix): we create and mark it (or mark an empty directory we find there); a non-empty directory
without the marker, or one marked for another prefix, is refused. Cleaning up removes only the entries
we write (``lock``, ``part-NNNNN[.tmp]``, ``merged``, the marker) and the directory if we created it.

A part is **reused** on a re-run when its ``part.json`` fingerprint (tokenizer sha256, dtype, options)
matches, its files are all there with the recorded sizes, and the input file's sha256 still matches.
Anything else is redone. Final names appear only at the end, by ``os.replace``: every ``.bin`` first,
then ``.counts.npy``, then the manifest, then every ``.idx`` (an ``.idx`` present means its ``.bin`` is
complete). Then the work dir is cleaned up (``--keep-work`` keeps it).

``--overwrite`` deletes only this prefix's own stale files: ``PREFIX.<slug>.bin/.idx/.counts.npy`` in
PREFIX's directory for set shards the previous manifest lists and this run does not write.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import re
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
WORK_MARKER = ".data_prep-work.json"
WORK_SUFFIX = ".data_prep-work"               # --work-dir DIR: DIR/<prefix basename>.data_prep-work
_OUR_WORK_ENTRY = re.compile(r"lock|merged|part-\d{5}(\.tmp)?|" + re.escape(WORK_MARKER) + r"\.tmp\d+")


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
    marker = {"format": "leviathan-data-prep-work/1", "output_prefix": mine, "created_dir": True,
              "note": "data_prep.tokenize work files; removed after a successful run (--keep-work keeps them)"}
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
        except OSError:                     # created meanwhile (another run): inspect it below
            os.unlink(tmp / WORK_MARKER)
            tmp.rmdir()
    if not work_dir.is_dir():
        raise UserError(f"work directory {work_dir} is not a directory; pass --work-dir DIR to work elsewhere")
    found = _read_marker(work_dir)
    if found is None:
        if any(work_dir.iterdir()):
            raise UserError(f"{work_dir} exists, is not empty and is not a data_prep work directory (no "
                            f"{WORK_MARKER}): refusing to use it; move its files away, or pass --work-dir DIR "
                            f"(work files then go to DIR/{os.path.basename(prefix)}{WORK_SUFFIX})")
        write_json_atomic(work_dir / WORK_MARKER, {**marker, "created_dir": False})
    elif found.get("output_prefix") != mine:
        raise UserError(f"work directory {work_dir} belongs to output prefix {found.get('output_prefix')}, "
                        f"not {mine}: pass another --work-dir (or remove {work_dir} if that run is over)")


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
        log(f"note: kept {work_dir} (with {left[0]}{' and more' if len(left) > 1 else ''}): data_prep "
            "did not write it")
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

    if job.overwrite:
        new = {o["prefix"] + e for o in outputs for e in (".bin", ".idx", ".counts.npy")}
        for f in stale_own_files(job.out_prefix):
            if f not in new:
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
        remove_work_dir(job.work_dir)
    return manifest


_SLUG = re.compile(r"[A-Za-z0-9._-]+")


def stale_own_files(prefix: str) -> list[str]:
    """The shards the manifest at PREFIX.manifest.json lists that are PREFIX's own by name:
    ``PREFIX[.<slug>].bin/.idx/.counts.npy`` in PREFIX's directory. A listed path elsewhere, or named for
    another prefix (e.g. ``PREFIX.<slug>`` that has a manifest of its own), is never returned."""
    try:
        prev = json.loads(Path(prefix + ".manifest.json").read_text())
        listed = [str(o["prefix"]) for o in prev.get("outputs", []) if isinstance(o, dict) and o.get("prefix")]
    except (OSError, ValueError, TypeError, AttributeError):
        return []
    d, base = os.path.dirname(os.path.abspath(prefix)), os.path.basename(prefix)
    found = []
    for p in listed:
        name = os.path.basename(p)
        if name != base and not (name.startswith(base + ".") and _SLUG.fullmatch(name[len(base) + 1:])):
            continue
        if os.path.realpath(os.path.dirname(os.path.abspath(p))) != os.path.realpath(d):
            continue
        own = os.path.join(os.path.dirname(prefix), name)
        if name != base and os.path.exists(own + ".manifest.json"):       # another run's prefix
            continue
        found += [own + e for e in (".bin", ".idx", ".counts.npy") if os.path.isfile(own + e)]
    return sorted(set(found))
