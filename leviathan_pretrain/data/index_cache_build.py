"""The data index cache built ahead of training, in one CPU process (``python -m leviathan_pretrain.build_data_cache``,
whose docstring says what it does for a config): the shard checks, megatron-core's index files through the trainer's
own code path, built in a private staging folder inside the cache dir and renamed into place (each index set's
``description.txt`` last), and the stamp (:mod:`.index_cache`); :func:`build_cache` returns a report of the steps
with their seconds and memory, and the files built or reused, which :func:`print_report` prints.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from leviathan_pretrain.data import datasets as D
from leviathan_pretrain.data import index_cache as C
from leviathan_pretrain.data.index_cache import BLENDED_FILES, GPT_FILES
from leviathan_pretrain.parallel import groups


def _proc_status(key: str) -> float | None:
    """``VmRSS`` / ``VmHWM`` of this process in MiB (Linux), else None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class StepMeter:
    """Seconds and memory of each step: resident set before it and its own peak (Linux resets the peak
    counter through ``/proc/self/clear_refs``; elsewhere the peak is the process's so far)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.memory: dict[str, dict] = {}

    @contextlib.contextmanager
    def step(self, name: str):
        before = _proc_status("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - t
            peak = _proc_status("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
            self.memory[name] = {"rss_before_mib": before, "peak_mib": peak}

    def peak(self) -> float:
        return max([m["peak_mib"] for m in self.memory.values()] + [_proc_status("VmRSS") or 0.0])


def _npy_intact(path: Path) -> bool:
    """The ``.npy`` header is readable and the file holds all the data it announces."""
    try:
        np.load(path, mmap_mode="r", allow_pickle=True)
        return True
    except (OSError, ValueError, EOFError):
        return False


def _stage_existing(cdir: Path, stage: Path) -> list[str]:
    """Symlink the cache dir's complete, intact index sets into ``stage``, so megatron-core finds them and only
    loads them. An index set (``HASH-Class-split-*``) is linked only when all its files are there and intact:
    megatron rebuilds a set with any file missing, writing every file of it, and must never write through a
    link into the real cache. Returns the names of damaged files (an earlier build killed mid-write)."""

    sets: dict[str, dict[str, Path]] = {}
    for f in cdir.iterdir():
        parts = f.name.split("-", 3)
        if f.is_file() and not f.name.startswith(".") and len(parts) == 4 and parts[1].endswith("Dataset"):
            sets.setdefault("-".join(parts[:3]), {})[parts[3]] = f
    damaged = []
    for base, files in sets.items():
        bad = [f.name for f in files.values() if f.suffix == ".npy" and not _npy_intact(f)]
        damaged += bad
        want = BLENDED_FILES if base.split("-")[1] == "BlendedDataset" else GPT_FILES
        if bad or set(files) != set(want):
            continue
        for f in files.values():
            os.symlink(f.resolve(), stage / f.name)
    return damaged


def build_cache(cfg, config_label: str = "", log=print) -> dict:
    """Checks, index build and stamp for ``cfg``; returns a report (steps with seconds and memory, files)."""
    m = StepMeter()
    with m.step("import megatron-core"):  # imported here: its import cost is a reported step
        import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
    with m.step("shard checks (data_summary)"):
        summary = D.data_summary(cfg)
    eod = summary["eod_id"]
    cdir = C.cache_dir(cfg)
    for p, s in summary["shards"].items():
        log(
            f"  shard {p}: {s['documents']:,} documents, {s['tokens']:,} tokens, max token id "
            f"{s['max_token_id']} (from {s['max_id_source'] or 'nowhere: no counts.npy, not scanned'})"
        )
    was_complete, why = C.cache_status(cfg, eod)
    log(
        f"  cache {cdir}: " + ("complete (stamp matches); loading it to check" if was_complete else f"to build ({why})")
    )

    cdir.mkdir(parents=True, exist_ok=True)
    for old in cdir.glob(".leviathan-build-*"):
        log(
            f"  note: {old} is the staging folder of a build_data_cache that did not finish (killed?); "
            "nothing reads it, delete it when no build_data_cache runs"
        )
    stage = Path(tempfile.mkdtemp(prefix=".leviathan-build-", dir=cdir))
    try:
        damaged = _stage_existing(cdir, stage)
        with m.step("index build or load (megatron-core)"), groups.one_process_group():
            splits = D.build_splits(cfg, eod, True, path_to_cache=str(stage))
        names = C.index_files(splits)
        new = [n for n in names if (stage / n).is_file() and not (stage / n).is_symlink()]
        clash = [n for n in new if n in damaged]
        if clash:
            raise D.ShardError(
                f"data cache {cdir}: {cdir / clash[0]} already exists but is damaged (truncated: an "
                "earlier build was probably killed while writing it); this command never deletes "
                "files it did not create: delete it and run again"
            )
        with m.step("rename into place + stamp"):
            # the .npy files first, each index set's description.txt last: megatron counts a set as cached
            # only when all its files exist
            for n in sorted(new, key=lambda n: n.endswith("description.txt")):
                if not (cdir / n).exists():  # else another builder just made it (same content): keep theirs
                    os.replace(stage / n, cdir / n)
            stamp = C.write_stamp(cfg, eod, names, "build_data_cache")
        described = [
            {"split": split, "class": type(ds).__name__, "samples": len(ds)}
            for split, ds in zip(("train", "valid", "test"), splits)
            if ds is not None
        ]
        del splits
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # our staging folder: symlinks and leftovers of ours only
    files = {n: {"bytes": (cdir / n).stat().st_size, "built": n in new} for n in names}
    return {
        "config": config_label,
        "cache_dir": str(cdir),
        "stamp": str(stamp),
        "was_complete": was_complete,
        "steps_s": m.seconds,
        "steps_memory": m.memory,
        "datasets": described,
        "files": files,
        "peak_rss_mib": m.peak(),
        "shards": summary["shards"],
    }


def print_report(rep: dict, log=print, verbose: bool = False) -> None:
    for d in rep["datasets"]:
        log(f"  {d['split']:5s} {d['class']}: {d['samples']:,} samples")
    built = {n: f for n, f in rep["files"].items() if f["built"]}
    log(
        f"  index files: {len(built)} built, {len(rep['files']) - len(built)} reused, "
        f"{sum(f['bytes'] for f in rep['files'].values()) / 2**20:,.1f} MiB in all"
    )
    by_kind: dict[tuple, list] = {}
    for n, f in rep["files"].items():  # HASH-Class-split-what
        _, kind, split, what = n.split("-", 3)
        by_kind.setdefault((split, kind, what), []).append(f)
    for (split, kind, what), fs in by_kind.items():
        if verbose or not what.endswith(".txt"):
            log(
                f"    {split:5s} {kind:14s} {what:26s} x{len(fs):<3d} {sum(f['bytes'] for f in fs) / 2**20:10.2f} MiB"
                f"  ({sum(f['built'] for f in fs)} built)"
            )
    if verbose:
        for n, f in rep["files"].items():
            log(f"    {'built ' if f['built'] else 'reused'} {f['bytes'] / 2**20:10.2f} MiB  {n}")
    for name, s in rep["steps_s"].items():
        mem = rep.get("steps_memory", {}).get(name, {})
        log(f"  {name:38s} {s:8.2f} s   peak RSS {mem.get('peak_mib') or 0:8,.0f} MiB")
    log(f"  peak RSS {rep['peak_rss_mib']:,.0f} MiB")
    log(f"  cache dir {rep['cache_dir']}")
    log(f"  stamp     {rep['stamp']}")
