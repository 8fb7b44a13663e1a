"""Closed-form sizes of every variant: padded vocabulary, matched ablation widths, parameter counts.

Pure Python (no torch, no megatron import) so ``python -m leviathan_pretrain.params`` is instant; the
counts are cross-checked against real models in tests/test_params.py.

Conventions:
- The output head (and the TIED/UNTIED input table) has megatron's padded vocabulary: a multiple of
  ``make_vocab_size_divisible_by * tensor_parallel`` (Megatron-LM's rule); LEV and the ablations index
  only the real ids ``[0, vocab_size)``.
- ``input`` = the input representation; ``head`` = the untied output head (0 for TIED, whose head *is*
  the input table); ``body`` = transformer layers + final norm.

What needs a variant's registry entry (its input's parameters, whether its head is tied) is counted in
:mod:`.counts`, which imports this module and the registry (:mod:`.variants`), which imports this one: no cycle.
"""

from __future__ import annotations

import math

MATCH_MULTIPLE = 8  # matched MLP widths are rounded to this (TP up to 8 divides them)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int = 1) -> int:
    multiple = max(1, divisible_by) * max(1, tensor_parallel)
    return int(math.ceil(vocab_size / multiple) * multiple)


def lev_codebook_params(vocab_size: int, lev) -> int:
    """LEV's shared digit codebooks ``k*b*d_seed`` (replicated over TP)."""
    return lev.digits * lev.resolved_base(vocab_size) * lev.seed_dim


def lev_head_params(hidden: int, lev) -> int:
    """LEV's heads ``h*(d_seed^2 + 2*d_seed + d_seed*kappa*r + r*D)`` (split over TP)."""
    d = lev.seed_dim
    return lev.heads * (d * d + 2 * d + d * lev.knots * lev.rank + lev.rank * hidden)


def lev_input_params(vocab_size: int, hidden: int, lev) -> int:
    """Spec: ``k*b*d_seed + h*(d_seed^2 + 2*d_seed + d_seed*kappa*r + r*D)``."""
    return lev_codebook_params(vocab_size, lev) + lev_head_params(hidden, lev)


def _round_multiple(x: float, m: int = MATCH_MULTIPLE) -> int:
    return max(m, int(round(x / m)) * m)


def albert_dim(model) -> int:
    """ALBERT's ``e`` with ``V*e + e*D`` ~= LEV's input parameter count (unless ``model.albert_dim`` is set)."""
    if model.albert_dim is not None:
        return model.albert_dim
    budget = lev_input_params(model.vocab_size, model.hidden_size, model.lev)
    return max(1, int(round(budget / (model.vocab_size + model.hidden_size))))


def factored_mlp_hidden(model) -> int:
    """Factored MLP: digit codebooks ``k*b*d_seed`` + LayerNorm + MLP ``d_seed -> m -> D``; ``m`` matches
    LEV's parameter count (unless ``model.mlp_hidden`` is set)."""
    if model.mlp_hidden is not None:
        return model.mlp_hidden
    lev = model.lev
    d = lev.seed_dim
    budget = lev_input_params(model.vocab_size, model.hidden_size, lev)
    codebooks = lev_codebook_params(model.vocab_size, lev)
    return _round_multiple((budget - codebooks - 2 * d) / (d + model.hidden_size))


