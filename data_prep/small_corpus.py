"""The small, real, multi-source corpus (the test and demo corpus) in The Pile's jsonl.zst format, in a directory
marked as ours; what ``python -m data_prep.make_corpus`` writes.

Every line is {"text": ..., "meta": {"pile_set_name": ...}}. No text is synthetic: ``github`` is the Python standard
library's own .py files (one document per file), ``pythondocs`` the Python 3.11 documentation sources (Debian
package python3.11-doc), ``dictionary`` GCIDE (Debian package dict-gcide), ~40 entries a document. :func:`build`
shuffles the documents with a seed, splits val/test/train (train in ``train_shards`` files) and writes the marker
first; :func:`clear_corpus` deletes only the files it writes, only from a marked directory.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import subprocess
import sysconfig
from pathlib import Path

import zstandard

from common.cli import UserError
from common.fileio import write_json_atomic

DOCS = Path("/usr/share/doc/python3.11/html/_sources")
GCIDE = Path("/usr/share/dictd/gcide.dict.dz")
SOURCES = ("github", "pythondocs", "dictionary")
PACKAGES = {"pythondocs": ("python3.11-doc", DOCS), "dictionary": ("dict-gcide", GCIDE)}
MARKER = ".data_prep-corpus.json"
_OURS = re.compile(r"(val|test)\.jsonl\.zst(\.tmp)?")
_OURS_TRAIN = re.compile(r"\d{2,}\.jsonl\.zst(\.tmp)?")


def is_ours(out_dir) -> bool:
    """Whether ``out_dir`` carries make_corpus's marker."""
    return (Path(out_dir) / MARKER).is_file()


def clear_corpus(out_dir) -> None:
    """Delete the files make_corpus writes (train/NN, val, test .jsonl.zst, their .tmp, the marker) from
    ``out_dir`` - only if it carries the marker - and ``train/`` if that leaves it empty. Other files stay."""
    out = Path(out_dir)
    if not out.exists():
        return
    if not is_ours(out):
        if out.is_dir() and not any(out.iterdir()):
            return
        raise UserError(
            f"{out} is not empty and was not written by data_prep.make_corpus (no {MARKER}): "
            "not deleting it; move it away or choose another output directory"
        )
    train = out / "train"
    for d, pattern in ((out, _OURS), (train, _OURS_TRAIN)):
        if d.is_dir():
            for p in d.iterdir():
                if pattern.fullmatch(p.name) and not p.is_dir():
                    p.unlink()
    if train.is_dir() and not any(train.iterdir()):
        train.rmdir()
    (out / MARKER).unlink()


def ensure_packages(sources) -> None:
    missing = [PACKAGES[s][0] for s in sources if s in PACKAGES and not PACKAGES[s][1].exists()]
    if missing:
        subprocess.run(["apt-get", "update", "-q"], check=False, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-q", *missing], check=True, stdout=subprocess.DEVNULL)


def github_docs():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield "Github", text


def python_docs():
    for path in sorted(DOCS.rglob("*.txt")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield "PythonDocs", text


def dictionary_docs(entries_per_doc=40):
    with gzip.open(GCIDE, "rt", encoding="utf-8", errors="replace") as f:
        raw = f.read()
    entries, current = [], []
    for line in raw.split("\n"):
        if line and not line[0].isspace() and current and current[-1] == "":
            entries.append("\n".join(current).strip())
            current = []
        current.append(line)
    entries.append("\n".join(current).strip())
    entries = [e for e in entries if e and not e.startswith("00-database")]
    for i in range(0, len(entries), entries_per_doc):
        yield "Dictionary", "\n\n".join(entries[i : i + entries_per_doc])


def write_jsonl_zst(path: Path, items) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh, zstandard.ZstdCompressor(level=3).stream_writer(fh) as w:
        for source, text in items:
            line = json.dumps({"text": text, "meta": {"pile_set_name": source}}, ensure_ascii=False)
            w.write(line.encode("utf-8") + b"\n")
    os.replace(tmp, path)


def summarize(items) -> str:
    counts: dict = {}
    for source, text in items:
        c = counts.setdefault(source, [0, 0])
        c[0] += 1
        c[1] += len(text.encode("utf-8"))
    return ", ".join(f"{k}: {v[0]} docs {v[1] / 1e6:.1f} MB" for k, v in sorted(counts.items()))


def build(
    out_dir, sources=SOURCES, val_fraction=0.01, seed=0, train_shards=1, install=False, quiet=False, max_bytes=None
) -> dict:
    """Write the corpus; returns {"train": [paths], "val": path, "test": path}."""
    sources = tuple(sources)
    for s in sources:
        if s not in SOURCES:
            raise UserError(f"unknown source {s!r}; choose from {', '.join(SOURCES)}")
    if install:
        ensure_packages(sources)
    for s in sources:
        if s in PACKAGES and not PACKAGES[s][1].exists():
            pkg, path = PACKAGES[s]
            raise UserError(
                f"missing {path}: install the Debian package {pkg} (or pass --install, or leave {s} out of --sources)"
            )
    if train_shards < 1:
        raise UserError("--train-shards must be >= 1")
    gens = {"github": github_docs, "pythondocs": python_docs, "dictionary": dictionary_docs}
    docs = [d for s in SOURCES if s in sources for d in gens[s]()]
    if not docs:
        raise UserError("no documents found")
    random.Random(seed).shuffle(docs)
    if max_bytes:
        kept, total = [], 0
        for d in docs:
            if total >= max_bytes:
                break
            kept.append(d)
            total += len(d[1].encode("utf-8"))
        docs = kept
    n_val = max(1, int(len(docs) * val_fraction))
    train = docs[2 * n_val :]
    splits = {"val": docs[:n_val], "test": docs[n_val : 2 * n_val]}
    per = -(-len(train) // train_shards)
    for k in range(train_shards):
        splits[f"train/{k:02d}"] = train[k * per : (k + 1) * per]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        out / MARKER,
        {
            "format": "leviathan-data-prep-corpus/1",
            "note": (  # before any data
                "written by python -m data_prep.make_corpus; --overwrite deletes only train/NN.jsonl.zst, "
                "val.jsonl.zst, test.jsonl.zst and this file"
            ),
        },
    )
    (out / "train").mkdir(exist_ok=True)
    result = {"train": [], "val": None, "test": None}
    for name, items in splits.items():
        path = out / f"{name}.jsonl.zst"
        write_jsonl_zst(path, items)
        if name.startswith("train/"):
            result["train"].append(str(path))
        else:
            result[name] = str(path)
        if not quiet:
            print(f"{name}: {summarize(items)}")
    return result
