"""One evaluation of ``lev evaluate`` (``python -m leviathan_pretrain.evaluate``; docs/evaluation.md).

The command line as :class:`EvalOptions`; :func:`evaluate`: the run's checkpoint loaded as one model
(:mod:`.load`), then each section scored into the :class:`~.report.EvalReport` (held-out sets, perplexity by training
frequency, WikiText, LAMBADA, the token vectors' geometry); :func:`evaluate_runs`: every ``--run`` in turn inside one
:func:`~.load.eval_world` (the libraries loaded once), each report written with its ``eval/`` TensorBoard scalars.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from common.dtypes import torch_dtype
from leviathan_pretrain.evaluation import heldout as H
from leviathan_pretrain.evaluation import texts as T
from leviathan_pretrain.evaluation.load import EvalError, Trained, eval_world, load_trained
from leviathan_pretrain.evaluation.report import (
    EvalReport,
    Meter,
    console_table,
    tensorboard_scalars,
    write_tensorboard,
)
from leviathan_pretrain.evaluation.scoring import score_streams, windows
from leviathan_pretrain.model import counts as param_counts
from leviathan_pretrain.model import geometry as G
from leviathan_pretrain.rundir.layout import RunLayout


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """The command line, parsed once (:meth:`from_namespace`). ``runs``: every ``--run``; ``run``: the one an
    evaluation loads (:func:`evaluate_runs` makes one copy per run with :func:`dataclasses.replace`). The ``--no-X``
    switches are the positive ``heldout`` / ``frequency`` / ``geometry`` / ``tensorboard``; the rest are the options'
    own names."""

    runs: tuple[str, ...]
    run: str
    step: int | None
    checkpoint_dir: str | None
    tokenizer: str | None
    data: tuple[str, ...] | None
    heldout: bool
    max_tokens: int | None
    frequency: bool
    geometry: bool
    bucket_edges: str
    quantile_buckets: int | None
    wikitext: str | None
    lambada: str | None
    context: int | None
    stride: int | None
    wikitext_stride: int | None
    batch_size: int
    device: str
    dtype: str
    out: str | None
    tensorboard: bool
    quiet: bool

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> EvalOptions:
        """From the command's parser (``leviathan_pretrain.evaluate``); ``run``: the first ``--run``."""
        derived = {"runs", "run", "data", "heldout", "frequency", "geometry", "tensorboard"}
        same = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if f.name not in derived}
        return cls(
            runs=tuple(ns.run),
            run=ns.run[0],
            data=tuple(ns.data) if ns.data else None,
            heldout=not ns.no_heldout,
            frequency=not ns.no_frequency,
            geometry=not ns.no_geometry,
            tensorboard=not ns.no_tensorboard,
            **same,
        )

    @property
    def edges(self) -> list[float]:
        """``--bucket-edges`` as numbers; ValueError when one is not a number (:func:`_check_args` says so)."""
        return [float(x) for x in self.bucket_edges.split(",") if x.strip()]


@dataclasses.dataclass(frozen=True)
class _Scoring:
    """What the scored sections share: the merged model and its vocabulary size, the windows (``context`` tokens,
    ``stride`` new ones on the shards), ``score_streams``'s keywords (batch size, device, this rank's share of the
    windows) and whether this rank prints progress."""

    model: object
    vocab_size: int
    context: int
    stride: int
    kw: dict
    verbose: bool


def _check_args(opts: EvalOptions) -> None:
    for opt in ("context", "stride", "wikitext_stride", "batch_size", "max_tokens", "step"):
        v = getattr(opts, opt)
        if v is not None and v < (0 if opt == "step" else 1):
            raise EvalError(f"--{opt.replace('_', '-')}: must be >= {0 if opt == 'step' else 1}, got {v}")
    try:
        opts.edges  # noqa: B018 - parsed here, to name a bad list before anything loads
    except ValueError:
        raise EvalError(f"--bucket-edges: {opts.bucket_edges!r} is not a comma-separated list of numbers") from None
    if opts.out and len(opts.runs) > 1:
        raise EvalError(f"--out names one report and {len(opts.runs)} runs were given: leave --out out, and each "
                        "report is written to RUN/eval/<tag>.json")  # fmt: skip


