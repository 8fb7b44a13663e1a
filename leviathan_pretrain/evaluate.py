"""Evaluate a trained run: held-out perplexity, perplexity by training frequency, WikiText, LAMBADA.

    python -m leviathan_pretrain.evaluate --run RUN_DIR [RUN_DIR ...] [--step N] [--data PREFIX ...]
        [--wikitext FILE] [--lambada FILE] [--out report.json] [options]

Loads the checkpoint (any TP / PP / ZeRO layout, merged into one model: leviathan_pretrain/evaluation/load.py)
on one process, or data-parallel on every rank of a launch (``python launchers/local.py -n N -- -m
leviathan_pretrain.evaluate ...``, torchrun, srun: each rank scores a share of the windows). Writes a JSON
report (default ``RUN/eval/<tag>.json``), ``eval/...`` TensorBoard scalars into the run's TensorBoard directory
at the checkpoint's step, and prints a table. Several runs (a sweep) are evaluated one after another in one process
with the same settings, each into its own report: the libraries are loaded once. Every target token is scored
exactly once (sliding windows: only the new tokens of a window are scored). Full reference: docs/evaluation.md.

Exit codes: 0 done; 2 bad input (run, checkpoint, tokenizer, data or text file), named in one error line.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from common import cli

EXAMPLES = """examples:
  python -m leviathan_pretrain.evaluate --run runs/1.2b-lev
  python -m leviathan_pretrain.evaluate --run runs/demo/train --wikitext ../shared/data/wikitext-103-test.raw
  python -m leviathan_pretrain.evaluate --run runs/sweep/* --max-tokens 400000   # each into RUN/eval/<tag>.json
  python -m leviathan_pretrain.evaluate --run runs/200m-lev --step 8000 --data data/pile_val --max-tokens 2000000 \\
      --quantile-buckets 5 --out lev-8000.json"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m leviathan_pretrain.evaluate",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = ap.add_argument_group("what to load")
    cli.add_run(
        g,
        "the run directory (train.out_dir), or its checkpoint directory; several: each is evaluated in turn",
        required=True,
        nargs="+",
    )
    cli.add_checkpoint_options(g, "evaluate")
    g = ap.add_argument_group("what to evaluate")
    g.add_argument(
        "--data",
        nargs="+",
        metavar="PREFIX",
        help="held-out shard prefixes (default: the run's data.valid_prefixes, else the validation split of its "
        "data.prefixes as training cut it)",
    )
    g.add_argument("--no-heldout", action="store_true", help="skip the held-out shards (and the frequency buckets)")
    g.add_argument("--max-tokens", type=int, help="per held-out set: whole documents up to this many tokens")
    g.add_argument("--no-frequency", action="store_true", help="skip the frequency-stratified perplexity")
    g.add_argument(
        "--no-geometry",
        action="store_true",
        help="skip the token-vector geometry (input rows and head: RMS, cosine, mean share, effective rank)",
    )
    g.add_argument(
        "--bucket-edges",
        default="1e-7,1e-6,1e-5,1e-4,1e-3",
        help="relative training frequencies between buckets (default log decades: 1e-7,1e-6,1e-5,1e-4,1e-3)",
    )
    g.add_argument("--quantile-buckets", type=int, metavar="K", help="K buckets of equal training token mass instead")
    g.add_argument("--wikitext", metavar="FILE", help="zero-shot WikiText-103 (raw format), e.g. wiki.test.raw")
    g.add_argument("--lambada", metavar="FILE", help='LAMBADA-style last-word accuracy: jsonl of {"text": ...}')
    g = ap.add_argument_group("how")
    g.add_argument("--context", type=int, help="window length in tokens (default: the run's model.seq_length)")
    g.add_argument("--stride", type=int, help="new tokens per window on shards (default: --context, disjoint)")
    g.add_argument("--wikitext-stride", type=int, help="new tokens per window on WikiText (default: --context / 2)")
    g.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (8)")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: CUDA when available")
    cli.add_dtype(g, "fp32", "compute dtype, bf16 on a GPU only", choices=("fp32", "bf16"))
    g = ap.add_argument_group("output")
    cli.add_out(g, "the JSON report (default RUN_DIR/eval/<tag>.json; one --run only)", metavar="FILE")
    g.add_argument("--no-tensorboard", action="store_true", help="do not write eval/ scalars to the run's TensorBoard")
    cli.add_quiet(g, "no progress lines")
    return ap


def main(argv=None) -> int:
    ns = build_parser().parse_args(argv)
    # megatron-core's notices on machines without Transformer Engine / Apex (every CPU): expected, not news
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
    # imported after parsing: --help answers without torch and megatron-core, which the evaluation loads
    from leviathan_pretrain.evaluation.evaluate_run import EvalOptions, evaluate_runs
    from leviathan_pretrain.evaluation.load import EvalError

    return cli.run_main(evaluate_runs, EvalOptions.from_namespace(ns), errors=(EvalError,))


if __name__ == "__main__":
    sys.exit(main())
