"""Build the trainer's data index cache ahead of training, in one CPU process:
``python -m leviathan_pretrain.build_data_cache --config FILE [key=value ...]``.

Takes the training command's own ``--config`` and overrides (same schema, :func:`load_config`) and does
rank 0's start-up data work, so that the training job only loads finished files:

1. the shard checks the trainer runs (``data_summary``: existence, sizes, vocabulary, tokenizer, splits);
   a shard without ``PREFIX.counts.npy`` is scanned once for its largest token id and the result is kept
   in the cache dir (``leviathan_shard_scans.json``, keyed by path + size + mtime);
2. megatron-core's document / sample / shuffle (and blend) indices, through the trainer's own code path
   (``trainer.data.build_splits``: same ``GPTDatasetConfig``, same sample counts), into ``data.cache_dir``
   (default ``<train.out_dir>/data_cache``); files already there are reused, not rebuilt;
3. the stamp ``leviathan_data_cache.json`` that tells the trainer the cache is complete for this config.

New files are built in a private staging folder inside the cache dir and renamed into place, so no file is
ever visible half-written under its final name; nothing this command did not create is deleted or
overwritten. Exit codes: 0 done, 2 bad config or data (the message names the key or file).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import warnings
from pathlib import Path

from common.cli import run_main
from common.exit_codes import EXIT_BAD_INPUT
from leviathan_pretrain.config import ConfigError, config_arguments, load_config_or_report  # light: no torch
from leviathan_pretrain.data.index_cache import atomic_write_text  # light: no torch

EPILOG = """examples:
  python -m leviathan_pretrain.build_data_cache --config configs/400m-lev.yaml \\
      data.prefixes=[/data/pile_train_text_document] train.out_dir=runs/pile-400m
  # in a SLURM chain: the same --config and overrides as the training step, on one CPU task
  srun -n 1 python -m leviathan_pretrain.build_data_cache --config $CFG $OVERRIDES --report cache_report.json

exit codes: 0 cache complete; 2 bad config or data (the message names the key or shard)"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m leviathan_pretrain.build_data_cache",
        description=__doc__.split("\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config_arguments(
        ap,
        config_help="the training YAML config (may name a 'base:' file it extends)",
        overrides_help="the training command's dotted overrides, e.g. train.steps=100000",
    )
    ap.add_argument("--report", metavar="FILE", help="also write what was done (steps, files, peak RSS) as JSON")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every index file")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cfg = load_config_or_report(args.config, args.overrides)
    if cfg is None:
        return EXIT_BAD_INPUT
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
    from leviathan_pretrain.data.datasets import ShardError  # only now: --help and config errors answer without torch

    return run_main(functools.partial(_build, cfg), args, errors=(ConfigError, ShardError))


def _build(cfg, args) -> int:
    t0 = time.perf_counter()  # the library's import counts (torch, imported only now as ShardError above)
    from leviathan_pretrain.data.index_cache_build import build_cache, print_report

    print(f"[build_data_cache] config {args.config} {' '.join(args.overrides)}".rstrip(), flush=True)
    rep = build_cache(cfg, f"{args.config} {' '.join(args.overrides)}".strip(), log=lambda m: print(m, flush=True))
    rep["wall_s"] = time.perf_counter() - t0
    print_report(rep, verbose=args.verbose)
    print(
        f'[build_data_cache] done in {rep["wall_s"]:.1f} s: the trainer will say "using the prebuilt data '
        f'index cache {rep["cache_dir"]}"',
        flush=True,
    )
    if args.report:
        atomic_write_text(Path(args.report), json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