def evaluate(opts: EvalOptions, world: tuple[int, int], device) -> tuple[EvalReport, Path | None]:
    """Everything ``opts`` asks of ``opts.run``, as an :class:`EvalReport`, and the run's TensorBoard directory
    (None when the run logged none): the header, then one section per metric, each filling its part."""
    t0 = time.monotonic()
    tr = _load(opts, device)
    sc = _scoring(opts, tr, world, device)
    report = _header(opts, tr, sc, world, device)
    scored = _heldout(opts, tr.cfg, sc, report) if opts.heldout else []
    if scored and opts.frequency:
        _frequency(opts, tr.cfg.data.prefixes, sc.vocab_size, scored, report)
    if opts.wikitext or opts.lambada:
        tok = _text_tokenizer(tr)
        if opts.wikitext:
            _wikitext(opts.wikitext, opts.wikitext_stride, tok, sc, report)
        if opts.lambada:
            _lambada(opts.lambada, tok, sc, report)
    if opts.geometry:
        _geometry(opts, tr, sc, report)
    if not (report.heldout or report.wikitext or report.lambada):
        raise EvalError("nothing to evaluate: --no-heldout without --wikitext or --lambada")
    report.seconds = round(time.monotonic() - t0, 1)
    return report, _tensorboard_dir(opts, tr.cfg)


def _load(opts: EvalOptions, device) -> Trained:
    """The run's checkpoint as one model, in ``--dtype`` on ``device``."""
    dtype = torch_dtype(opts.dtype)
    if dtype == torch.bfloat16 and device.type != "cuda":
        raise EvalError("--dtype bf16: needs a GPU here (CPU bf16 matmuls are slow and not what training used)")
    return load_trained(opts.run, opts.step, opts.checkpoint_dir, opts.tokenizer, device=device, dtype=dtype)


def _scoring(opts: EvalOptions, tr: Trained, world: tuple[int, int], device) -> _Scoring:
    """The windows (``--context``, default the trained seq_length; ``--stride``, default disjoint) and the rest
    every section scores with."""
    seq_length = tr.cfg.model.seq_length
    context = opts.context or seq_length
    if context > seq_length:
        print(f"[evaluate] note: --context {context} is longer than the trained seq_length {seq_length}")
    stride = opts.stride or context
    if stride > context:
        raise EvalError(f"--stride {stride}: must be <= --context {context}")
    kw = dict(batch_size=opts.batch_size, device=device, shard=world)
    return _Scoring(tr.model, tr.vocab_size, context, stride, kw, not opts.quiet and world[0] == 0)


def _header(opts: EvalOptions, tr: Trained, sc: _Scoring, world: tuple[int, int], device) -> EvalReport:
    """The report with what was loaded (run, checkpoint, parameters, tokens seen) and the settings, no metric yet;
    says what was loaded. ``params``: the trained parameters (``total``) in model/counts.py's words, as
    ``python -m leviathan_pretrain.params`` and the trainer's start count them."""
    cfg, layout = tr.cfg, tr.record.layout
    counts = param_counts.param_summary(cfg.model, layout.tp)  # at the TP it trained with: its padded vocabulary
    total, n_input = counts["total"], counts["input"]
    extra = ("body", "head", "padding", "vocab_size", "padded_vocab_size", "tensor_parallel")
    report = EvalReport(
        run=str(Path(opts.run).resolve()),
        checkpoint=str((tr.ckpt_dir / tr.tag).resolve()),
        tag=tr.tag,
        step=tr.step,
        variant=tr.variant,
        params={"total": total, "input_layer": n_input, "non_input": total - n_input, **{k: counts[k] for k in extra}},
        tokens_seen=tr.record.consumed_samples * cfg.model.seq_length,
        created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        settings={"context": sc.context, "stride": sc.stride, "batch_size": opts.batch_size, "device": str(device),
                  "dtype": opts.dtype, "max_tokens": opts.max_tokens, "world": world[1]},
    )  # fmt: skip
    if sc.verbose:
        print(f"[evaluate] {tr.ckpt_dir / tr.tag}: {tr.variant}, layout {layout.to_json()}, step {tr.step}", flush=True)
    return report


