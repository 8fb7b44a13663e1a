"""What the model builders take besides ``ModelConfig``, and the model's own error type.

:class:`BuildSettings` is the part of the parallel/run settings a model needs: tensor-parallel size and
process group, parameter precision, device (where megatron-core initialises its weights and which attention
runs) and ``init_on_cpu``. It is built once by the caller (``BuildSettings.from_parallel(cfg.parallel,
tp_group=...)``) and handed down; nothing in the model reads megatron-core's global parallel state or the
whole ``Config``.

:class:`ModelConfigError` (a ``ValueError``) is what the builders raise for a model/settings combination they
cannot build; config *loading* keeps its own validation and ``ConfigError`` (config/schema.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.dtypes import DTYPES as _DTYPES
from common.dtypes import torch_dtype

DTYPES = tuple(_DTYPES)


class ModelConfigError(ValueError):
    """The model cannot be built as asked (names the setting, e.g. ``model.attention_backend``)."""


def resolve_device(want: str):
    """``auto`` | ``cpu`` | ``cuda`` -> a ``torch.device`` type (``auto``: CUDA when available). The one device
    rule of the project: ``parallel.select_device`` adds the rank's GPU index and the availability check."""
    import torch

    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def resolved_attention(backend: str) -> str:
    """``model.attention_backend`` resolved: ``auto`` is ``sdpa`` on every device (``is_causal`` SDPA picks torch's
    flash / memory-efficient kernels on a GPU: no ``s x s`` scores); ``megatron`` is megatron-core's
    ``DotProductAttention`` (CUDA only, the full fp32 ``s x s`` softmax). The model and the planner both ask here."""
    return "sdpa" if backend == "auto" else backend


LIGER_INSTALL = "pip install liger-kernel==0.8.5 (triton comes with a CUDA torch)"


def liger_installed() -> bool:
    """Whether ``liger_kernel`` and ``triton`` are installed, found without importing them (the planner's
    question; a model build imports the kernel: model/loss_liger.py)."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("triton", "liger_kernel"))


def resolved_loss_impl(impl: str, device: str, tensor_parallel: int, liger_ok: bool) -> str:
    """``model.loss_impl`` resolved for ``device`` (``cuda``/``gpu``/``cpu``): ``auto`` is ``liger`` on a GPU at
    TP = 1 when the kernel is there (``liger_ok``), else ``fused``; the others are themselves. The model
    (model/head.py, where the device is known) and the planner both ask here."""
    if impl != "auto":
        return impl
    return "liger" if device in ("cuda", "gpu") and tensor_parallel == 1 and liger_ok else "fused"


def group_size(group) -> int:
    """Ranks in ``group`` (1 for ``None``: TP = 1, or no torch.distributed)."""
    return 1 if group is None else group.size()


def group_rank(group) -> int:
    return 0 if group is None else group.rank()


@dataclass(frozen=True)
class BuildSettings:
    """Tensor-parallel size and group, precision and device of one model build.

    ``tp_group`` is the ``torch.distributed`` group of this rank's tensor-parallel peers (megatron-core's
    ``pg_collection.tp``); pass it whenever torch.distributed is initialised (also at TP = 1: megatron-core's
    layers fall back to its global group otherwise). ``None`` only for standalone use (tests, benchmarks,
    export) without a process group. ``device``: ``auto`` | ``cpu`` | ``cuda``."""

    tensor_parallel: int = 1
    tp_group: Any = None
    precision: str = "fp32"
    device: str = "auto"
    init_on_cpu: bool = False
    sequence_parallel: bool = False

    @classmethod
    def from_parallel(cls, parallel, tp_group=None, device=None) -> "BuildSettings":
        """From a ``ParallelConfig`` (``tensor_parallel``, ``precision``, ``device``, ``init_on_cpu``,
        ``sequence_parallel``); ``device`` overrides ``parallel.device`` (the rank's resolved device)."""
        return cls(
            tensor_parallel=parallel.tensor_parallel,
            tp_group=tp_group,
            precision=parallel.precision,
            device=str(device) if device is not None else parallel.device,
            init_on_cpu=parallel.init_on_cpu,
            sequence_parallel=parallel.sequence_parallel,
        )

    def __post_init__(self):
        if self.precision not in DTYPES:
            raise ModelConfigError(f"parallel.precision: unknown {self.precision!r} (one of {', '.join(DTYPES)})")
        if group_size(self.tp_group) != self.tensor_parallel:
            raise ModelConfigError(
                f"parallel.tensor_parallel={self.tensor_parallel} but the tensor-parallel group given has "
                f"{group_size(self.tp_group)} rank(s) (initialise the process groups for this layout first)"
            )

    @property
    def torch_device(self):
        return resolve_device(self.device)

    @property
    def params_dtype(self):
        return torch_dtype(self.precision)
