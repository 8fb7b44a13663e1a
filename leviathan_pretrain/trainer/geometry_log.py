"""The token vectors' geometry during training (``logging.geometry_interval``): model/geometry.py's measures of
the input rows and of the output head's rows, at step 0 (the model as initialised, before any step) and every N
steps, into TensorBoard (``geometry/input/cosine`` ...) and ``train_log.jsonl`` (a step record of the same flat
keys, which ``compare`` plots against tokens).

The same 2,048 ids as ``evaluate``'s report (:data:`~leviathan_pretrain.model.geometry.SEED`), so a run's value
at step 0 and the report's at the end are of the same rows. Read off the training model in place, at any TP / PP /
ZeRO stage: a computed input's rows are ``compute_rows`` summed over TP where they are partial (as
``materialize``), a vocab-parallel table's rows (TIED / UNTIED input, every head) are each TP rank's own rows
summed over TP; under ZeRO 3 the pieces' parameters are gathered for the measurement. Input rows on the first
pipeline stage, head rows on the last (TIED's tied copy there), the result sent to the writer rank.
"""

from __future__ import annotations

import contextlib

import deepspeed
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from leviathan_pretrain.model import geometry as G
from leviathan_pretrain.model.gpt import InputPiece, OutputPiece

MEASURES = ("rms", "cosine", "mean_share", "eff_rank")


def _piece(module: torch.nn.Module, kind: type) -> torch.nn.Module | None:
    return next((m for m in module.modules() if isinstance(m, kind)), None)


def _tp_sum(rows: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(rows, group=group)
    return rows


@torch.no_grad()
def vocab_parallel_rows(weight: torch.Tensor, ids: torch.Tensor, group) -> torch.Tensor:
    """The rows ``[n, D]`` (fp32) of ``ids`` of a ``[V_pad / tp, D]`` vocab-parallel weight: each TP rank's own
    rows, zeros elsewhere, summed over TP (collective over ``group``)."""
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    per = weight.shape[0]
    local = ids.to(weight.device) - rank * per
    inside = (local >= 0) & (local < per)
    rows = torch.zeros(ids.numel(), weight.shape[1], device=weight.device, dtype=torch.float32)
    rows[inside] = weight[local[inside]].float()
    return _tp_sum(rows, group)


@torch.no_grad()
def input_rows(piece: InputPiece, ids: torch.Tensor) -> torch.Tensor:
    """The input rows of ``ids`` (collective over the piece's TP group)."""
    layer = piece.embedding
    if hasattr(layer, "compute_rows"):
        device = next(layer.parameters()).device
        rows = layer.compute_rows(ids.to(device)).float()
        return _tp_sum(rows, layer.tp_group) if layer.partial_over_tp else rows
    return vocab_parallel_rows(piece.table, ids, piece.tp_group)


@torch.no_grad()
def head_rows(module: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor | None:
    """The output head's rows of ``ids`` on the last stage (TIED: its input table); None on other stages."""
    out = _piece(module, OutputPiece)
    if out is not None:
        return vocab_parallel_rows(out.output_layer.weight, ids, out.tp_group)
    tied = _piece(module, InputPiece)
    if tied is not None and hasattr(tied, "head_options"):
        return vocab_parallel_rows(tied.table, ids, tied.tp_group)
    return None


def _measure(piece: torch.nn.Module | None, rows_of, prefix: str, zero3: bool, groups) -> dict:
    if piece is None:
        return {}
    out = {}
    with deepspeed.zero.GatheredParameters(list(piece.parameters())) if zero3 else contextlib.nullcontext():
        for name, ids in groups:
            rows = rows_of(ids)
            if rows is None:
                return {}
            g = G.row_geometry(rows)
            at = prefix if name is None else f"{prefix}/{name}"
            out.update({f"{at}/{k}": g[k] for k in MEASURES if g[k] is not None})
    return out


def id_groups(cfg) -> list[tuple[str | None, torch.Tensor]]:
    """``[(None, the sampled ids), (bucket name, its sampled ids), ...]``: the buckets (``evaluate``'s decades of
    training frequency) only with ``logging.geometry_buckets`` and the shards' counts at hand."""
    vocab = cfg.model.vocab_size
    groups = [(None, G.sample_ids(torch.arange(vocab)))]
    if cfg.logging.geometry_buckets:
        from leviathan_pretrain.evaluation import heldout as H
        from leviathan_pretrain.evaluation.load import EvalError

        try:
            counts, _ = H.training_counts(list(cfg.data.prefixes), vocab)
        except EvalError:
            return groups
        groups += [(name, G.sample_ids(ids)) for name, ids in G.bucket_ids(counts, H.decade_buckets()) if ids.numel()]
    return groups


def geometry_stats(cfg, module: torch.nn.Module, dims, groups) -> dict:
    """Collective (every rank): ``{"geometry/input/cosine": ..., "geometry/head/...": ...}`` on the writer rank
    (the input part sent from the first stage under PP)."""
    zero3 = cfg.parallel.zero_stage == 3
    stats = {}
    if dims.first_stage:
        piece = _piece(module, InputPiece)
        stats = _measure(piece, lambda ids: input_rows(piece, ids), "geometry/input", zero3, groups)
    if dims.pp > 1:
        box = [stats]
        dist.broadcast_object_list(
            box, src=ps.get_pipeline_model_parallel_first_rank(), group=ps.get_pipeline_model_parallel_group()
        )
        stats = dict(box[0])
    if dims.last_stage:
        owner = _piece(module, OutputPiece) or _piece(module, InputPiece)
        stats.update(_measure(owner, lambda ids: head_rows(module, ids), "geometry/head", zero3, groups))
    return stats
