"""Tokenizer training on a seeded, bounded sample (:mod:`data_prep.tokenizer_sample`): the options of
``python -m data_prep.train_tokenizer`` (:class:`TokenizerTrainingOptions`), SentencePiece's training, the byte-level
BPE's (:mod:`data_prep.train_bpe`) for ``--kind bpe``, and the files written.

SentencePiece's model settings: BPE (or unigram), byte fallback, digits split, identity normalization, whitespace
kept as is (no extra-space removal, no dummy prefix, whitespace-only pieces allowed) so any UTF-8 text - code
included - decodes back exactly; unk=0, bos=1, eos=2 (the end-of-document token data_prep.tokenize appends), no pad.
The sample is fed to it line by line (lines longer than ``max_line_bytes`` are cut).

Writes DIR/tokenizer.model, DIR/tokenizer.vocab and DIR/tokenizer_meta.json (settings, sample provenance: inputs
with sha256, seed, documents/bytes seen and sampled, per-set counts, sample sha256); ``--kind bpe`` writes
DIR/tokenizer.json and DIR/tokenizer_meta.json. The file that makes a tokenizer usable is written last. The
vocabulary comes out at exactly ``vocab_size`` or training fails with a :class:`common.cli.UserError` that says
how many pieces the sample supports.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import sentencepiece as spm

from common.cli import UserError
from common.fileio import write_bytes_atomic, write_json_atomic
from data_prep.console import human_bytes, log
from data_prep.tokenizer_sample import Sample, draw_sample

FILES = ("tokenizer.model", "tokenizer.vocab", "tokenizer_meta.json")


@dataclass
class TokenizerTrainingOptions:
    """What ``train`` needs; sizes in the command line's units (MB, KB), as given."""

    input: list
    vocab_size: int
    output: str
    kind: str = "sentencepiece"
    model_type: str = "bpe"
    sample_bytes: float = 256.0  # MB
    seed: int = 0
    max_doc_bytes: float = 100.0  # KB
    max_line_bytes: int = 4096
    max_record_bytes: float = 512.0  # MB
    character_coverage: float = 0.9999
    user_defined_symbols: str = ""
    threads: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    json_key: str = "text"
    format: str = "auto"
    text_unit: str = "file"
    include_sets: list | None = None
    exclude_sets: list | None = None
    preset: str | None = None
    overwrite: bool = False
    verbose: bool = False
    argv: list | None = None  # the command line, for the meta file (default: sys.argv[1:])

    @classmethod
    def from_args(cls, args: argparse.Namespace, argv=None) -> TokenizerTrainingOptions:
        return cls(**vars(args), argv=list(argv) if argv is not None else sys.argv[1:])

    def check(self) -> None:
        if self.vocab_size < 300:
            raise UserError(f"--vocab-size {self.vocab_size} is too small (byte fallback alone needs 256 + 3 pieces)")
        if self.sample_bytes <= 0 or self.max_doc_bytes <= 0 or self.max_line_bytes < 16 or self.max_record_bytes <= 0:
            raise UserError(
                "--sample-bytes, --max-doc-bytes and --max-record-bytes must be > 0, --max-line-bytes >= 16"
            )
        if self.kind == "bpe" and self.model_type != "bpe":
            raise UserError(f"--model-type {self.model_type} is SentencePiece's; --kind bpe trains a byte-level BPE")
        model = Path(self.output) / ("tokenizer.json" if self.kind == "bpe" else "tokenizer.model")
        if model.exists() and not self.overwrite:
            raise UserError(f"output already exists: {model} (pass --overwrite to replace it)")

    @property
    def max_record(self) -> int:
        return max(1, int(self.max_record_bytes * 1e6))


def sentences(sample: list, max_line: int):
    step = max(1, max_line // 4)  # chars; <= max_line bytes in UTF-8
    for _, doc, _ in sample:
        for line in doc.decode("utf-8", errors="ignore").split("\n"):
            if not line:
                continue
            if len(line) <= step:
                yield line
            else:
                for i in range(0, len(line), step):
                    yield line[i : i + step]


def trainer_settings(opts: TokenizerTrainingOptions) -> dict:
    """SentencePieceTrainer settings (the model settings in the module docstring)."""
    settings = dict(
        model_type=opts.model_type,
        vocab_size=opts.vocab_size,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_by_whitespace=True,
        character_coverage=opts.character_coverage,
        max_sentence_length=opts.max_line_bytes,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        num_threads=max(1, opts.threads),
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=True,
    )
    if opts.user_defined_symbols:
        settings["user_defined_symbols"] = [s for s in opts.user_defined_symbols.split(",") if s]
    return settings


def train_model(sample: Sample, settings: dict, opts: TokenizerTrainingOptions) -> bytes:
    """The serialized model; a SentencePiece failure (e.g. a vocabulary too large for the sample) is a UserError."""
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(sample.docs, opts.max_line_bytes),
            model_writer=model,
            minloglevel=0 if opts.verbose else 2,
            **settings,
        )
    except RuntimeError as e:
        msg = str(e)
        m = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", msg)
        if m:
            raise UserError(
                f"--vocab-size {opts.vocab_size} is too large for this sample: SentencePiece can "
                f"build at most {int(m.group(2)):,} pieces from {human_bytes(sample.reservoir.bytes)} "
                "of text; raise --sample-bytes (or lower --vocab-size)"
            ) from None
        raise UserError(f"SentencePiece training failed: {msg.splitlines()[-1][:300]}") from None
    return model.getvalue()


