"""Compare training runs and their evaluation reports: one table (Markdown + CSV) and plots.

    python -m leviathan_pretrain.compare RUN_A RUN_B ... [--baseline RUN] [--out DIR]

Each RUN is a run directory (the trainer's ``train.out_dir``: ``train_log.jsonl`` or ``tensorboard/``,
``checkpoints/``, ``eval/<tag>.json``) or an evaluation report file (``python -m leviathan_pretrain.evaluate``).
A run directory uses its report with the highest step; a run without one still gets its curves and its final
validation loss from the training log. Writes ``comparison.md``, ``comparison.csv``, ``val_loss_vs_tokens.png``,
``ppl_by_frequency.png``, (when a report has WikiText) ``wikitext_ppl.png`` and (when a training log has geometry
records) ``geometry_vs_tokens.png`` to ``--out`` (default ``compare-<timestamp>/``). Bad input: one ``error:``
line, exit 2. docs/compare.md says how each number is made.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import cli
from leviathan_pretrain.comparison.outputs import write_comparison
from leviathan_pretrain.comparison.runs import CompareError, load_run, pick_baseline, unique_names


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m leviathan_pretrain.compare",
        description=__doc__.split("\n\n")[0],
        epilog="Outputs and how each number is computed: docs/compare.md",
    )
    ap.add_argument("runs", nargs="+", metavar="RUN", help="run directory (train.out_dir) or evaluation report file")
    ap.add_argument("--baseline", metavar="RUN", help="the run the others are compared with (path or name); "
                    "default: the first run whose variant is tied, else the first run")  # fmt: skip
    cli.add_out(ap, "output directory (default: compare-<timestamp>/ here)", metavar="DIR")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # OSError: the outputs cannot be written (it names the path)
    return cli.run_main(_compare, args, errors=(CompareError, OSError))


def _compare(args) -> int:
    runs = [load_run(a) for a in args.runs]
    base_i, why = pick_baseline(runs, args.baseline)
    unique_names(runs)
    out = Path(args.out or f"compare-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and not out.is_dir():
        raise CompareError(f"{out}: exists and is not a directory")
    text, written = write_comparison(runs, base_i, why, out)
    print(text)
    for p in written:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
