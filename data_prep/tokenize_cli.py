"""Tokenize jsonl / plain-text files (each optionally .zst or .gz) or Parquet into megatron-core ``MMIDIDX`` shards.

  python -m data_prep.tokenize --input 'pile/train/*.jsonl.zst' --tokenizer tok/tokenizer.model \\
      --out data/pile_train --workers 16
  python -m data_prep.tokenize ... --tokenizer o200k_base.tiktoken         (tiktoken's file, int32 shards)
  python -m data_prep.tokenize ... --tokenizer gpt-neox-20b/tokenizer.json (Hugging Face)

Writes PREFIX.bin + PREFIX.idx (one document per record, the tokenizer's end-of-text id appended;
uint16 if the vocabulary fits, else int32), PREFIX.counts.npy (int64 occurrences per token id) and
PREFIX.manifest.json. With --split-by-set: one PREFIX.<set>.bin/.idx/.counts.npy per pile_set_name
(PREFIX.counts.npy is then the total). Runs are resumable: see data_prep/parts.py. Under mpirun/srun
add --mpi: input files are spread over the ranks, rank 0 merges; the bytes equal a one-process run.
Does not import torch or megatron.core.
"""

# The docstring above is the --help text. `python -m data_prep.tokenize` (data_prep/tokenize.py) runs main().
from __future__ import annotations

import argparse
import os
import sys

from common import cli
from common.exit_codes import EXIT_BAD_INPUT
from data_prep.comm import LocalComm, MpiComm, RanksFailed
from data_prep.console import log, set_log_prefix
from data_prep.input_files import FORMATS
from data_prep.pile_sets import PRESETS
from data_prep.runner import run_job
from data_prep.tokenize_job import make_job, summary


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m data_prep.tokenize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="GLOB",
        help="input files or globs, in order (document order = input order)",
    )
    ap.add_argument(
        "--tokenizer",
        required=True,
        metavar="PATH",
        help="a SentencePiece .model, a Hugging Face tokenizer.json or a directory holding one, a tiktoken "
        ".tiktoken ranks file, or tiktoken:NAME (e.g. tiktoken:o200k_base, from tiktoken's local cache)",
    )
    ap.add_argument(
        "--tiktoken-pattern",
        metavar="NAME",
        help="split pattern of a .tiktoken file: o200k | cl100k | p50k | r50k (default: the published encoding "
        "the file is, by its sha256 or name)",
    )
    ap.add_argument(
        "--eod-token",
        metavar="TEXT",
        help="the end-of-document token appended to every document (default: the tokenizer's own: <|endoftext|> "
        "for tiktoken and GPT-NeoX, tokenizer_config.json's eos_token, SentencePiece's eos piece)",
    )
    cli.add_out(
        ap,
        "writes PREFIX.bin/.idx/.counts.npy/.manifest.json",
        old=("--output-prefix",),
        metavar="PREFIX",
        required=True,
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="encoder threads per process (default: usable cores, %(default)s here)",
    )
    ap.add_argument(
        "--json-key",
        "--text-column",
        default="text",
        help="jsonl field / Parquet column holding the text (default: text)",
    )
    ap.add_argument(
        "--format",
        default="auto",
        choices=("auto", *FORMATS),
        help="auto: *.parquet is Parquet, *.jsonl/*.json/*.ndjson[.zst|.gz] are jsonl, anything else plain text",
    )
    ap.add_argument(
        "--text-unit",
        default="file",
        choices=("file", "line", "paragraph"),
        help="plain-text inputs: one document per file (default), per line, or per blank-line separated paragraph",
    )
    ap.add_argument("--include-sets", nargs="+", metavar="SET", help="keep only these pile_set_name values")
    ap.add_argument("--exclude-sets", nargs="+", metavar="SET", help="drop these pile_set_name values")
    ap.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="named filter; pile-uncopyrighted drops " + ", ".join(PRESETS["pile-uncopyrighted"]["exclude_sets"]),
    )
    ap.add_argument(
        "--split-by-set",
        action="store_true",
        help="one PREFIX.<set>.bin/.idx pair per pile_set_name (for weighted blending)",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "uint16", "int32"),
        help="token dtype; auto = uint16 if vocab <= 65536 else int32",
    )
    ap.add_argument(
        "--on-bad-record",
        default="skip",
        choices=("skip", "error"),
        help="skip (and count) unusable records, or stop at the first one naming FILE:LINE",
    )
    cli.add_overwrite(
        ap,
        "replace existing outputs: PREFIX.bin/.idx/.counts.npy/.manifest.json, and delete "
        "PREFIX.<set>.* shards of the previous run (only PREFIX's own files, in its directory)",
    )
    ap.add_argument(
        "--work-dir",
        metavar="DIR",
        help="partial shards for resuming go to DIR/<prefix basename>.data_prep-work (default: "
        "PREFIX.work); created and marked by data_prep, removed after success; DIR itself is "
        "never deleted, and an existing unmarked non-empty work dir is refused",
    )
    ap.add_argument("--keep-work", action="store_true", help="keep the work dir after success")
    ap.add_argument(
        "--max-record-bytes",
        type=float,
        default=512.0,
        metavar="MB",
        help="skip (as record_too_long) a jsonl line / text record longer than this, without "
        "holding it in memory (default 512 MB, meant to be far above any real document)",
    )
    ap.add_argument(
        "--batch-bytes",
        type=float,
        default=4.0,
        metavar="MB",
        help="text per encoder batch in MB (default 4); peak memory is about "
        "100 MB + 6 x workers x this, whatever the corpus size",
    )
    ap.add_argument(
        "--chunk-bytes",
        type=int,
        default=8192,
        help="encode documents longer than 2x this in newline-ended pieces of ~this size "
        "(SentencePiece is several times slower per byte on long strings); used only "
        "when the tokenizer gives identical ids that way (checked at start); 0: never",
    )
    ap.add_argument(
        "--mpi",
        action="store_true",
        help="run under mpirun/srun: spread input files over ranks (needs a shared filesystem)",
    )
    ap.add_argument(
        "--log-interval", type=float, default=30.0, help="seconds between progress lines when stderr is not a terminal"
    )
    cli.add_quiet(ap, "no progress bar or progress lines", old=("--no-progress",))
    return ap


def main(argv=None) -> int:
    """``python -m data_prep.tokenize``: 0 on success; UserError (one process) or 2 (under --mpi) otherwise."""
    set_log_prefix("data_prep.tokenize")
    args = build_parser().parse_args(argv)
    comm = MpiComm() if args.mpi else LocalComm()
    if comm.ranked:
        set_log_prefix(f"data_prep.tokenize rank {comm.rank}/{comm.size}")
    try:
        manifest = run_job(lambda: make_job(args, argv), comm)
    except RanksFailed as e:
        if comm.rank == 0:
            print(f"error: {e}", flush=True, file=sys.stderr)
        return EXIT_BAD_INPUT
    if comm.rank == 0:
        log(summary(manifest))
    return 0
