"""Faults: non-finite steps, preemption signals, and the exit codes a launcher acts on.

Exit codes of ``python -m leviathan_pretrain.train``:

- ``0``  finished ``train.steps`` (final checkpoint written)
- ``2``  bad config or data (one line naming the key or file; nothing was trained)
- ``3``  stopped after ``train.max_bad_steps`` consecutive non-finite steps (no new checkpoint written)
- ``75`` stopped early *with* a checkpoint: SIGTERM/SIGUSR1 (preemption, SLURM's warning before the time
  limit), ``train.exit_at_step`` or ``train.exit_after_minutes``. Re-run the same command to continue; a
  launcher requeues on this code (75 is ``EX_TEMPFAIL``).

Non-finite steps: a step whose loss or gradient norm is NaN/Inf is skipped (no parameter update, LR
schedule not advanced) and counted. DeepSpeed's optimizers detect it themselves (fp16 loss-scale overflow,
ZeRO 1-3 and bf16 gradient checks); ZeRO stage 0 in fp32 uses :class:`AdamWSkipNonFinite` for the same.
"""
from __future__ import annotations

import math
import signal

import torch
import torch.distributed as dist

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_DIVERGED = 3
EXIT_REQUEUE = 75


class Diverged(RuntimeError):
    """Too many consecutive non-finite steps."""


class BadStepCounter:
    """Consecutive and total skipped (non-finite) steps; raises :class:`Diverged` at the limit."""

    def __init__(self, limit: int, total: int = 0):
        self.limit, self.consecutive, self.total = limit, 0, total

    def update(self, step: int, bad: bool, loss: float, grad_norm: float | None) -> None:
        if not bad:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        if self.consecutive >= self.limit:
            raise Diverged(f"step {step}: {self.consecutive} consecutive non-finite steps (loss={loss}, "
                           f"grad_norm={grad_norm}; limit train.max_bad_steps={self.limit}); stopping without "
                           f"saving (the last good checkpoint is untouched)")


def is_finite(x) -> bool:
    return x is not None and math.isfinite(float(x))


class StopSignals:
    """SIGTERM / SIGUSR1 set a flag; the loop finishes the step, agrees across ranks, checkpoints, exits 75."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: int | None = None
        self._old = {}

    def install(self) -> "StopSignals":
        for s in self.SIGNALS:
            self._old[s] = signal.signal(s, self._handler)
        return self

    def _handler(self, signum, frame):
        self.received = signum

    def uninstall(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def any_rank(self, device) -> bool:
        """Collective: True on every rank if any rank received a stop signal."""
        flag = torch.tensor([1.0 if self.received is not None else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)


class AdamWSkipNonFinite(torch.optim.AdamW):
    """AdamW that measures the global gradient norm itself, skips the update when it is not finite
    (``overflow`` is read by DeepSpeed, which then counts the step as skipped), and clips otherwise.

    For ZeRO stage 0 in fp32, where DeepSpeed hands the gradients straight to the optimizer. The norm is
    summed over megatron-core's model-parallel group (TP x PP), counting tensor-parallel shards once per
    rank and replicated parameters once (``param_is_not_tensor_parallel_duplicate``), and pipeline-tied
    copies (``ds_pipe_replicated``) once."""

    def __init__(self, params, clip_grad: float = 0.0, **kw):
        super().__init__(params, **kw)
        self.clip_grad = clip_grad
        self.overflow = False
        self._global_grad_norm = None

    @torch.no_grad()
    def grad_norm(self) -> float:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        parallel = ps.model_parallel_is_initialized()
        grads = [p.grad for g in self.param_groups for p in g["params"]
                 if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)
                 and (not parallel or param_is_not_tensor_parallel_duplicate(p))]
        dev = grads[0].device if grads else torch.device("cpu")
        sq = torch.zeros(1, dtype=torch.float64, device=dev)
        for grad in grads:
            sq += grad.detach().double().pow(2).sum()
        if parallel and dist.is_initialized():
            dist.all_reduce(sq, group=ps.get_model_parallel_group())
        return float(sq.sqrt().item())

    def step(self, closure=None):
        norm = self.grad_norm()
        self._global_grad_norm = norm
        self.overflow = not math.isfinite(norm)
        if self.overflow:
            self.zero_grad(set_to_none=True)
            return None
        if self.clip_grad > 0 and norm > self.clip_grad:
            scale = self.clip_grad / (norm + 1e-6)
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.grad.mul_(scale)
        return super().step(closure)
