"""Held-out shards and training-frequency buckets.

- :func:`heldout_sets` — what to evaluate: ``--data PREFIX ...``, else the run's ``data.valid_prefixes``, else
  the validation split of each training prefix exactly as megatron-core cut it in training
  (``trainer.data.split_bounds``: the same documents the trainer validated on);
- :func:`read_stream` — a set's documents as one token stream, as training packs them (each document ends
  with the EOD token data_prep wrote), read with megatron-core's ``IndexedDataset``;
- :func:`training_counts` — how often each token id occurs in the training data: the training shards'
  ``PREFIX.counts.npy`` (data_prep writes them), summed over the blended prefixes;
- :func:`frequency_buckets` — per-target losses grouped by the *target* token's relative training frequency:
  log decades (``<1e-07``, ``1e-07..1e-06``, ..., ``>=1e-03``; edges configurable) or, with ``quantiles=K``, K
  buckets holding equal shares of the training token mass (rare types first); ids never seen in training
  have their own ``unseen`` bucket. Per bucket: targets, distinct types, mean loss (nats), ppl = exp(mean).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from leviathan_pretrain.evaluation.load import EvalError

DECADES = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3)


@dataclass
class HeldoutSet:
    name: str
    prefix: str
    documents: tuple[int, int] | None = None  # [begin, end) document range; None: all


def _check_prefix(prefix: str) -> None:
    for ext in (".bin", ".idx"):
        if not Path(prefix + ext).is_file():
            raise EvalError(f"{prefix}{ext}: not found (give shard prefixes: PREFIX.bin + PREFIX.idx)")


def heldout_sets(cfg, data: list[str] | None) -> list[HeldoutSet]:
    """The held-out sets to score (see the module doc); names are the prefixes' file names."""
    if data:
        sets = [HeldoutSet(Path(p).name, p) for p in data]
    elif cfg.data.valid_prefixes:
        sets = [HeldoutSet(Path(p).name, p) for p in cfg.data.valid_prefixes]
    else:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        from leviathan_pretrain.data.datasets import split_bounds

        sets = []
        for p in cfg.data.prefixes:
            _check_prefix(p)
            n = len(IndexedDataset(p, mmap=True))
            bounds = split_bounds(cfg.data.split, n)[1]
            if bounds is None or bounds[1] <= bounds[0]:
                raise EvalError(f"{p}: data.split={cfg.data.split!r} gives it no validation documents; use --data")
            sets.append(HeldoutSet(f"{Path(p).name}:valid", p, bounds))
        if not sets:
            raise EvalError("the run has no data.prefixes or data.valid_prefixes recorded: give --data PREFIX")
    for s in sets:
        _check_prefix(s.prefix)
    return sets


def read_stream(hs: HeldoutSet, max_tokens: int | None = None) -> tuple[np.ndarray, int, int]:
    """``(tokens int64, documents read, documents left out by max_tokens)`` of a held-out set: whole documents
    in order until ``max_tokens`` would be passed (at least one)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(hs.prefix, mmap=True)
    begin, end = hs.documents or (0, len(ds))
    lengths = np.asarray(ds.sequence_lengths[begin:end], dtype=np.int64)
    n = len(lengths)
    if max_tokens is not None and n:
        n = max(1, int(np.searchsorted(np.cumsum(lengths), max_tokens, side="right")))
    parts = [np.asarray(ds[i], dtype=np.int64) for i in range(begin, begin + n)]
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return tokens, n, (end - begin) - n


def training_counts(prefixes: list[str], vocab_size: int) -> tuple[np.ndarray, list[str]]:
    """Summed ``PREFIX.counts.npy`` of the training prefixes (length ``vocab_size``) and the files read."""
    if not prefixes:
        raise EvalError("the run records no data.prefixes: no training frequencies (use --no-frequency)")
    total, files = np.zeros(vocab_size, dtype=np.int64), []
    for p in prefixes:
        f = Path(p + ".counts.npy")
        if not f.is_file():
            raise EvalError(f"{f}: not found (data_prep writes it beside each shard; or use --no-frequency)")
        c = np.load(f, allow_pickle=False).astype(np.int64)
        if c.ndim != 1 or len(c) > vocab_size and c[vocab_size:].any():
            raise EvalError(f"{f}: counts of ids beyond model.vocab_size={vocab_size}: another tokenizer's shard")
        total[: min(len(c), vocab_size)] += c[:vocab_size]
        files.append(str(f.resolve()))
    return total, files


def _fmt(x: float) -> str:
    """``1e-07``, ``2.5e-05``: a relative frequency as a bucket name."""
    mantissa, exp = f"{x:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{exp}"


def decade_buckets(edges=DECADES) -> list[tuple[str, float, float]]:
    """``[(name, lo, hi), ...]`` relative-frequency intervals ``[lo, hi)`` for ``edges``, after ``unseen``."""
    edges = sorted(float(e) for e in edges)
    if not edges or edges[0] <= 0 or edges[-1] >= 1:
        raise EvalError(f"--bucket-edges: need increasing relative frequencies in (0, 1), got {edges}")
    out = [(f"<{_fmt(edges[0])}", 0.0, edges[0])]
    out += [(f"{_fmt(a)}..{_fmt(b)}", a, b) for a, b in zip(edges, edges[1:])]
    out.append((f">={_fmt(edges[-1])}", edges[-1], 1.0))
    return out


def quantile_buckets(counts: np.ndarray, k: int) -> list[tuple[str, float, float]]:
    """About K intervals of relative frequency, each holding ~1/K of the training token mass (rarest types
    first); fewer when types of one frequency carry more than 1/K on their own."""
    if k < 2:
        raise EvalError(f"--quantile-buckets: need at least 2, got {k}")
    freq = np.sort(counts[counts > 0]) / counts.sum()
    cum = np.cumsum(freq)
    edges = sorted({float(freq[min(len(freq) - 1, int(np.searchsorted(cum, q / k)))]) for q in range(1, k)})
    edges = [e for e in edges if e > float(freq[0])]  # the first bucket starts at the rarest type
    bounds = [0.0, *edges, 1.0]
    n = len(bounds) - 1
    return [(f"q{i + 1}/{n}", bounds[i], bounds[i + 1]) for i in range(n)]


def frequency_buckets(
    losses: np.ndarray, targets: np.ndarray, counts: np.ndarray, edges=DECADES, quantiles: int | None = None
) -> dict:
    """The ``frequency`` part of a report (see the module doc); ``losses``/``targets``: every scored target."""
    total = int(counts.sum())
    if total == 0:
        raise EvalError("the training counts are all zero")
    rel = counts[targets] / total
    specs = quantile_buckets(counts, quantiles) if quantiles else decade_buckets(edges)
    seen = counts[targets] > 0
    buckets = [_bucket("unseen", 0.0, 0.0, losses[~seen], targets[~seen])]
    for i, (name, lo, hi) in enumerate(specs):
        last = i == len(specs) - 1
        m = seen & (rel >= lo) & ((rel <= hi) if last else (rel < hi))
        buckets.append(_bucket(name, lo, hi, losses[m], targets[m]))
    return {
        "training_tokens": total,
        "mode": f"quantiles:{quantiles}" if quantiles else "decades",
        "buckets": buckets,
    }


def _bucket(name: str, lo: float, hi: float, losses: np.ndarray, targets: np.ndarray) -> dict:
    mean = float(losses.mean()) if losses.size else None
    return {
        "name": name,
        "lo": lo,
        "hi": hi,
        "tokens": int(losses.size),
        "types": int(np.unique(targets).size),
        "loss": mean,
        "ppl": math.exp(mean) if mean is not None else None,
    }
