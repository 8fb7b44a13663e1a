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
import os
import sys

from common import cli
from common.cli import run_main
from data_prep.console import set_log_prefix
from data_prep.input_files import FORMATS
from data_prep.pile_sets import PRESETS
from data_prep.tokenizer_training import TokenizerTrainingOptions, train


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
    ap.add_argument("--json-key", "--text-column", default="text", help="jsonl field / Parquet column of the text")
    ap.add_argument("--format", default="auto", choices=("auto", *FORMATS))
    ap.add_argument("--text-unit", default="file", choices=("file", "line", "paragraph"))
    ap.add_argument("--include-sets", nargs="+", metavar="SET")
    ap.add_argument("--exclude-sets", nargs="+", metavar="SET")
    ap.add_argument("--preset", choices=sorted(PRESETS))
    cli.add_overwrite(ap, "replace an existing DIR/tokenizer.model (DIR/tokenizer.json with --kind bpe)")
    ap.add_argument("--verbose", action="store_true", help="show SentencePiece's own training log")
    return ap


def main(argv=None) -> int:
    set_log_prefix("data_prep.train_tokenizer")
    train(TokenizerTrainingOptions.from_args(build_parser().parse_args(argv), argv))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
