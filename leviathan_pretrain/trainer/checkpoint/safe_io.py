"""Checkpoint file I/O that never unpickles arbitrary objects: ``torch.load(weights_only=True)`` everywhere.

:func:`safe_load` allow-lists only the few DeepSpeed classes its optimizer states contain; anything else in a
file fails with a :class:`CheckpointError` naming it, as does a truncated, corrupt or unreadable file (one line:
the file, the loader's words, what to do; :mod:`.errors`). :func:`safe_save` writes through a Python file
object, so that a full disk or a permission error says so (:class:`.errors.CheckpointSaveError`).
:class:`SafeCheckpointEngine` is DeepSpeed's torch checkpoint engine with both, and it records the files it writes
(so each rank can fsync its own).
"""

from __future__ import annotations

from pathlib import Path

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from common.entry_points import resolve
from leviathan_pretrain.trainer.checkpoint.errors import load_error, writing
from leviathan_pretrain.trainer.checkpoint.names import CheckpointError

# Classes DeepSpeed pickles into its optimizer states (checked with torch.load(weights_only=True)).
SAFE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler:LossScaler",
    "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
    "deepspeed.runtime.zero.config:ZeroStageEnum",
    "deepspeed.utils.tensor_fragment:fragment_address",
)


def _safe_globals() -> list:
    out = []
    for spec in SAFE_GLOBALS:
        try:
            out.append(resolve(spec))
        except (ImportError, AttributeError):
            pass
    return out


def safe_load(path, map_location="cpu"):
    """``torch.load(weights_only=True)`` with DeepSpeed's allow-listed classes; never arbitrary unpickling. A file
    refused, truncated, corrupt or unreadable: :class:`CheckpointError` naming it (:func:`.errors.load_error`)."""
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        err = load_error(e, path)
        if err is None:
            raise
        raise err from None


def safe_save(obj, path, **kw) -> None:
    """``torch.save(obj, path, **kw)`` into a file we open: an ``OSError`` (a full disk, permissions, a read-only
    mount) keeps its errno and leaves as a one-line :class:`.errors.CheckpointSaveError` naming ``path``
    (``torch.save`` to a path says ``unexpected pos`` instead)."""
    with writing(path), open(path, "wb") as f:
        torch.save(obj, f, **kw)


class SafeCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine with weights-only loading that records the files it writes
    (:func:`save` fsyncs them on the writing rank)."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.written: list[str] = []
        self.mark: tuple[Path, str] | None = None  # the save's in-progress mark and its text, checked per file

    def start_recording(self, mark: tuple[Path, str] | None = None) -> list[str]:
        self.written, self.mark = [], mark
        return self.written

    def check_mark(self, path) -> None:
        """The folder being written is still the one our rank 0 created for this save: its ``leviathan.saving``
        holds the text it wrote. A trainer that stalled mid-save and lost its run directory to another (the run
        lock) stops here instead of writing into the new owner's checkpoint."""
        if self.mark is None:
            return
        where, text = self.mark
        try:
            now = where.read_text()
        except OSError:
            now = None
        if now != text:
            raise CheckpointError(
                f"{path}: not written: {where} is no longer this save's (another trainer took the run directory "
                "over); stopping without writing"
            )

    def load(self, path: str, map_location=None):
        return safe_load(path, map_location)

    def save(self, state_dict, path: str):
        self.check_mark(path)
        # DeepSpeed's torch.save(state_dict, path, ...), through a file object of ours: errors name path and cause
        safe_save(state_dict, path, _use_new_zipfile_serialization=self.zipfile_serialization)
        self.written.append(str(path))


def install_safe_engine(ds_engine) -> SafeCheckpointEngine:
    eng = SafeCheckpointEngine(ds_engine._config)
    ds_engine.checkpoint_engine = eng
    return eng
