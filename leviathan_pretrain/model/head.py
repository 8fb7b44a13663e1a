"""The output head and its loss, for every ``model.loss_impl``.

- ``fused``: the head returns :class:`HeadInput` (the hidden states through ``copy_to_tp`` and the
  ``[V_pad / tp, D]`` weight) and the loss is :mod:`.loss`'s chunked linear + cross entropy: the
  ``[tokens, V]`` logits never exist. ``HeadInput.logits()`` makes them where logits are asked for.
- ``liger`` (CUDA, TP = 1): as ``fused``, but the training mean runs through Liger-Kernel's Triton kernel
  (:mod:`.loss_liger`; per-token losses stay on :mod:`.loss`). If the kernel fails at its first launch under
  ``auto``, the mean falls back to ``fused`` with one warning; under an explicit ``liger`` it raises.
- ``auto`` (the default) is resolved at build (:meth:`HeadOptions.of`, where the device is known): ``liger`` on
  CUDA at TP = 1 when liger-kernel imports, else ``fused``. The resolved name is ``HeadOptions.impl``.
- ``megatron``: the head returns the vocab-parallel logits ``[s, b, V_pad / tp]`` and the loss is megatron-core's
  ``vocab_parallel_cross_entropy`` (the path before; kept as an option and as the reference in tests).

:func:`head_forward` is the one head of both untied (``OutputPiece``) and TIED (``tied_head``) models. Given a
:class:`LossRequest` it computes the loss inside the head module's own forward (ZeRO-3 gathers a module's
weights only for its forward), per token or as the loss-mask mean. :func:`token_loss` and :func:`mean_loss`
take either head output (the pipeline's loss function gets the last stage's output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel

from common.dtypes import nbytes
from leviathan_pretrain.model import loss as fused
from leviathan_pretrain.model import loss_liger, sizes
from leviathan_pretrain.model.sp import gather_seq
from leviathan_pretrain.model.tp import copy_to_tp


@dataclass
class HeadInput:
    """The fused head's operands: ``hidden [s, b, D]`` (through ``copy_to_tp``), ``weight [V_pad / tp, D]``."""

    hidden: torch.Tensor
    weight: torch.Tensor
    group: object
    chunk: int  # tokens per chunk of model/loss.py's paths
    opts: "HeadOptions | None" = None  # the head's options (None: model/loss.py for everything)

    def logits(self) -> torch.Tensor:
        """``[s, b, V_pad / tp]`` in the model dtype (what the unfused head returns)."""
        return torch.matmul(self.hidden, self.weight.t())


@dataclass
class LossRequest:
    """Ask the head for the loss of ``hidden [s, b, D]``: per token ``[b, s]`` (``mask`` None) or the mean over
    ``mask [b, s]`` (a scalar)."""

    hidden: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class HeadOptions:
    """What the head needs of the model config besides its weight: the loss implementation (resolved: ``fused``,
    ``liger`` or ``megatron``), the training loss's chunk in tokens, the fused path's chunk for per-token losses
    (the same under ``fused``; under ``liger`` it holds fp32 logits too) and what ``model.loss_impl`` asked for."""

    impl: str
    chunk: int  # tokens per chunk of the training mean
    token_chunk: int | None = None  # tokens per chunk of model/loss.py's per-token loss; None: ``chunk``
    requested: str | None = None  # None: ``impl``
    sequence_parallel: bool = False  # the hidden states arrive as [s / tp, b, D]: gathered, not copied, at entry

    @classmethod
    def of(cls, model, build, vocab_local: int) -> "HeadOptions":
        """Resolves ``model.loss_impl`` for ``build`` (:func:`.loss_liger.resolve`; raises ``ModelConfigError``
        for a ``liger`` that cannot run there). The liger chunk holds only model-dtype logits: the same byte
        budget at the model dtype's size (sizes.loss_chunk_tokens)."""
        device = build.torch_device.type
        impl = loss_liger.resolve(model.loss_impl, build)
        fp32 = sizes.loss_chunk_tokens(vocab_local, device, model.loss_chunk_tokens)
        chunk = fp32
        if impl == "liger":
            chunk = sizes.loss_chunk_tokens(vocab_local, device, model.loss_chunk_tokens, nbytes(build.precision))
        sp = bool(build.sequence_parallel) and build.tensor_parallel > 1
        return cls(impl, chunk, fp32, model.loss_impl, sp)

    @property
    def fused_chunk(self) -> int:
        """The chunk of model/loss.py's paths (per-token losses; the mean under ``fused`` and its fallback)."""
        return self.chunk if self.token_chunk is None else self.token_chunk


