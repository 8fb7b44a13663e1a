"""The data half of the demo as steps: a small real corpus (``small_corpus``), a SentencePiece tokenizer, megatron-core
train/val shards, each reused when its output is there. ``run_demo(out)`` runs them and returns the paths (the
command: ``python -m data_prep.data_demo``; the whole demo, ``lev demo``, appends training to it).

Writes OUT/corpus/ (make_corpus's, marked), OUT/tokenizer/tokenizer.{model,vocab,_meta.json} and
OUT/data/{train,val}.{bin,idx,counts.npy,manifest.json}. Nothing else in OUT is touched, ``force`` included: it
replaces these files, and deletes a corpus directory only if make_corpus marked it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from common.cli import UserError
from data_prep import small_corpus, tokenize_cli, train_tokenizer
from data_prep.console import human_bytes
from data_prep.manifest import Manifest


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _remove_empty_dir(d: Path) -> None:
    if d.exists():
        try:
            d.rmdir()
        except OSError:
            raise UserError(f"{d} holds files the demo did not write: move them away (or use another --out)") from None


def step_corpus(out: Path, max_mb: float | None, force: bool = False) -> dict:
    corpus = out / "corpus"
    paths = {
        "train": [str(corpus / "train" / "00.jsonl.zst")],
        "val": str(corpus / "val.jsonl.zst"),
        "test": str(corpus / "test.jsonl.zst"),
    }
    t = time.monotonic()
    if not force and all(os.path.exists(p) for p in (*paths["train"], paths["val"], paths["test"])):
        _say(f"1/3 corpus: reusing {corpus}")
        return paths
    tmp = out / "corpus.tmp"
    for d in (tmp, corpus):  # only make_corpus's own files, only in a dir it marked
        small_corpus.clear_corpus(d)
        _remove_empty_dir(d)
    small_corpus.build(
        tmp, sources=["github"], val_fraction=0.02, quiet=True, max_bytes=int(max_mb * 1e6) if max_mb else None
    )
    os.replace(tmp, corpus)
    sizes = {"train": os.path.getsize(paths["train"][0]), "val": os.path.getsize(paths["val"])}
    _say(
        f"1/3 corpus: the standard library's .py files as Pile 'Github' documents -> {corpus}/ "
        f"(train {human_bytes(sizes['train'])}, val {human_bytes(sizes['val'])} compressed) "
        f"in {time.monotonic() - t:.1f} s"
    )
    return paths


def step_tokenizer(out: Path, corpus: dict, vocab_size: int, sample_mb: float, force: bool = False) -> str:
    model = out / "tokenizer" / "tokenizer.model"
    if model.exists() and not force:
        _say(f"2/3 tokenizer: reusing {model}")
        return str(model)
    t = time.monotonic()
    train_tokenizer.main(
        [
            "--input",
            *corpus["train"],
            "--vocab-size",
            str(vocab_size),
            "--sample-bytes",
            str(sample_mb),
            "--out",
            str(model.parent),
            "--overwrite",
        ]
    )
    meta = json.loads((model.parent / "tokenizer_meta.json").read_text())
    _say(
        f"2/3 tokenizer: BPE, {meta['vocab_size']:,} pieces, EOD id {meta['eod_id']}, trained on "
        f"{meta['sample']['documents']:,} documents ({human_bytes(meta['sample']['bytes'])}) -> {model} "
        f"in {time.monotonic() - t:.1f} s"
    )
    return str(model)


def step_shards(out: Path, corpus: dict, model: str, workers: int | None, force: bool = False) -> dict:
    prefixes = {"train": str(out / "data" / "train"), "val": str(out / "data" / "val")}
    for split, prefix in prefixes.items():
        inputs = corpus["train"] if split == "train" else [corpus["val"]]
        if not force and os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".manifest.json"):
            _say(f"3/3 shards: reusing {prefix}.bin/.idx")
            continue
        t = time.monotonic()
        args = ["--input", *inputs, "--tokenizer", model, "--out", prefix, "--overwrite"]
        if workers:
            args += ["--workers", str(workers)]
        if tokenize_cli.main(args) != 0:
            raise UserError(f"tokenizing {split} failed")
        m = Manifest.from_json(json.loads(Path(prefix + ".manifest.json").read_text()))
        _say(
            f"3/3 shards: {split}: {m.documents:,} documents, {m.tokens:,} tokens ({m.dtype}) "
            f"-> {prefix}.bin/.idx/.counts.npy/.manifest.json in {time.monotonic() - t:.1f} s"
        )
    return prefixes


def run_demo(
    out,
    *,
    vocab_size: int = 8000,
    sample_mb: float = 8.0,
    max_mb: float | None = None,
    workers: int | None = None,
    force: bool = False,
) -> dict:
    """Run the data steps; returns ``{"out", "corpus", "tokenizer", "train_prefix", "val_prefix"}``.
    ``force`` redoes every step (replacing only the demo's own files; nothing else in ``out`` is deleted)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    corpus = step_corpus(out, max_mb, force)
    model = step_tokenizer(out, corpus, vocab_size, sample_mb, force)
    prefixes = step_shards(out, corpus, model, workers, force)
    result = {
        "out": str(out),
        "corpus": corpus,
        "tokenizer": model,
        "train_prefix": prefixes["train"],
        "val_prefix": prefixes["val"],
    }
    _say(f"done in {time.monotonic() - t0:.1f} s: tokenizer {model}, train {prefixes['train']}, val {prefixes['val']}")
    return result