def _heldout(opts: EvalOptions, cfg, sc: _Scoring, report: EvalReport) -> list[tuple]:
    """Each held-out set (``--data``, else the run's) scored into ``report.heldout``; ``(losses, targets)`` of
    each set, for the frequency buckets."""
    scored = []
    for hs in H.heldout_sets(cfg, opts.data):
        entry, s = _heldout_set(hs, opts.max_tokens, sc)
        report.heldout.append(entry)
        scored.append((s.loss, s.target))
    return scored


def _heldout_set(hs, max_tokens: int | None, sc: _Scoring) -> tuple[dict, object]:
    """One held-out set's report entry and its :class:`~leviathan_pretrain.evaluation.scoring.Scores`. The entry
    names the data (``prefix``, ``document_range`` [first, end) of the shard's documents read, ``split``:
    "validation" for the validation split of a ``data.prefixes`` shard, else None: the file from its start) and
    ``tokens``, the target tokens scored (every one of the stream, each once)."""
    tokens, docs, left = H.read_stream(hs, max_tokens)
    first = hs.documents[0] if hs.documents else 0
    if tokens.size < 2:
        raise EvalError(f"{hs.prefix}: fewer than 2 tokens to evaluate")
    if int(tokens.max()) >= sc.vocab_size:
        raise EvalError(
            f"{hs.prefix}: token id {int(tokens.max())} >= model.vocab_size={sc.vocab_size}: another tokenizer"
        )
    meter = Meter(hs.name, tokens.size - 1, sc.verbose)
    s = score_streams(sc.model, [tokens], sc.vocab_size, sc.context, sc.stride, progress=meter, **sc.kw)[0]
    meter.close()
    entry = {"name": hs.name, "prefix": str(Path(hs.prefix).resolve()), "documents": docs, "documents_left_out": left,
             "document_range": [first, first + docs], "split": "validation" if hs.documents else None,
             "tokens": s.tokens, "loss": s.mean_loss, "ppl": math.exp(s.mean_loss),
             **meter.rates(s.tokens)}  # fmt: skip
    return entry, s


def _frequency(opts: EvalOptions, prefixes, vocab_size: int, scored: list[tuple], report: EvalReport) -> None:
    """``report.frequency``: the held-out targets' perplexity by training frequency (``--bucket-edges`` or
    ``--quantile-buckets``); skipped, with a note, when the training counts are not to be had."""
    try:
        train_counts, files = H.training_counts(list(prefixes), vocab_size)
    except EvalError as e:
        print(f"[evaluate] frequency buckets skipped: {e}", file=sys.stderr)
        return
    losses, targets = (np.concatenate(arrays) for arrays in zip(*scored))
    fr = H.frequency_buckets(losses, targets, train_counts, opts.edges, opts.quantile_buckets)
    report.frequency = {"counts": files, **fr}


def _geometry(opts: EvalOptions, tr: Trained, sc: _Scoring, report: EvalReport) -> None:
    """``report.geometry``: the token vectors' geometry (model/geometry.py), overall and per training-frequency
    bucket (the same buckets as ``report.frequency``; none when the training counts are not to be had). Read off the
    model's parameters: no data, the same on every rank."""
    buckets = []
    try:
        counts, _ = H.training_counts(list(tr.cfg.data.prefixes), sc.vocab_size)
        specs = (
            H.quantile_buckets(counts, opts.quantile_buckets) if opts.quantile_buckets else H.decade_buckets(opts.edges)
        )
        buckets = G.bucket_ids(counts, specs)
    except EvalError as e:
        if sc.verbose:
            print(f"[evaluate] geometry by frequency skipped: {e}", file=sys.stderr)
    report.geometry = G.geometry(sc.model, sc.vocab_size, buckets)


