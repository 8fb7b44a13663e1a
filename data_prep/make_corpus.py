"""Build a small, real, multi-source corpus in The Pile's jsonl format (the test and demo corpus).

Every line is {"text": ..., "meta": {"pile_set_name": ...}}, exactly like the Pile's
train/NN.jsonl.zst shards. No text is synthetic; it comes from the Python standard library and
Debian packages:

  Github      the Python standard library's own .py files (one document per file); always present
  PythonDocs  the Python 3.11 documentation sources (Debian package python3.11-doc)
  Dictionary  GCIDE, the 1913 Webster's based dictionary (Debian package dict-gcide), grouped into
              documents of ~40 entries

  python -m data_prep.make_corpus --out OUT_DIR [--sources github,pythondocs,dictionary] [--train-shards 1]

Writes OUT_DIR/train/00.jsonl.zst (.. NN with --train-shards), OUT_DIR/val.jsonl.zst and
OUT_DIR/test.jsonl.zst and prints a summary; OUT_DIR is marked with .data_prep-corpus.json. Deterministic
for a given seed and machine. With the defaults the output is byte-identical to the shared make-minipile
tool's (~80 MB train split). --overwrite replaces a corpus make_corpus wrote (only its own files: other
files in OUT_DIR stay); a non-empty OUT_DIR without the marker is refused even with --overwrite.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import cli
from common.cli import UserError, run_main
from data_prep.small_corpus import SOURCES, build, clear_corpus


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m data_prep.make_corpus",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.add_out(ap, "the corpus directory", metavar="OUT_DIR", required=True, positional="OUT_DIR")
    ap.add_argument(
        "--sources",
        default=",".join(SOURCES),
        help="comma-separated subset of github,pythondocs,dictionary (default: all)",
    )
    ap.add_argument("--install", action="store_true", help="apt-get the Debian packages if missing")
    ap.add_argument("--val-fraction", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-shards", type=int, default=1, help="split train into this many files")
    ap.add_argument("--max-mb", type=float, help="stop after about this much text (after shuffling)")
    cli.add_overwrite(
        ap,
        "replace a corpus make_corpus wrote in OUT_DIR (deletes only its own files; an unmarked non-empty OUT_DIR "
        "is refused)",
        old=("--force",),
    )
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"output is not a directory: {out}")
    if out.exists() and any(out.iterdir()):
        if not args.overwrite:
            raise UserError(
                f"output directory is not empty: {out} (pass --overwrite to replace the corpus make_corpus wrote there)"
            )
        clear_corpus(out)
    build(
        out,
        [s.strip() for s in args.sources.split(",") if s.strip()],
        args.val_fraction,
        args.seed,
        args.train_shards,
        args.install,
        max_bytes=int(args.max_mb * 1e6) if args.max_mb else None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
