"""Sequence parallelism (``parallel.sequence_parallel``, Megatron-LM's, Korthikanti et al. 2022) on any device.

Under SP the hidden states between the pieces are this TP rank's slice of the sequence, ``[s / tp, b, D]``: the
norms, residual adds and the input layer's output run on ``1 / tp`` of the tokens, and each all-reduce of the
tensor-parallel layers becomes an all-gather before a column-parallel linear and a reduce-scatter after a
row-parallel one (the same bytes on the wire).

megatron-core 0.16.1 has all of this, but every one of its sequence-parallel collectives allocates its buffers
with ``torch.cuda.current_device()`` (``mappings.py``'s first-dimension gather and reduce-scatter, the
column-parallel linear's global buffer), its ``WrappedTorchNorm`` refuses SP, and it leaves the norm weights'
gradient sum over TP to its own ``finalize_model_grads``, which DeepSpeed never calls. Here:

- :func:`gather_seq` / :func:`reduce_scatter_seq` / :func:`split_seq`: the three sequence collectives as autograd
  functions with buffers where the tensor is (gloo on the CPU, NCCL on GPUs: one code path);
- :class:`SPColumnParallelLinear`: all-gathers its input along the sequence, keeps only the slice for backward
  and gathers it again there (megatron's own memory rule: the saved input is ``1 / tp`` of the tokens);
- :class:`SPRowParallelLinear`: reduce-scatters its output along the sequence (and, like
  ``GroupRowParallelLinear``, hands its own group to megatron's linear function);
- :class:`SPRMSNorm`: ``torch.nn.RMSNorm`` (the same ``weight`` key as ``WrappedTorchNorm``'s) whose weight goes
  through ``copy_to_tensor_model_parallel_region``: each rank's gradient of it covers only its slice of the
  sequence, and autograd sums it over TP before any DeepSpeed hook reads it (ZeRO 2/3 and BF16_Optimizer's
  ``immediate_grad_update`` take each gradient in a hook during backward: a sum after backward would be too late).

With SP off (or TP = 1) none of these is built: the layer spec, norms and head are those of before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel

from leviathan_pretrain.model.settings import group_rank, group_size


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    out = torch.empty((x.shape[0] * n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if x.shape[0] % n:
        raise ValueError(f"sequence parallelism: {x.shape[0]} positions do not split over {n} tensor-parallel ranks")
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _split(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if x.shape[0] % n:
        raise ValueError(f"sequence parallelism: {x.shape[0]} positions do not split over {n} tensor-parallel ranks")
    part = x.shape[0] // n
    return x.narrow(0, group_rank(group) * part, part).clone()


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 (the sequence); backward: reduce-scatter (each rank's gradient summed over TP)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterSeq(torch.autograd.Function):
    """Sum over TP, keep this rank's slice of dim 0; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


class _SplitSeq(torch.autograd.Function):
    """This rank's slice of dim 0 of a tensor every TP rank holds in full; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """``[s / tp, ...]`` on each rank -> ``[s, ...]`` on every rank (identity without TP)."""
    return _GatherSeq.apply(x, group) if group_size(group) > 1 else x


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """``[s, ...]`` partial sums -> this rank's ``[s / tp, ...]`` of their sum over TP (identity without TP)."""
    return _ReduceScatterSeq.apply(x, group) if group_size(group) > 1 else x


def split_seq(x: torch.Tensor, group) -> torch.Tensor:
    """``[s, ...]`` replicated over TP -> this rank's ``[s / tp, ...]`` (identity without TP)."""
    return _SplitSeq.apply(x, group) if group_size(group) > 1 else x


class _GatheredLinear(torch.autograd.Function):
    """``all_gather_seq(x) @ weight^T``, saving ``x`` (the slice) and gathering it again in backward; the input
    gradient is reduce-scattered. The matmuls are those of megatron-core's linear function (same shapes and order:
    the weight gradient is ``grad [s b, out]^T @ input [s b, in]``), so SP equals SP off bit for bit at TP = 2."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        return torch.matmul(_gather(x, group), weight.t())

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _reduce_scatter(grad.matmul(weight), ctx.group)
        if ctx.needs_input_grad[1]:
            total = _gather(x, ctx.group)
            g2 = grad.reshape(-1, grad.shape[-1])
            grad_w = g2.t().matmul(total.reshape(-1, total.shape[-1]))
        return grad_x, grad_w, None


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """``[s / tp, b, in]`` -> ``[s, b, out / tp]``: the column-parallel linear of a sequence-parallel input."""
    if group_size(group) == 1:
        return torch.matmul(x, weight.t())
    return _GatheredLinear.apply(x, weight, group)


class SPColumnParallelLinear(tensor_parallel.ColumnParallelLinear):
    """megatron-core's ``ColumnParallelLinear`` whose sequence-parallel input is gathered by
    :func:`gathered_linear` (any device) instead of megatron's CUDA buffer; without SP it is megatron's."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not kwargs.get("sequence_parallel"):
            return super()._forward_impl(input, weight, *args, **kwargs)
        out = gathered_linear(input, weight, self.tp_group)
        bias = kwargs.get("bias")
        return out + bias if bias is not None else out


class SPRowParallelLinear(tensor_parallel.RowParallelLinear):
    """megatron-core's ``RowParallelLinear`` whose output is reduce-scattered along the sequence by
    :func:`reduce_scatter_seq` (any device) under SP; it hands its own ``tp_group`` to the linear function (as
    ``GroupRowParallelLinear``)."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group", self.tp_group) is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)

    def forward(self, input_):
        if not self.sequence_parallel:
            return super().forward(input_)
        out = self._forward_impl(
            input=input_,
            weight=self.weight,
            bias=None,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=False,
            sequence_parallel=False,
            tp_group=self.tp_group,
            grad_output_buffer=None,
        )
        out = reduce_scatter_seq(out, self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


class SPRMSNorm(torch.nn.RMSNorm):
    """RMSNorm of a sequence slice: ``torch.nn.RMSNorm`` (``WrappedTorchNorm``'s module, the same ``weight`` key)
    whose weight is summed over TP in backward (``copy_to_tensor_model_parallel_region``). A layer-spec module:
    ``SPRMSNorm(config, hidden_size, eps, tp_group)``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, tp_group=None, **_):
        super().__init__(hidden_size, eps=eps)  # as WrappedTorchNorm builds it
        self.tp_group = tp_group
        self.weight.sequence_parallel = True  # megatron's mark (documentation: the sum is done here, in autograd)

    def forward(self, x):
        weight = self.weight
        if group_size(self.tp_group) > 1:
            weight = tensor_parallel.copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)
