"""Checkpoint file I/O that never unpickles arbitrary objects: ``torch.load(weights_only=True)`` everywhere.

:func:`safe_load` allow-lists only the few DeepSpeed classes its optimizer states contain; anything else in a
file fails with a :class:`CheckpointError` naming it. :class:`SafeCheckpointEngine` is DeepSpeed's torch
checkpoint engine with that loading, and it records the files it writes (so each rank can fsync its own).
"""

from __future__ import annotations

import importlib
import pickle

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from leviathan_pretrain.trainer.ckpt_names import CheckpointError  # noqa: F401  (defined there: torch-free)

# Classes DeepSpeed pickles into its optimizer states (checked with torch.load(weights_only=True)).
SAFE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def _safe_globals() -> list:
    out = []
    for name in SAFE_GLOBALS:
        mod, _, attr = name.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(mod), attr))
        except (ImportError, AttributeError):
            pass
    return out


def safe_load(path, map_location="cpu"):
    """``torch.load(weights_only=True)`` with DeepSpeed's allow-listed classes; never arbitrary unpickling."""
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(
            f"{path}: refused by weights_only loading ({first[-1] if first else e}); "
            "this file holds objects other than tensors and plain containers"
        ) from None


class SafeCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine with weights-only loading that records the files it writes
    (:func:`save` fsyncs them on the writing rank)."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.written: list[str] = []

    def start_recording(self) -> list[str]:
        self.written = []
        return self.written

    def load(self, path: str, map_location=None):
        return safe_load(path, map_location)

    def save(self, state_dict, path: str):
        super().save(state_dict, path)
        self.written.append(str(path))


def install_safe_engine(ds_engine) -> SafeCheckpointEngine:
    eng = SafeCheckpointEngine(ds_engine._config)
    ds_engine.checkpoint_engine = eng
    return eng
