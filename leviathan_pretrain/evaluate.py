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
import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from leviathan_pretrain import cli
from leviathan_pretrain.dtypes import torch_dtype
from leviathan_pretrain.rundir.layout import RunLayout

if TYPE_CHECKING:
    from leviathan_pretrain.evaluation.report import EvalReport

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


def _check_args(ns) -> None:
    from leviathan_pretrain.evaluation.load import EvalError

    for opt in ("context", "stride", "wikitext_stride", "batch_size", "max_tokens", "step"):
        v = getattr(ns, opt)
        if v is not None and v < (0 if opt == "step" else 1):
            raise EvalError(f"--{opt.replace('_', '-')}: must be >= {0 if opt == 'step' else 1}, got {v}")
    try:
        ns.edges = [float(x) for x in ns.bucket_edges.split(",") if x.strip()]
    except ValueError:
        raise EvalError(f"--bucket-edges: {ns.bucket_edges!r} is not a comma-separated list of numbers") from None
    if ns.out and len(ns.run) > 1:
        raise EvalError(f"--out names one report and {len(ns.run)} runs were given: leave --out out, and each report "
                        "is written to RUN/eval/<tag>.json")  # fmt: skip


def evaluate(ns, world: tuple[int, int], device) -> tuple[EvalReport, Path | None]:
    """Everything ``ns`` asks for, as an :class:`EvalReport`, and the run's TensorBoard directory
    (None when the run logged none)."""
    import torch

    from leviathan_pretrain.evaluation import heldout as H
    from leviathan_pretrain.evaluation import texts as T
    from leviathan_pretrain.evaluation.load import EvalError, load_trained
    from leviathan_pretrain.evaluation.report import EvalReport, Meter
    from leviathan_pretrain.evaluation.scoring import score_streams
    from leviathan_pretrain.model import sizes

    t0 = time.monotonic()
    dtype = torch_dtype(ns.dtype)
    if dtype == torch.bfloat16 and device.type != "cuda":
        raise EvalError("--dtype bf16: needs a GPU here (CPU bf16 matmuls are slow and not what training used)")
    tr = load_trained(ns.run, ns.step, ns.checkpoint_dir, ns.tokenizer, device=device, dtype=dtype)
    cfg, V = tr.cfg, tr.vocab_size
    context = ns.context or cfg.model.seq_length
    if context > cfg.model.seq_length:
        print(f"[evaluate] note: --context {context} is longer than the trained seq_length {cfg.model.seq_length}")
    stride = ns.stride or context
    if stride > context:
        raise EvalError(f"--stride {stride}: must be <= --context {context}")
    verbose = not ns.quiet and world[0] == 0
    kw = dict(batch_size=ns.batch_size, device=device, shard=world)
    counts = sizes.param_breakdown(cfg.model, tr.record.layout.tp)
    report = EvalReport(
        run=str(Path(ns.run).resolve()),
        checkpoint=str((tr.ckpt_dir / tr.tag).resolve()),
        tag=tr.tag,
        step=tr.step,
        variant=tr.variant,
        params={
            "total": counts["total"],
            "input_layer": counts["input"],
            "non_input": counts["total"] - counts["input"],
        },
        tokens_seen=tr.record.consumed_samples * cfg.model.seq_length,
        created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        settings={
            "context": context,
            "stride": stride,
            "batch_size": ns.batch_size,
            "device": str(device),
            "dtype": ns.dtype,
            "max_tokens": ns.max_tokens,
            "world": world[1],
        },
    )
    if verbose:
        print(
            f"[evaluate] {tr.ckpt_dir / tr.tag}: {tr.variant}, layout {tr.record.layout.to_json()}, step {tr.step}",
            flush=True,
        )
    all_loss, all_tgt = [], []
    if not ns.no_heldout:
        for hs in H.heldout_sets(cfg, ns.data):
            tokens, docs, left = H.read_stream(hs, ns.max_tokens)
            if tokens.size < 2:
                raise EvalError(f"{hs.prefix}: fewer than 2 tokens to evaluate")
            if int(tokens.max()) >= V:
                raise EvalError(f"{hs.prefix}: token id {int(tokens.max())} >= model.vocab_size={V}: another tokenizer")
            meter = Meter(hs.name, tokens.size - 1, verbose)
            s = score_streams(tr.model, [tokens], V, context, stride, progress=meter, **kw)[0]
            meter.close()
            report.heldout.append(
                {
                    "name": hs.name,
                    "prefix": str(Path(hs.prefix).resolve()),
                    "documents": docs,
                    "documents_left_out": left,
                    "tokens": s.tokens,
                    "loss": s.mean_loss,
                    "ppl": math.exp(s.mean_loss),
                }
            )
            all_loss.append(s.loss)
            all_tgt.append(s.target)
    if all_loss and not ns.no_frequency:
        import numpy as np

        try:
            train_counts, files = H.training_counts(list(cfg.data.prefixes), V)
        except EvalError as e:
            print(f"[evaluate] frequency buckets skipped: {e}", file=sys.stderr)
        else:
            fr = H.frequency_buckets(
                np.concatenate(all_loss), np.concatenate(all_tgt), train_counts, ns.edges, ns.quantile_buckets
            )
            report.frequency = {"counts": files, **fr}
    tok = None
    if ns.wikitext or ns.lambada:
        if tr.tokenizer is None:
            raise EvalError(
                "WikiText/LAMBADA need the run's tokenizer: the recorded data.tokenizer is missing; "
                "give --tokenizer PATH"
            )
        tok = tr.tokenizer
        eod = tok.eod_id
    if ns.wikitext:
        texts = T.wikitext_articles(ns.wikitext)
        ws = ns.wikitext_stride or max(1, context // 2)
        if ws > context:
            raise EvalError(f"--wikitext-stride {ws}: must be <= --context {context}")
        streams = T.wikitext_streams(tok, eod, texts)
        meter = Meter("wikitext", sum(len(s) - 1 for s in streams), verbose)
        w = T.score_wikitext(tr.model, streams, V, texts, context, ws, progress=meter, **kw)
        meter.close()
        report.wikitext = {"path": str(Path(ns.wikitext).resolve()), **w}
    if ns.lambada:
        la = T.score_lambada(tr.model, tok, eod, V, T.lambada_examples(ns.lambada), context, **kw)
        la.pop("word_nats")
        report.lambada = {"path": str(Path(ns.lambada).resolve()), **la}
    if not (report.heldout or report.wikitext or report.lambada):
        raise EvalError("nothing to evaluate: --no-heldout without --wikitext or --lambada")
    report.seconds = round(time.monotonic() - t0, 1)
    return report, _tensorboard_dir(ns, cfg)


def main(argv=None) -> int:
    ns = build_parser().parse_args(argv)
    import warnings

    # megatron-core's notices on machines without Transformer Engine / Apex (every CPU): expected, not news
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
    from leviathan_pretrain.evaluation.load import EvalError

    return cli.run_main(_evaluate_runs, ns, errors=(EvalError,))


def _evaluate_runs(ns) -> int:
    from leviathan_pretrain.evaluation.load import eval_world

    _check_args(ns)
    with eval_world(ns.device) as device:
        import torch.distributed as dist

        world = (dist.get_rank(), dist.get_world_size())
        for i, run in enumerate(ns.run):  # --run: one or more (each evaluated alone below)
            if len(ns.run) > 1 and world[0] == 0:
                print(f"[evaluate] run {i + 1}/{len(ns.run)}: {run}", flush=True)
            one = argparse.Namespace(**{**vars(ns), "run": run})
            report, tb = evaluate(one, world, device)
            if world[0] == 0:
                _write(one, report, tb)
    return 0


def _write(ns, report: EvalReport, tb: Path | None) -> None:
    from leviathan_pretrain.evaluation.report import console_table, tensorboard_scalars

    out = Path(ns.out) if ns.out else RunLayout(Path(ns.run)).report(report.tag)
    report.write(out)
    print(console_table(report))
    print(f"\nreport: {out}")
    if tb is not None and not ns.no_tensorboard:
        from leviathan_pretrain.evaluation.report import write_tensorboard

        write_tensorboard(tb, report.step, tensorboard_scalars(report))
        print(f"tensorboard: eval/ scalars at step {report.step} in {tb}")


def _tensorboard_dir(ns, cfg) -> Path | None:
    """The run's TensorBoard directory: the recorded ``logging.tensorboard_dir`` if it exists here, else
    RUN/tensorboard (None when the run logged no TensorBoard)."""
    if not cfg.logging.tensorboard:
        return None
    recorded = cfg.logging.tensorboard_dir
    if recorded and Path(recorded).is_dir():
        return Path(recorded)
    return RunLayout(Path(ns.run)).events


if __name__ == "__main__":
    sys.exit(main())
