"""The demo: a small real corpus -> a SentencePiece tokenizer -> megatron-core train/val shards.

  python -m data_prep.data_demo --out runs/demo        (what ``make demo`` runs)

The corpus is the Python standard library's own .py sources as the Pile's "Github" set, written in
the Pile's jsonl.zst format, so it exists on any machine with Python (no extra packages). Steps whose
outputs already exist are reused (``--overwrite`` redoes them). Each step prints its paths, documents,
tokens and time. ``run_demo()`` returns the paths, so a later stage (training) appends steps to it.

Writes OUT/corpus/ (make_corpus's, marked), OUT/tokenizer/tokenizer.{model,vocab,_meta.json} and
OUT/data/{train,val}.{bin,idx,counts.npy,manifest.json}. Nothing else in OUT is touched, ``--overwrite``
included: it replaces these files, and deletes a corpus directory only if make_corpus marked it.
"""

from __future__ import annotations

import argparse
import sys

from common import cli
from common.cli import run_main
from data_prep.demo_steps import run_demo


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m data_prep.data_demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cli.add_out(ap, "output directory (default runs/demo)", metavar="DIR", default="runs/demo")
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--sample-mb", type=float, default=8.0, help="tokenizer training sample (MB)")
    ap.add_argument("--max-mb", type=float, help="cap the corpus at about this much text")
    ap.add_argument("--workers", type=int, help="tokenizer threads (default: usable cores)")
    cli.add_overwrite(
        ap, "redo every step, replacing the demo's own files (nothing else in OUT is deleted)", old=("--force",)
    )
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    run_demo(
        args.out,
        vocab_size=args.vocab_size,
        sample_mb=args.sample_mb,
        max_mb=args.max_mb,
        workers=args.workers,
        force=args.overwrite,
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
