"""The final outputs of a tokenize run: merging the parts into them, the manifest, publishing, --overwrite.

Final names appear only at the end, by ``os.replace``: every ``.bin`` first, then ``.counts.npy``, then the
manifest, then every ``.idx`` (an ``.idx`` present means its ``.bin`` is complete). Then the work dir is
cleaned up (``--keep-work`` keeps it).

``--overwrite`` deletes only this prefix's own stale files: ``PREFIX.<slug>.bin/.idx/.counts.npy`` in
PREFIX's directory for set shards the previous manifest lists and this run does not write.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.cli import UserError
from common.fileio import write_json_atomic
from data_prep.file_tokenizer import set_slug
from data_prep.manifest import Manifest, output_entry, part_totals, sum_counts
from data_prep.parts import Job, part_dir
from data_prep.shards import merge_shards
from data_prep.workdir import remove_work_dir


def existing_outputs(prefix: str) -> list[str]:
    names = [prefix + s for s in (".bin", ".idx", ".counts.npy", ".manifest.json")]
    found = [n for n in names if os.path.exists(n)]
    esc = glob.escape(prefix)
    found += sorted(glob.glob(esc + ".*.idx") + glob.glob(esc + ".*.bin"))
    return found


@dataclass
class _Merged:
    """One shard pair merged from the parts under WORK/merged (``tmp``), to be renamed to ``prefix``."""

    set: str | None
    prefix: str
    tmp: str
    documents: int
    tokens: int


def plain_text_hint(skipped: dict, records: int) -> str:
    """The fix when most records were skipped as invalid JSON (plain text read as jsonl), else ""."""
    bad = int(skipped.get("invalid_json", 0))
    return "the input looks like plain text: add --format text" if bad and 2 * bad > records else ""


def finalize(job: Job, metas: list, t_start: float) -> Manifest:
    """Merge the parts (``metas``: their part.json records, in input order) into the final prefix(es), write the
    manifest, publish, clean up."""
    merged = job.work_dir / "merged"
    shutil.rmtree(merged, ignore_errors=True)
    merged.mkdir(parents=True)
    if not any(m["shards"] for m in metas):
        skipped = sum_counts(m["skipped"] for m in metas)
        hint = plain_text_hint(skipped, sum(m["records"] for m in metas))
        raise UserError(
            "no documents to write: every record was skipped or filtered out "
            f"(skipped: {skipped}, filtered: {sum_counts(m['filtered_sets'] for m in metas)}); "
            f"kept the work dir {job.work_dir}/ for a resume (a successful run removes it)"
            + ("; " + hint if hint else "")
        )
    outputs = _merge_parts(job, metas, merged)
    total_counts = _total_counts(job, outputs, merged)
    manifest = _manifest(job, metas, outputs, t_start)
    write_json_atomic(merged / "manifest.json", manifest.to_json())
    if job.overwrite:
        new = {o.prefix + e for o in outputs for e in (".bin", ".idx", ".counts.npy")}
        for f in stale_own_files(job.out_prefix):
            if f not in new:
                os.unlink(f)
    _publish(job.out_prefix, outputs, total_counts, merged / "manifest.json")
    if not job.keep_work:
        remove_work_dir(job.work_dir)
    return manifest


def _merge_parts(job: Job, metas: list, merged: Path) -> list[_Merged]:
    """One merged shard pair per output: all documents, or one per set (``PREFIX.<slug>``) with --split-by-set."""
    keys = [""] if not job.split_by_set else sorted({k for m in metas for k in m["shards"]})
    outputs, used = [], set()
    for key in keys:
        parts = [str(part_dir(job, i) / m["shards"][key]["file"]) for i, m in enumerate(metas) if key in m["shards"]]
        suffix = "" if key == "" else "." + set_slug(key)
        while suffix and suffix in used:
            suffix += "_"
        used.add(suffix)
        tmp = str(merged / ("out" + suffix))
        info = merge_shards(parts, tmp, job.dtype, job.tok.vocab_size)
        outputs.append(_Merged(key or None, job.out_prefix + suffix, tmp, info["documents"], info["tokens"]))
    return outputs


def _total_counts(job: Job, outputs: list[_Merged], merged: Path) -> str | None:
    """With --split-by-set: the summed counts of all sets, saved under WORK/merged; else None (the one output's
    counts are PREFIX.counts.npy)."""
    if not job.split_by_set:
        return None
    total = np.zeros(job.tok.vocab_size, np.int64)
    for o in outputs:
        total += np.load(o.tmp + ".counts.npy")
    path = str(merged / "total.counts.npy")
    np.save(path, total)
    return path


def _manifest(job: Job, metas: list, outputs: list[_Merged], t_start: float) -> Manifest:
    return Manifest(
        command=job.command,
        created_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        tokenizer=job.tok.describe(),
        dtype=job.dtype.name,
        eod_id=job.tok.eod_id,
        options={**job.options, "split_by_set": job.split_by_set},
        documents=sum(o.documents for o in outputs),
        tokens=sum(o.tokens for o in outputs),
        outputs=[output_entry(o.set, o.prefix, o.documents, o.tokens) for o in outputs],
        counts=job.out_prefix + ".counts.npy",
        manifest=job.out_prefix + ".manifest.json",
        workers=job.workers,
        encode_chunk_bytes=job.chunk_bytes,
        ranks=job.ranks,
        elapsed_s=round(time.monotonic() - t_start, 3),
        **part_totals(metas),
    )


def _publish(prefix: str, outputs: list[_Merged], total_counts: str | None, manifest: Path) -> None:
    """Final names, .idx last: an .idx under its final name means the pair is complete."""
    for o in outputs:
        os.replace(o.tmp + ".bin", o.prefix + ".bin")
    for o in outputs:  # split by set: every output is PREFIX.<slug>, and PREFIX.counts.npy is the total
        os.replace(o.tmp + ".counts.npy", o.prefix + ".counts.npy")
    if total_counts is not None:
        os.replace(total_counts, prefix + ".counts.npy")
    os.replace(manifest, prefix + ".manifest.json")
    for o in outputs:
        os.replace(o.tmp + ".idx", o.prefix + ".idx")


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
        if name != base and not (name.startswith(base + ".") and _SLUG.fullmatch(name[len(base) + 1 :])):
            continue
        if os.path.realpath(os.path.dirname(os.path.abspath(p))) != os.path.realpath(d):
            continue
        own = os.path.join(os.path.dirname(prefix), name)
        if name != base and os.path.exists(own + ".manifest.json"):  # another run's prefix
            continue
        found += [own + e for e in (".bin", ".idx", ".counts.npy") if os.path.isfile(own + e)]
    return sorted(set(found))
