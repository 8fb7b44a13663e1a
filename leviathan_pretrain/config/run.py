"""The ``train`` and ``checkpoint`` sections of the config schema (:class:`TrainConfig`, :class:`CheckpointConfig`):
the run's length and batches, its stop conditions and divergence guard, checkpoints, resume rules and the
run-directory lock. ``leviathan_pretrain.config`` re-exports them; validation raises
:class:`~leviathan_pretrain.config.loader.ConfigError` naming the dotted key."""

from __future__ import annotations

import re
from dataclasses import dataclass

from leviathan_pretrain.config.loader import require


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps of the whole run (the LR schedule's length)
    micro_batch_size: int = 4  # sequences per rank per forward/backward
    global_batch_size: int = 8  # sequences per optimizer step; accumulation = global / (micro x DP)
    seed: int = 1234
    eval_interval: int = 200  # validation every N steps (and at the end); 0 disables
    eval_iters: int = 10  # global batches of the held-out split per validation
    max_bad_steps: int = 5  # consecutive NaN/Inf steps before stopping
    # The loss-spike guard (trainer/guard.py; LLM Foundry's KillLossSpike rule): a finite loss above spike_factor x
    # the mean of the last spike_window healthy losses, or a gradient norm above grad_spike_factor x theirs, for
    # spike_patience steps in a row stops the run (exit 3) with the last good checkpoint kept; 0 turns a rule off.
    spike_factor: float = 2.0
    grad_spike_factor: float = 10.0
    spike_patience: int = 4
    spike_window: int = 100  # the running mean's length; the guard watches once this many steps are seen
    out_dir: str = "runs/default"  # checkpoints/, tensorboard/, train_log.jsonl below this
    exit_at_step: int | None = None  # stop after this step with a checkpoint (exit 75); resume continues
    exit_after_minutes: float | None = None  # same, once this much wall time has passed (job time limits)

    def validate(self, prefix: str) -> None:
        for name in ("steps", "micro_batch_size", "global_batch_size", "eval_iters", "max_bad_steps"):
            v = getattr(self, name)
            require(v >= 1, f"{prefix}.{name}", f"must be >= 1, got {v}")
        require(self.eval_interval >= 0, f"{prefix}.eval_interval", "must be >= 0 (0 disables validation)")
        require(
            self.global_batch_size % self.micro_batch_size == 0,
            f"{prefix}.global_batch_size",
            f"{self.global_batch_size} is not a multiple of train.micro_batch_size={self.micro_batch_size}",
        )
        require(self.exit_at_step is None or self.exit_at_step >= 1, f"{prefix}.exit_at_step", "must be >= 1")
        require(
            self.exit_after_minutes is None or self.exit_after_minutes > 0,
            f"{prefix}.exit_after_minutes",
            "must be > 0",
        )
        require(bool(self.out_dir), f"{prefix}.out_dir", "must not be empty")
        for name in ("spike_factor", "grad_spike_factor"):
            v = getattr(self, name)
            require(v == 0 or v > 1, f"{prefix}.{name}", f"must be > 1, or 0 to turn this rule off; got {v}")
        for name in ("spike_patience", "spike_window"):
            require(getattr(self, name) >= 1, f"{prefix}.{name}", f"must be >= 1, got {getattr(self, name)}")


@dataclass
class CheckpointConfig:
    save_interval: int = 500  # a DeepSpeed checkpoint every N steps, and always at the end
    keep_last: int = 3  # complete checkpoints kept (older ones are deleted)
    resume: bool = True  # continue from <dir>/latest when it exists
    dir: str | None = None  # None -> <train.out_dir>/checkpoints
    # resume at another data-parallel size (a requeue on fewer/more nodes): ZeRO 1-3 via DeepSpeed's universal
    # checkpoint, converted once into <tag>/universal (exact); false: refuse a DP change. TP/PP changes: refused.
    reshard: bool = True
    # the checkpoint to resume from (a tag, e.g. global_step400) instead of the one `latest` names
    resume_from: str | None = None
    # when the checkpoint to resume from is unusable (a file truncated or corrupt): false stops naming the file and
    # the older checkpoint; true resumes from the newest older complete checkpoint that is intact, and says so
    fallback: bool = False
    # a new run in a directory holding checkpoints: they are moved (never deleted) into <dir>/replaced-<UTC time>/
    start_over: bool = False
    # the run-directory lease (trainer/checkpoint/run_lock.py): its heartbeat, and how long a holder on another host
    # must be silent before its lease is taken over (a live holder is refused)
    lock_heartbeat_s: float = 10.0
    lock_timeout_s: float = 60.0

    def validate(self, prefix: str) -> None:
        require(self.save_interval >= 1, f"{prefix}.save_interval", "must be >= 1")
        require(self.keep_last >= 1, f"{prefix}.keep_last", "must be >= 1")
        require(self.lock_heartbeat_s > 0, f"{prefix}.lock_heartbeat_s", "must be > 0")
        require(
            self.lock_timeout_s >= 3 * self.lock_heartbeat_s * (1 - 1e-9),  # 0.6 s against 3 x 0.2 s: in float
            f"{prefix}.lock_timeout_s",
            f"must be >= 3 x checkpoint.lock_heartbeat_s ({3 * self.lock_heartbeat_s:g}): a live holder must get "
            "several heartbeats in before its lease counts as stale",
        )
        require(
            self.resume_from is None or re.fullmatch(r"global_step\d+", self.resume_from) is not None,
            f"{prefix}.resume_from",
            f"must be a checkpoint tag like global_step400, got {self.resume_from!r}",
        )
        require(
            not (self.start_over and self.resume_from),
            f"{prefix}.start_over",
            "true starts a new run; it cannot be combined with checkpoint.resume_from",
        )
