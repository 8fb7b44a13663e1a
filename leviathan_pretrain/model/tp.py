"""Tensor-parallel helpers for the parameters the input layers shard themselves.

Every rank draws the *full* master tensor from the default (CPU) generator with the same seed and keeps
its slice (megatron-core's ``use_cpu_initialization`` convention), so TP = N starts from exactly the
TP = 1 weights. Sharded parameters carry megatron-core's TP attributes (DeepSpeed's gradient clipping
and checkpoint merging read them); replicated ones carry none.
"""
from __future__ import annotations

from typing import Callable

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel


def tp_size() -> int:
    return ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def tp_rank() -> int:
    return ps.get_tensor_model_parallel_rank() if ps.model_parallel_is_initialized() else 0


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


def sharded_param(shape, dim: int, init, dtype, *, size: int | None = None, rank: int | None = None
                  ) -> torch.nn.Parameter:
    """This rank's slice (along ``dim``) of a full ``shape`` master tensor, with megatron-core's TP attributes."""
    size = tp_size() if size is None else size
    rank = tp_rank() if rank is None else rank
    if shape[dim] % size:
        raise ValueError(f"dimension {dim} of {tuple(shape)} is not divisible by tensor_parallel={size}")
    part = shape[dim] // size
    full = _master(shape, init)
    p = torch.nn.Parameter(full.narrow(dim, rank * part, part).clone().to(dtype))
    tensor_parallel.set_tensor_model_parallel_attributes(p, True, dim, 1)
    return p


# megatron-core's mappings, skipped when there is no tensor-parallel group (TP = 1 or no parallel state),
# so the input layers also run standalone (tests, benchmarks, export) without torch.distributed.
def copy_to_tp(x):
    return tensor_parallel.copy_to_tensor_model_parallel_region(x) if tp_size() > 1 else x


def reduce_from_tp(x):
    return tensor_parallel.reduce_from_tensor_model_parallel_region(x) if tp_size() > 1 else x


def reduce_scatter_to_sp(x):
    return tensor_parallel.reduce_scatter_to_sequence_parallel_region(x) if tp_size() > 1 else x


def scatter_to_sp(x):
    return tensor_parallel.scatter_to_sequence_parallel_region(x) if tp_size() > 1 else x
