"""Train a tokenizer on a bounded, seeded random sample of documents: SentencePiece (default) or, with --kind bpe,
a byte-level BPE tokenizer.json with the Hugging Face tokenizers library (GPT-2 / GPT-NeoX / Llama 3 style).

  python -m data_prep.train_tokenizer --input 'pile/train/0[0-2].jsonl.zst' --vocab-size 50000 --out tok/
  python -m data_prep.train_tokenizer --kind bpe --input 'pile/train/0[0-2].jsonl.zst' --vocab-size 50000 --out bpe/

One pass over the inputs keeps a uniform random sample of documents within --sample-bytes (bottom-k
reservoir over seeded random keys: memory stays at the budget, the sample depends only on the seed
and the input order). Documents longer than --max-doc-bytes contribute a seeded random window; input
records longer than --max-record-bytes are skipped (record_too_long) without being held in memory.
The sample is fed to SentencePiece line by line (lines longer than --max-line-bytes are cut).

Model settings: BPE (or --model-type unigram), byte fallback, digits split, identity normalization,
whitespace kept as is (no extra-space removal, no dummy prefix, whitespace-only pieces allowed) so
any UTF-8 text - code included - decodes back exactly; unk=0, bos=1, eos=2 (the end-of-document
token data_prep.tokenize appends), no pad.

--kind bpe: the ByteLevel pre-tokenizer over the 256 byte symbols (any UTF-8 text round-trips), <|endoftext|> as
the EOD (the one special token, plus --user-defined-symbols), no BOS/EOS template; writes DIR/tokenizer.json and
DIR/tokenizer_meta.json (--model-type, --character-coverage are SentencePiece's).

Writes DIR/tokenizer.model, DIR/tokenizer.vocab and DIR/tokenizer_meta.json (settings, sample
provenance: inputs with sha256, seed, documents/bytes seen and sampled, per-set counts, sample sha256).
The vocabulary comes out at exactly --vocab-size or the command fails: if the sample is too small for
it, the error says how many pieces it supports; raise --sample-bytes. Measured on the minipile corpus:
50k needs ~1 MB of text, 100k ~3 MB, 200k ~8-10 MB; the Pile is far more diverse, and 200k on a
256 MB sample is fine. SentencePiece's BPE trainer uses ~12x the sample size in memory.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import io
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import sentencepiece as spm

from common import cli
from common.cli import UserError, run_main
from common.fileio import write_bytes_atomic, write_json_atomic
from data_prep.console import human_bytes, log, per_file, set_log_prefix
from data_prep.input_files import expand_inputs
from data_prep.pile_sets import NO_SET, PRESETS, SetFilter, make_set_filter
from data_prep.sources import FileReader

FILES = ("tokenizer.model", "tokenizer.vocab", "tokenizer_meta.json")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m data_prep.train_tokenizer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--input", nargs="+", required=True, metavar="GLOB", help="input files or globs")
    ap.add_argument("--vocab-size", type=int, required=True, help="exact vocabulary size, e.g. 50000")
    cli.add_out(ap, "output directory", old=("--output",), dest="output", metavar="DIR", required=True)
    ap.add_argument(
        "--kind",
        default="sentencepiece",
        choices=("sentencepiece", "bpe"),
        help="sentencepiece: tokenizer.model (default); bpe: a byte-level BPE tokenizer.json (tokenizers library)",
    )
    ap.add_argument("--model-type", default="bpe", choices=("bpe", "unigram"), help="SentencePiece's model type")
    ap.add_argument(
        "--sample-bytes", type=float, default=256.0, metavar="MB", help="text sampled for training, in MB (default 256)"
    )
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument(
        "--max-doc-bytes",
        type=float,
        default=100.0,
        metavar="KB",
        help="longer documents contribute a random window of this size (default 100 KB)",
    )
    ap.add_argument(
        "--max-line-bytes",
        type=int,
        default=4096,
        help="longer lines are cut into pieces of at most this many bytes (default 4096)",
    )
    ap.add_argument(
        "--max-record-bytes",
        type=float,
        default=512.0,
        metavar="MB",
        help="skip (as record_too_long) an input jsonl line / text record longer than this, "
        "without holding it in memory (default 512 MB)",
    )
    ap.add_argument("--character-coverage", type=float, default=0.9999)
    ap.add_argument("--user-defined-symbols", default="", help="comma-separated extra pieces")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="trainer threads")
    ap.add_argument("--json-key", default="text")
    ap.add_argument("--format", default="auto", choices=("auto", "jsonl", "text"))
    ap.add_argument("--text-unit", default="file", choices=("file", "line", "paragraph"))
    ap.add_argument("--include-sets", nargs="+", metavar="SET")
    ap.add_argument("--exclude-sets", nargs="+", metavar="SET")
    ap.add_argument("--preset", choices=sorted(PRESETS))
    cli.add_overwrite(ap, "replace an existing DIR/tokenizer.model (DIR/tokenizer.json with --kind bpe)")
    ap.add_argument("--verbose", action="store_true", help="show SentencePiece's own training log")
    return ap


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


class Reservoir:
    """Bottom-k (by seeded random key) sample of documents under a byte budget."""

    def __init__(self, budget: int, max_doc: int, seed: int):
        self.budget, self.max_doc = budget, max_doc
        self.rng = random.Random(seed)
        self.heap: list = []  # (-key, order, doc bytes, set name)
        self.bytes = 0
        self.seen_docs = 0
        self.seen_bytes = 0

    def offer(self, order: tuple, doc: bytes, name) -> None:
        self.seen_docs += 1
        self.seen_bytes += len(doc)
        key = self.rng.random()
        if len(doc) > self.max_doc:
            start = int(self.rng.random() * (len(doc) - self.max_doc))
            doc = doc[start : start + self.max_doc]
            nl = doc.find(b"\n")
            if start and 0 <= nl < len(doc) - 1:
                doc = doc[nl + 1 :]
        if self.heap and self.bytes + len(doc) > self.budget and -self.heap[0][0] < key:
            return  # would be evicted at once
        heapq.heappush(self.heap, (-key, order, doc, name))
        self.bytes += len(doc)
        while self.bytes > self.budget and len(self.heap) > 1:
            _, _, d, _ = heapq.heappop(self.heap)
            self.bytes -= len(d)

    def sample(self) -> list:
        return sorted(((o, d, n) for _, o, d, n in self.heap), key=lambda t: t[0])


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


@dataclass
class Sample:
    """The documents drawn for training and where they came from."""

    reservoir: Reservoir
    docs: list  # (order, document bytes, set name), in input order
    inputs: list  # per input file: path, bytes, sha256, records, documents, skips
    skipped: Counter
    set_filter: SetFilter
    sha256: str = ""  # of the sample: length-prefixed documents, in order
    sets: dict = field(default_factory=dict)  # documents per set
    seconds: float = 0.0  # reading and sampling


def draw_sample(opts: TokenizerTrainingOptions) -> Sample:
    """One pass over the inputs into the seeded reservoir; UserError if nothing usable is left."""
    t0 = time.monotonic()
    inputs = expand_inputs(opts.input)
    sf = make_set_filter(opts.include_sets, opts.exclude_sets, opts.preset)
    res = Reservoir(int(opts.sample_bytes * 1e6), int(opts.max_doc_bytes * 1e3), opts.seed)
    in_meta, skipped = [], Counter()
    for fi, path in enumerate(inputs):
        r = FileReader(
            path,
            fmt=opts.format,
            json_key=opts.json_key,
            text_unit=opts.text_unit,
            set_filter=sf,
            max_record_bytes=opts.max_record,
        )
        seq = 0
        for batch in r.batches():
            for doc, sid in zip(batch.units, batch.set_ids):
                res.offer((fi, seq), doc, r.set_names[sid])
                seq += 1
        st = r.stats
        skipped.update(st.skipped)
        in_meta.append(
            {
                "path": os.path.abspath(path),
                "bytes": st.bytes,
                "sha256": st.sha256,
                "records": st.records,
                "documents": st.documents,
                "skipped": dict(st.skipped),
                "filtered_sets": dict(st.filtered),
            }
        )
        if per_file(fi, len(inputs)):
            log(f"read {path} ({fi + 1}/{len(inputs)}): {st.documents:,} docs (sample so far {human_bytes(res.bytes)})")
    sample = Sample(res, res.sample(), in_meta, skipped, sf)
    if not sample.docs:
        raise UserError("no usable documents in the inputs (all skipped or filtered)")
    h = hashlib.sha256()
    sets: Counter = Counter()
    for _, doc, name in sample.docs:
        h.update(len(doc).to_bytes(8, "little"))
        h.update(doc)
        sets[NO_SET if name is None else name] += 1
    sample.sha256, sample.sets = h.hexdigest(), dict(sorted(sets.items()))
    sample.seconds = time.monotonic() - t0
    return sample


def trainer_settings(opts: TokenizerTrainingOptions) -> dict:
    """SentencePieceTrainer settings (see the module docstring)."""
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


def write_tokenizer(out: Path, proto: bytes, sp: spm.SentencePieceProcessor, meta: dict) -> None:
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
    write_tokenizer(out, proto, sp, meta)
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


def main(argv=None) -> int:
    set_log_prefix("data_prep.train_tokenizer")
    train(TokenizerTrainingOptions.from_args(build_parser().parse_args(argv), argv))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