def tokenizer_meta(
    opts: TokenizerTrainingOptions,
    sample: Sample,
    settings: dict,
    proto: bytes,
    model: dict,
    t_train: float,
) -> dict:
    """tokenizer_meta.json: settings, versions and the sample's provenance."""
    res = sample.reservoir
    return {
        "format": "leviathan-tokenizer-meta/1",
        "command": [
            "python",
            "-m",
            "data_prep.train_tokenizer",
            *(opts.argv if opts.argv is not None else sys.argv[1:]),
        ],
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kind": opts.kind,
        "model_sha256": hashlib.sha256(proto).hexdigest(),
        **model,
        "trainer_settings": settings,
        "sample": {
            "seed": opts.seed,
            "budget_bytes": res.budget,
            "max_doc_bytes": res.max_doc,
            "max_line_bytes": opts.max_line_bytes,
            "max_record_bytes": opts.max_record,
            "documents_seen": res.seen_docs,
            "bytes_seen": res.seen_bytes,
            "documents": len(sample.docs),
            "bytes": res.bytes,
            "sha256": sample.sha256,
            "sets": sample.sets,
            "skipped": dict(sample.skipped),
            "filter": sample.set_filter.describe(),
            "preset": opts.preset,
        },
        "inputs": sample.inputs,
        "elapsed_s": {"read_and_sample": round(sample.seconds, 2), "train": round(t_train, 2)},
    }


def write_sentencepiece(out: Path, proto: bytes, sp: spm.SentencePieceProcessor, meta: dict) -> None:
    """meta, vocab, then the model: a tokenizer.model present means the three are complete."""
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "tokenizer_meta.json", meta)
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.vocab_size()))
    write_bytes_atomic(out / "tokenizer.vocab", vocab.encode("utf-8"))
    write_bytes_atomic(out / "tokenizer.model", proto)


def train(opts: TokenizerTrainingOptions) -> dict:
    """Sample, train, write DIR/tokenizer.{model,vocab} and tokenizer_meta.json; returns the meta."""
    t0 = time.monotonic()
    opts.check()
    sample = draw_sample(opts)
    res = sample.reservoir
    log(
        f"sampled {len(sample.docs):,} of {res.seen_docs:,} docs, {human_bytes(res.bytes)} of "
        f"{human_bytes(res.seen_bytes)}; training {'byte-level BPE' if opts.kind == 'bpe' else opts.model_type} "
        f"vocab {opts.vocab_size:,}"
    )
    if opts.kind == "bpe":
        return _train_bpe(opts, sample, t0)
    settings = trainer_settings(opts)
    t1 = time.monotonic()
    proto = train_model(sample, settings, opts)
    t_train = time.monotonic() - t1
    sp = spm.SentencePieceProcessor(model_proto=proto)
    if sp.vocab_size() != opts.vocab_size:
        raise UserError(f"SentencePiece produced {sp.vocab_size()} pieces instead of {opts.vocab_size}")
    info = {
        "sentencepiece_version": spm.__version__,
        "vocab_size": sp.vocab_size(),
        "eod_id": sp.eos_id(),
        "eod_piece": sp.id_to_piece(sp.eos_id()),
    }
    meta = tokenizer_meta(opts, sample, settings, proto, info, t_train)
    out = Path(opts.output)
    write_sentencepiece(out, proto, sp, meta)
    log(
        f"wrote {out / 'tokenizer.model'} ({opts.model_type}, {sp.vocab_size():,} pieces, eos/EOD id "
        f"{sp.eos_id()}) in {time.monotonic() - t0:.1f} s (sampling {sample.seconds:.1f} s, training {t_train:.1f} s)"
    )
    return meta


def _train_bpe(opts: TokenizerTrainingOptions, sample: Sample, t0: float) -> dict:
    """--kind bpe: train, then write DIR/tokenizer_meta.json and DIR/tokenizer.json (last: present = complete)."""
    from data_prep.train_bpe import describe, train_bpe

    t1 = time.monotonic()
    text, settings = train_bpe(sample, opts)
    t_train = time.monotonic() - t1
    data = text.encode("utf-8")
    info = describe(text)
    meta = tokenizer_meta(opts, sample, settings, data, info, t_train)
    out = Path(opts.output)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "tokenizer_meta.json", meta)
    write_bytes_atomic(out / "tokenizer.json", data)
    log(
        f"wrote {out / 'tokenizer.json'} (byte-level BPE, {info['vocab_size']:,} ids, EOD {info['eod_piece']} id "
        f"{info['eod_id']}) in {time.monotonic() - t0:.1f} s (sampling {sample.seconds:.1f} s, "
        f"training {t_train:.1f} s)"
    )
    return meta
