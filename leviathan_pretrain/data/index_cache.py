"""The data index cache's bookkeeping: where it is, which index files megatron-core reads, and the stamp.

``<cache_dir>/leviathan_data_cache.json`` records, per configuration, a fingerprint of everything that
determines megatron-core's index files (shards with size and mtime, blend, split, sequence length, seed,
samples per split, EOD id, vocabulary, megatron-core version) and the files with their sizes. The trainer
(:func:`.data.build_datasets`) and ``python -m leviathan_pretrain.build_data_cache`` both read and write it
through this module; nothing here builds datasets.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
import time
from pathlib import Path

from common.fileio import read_json, write_bytes_atomic
from leviathan_pretrain.config import Config

STAMP = "leviathan_data_cache.json"  # in the cache dir: which index sets are complete, and their files


def cache_dir(cfg: Config) -> Path:
    """The megatron-core index cache (and this module's stamp and scan files): ``data.cache_dir`` or
    ``<train.out_dir>/data_cache``."""
    return Path(cfg.data.cache_dir or Path(cfg.train.out_dir) / "data_cache")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` under a temporary name in the same directory, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, text.encode())


def file_key(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def index_files(datasets) -> list[str]:
    """Names (in the cache dir) of the index files megatron-core reads for these datasets, as it names them."""
    out: list[str] = []
    for ds in datasets:
        if ds is None or not hasattr(ds, "unique_description_hash"):
            continue
        kind = type(ds).__name__
        if hasattr(ds, "datasets"):  # BlendedDataset
            base, affixes = f"{ds.unique_description_hash}-{kind}-{ds.split.name}", BLENDED_FILES
            out += [n for n in index_files(ds.datasets) if n not in out]
        else:  # GPTDataset
            base, affixes = f"{ds.unique_description_hash}-{kind}-{ds.index_split.name}", GPT_FILES
        out += [f"{base}-{a}" for a in affixes if f"{base}-{a}" not in out]
    return out


GPT_FILES = ("document_index.npy", "sample_index.npy", "shuffle_index.npy", "description.txt")
BLENDED_FILES = ("dataset_index.npy", "dataset_sample_index.npy", "description.txt")


def _megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "unknown"


def cache_fingerprint(cfg: Config, eod: int) -> dict:
    """Everything that determines the index files: shards (path, size, mtime), blend, split, sequence length,
    seed, samples per split, EOD id, vocabulary and the megatron-core version that builds them."""
    d = cfg.data
    shards = {}
    for p in list(d.prefixes) + list(d.valid_prefixes or []):
        shards[p] = {ext[1:]: file_key(Path(p + ext)) if Path(p + ext).is_file() else None for ext in (".bin", ".idx")}
    g = cfg.train.global_batch_size
    return {
        "data.prefixes": list(d.prefixes),
        "data.weights": list(d.weights) if d.weights else None,
        "data.split": d.split,
        "data.valid_prefixes": list(d.valid_prefixes) if d.valid_prefixes is not None else None,
        "model.seq_length": cfg.model.seq_length,
        "data.seed": d.seed,
        "samples (train.steps x train.global_batch_size, train.eval_iters x train.global_batch_size)": [
            cfg.train.steps * g,
            cfg.train.eval_iters * g,
        ],
        "eod id": eod,
        "model.vocab_size": cfg.model.vocab_size,
        "shard files (size, mtime)": shards,
        "megatron-core": _megatron_version(),
    }


def fingerprint_key(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def cache_status(cfg: Config, eod: int) -> tuple[bool, str]:
    """(True, "") when the stamp in the cache dir lists this configuration and all its files are there with
    the recorded sizes; else (False, why)."""
    cdir = cache_dir(cfg)
    fp = cache_fingerprint(cfg, eod)
    entries = read_json(cdir / STAMP).get("entries")
    if not isinstance(entries, dict) or not entries:
        return False, f"{cdir / STAMP} does not exist" if not (cdir / STAMP).exists() else f"{cdir / STAMP} is empty"
    entry = entries.get(fingerprint_key(fp))
    if isinstance(entry, dict):
        files = entry.get("files", {})
        bad = [n for n, size in files.items() if not (cdir / n).is_file() or (cdir / n).stat().st_size != size]
        if files and not bad:
            return True, ""
        return False, (
            f"{len(bad)} of its index files are missing or changed (e.g. {cdir / bad[0]})"
            if bad
            else "its stamp lists no files"
        )
    last = max((e for e in entries.values() if isinstance(e, dict)), key=lambda e: e.get("created", ""), default={})
    old = last.get("fingerprint", {})
    diff = [f"{k}: {old.get(k)!r} -> {fp[k]!r}" for k in fp if old.get(k) != fp[k]]
    return False, (
        f"it was built for another configuration ({'; '.join(diff)[:600]})"
        if diff
        else "no stamp entry matches this configuration"
    )


def write_stamp(cfg: Config, eod: int, files: list[str], built_by: str) -> Path:
    """Record this configuration and its index files (with sizes) as complete in the cache dir's stamp."""
    cdir = cache_dir(cfg)
    fp = cache_fingerprint(cfg, eod)
    stamp = read_json(cdir / STAMP)
    entries = stamp.get("entries") if isinstance(stamp.get("entries"), dict) else {}
    entries[fingerprint_key(fp)] = {
        "fingerprint": fp,
        "files": {n: (cdir / n).stat().st_size for n in files},
        "built_by": built_by,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    atomic_write_text(cdir / STAMP, json.dumps({"format": 1, "entries": entries}, indent=1))
    return cdir / STAMP


def command_for(cfg: Config) -> str:
    """The ``build_data_cache`` command for this run: this process's own arguments when it was started as
    ``leviathan_pretrain.train`` (without the ``--local_rank`` a launcher appends), else the resolved config
    the trainer writes (``<out_dir>/config.json``)."""
    if Path(sys.argv[0]).name == "train.py" and Path(sys.argv[0]).parent.name == "leviathan_pretrain":
        args, skip = [], False
        for a in sys.argv[1:]:
            if skip or a.startswith(("--local_rank", "--local-rank")):
                skip = a in ("--local_rank", "--local-rank")  # its value is the next argument
                continue
            args.append(a)
        return shlex.join(["python", "-m", "leviathan_pretrain.build_data_cache", *args])
    resolved = Path(cfg.train.out_dir) / "config.json"
    if resolved.is_file():
        return f"python -m leviathan_pretrain.build_data_cache --config {shlex.quote(str(resolved))}"
    return "python -m leviathan_pretrain.build_data_cache --config FILE key=value ... (this run's arguments)"
