"""The main job on the embedded default corpus: ``python -m leviathan_pretrain.demo`` (what ``make demo`` runs).

1. Prepares the data with ``data_prep.demo_steps.run_demo(<out>)`` (``python -m data_prep.data_demo``: a corpus from the
   Python standard library's sources -> SentencePiece tokenizer -> megatron-core train/val shards; steps
   already done are reused).
2. Trains the ``tiny-cpu`` LEV model on 2 local processes with tensor parallelism 2
   (``launchers/local.py``), with periodic validation and checkpoints, for a few minutes.
3. Evaluates the trained checkpoint (``python -m leviathan_pretrain.evaluate`` on the same local processes,
   data-parallel: validation perplexity, perplexity by training frequency, and zero-shot WikiText-103 word
   perplexity when ``--wikitext`` names the raw test file) and exports it as a Hugging Face Llama model
   (``python -m leviathan_pretrain.export_hf``); each is skipped, and said so, when its output for the latest
   checkpoint is already there.
4. Prints where the checkpoints, TensorBoard logs, evaluation report and export are, what the figures mean, and how
   long each step took.

Re-running continues from the last checkpoint (and does nothing once the run is complete); ``--overwrite``
starts the training over. Exit code: the trainer's (0 done; 75 stopped early with a checkpoint: re-run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import cli
from common.exit_codes import EXIT_BAD_INPUT
from leviathan_pretrain.walkthrough import results
from leviathan_pretrain.walkthrough.steps import (
    REPO,
    Clock,
    DemoError,
    Request,
    evaluate_and_export,
    prepare_data,
    prepare_run_dir,
    train,
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m leviathan_pretrain.demo",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="extra key=value overrides go to the trainer, e.g. train.steps=60",
    )
    cli.add_out(ap, "demo directory (default runs/demo)", metavar="DIR", default="runs/demo")
    ap.add_argument("--config", default=str(REPO / "configs/tiny-cpu-lev.yaml"), help="training config")
    ap.add_argument("--nprocs", type=int, default=2, help="local ranks (default 2, all tensor-parallel)")
    ap.add_argument("--steps", type=int, default=120, help="training steps (default 120: a few minutes on 2 cores)")
    ap.add_argument("--data-prefix", default=None, help="use this shard instead of running data_prep.data_demo")
    ap.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="the tokenizer --data-prefix was written with, any kind (tokenizer.model, tokenizer.json or its "
        "directory, a .tiktoken file with data.tiktoken_pattern=..., tiktoken:NAME); the vocabulary is its",
    )
    cli.add_overwrite(
        ap, "delete the previous demo training run first (only a directory the demo created)", old=("--fresh",)
    )
    ap.add_argument(
        "--wikitext",
        default=None,
        metavar="PATH",
        help="WikiText-103's raw test file (wiki.test.raw) for a zero-shot word perplexity too (default: none; the "
        "demo's model is trained on Python sources, so expect a very high figure on English prose)",
    )
    ap.add_argument("--no-eval", action="store_true", help="stop after training (no evaluation, no export)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="more trainer overrides")
    return ap


def parse(argv=None) -> Request:
    args = build_parser().parse_args(argv)
    return Request(
        out=Path(args.out),
        config=args.config,
        nprocs=args.nprocs,
        steps=args.steps,
        data_prefix=args.data_prefix,
        tokenizer=args.tokenizer,
        overwrite=args.overwrite,
        wikitext=args.wikitext,
        evaluate=not args.no_eval,
        overrides=tuple(args.overrides),
    )


def main(argv=None) -> int:
    req = parse(argv)
    clock = Clock()
    try:
        data = prepare_data(req)
        prepare_run_dir(req.run_dir, req.overwrite)
    except DemoError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    t = clock.lap("data", clock.t0)
    rc = train(req, data)
    clock.lap("training", t)
    results.print_results(req.run_dir, rc)
    if rc == 0 and req.evaluate:
        rc = evaluate_and_export(req, clock)
        if rc == 0:
            results.explain(req.run_dir)
    print(clock.summary(), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
