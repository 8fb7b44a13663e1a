"""The geometry of a model's token vectors: its input rows (LEV materialised, a table as it is) and its output head.

For a set of ids (sampled with a fixed seed; per training-frequency bucket too), of the rows ``X [n, D]``:

- ``rms``: sqrt(mean(X^2));
- ``cosine``: the mean pairwise cosine of the rows, ``(||sum_i x_i/|x_i| ||^2 - n) / (n (n - 1))`` (0 for
  independent random rows, 1 when all point one way);
- ``mean_share``: the mean row's norm over the mean row norm, ``||mean_i x_i|| / mean_i ||x_i||`` (the common
  mode's part of a row; ~1/sqrt(n) for random rows);
- ``eff_rank``: the effective rank, ``exp(entropy(s / sum(s)))`` of the singular values ``s`` of ``X`` (not
  centred: a common mode is one large singular value), between 1 and min(n, D).

The paper speaks of the "anisotropic geometry" of tables; these make it a number (docs/evaluation.md). They are
read off the model's own parameters at TP = 1 (:func:`input_rows`, :func:`head_rows`); nothing is trained.
"""

from __future__ import annotations

import torch

SAMPLE, SEED = 2048, 4321  # ids per measurement, and the seed that draws them


def row_geometry(rows: torch.Tensor) -> dict:
    """``{rows, width, rms, cosine, mean_share, eff_rank}`` of ``rows [n, D]`` (computed in float64)."""
    x = rows.detach().double()
    n = x.shape[0]
    if n == 0:
        return {"rows": 0, "width": x.shape[1], "rms": None, "cosine": None, "mean_share": None, "eff_rank": None}
    norms = x.norm(dim=1)
    unit = x / norms.clamp_min(1e-30)[:, None]
    cosine = float((unit.sum(0).pow(2).sum() - n) / (n * (n - 1))) if n > 1 else None
    s = torch.linalg.svdvals(x)
    p = s / s.sum().clamp_min(1e-30)
    entropy = -(p[p > 0] * p[p > 0].log()).sum()
    return {
        "rows": n,
        "width": x.shape[1],
        "rms": float(x.pow(2).mean().sqrt()),
        "cosine": cosine,
        "mean_share": float(x.mean(0).norm() / norms.mean().clamp_min(1e-30)),
        "eff_rank": float(entropy.exp()),
    }


def sample_ids(pool: torch.Tensor, n: int = SAMPLE, seed: int = SEED) -> torch.Tensor:
    """Up to ``n`` of the ids in ``pool``, drawn with ``seed`` (the same on every machine), sorted."""
    if pool.numel() <= n:
        return pool.sort().values
    gen = torch.Generator().manual_seed(seed)
    return pool[torch.randperm(pool.numel(), generator=gen)[:n]].sort().values


@torch.no_grad()
def input_rows(model, ids: torch.Tensor) -> torch.Tensor:
    """The input vectors of ``ids`` (``[n, D]``, fp32) of a TP = 1 :class:`~.assembly.GPT`: a table's rows (TIED,
    UNTIED), or a computed input's ``compute_rows`` (LEV, ALBERT, the MLPs)."""
    layer = model.input_layer
    if hasattr(layer, "compute_rows"):
        device = next(layer.parameters()).device
        return layer.compute_rows(ids.to(device)).float()
    weight = layer.word_embeddings.weight
    return weight[ids.to(weight.device)].float()


@torch.no_grad()
def head_rows(model, ids: torch.Tensor) -> torch.Tensor:
    """The output head's rows of ``ids`` (``[n, D]``, fp32); for TIED the input table itself."""
    weight = model.head_weight
    return weight[ids.to(weight.device)].float()


def geometry(model, vocab_size: int, buckets: list[tuple[str, torch.Tensor]] = ()) -> dict:
    """``{sample, seed, input: {..., buckets: [...]}, head: {...}}``: :func:`row_geometry` of the input rows and the
    head rows over :data:`SAMPLE` ids of the vocabulary, and over each ``(name, ids of the bucket)``."""
    out = {"sample": SAMPLE, "seed": SEED}
    everyone = sample_ids(torch.arange(vocab_size))
    for key, rows_of in (("input", input_rows), ("head", head_rows)):
        part = row_geometry(rows_of(model, everyone))
        empty = torch.zeros(0, part["width"])
        part["buckets"] = [
            {
                "name": name,
                "types": int(ids.numel()),
                **row_geometry(rows_of(model, sample_ids(ids)) if ids.numel() else empty),
            }
            for name, ids in buckets
        ]
        out[key] = part
    return out


def bucket_ids(counts, specs: list[tuple[str, float, float]]) -> list[tuple[str, torch.Tensor]]:
    """The vocabulary's ids by relative training frequency: ``unseen`` (count 0), then one entry per ``(name, lo,
    hi)`` of :func:`~leviathan_pretrain.evaluation.heldout.decade_buckets` / ``quantile_buckets`` (the same edges
    the frequency buckets of the report use; the last one closed)."""
    c = torch.as_tensor(counts, dtype=torch.float64)
    rel = c / max(float(c.sum()), 1.0)
    out = [("unseen", torch.nonzero(c == 0).flatten())]
    for i, (name, lo, hi) in enumerate(specs):
        last = i == len(specs) - 1
        m = (c > 0) & (rel >= lo) & ((rel <= hi) if last else (rel < hi))
        out.append((name, torch.nonzero(m).flatten()))
    return out


def summary(g: dict) -> str:
    """Two console lines: the input rows and the head rows, over the whole sample."""
    return "\n".join(
        f"  {key:<5} rms {g[key]['rms']:.4f}  cosine {g[key]['cosine']:+.3f}  mean share {g[key]['mean_share']:.3f}  "
        f"effective rank {g[key]['eff_rank']:.1f} (of at most {min(g[key]['rows'], g[key]['width'])})"
        for key in ("input", "head")
    )
