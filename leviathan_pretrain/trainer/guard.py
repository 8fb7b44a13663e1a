"""The divergence guard: which steps are healthy enough to checkpoint, and when a run must stop.

A step is *healthy* when it was applied (not skipped as non-finite), its loss is finite, and neither spike rule
holds for it. The loop saves only at healthy steps (a save that falls due at an unhealthy one waits for the next
healthy step), so ``latest`` never names a checkpoint written after the last finite, applied step, and nothing is
pruned while steps are being skipped or the loss is spiking.

The run stops (:class:`~.faults.Diverged`, exit 3) when

- ``train.max_bad_steps`` consecutive steps were skipped as non-finite (NaN/Inf loss or gradient norm);
- the loss stays above ``train.spike_factor`` x the mean of the last ``train.spike_window`` healthy losses for
  ``train.spike_patience`` steps in a row, or the gradient norm above ``train.grad_spike_factor`` x theirs (the rule
  of LLM Foundry's ``KillLossSpike``: a multiple of a running window, several steps in a row, so one noisy batch
  does not stop a run). The window must be full before these rules watch; it restarts with every start.

It stops rather than rolling back in-process (OLMo restarts from the last checkpoint, PaLM skipped ~200-500
batches after rewinding ~100 steps): what to change before going on (a lower ``optim.lr``, another checkpoint,
``checkpoint.resume_from``) is the user's call, and the message gives the last good checkpoint and the data window.

A checkpoint saved at step ``s`` is *confirmed* once step ``s + 1`` is healthy (the first loss measured with its
weights). Pruning never removes the newest confirmed checkpoint; when the guard fires while the newest checkpoint is
unconfirmed (its very update may be the one that diverged), ``latest`` is pointed back at the newest confirmed one.
"""

from __future__ import annotations

import math
from collections import deque


def is_finite(x) -> bool:
    return x is not None and math.isfinite(float(x))


class Guard:
    """Health of the steps of one start (collective values only: every rank decides the same)."""

    def __init__(self, t):
        self.max_bad, self.factor, self.gfactor = t.max_bad_steps, t.spike_factor, t.grad_spike_factor
        self.patience = t.spike_patience
        self.losses: deque[float] = deque(maxlen=t.spike_window)
        self.gnorms: deque[float] = deque(maxlen=t.spike_window)
        self.bad_run = 0  # consecutive non-finite (skipped) steps
        self.spike_run = 0  # consecutive spiking steps
        self.healthy = True  # the last step's verdict
        self.why = ""  # what made the last step unhealthy
        self.first_unhealthy: tuple[int, int] | None = None  # (step, consumed samples before it) of the current run

    def _spiking(self, loss: float, gnorm: float | None) -> str | None:
        if len(self.losses) < (self.losses.maxlen or 0):
            return None
        mean = sum(self.losses) / len(self.losses)
        if self.factor and loss > self.factor * mean:
            return (
                f"loss {loss:.4g} above train.spike_factor={self.factor:g} x its running mean {mean:.4g} "
                f"(last {len(self.losses)} healthy steps)"
            )
        if self.gfactor and is_finite(gnorm) and len(self.gnorms) == len(self.losses):
            gmean = sum(self.gnorms) / len(self.gnorms)
            if gmean > 0 and gnorm > self.gfactor * gmean:
                return (
                    f"gradient norm {gnorm:.4g} above train.grad_spike_factor={self.gfactor:g} x its running mean "
                    f"{gmean:.4g}"
                )
        return None

    def update(self, step: int, consumed_before: int, applied: bool, loss, gnorm) -> str | None:
        """Record step ``step``'s outcome; returns why the run must stop (None: go on)."""
        if not applied or not is_finite(loss):
            self.bad_run += 1  # the spike run goes on: a skipped step (no update) neither ends nor extends it
            self.why = f"step {step} skipped as non-finite (loss={loss}, grad_norm={gnorm})"
        else:
            self.bad_run = 0
            spike = self._spiking(float(loss), gnorm)
            if spike:
                self.spike_run += 1
                self.why = f"step {step}: {spike}"
            else:
                self.spike_run = 0
                self.losses.append(float(loss))
                if is_finite(gnorm):
                    self.gnorms.append(float(gnorm))
        self.healthy = self.bad_run == 0 and self.spike_run == 0
        if self.healthy:
            self.first_unhealthy = None
        elif self.first_unhealthy is None:
            self.first_unhealthy = (step, consumed_before)
        if self.bad_run >= self.max_bad:
            return f"{self.bad_run} consecutive non-finite steps (limit train.max_bad_steps={self.max_bad}); {self.why}"
        if self.spike_run >= self.patience:
            return f"a loss spike for {self.spike_run} steps (train.spike_patience={self.patience}); {self.why}"
        return None

    def window(self, consumed_now: int) -> str:
        """The unhealthy steps and their data (consumed-sample range), for the stop message."""
        if self.first_unhealthy is None:
            return ""
        step, before = self.first_unhealthy
        return f"unhealthy since step {step} (training samples {before}..{consumed_now - 1})"
