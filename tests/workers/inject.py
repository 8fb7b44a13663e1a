"""Test-only fault injection, installed from test workers (never from product code).

:func:`nan_loss`: the training loss of the given steps becomes NaN, or a multiple of itself (a spike), on one rank
or on every rank, through the two places a loss is made: ``ModelEngine._loss`` (PP = 1) and ``PipeLoss`` (the
pipeline engine). Validation losses are never touched (the flag is on only inside ``Trainer.train_step``).
"""

from __future__ import annotations

import os

from leviathan_pretrain.trainer import engine, loop, pipeline_parallel

_ACTIVE = {"on": False, "steps": frozenset(), "rank": None, "factor": float("nan")}


def _poison(loss):
    return loss * _ACTIVE["factor"] if _ACTIVE["on"] else loss


def _install() -> None:
    if getattr(loop.Trainer, "_nan_injection", False):
        return
    model_loss, pipe_loss, train_step = (
        engine.ModelEngine._loss,
        pipeline_parallel.PipeLoss.__call__,
        loop.Trainer.train_step,
    )

    def step(self):
        rank = int(os.environ.get("RANK", "0"))
        _ACTIVE["on"] = self.state.step in _ACTIVE["steps"] and _ACTIVE["rank"] in (None, rank)
        try:
            return train_step(self)
        finally:
            _ACTIVE["on"] = False

    engine.ModelEngine._loss = lambda self, mb: _poison(model_loss(self, mb))
    pipeline_parallel.PipeLoss.__call__ = lambda self, logits, targets: _poison(pipe_loss(self, logits, targets))
    loop.Trainer.train_step = step
    loop.Trainer._nan_injection = True


def nan_loss(steps, rank: int | None = None, factor: float = float("nan")) -> None:
    """Make the loss of ``steps`` NaN on ``rank`` (every rank when None) for the runs that follow; with ``factor``
    a number, that many times itself instead (a loss spike, gradients scaled alike)."""
    _install()
    _ACTIVE.update(steps=frozenset(int(s) for s in steps), rank=rank, factor=factor)
