"""Tensor-parallel helpers for the parameters the input layers shard themselves.

Every rank draws the *full* master tensor from the default (CPU) generator with the same seed and keeps
its slice (megatron-core's ``use_cpu_initialization`` convention), so TP = N starts from exactly the
TP = 1 weights. Sharded parameters carry megatron-core's TP attributes (DeepSpeed's gradient clipping
and checkpoint merging read them); replicated ones carry none.

The process group is always passed in (the layer's ``tp_group``); ``None`` means no tensor parallelism.
"""

from __future__ import annotations

from typing import Callable

import torch
from megatron.core import tensor_parallel

from leviathan_pretrain.model.settings import ModelConfigError, group_rank, group_size


def _master(shape, init: Callable[[torch.Tensor], object]) -> torch.Tensor:
    t = torch.empty(*shape, dtype=torch.float32)
    with torch.no_grad():
        init(t)
    return t


def normal_init(std: float, mean: float = 0.0):
    return lambda t: t.normal_(mean, std)


def const_init(value: float):
    return lambda t: t.fill_(value)


def replicated_param(shape, init, dtype) -> torch.nn.Parameter:
    """A parameter every TP rank holds in full (no TP attributes)."""
    return torch.nn.Parameter(_master(shape, init).to(dtype))


def sharded_param(shape, dim: int, init, dtype, group=None) -> torch.nn.Parameter:
    """This rank's slice (along ``dim``) of a full ``shape`` master tensor, with megatron-core's TP attributes."""
    size, rank = group_size(group), group_rank(group)
    if shape[dim] % size:
        raise ModelConfigError(f"dimension {dim} of {tuple(shape)} is not divisible by tensor_parallel={size}")
    part = shape[dim] // size
    full = _master(shape, init)
    p = torch.nn.Parameter(full.narrow(dim, rank * part, part).clone().to(dtype))
    tensor_parallel.set_tensor_model_parallel_attributes(p, True, dim, 1)
    return p


# megatron-core's mappings over the given group, skipped without tensor parallelism (TP = 1 or no process
# group), so the input layers also run standalone (tests, benchmarks, export) without torch.distributed.
def copy_to_tp(x, group):
    return tensor_parallel.copy_to_tensor_model_parallel_region(x, group=group) if group_size(group) > 1 else x


def reduce_from_tp(x, group):
    return tensor_parallel.reduce_from_tensor_model_parallel_region(x, group=group) if group_size(group) > 1 else x


def all_gather_dim0(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` from every rank of ``group``, concatenated along dim 0 (``t`` itself without TP); a collective."""
    if group_size(group) == 1:
        return t
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(group_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)