def _text_tokenizer(tr: Trained):
    """The run's tokenizer, which WikiText and LAMBADA need."""
    if tr.tokenizer is None:
        raise EvalError(
            "WikiText/LAMBADA need the run's tokenizer: the recorded data.tokenizer is missing; give --tokenizer PATH"
        )
    return tr.tokenizer


def _wikitext(path: str, stride: int | None, tok, sc: _Scoring, report: EvalReport) -> None:
    """``report.wikitext``: zero-shot WikiText-103 of ``path``, windows of ``stride`` new tokens (default half
    the context)."""
    texts = T.wikitext_articles(path)
    ws = stride or max(1, sc.context // 2)
    if ws > sc.context:
        raise EvalError(f"--wikitext-stride {ws}: must be <= --context {sc.context}")
    streams = T.wikitext_streams(tok, tok.eod_id, texts)
    meter = Meter("wikitext", sum(len(s) - 1 for s in streams), sc.verbose)
    w = T.score_wikitext(sc.model, streams, sc.vocab_size, texts, sc.context, ws, progress=meter, **sc.kw)
    meter.close()
    inputs = sum(x.end - x.start for i, s in enumerate(streams) for x in windows(len(s), sc.context, ws, i))
    report.wikitext = {"path": str(Path(path).resolve()), **w, **meter.rates(w["tokens"], inputs)}


def _lambada(path: str, tok, sc: _Scoring, report: EvalReport) -> None:
    """``report.lambada``: last-word accuracy on the examples of ``path``."""
    examples = T.lambada_examples(path)
    la = T.score_lambada(sc.model, tok, tok.eod_id, sc.vocab_size, examples, sc.context, **sc.kw)
    la.pop("word_nats")
    report.lambada = {"path": str(Path(path).resolve()), **la}


def evaluate_runs(opts: EvalOptions) -> int:
    """Every ``--run`` in turn, each evaluated alone with the same settings into its own report (written by rank
    0); 0."""
    _check_args(opts)
    with eval_world(opts.device) as device:
        world = (dist.get_rank(), dist.get_world_size())
        for i, run in enumerate(opts.runs):  # --run: one or more (each evaluated alone below)
            if len(opts.runs) > 1 and world[0] == 0:
                print(f"[evaluate] run {i + 1}/{len(opts.runs)}: {run}", flush=True)
            one = dataclasses.replace(opts, run=run)
            report, tb = evaluate(one, world, device)
            if world[0] == 0:
                _write(one, report, tb)
    return 0


def _write(opts: EvalOptions, report: EvalReport, tb: Path | None) -> None:
    out = Path(opts.out) if opts.out else RunLayout(Path(opts.run)).report(report.tag)
    report.write(out)
    print(console_table(report))
    print(f"\nreport: {out}")
    if tb is not None and opts.tensorboard:
        write_tensorboard(tb, report.step, tensorboard_scalars(report))
        print(f"tensorboard: eval/ scalars at step {report.step} in {tb}")


def _tensorboard_dir(opts: EvalOptions, cfg) -> Path | None:
    """The run's TensorBoard directory: the recorded ``logging.tensorboard_dir`` if it exists here, else
    RUN/tensorboard (None when the run logged no TensorBoard)."""
    if not cfg.logging.tensorboard:
        return None
    recorded = cfg.logging.tensorboard_dir
    if recorded and Path(recorded).is_dir():
        return Path(recorded)
    return RunLayout(Path(opts.run)).events
