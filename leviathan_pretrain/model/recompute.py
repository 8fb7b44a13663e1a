"""Activation recompute (``model.recompute``; docs/training.md, "Memory levers").

Where megatron-core recomputes, with torch's own checkpoint (``torch.utils.checkpoint``, non-reentrant, the RNG
states saved and replayed) instead of megatron-core's ``tensor_parallel.checkpoint``: that one saves the CUDA RNG
tracker's states and asserts on a build of torch without CUDA, so it could never be tested on the CPU; no layer of
ours forks megatron's RNG tracker (dropout is 0, attention is SDPA), so torch's replay is all a recompute needs.
Non-reentrant: the recompute runs inside the same backward pass, so DeepSpeed's gradient hooks (ZeRO's reduction,
``immediate_grad_update``) see one ordinary backward.

- ``selective`` (:func:`recomputed`): the layer-spec modules named by ``model.recompute_modules`` are swapped for a
  subclass whose forward is checkpointed: ``core_attn`` (the core attention: q, k, v in, the context out; with the
  ``megatron`` backend this drops the ``[b, heads, s, s]`` softmax, with SDPA only GQA's expanded k and v),
  ``mlp`` (fc1, SwiGLU, fc2: the MLP keeps only its input);
- ``full`` (:func:`mark_blocks`): a transformer layer keeps only its input; the first ``model.recompute_layers``
  layers of each pipeline stage (megatron-core's ``block`` method; null: every layer, its ``uniform`` method with
  one layer per checkpoint). Set on the stage's :class:`~.gpt.BlockPiece` s after they are built, so the PP = 1
  model and each stage of DeepSpeed's pipeline (trainer/pipeline_parallel.py) are marked alike.

Only in training with gradients on: evaluation (``no_grad``, ``eval()``) runs the plain forward.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from leviathan_pretrain.model.sizes import blocks_to_recompute


def checkpointed(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` whose activations are recomputed in backward (torch's non-reentrant checkpoint)."""
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


def active(module: torch.nn.Module) -> bool:
    """Whether a recompute applies now: training, with gradients on."""
    return module.training and torch.is_grad_enabled()


@functools.cache
def recomputed(cls: type) -> type:
    """``cls`` (an ``nn.Module``) whose forward is checkpointed while :func:`active` (one subclass per class)."""

    class Recomputed(cls):
        def forward(self, *args, **kwargs):
            if active(self):
                return checkpointed(super().forward, *args, **kwargs)
            return super().forward(*args, **kwargs)

    Recomputed.__name__ = Recomputed.__qualname__ = f"Recomputed{cls.__name__}"
    return Recomputed


def mark_blocks(pieces, model) -> int:
    """Set ``recompute`` on the stage's transformer-layer pieces (those with the attribute, in order) for
    ``model.recompute=full``; the number marked."""
    blocks = [p for p in pieces if hasattr(p, "recompute")]
    n = blocks_to_recompute(model, len(blocks))
    for i, piece in enumerate(blocks):
        piece.recompute = i < n
    return n