def flat_mlp_dims(model) -> tuple[int, int]:
    """Flat MLP: table ``V x e`` + MLP ``e -> m -> D``. Default: about half of LEV's budget to
    the table, the rest to the MLP (``model.flat_mlp_dim`` / ``model.mlp_hidden`` override)."""
    budget = lev_input_params(model.vocab_size, model.hidden_size, model.lev)
    e = model.flat_mlp_dim if model.flat_mlp_dim is not None else max(1, budget // 2 // model.vocab_size)
    if model.mlp_hidden is not None:
        return e, model.mlp_hidden
    rest = max(0, budget - model.vocab_size * e)
    return e, _round_multiple(rest / (e + model.hidden_size))


def layer_params_split(model) -> tuple[int, int]:
    """One transformer layer's ``(replicated, tp_sharded)`` parameters: two RMSNorms; QKV, the attention output
    and SwiGLU (the matmul weights). No biases."""
    D = model.hidden_size
    heads = model.num_attention_heads
    kv = (model.num_query_groups or heads) * (D // heads)
    F = model.resolved_ffn_hidden_size()
    return 2 * D, D * (D + 2 * kv) + D * D + 3 * D * F


def body_params(model) -> int:
    """Transformer layers (RMSNorm, QKV, proj, SwiGLU; no biases) + the final norm."""
    return model.num_layers * sum(layer_params_split(model)) + model.hidden_size


# The fused loss (model/loss.py) computes the head's logits at most this many bytes of fp32 logits a chunk at a
# time (per rank: the chunk x V_pad / tp slice); set ``model.loss_chunk_tokens`` to fix the chunk instead.
# CUDA: 2 GiB. Each chunk also reads and writes the head weight's [V, D] fp32 gradient sum, so few chunks pay:
# on an H200 (400M TIED, V = 200,064, 8,192 tokens a micro-batch, gpu_check 2026-12-04) our step over a plain
# Hugging Face Llama's was 1.271 with 670-token chunks (the old 512 MiB), 1.112 with 2,048, 1.071 with 8,192.
# ``model.loss_impl: liger`` (model/loss_liger.py) holds only the model-dtype logits of a chunk (no fp32 copy): the
# same budget at the model dtype's bytes per logit (V = 200,064, bf16: 5,366 tokens, an 8,192-token micro-batch
# in two chunks of 4,096).
LOSS_CHUNK_BYTES = {"cuda": 2 * 2**30, "cpu": 128 * 2**20}
LOSS_CHUNK_MIN = 64


def loss_chunk_tokens(vocab_local: int, device: str, override: int | None = None, bytes_per_logit: int = 4) -> int:
    """Tokens per chunk of the fused loss for a ``vocab_local``-wide head slice on ``device`` (``cuda``/``cpu``,
    ``gpu`` is ``cuda``): ``override``, else as many as fit :data:`LOSS_CHUNK_BYTES` at ``bytes_per_logit`` (4:
    the fused loss's fp32 logits; the liger loss: the model dtype's) (at least 64)."""
    if override is not None:
        return int(override)
    budget = LOSS_CHUNK_BYTES["cpu" if device == "cpu" else "cuda"]
    return max(LOSS_CHUNK_MIN, budget // (bytes_per_logit * max(1, vocab_local)))


def loss_spans(tokens: int, chunk: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` spans the fused loss (model/loss.py) walks ``tokens`` in under a ``chunk`` limit: as few as
    the limit allows, their lengths differing by at most one (8,192 tokens under 2,683: four of 2,048, not three
    of 2,683 and one of 143)."""
    k = max(1, -(-tokens // max(1, chunk)))
    q, r = divmod(tokens, k)
    bounds = [i * q + min(i, r) for i in range(k + 1)]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def balanced_chunk(tokens: int, chunk: int) -> int:
    """The longest of :func:`loss_spans` (what the planner counts); ``chunk`` when there are no tokens."""
    return max((hi - lo for lo, hi in loss_spans(tokens, chunk)), default=max(1, chunk))


# LEV's spline product (model/spline.py) walks the unique ids of a micro-batch this many bytes of work buffers
# at a time (per rank: heads / tp heads); ``model.lev.chunk_mib`` sets the budget, ``model.lev.token_chunk`` the
# chunk itself. CPU: 48 MiB = 64 ids at the spec's defaults (h 8, d_seed 128, kappa 16, r 64), cache-friendly
# blocks. CUDA: few enough chunks (launch overhead: ~100 small kernels a chunk) with big enough kernels: 512 MiB
# (682 ids). Measured on an H200 (benchmarks/profile_lev_gpu.py --scale 400m, 4,327 unique ids, forward +
# backward per micro-batch, 2026-12-04): 48 MiB 75.5 ms, 128 MiB 33.0, 256 MiB 21.1, 512 MiB 14.6, 1 GiB 13.7.
LEV_CHUNK_BYTES = {"cuda": 512 * 2**20, "cpu": 48 * 2**20}
LEV_COORD_BYTES = 128  # per (id, head, coordinate): the basis's and its derivative's temporaries (measured 68-78)


def lev_chunk_bytes_per_id(heads_local: int, seed_dim: int, knots: int, rank: int) -> int:
    """Peak work bytes of one unique id in a chunk of the spline product: its backward (which recomputes ``phi``)
    holds, per (head, coordinate) pair, two fp32 ``[r]`` rows (``phi`` and ``dL/dphi``), two fp32 ``[kappa]`` rows
    (the basis matrix and ``dL/dphi S^T``) and :data:`LEV_COORD_BYTES` of element-wise temporaries (knot indices,
    3 weights and their gradients, int64 neighbour indices, ...); the forward holds less (measured on CPU:
    backward 708 B per pair at the spec's defaults vs 768 counted, forward 552)."""
    return heads_local * seed_dim * (8 * rank + 8 * knots + LEV_COORD_BYTES)


def lev_chunk_ids(lev, heads_local: int, device: str) -> int:
    """Unique ids per chunk of LEV's spline product on ``device`` (``cuda``/``cpu``; any other is ``cuda``):
    ``lev.token_chunk``; else the legacy ``lev.chunk_elements // (heads_local * d_seed * r)``; else as many as
    fit ``lev.chunk_mib`` MiB (null: :data:`LEV_CHUNK_BYTES` of the device) by :func:`lev_chunk_bytes_per_id`.
    At least 1."""
    if lev.token_chunk is not None:
        return int(lev.token_chunk)
    if lev.chunk_elements is not None:
        return max(1, lev.chunk_elements // max(1, heads_local * lev.seed_dim * lev.rank))
    if lev.chunk_mib is not None:
        budget = lev.chunk_mib * 2**20
    else:
        budget = LEV_CHUNK_BYTES["cpu" if device == "cpu" else "cuda"]
    return max(1, int(budget // lev_chunk_bytes_per_id(heads_local, lev.seed_dim, lev.knots, lev.rank)))


def blocks_to_recompute(model, blocks: int) -> int:
    """How many of a stage's ``blocks`` transformer layers ``model.recompute=full`` recomputes (0 otherwise): the
    first ``model.recompute_layers`` (null: all)."""
    if model.recompute != "full":
        return 0
    return blocks if model.recompute_layers is None else min(blocks, model.recompute_layers)