def head_entry(x: torch.Tensor, group, opts: HeadOptions) -> torch.Tensor:
    """The hidden states as the vocab-parallel head takes them, ``[s, b, D]`` on every TP rank: ``copy_to_tp``
    (identity; the input gradient summed over TP), or under sequence parallelism the all-gather of the ranks'
    ``[s / tp, b, D]`` (the input gradient reduce-scattered: the same sum, each rank keeping its slice)."""
    return gather_seq(x, group) if opts.sequence_parallel else copy_to_tp(x, group)


def head_forward(x, weight: torch.Tensor, group, opts: HeadOptions, unfused=None):
    """``hidden [s, b, D]`` (``[s / tp, b, D]`` under sequence parallelism) -> logits (``megatron``:
    ``unfused(hidden)``, else ``hidden @ weight^T``) or a :class:`HeadInput` (``fused``); a :class:`LossRequest`
    -> its loss (see the module doc)."""
    if isinstance(x, LossRequest):
        out = head_forward(x.hidden, weight, group, opts, unfused)
        return token_loss(out, x.labels) if x.mask is None else mean_loss(out, x.labels, x.mask)
    if opts.impl in ("fused", "liger"):
        return HeadInput(head_entry(x, group, opts), weight, group, opts.fused_chunk, opts)
    if unfused is not None and not opts.sequence_parallel:
        return unfused(x)
    return torch.matmul(head_entry(x, group, opts), weight.t())


def logits_of(out) -> torch.Tensor:
    """The vocab-parallel logits ``[s, b, V_pad / tp]`` of either head output."""
    return out.logits() if isinstance(out, HeadInput) else out


def _flat(out: HeadInput, labels: torch.Tensor):
    """``(hidden [s*b, D], labels [s*b])`` in the hidden states' ``[s, b]`` order."""
    return out.hidden.reshape(-1, out.hidden.shape[-1]), labels.t().reshape(-1)


def token_loss(out, labels: torch.Tensor) -> torch.Tensor:
    """Per-token loss ``[b, s]`` (fp32) of a head output and ``labels [b, s]`` (megatron-core's loss for logits;
    in megatron-core 0.16.1 it takes no process group and uses the global tensor-parallel group)."""
    if isinstance(out, HeadInput):
        h, y = _flat(out, labels)
        s, b = out.hidden.shape[:2]
        return fused.token_loss(h, out.weight, y, out.group, out.chunk).view(s, b).t().contiguous()
    return tensor_parallel.vocab_parallel_cross_entropy(out, labels.t().contiguous()).t().contiguous()


def mean_loss(out, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The training loss: the mean of the per-token loss over the positions where ``mask [b, s]`` is set."""
    if isinstance(out, HeadInput):
        h, y = _flat(out, labels)
        m = mask.t().reshape(-1).float()
        w = m / m.sum().clamp(min=1.0)
        opts = out.opts
        if opts is not None and opts.impl == "liger" and loss_liger.failed() is None:
            try:
                return loss_liger.mean_loss(h, out.weight, y, w, opts.chunk)
            except loss_liger.LaunchError as e:
                if opts.requested == "liger":
                    raise RuntimeError(
                        f"model.loss_impl=liger: Liger-Kernel's cross entropy failed at its first launch ({e}); "
                        "set model.loss_impl=fused"
                    ) from e
                loss_liger.give_up(e)
        return fused.mean_loss(h, out.weight, y, w, out.group, out.chunk)
    return masked_mean(token_loss(out, labels), mask)


def masked_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``per_token`` over the positions where ``mask`` is set."""
    mask = mask.to(per_token.dtype)
    return (per_token.float() * mask.float()).sum() / mask.float().sum().clamp(min=1.0)
