"""The training loop: set-up checks, resume, steps, validation, checkpoints, stop conditions.

``run(cfg)`` is everything ``python -m leviathan_pretrain.train`` does after parsing; it returns the exit
code (see :mod:`.faults`). :class:`Trainer` holds one run (engine, batches, :class:`.state.TrainState`). It is
re-entrant within one process (tests run several configurations per launch): process groups are re-initialised
when the parallel layout changes. The concerns live elsewhere: the grid in ``parallel.ParallelDims``, resume
rules in :mod:`.checkpoint`, stop conditions and exit codes in :mod:`.faults`.
"""

from __future__ import annotations

import json
import math
import time

import deepspeed
import torch.distributed as dist
from megatron.core import parallel_state as ps

from common.exit_codes import EXIT_OK, EXIT_REQUEUE
from leviathan_pretrain.config import Config, ConfigError, to_dict
from leviathan_pretrain.data.datasets import Batches, ShardError, build_datasets, data_summary
from leviathan_pretrain.data.prefetch import Prefetcher
from leviathan_pretrain.model import counts as param_counts
from leviathan_pretrain.model.assembly import LAYOUT_VERSION
from leviathan_pretrain.model.flops import model_flops_per_token
from leviathan_pretrain.model.lev import lev_health, lev_layer
from leviathan_pretrain.parallel.groups import (
    ParallelDims,
    init_distributed,
    parallel_dims,
    seed_everything,
    set_group_timeouts,
)
from leviathan_pretrain.rundir import host
from leviathan_pretrain.rundir.layout import RunLayout
from leviathan_pretrain.trainer.checkpoint import resume as ckpt_resume
from leviathan_pretrain.trainer.checkpoint import store as ckpt
from leviathan_pretrain.trainer.checkpoint.names import step_of
from leviathan_pretrain.trainer.checkpoint.record import CheckpointRecord, ParallelLayout
from leviathan_pretrain.trainer.checkpoint.run_lock import LockLost, RunLocks
from leviathan_pretrain.trainer.engine import build_engine
from leviathan_pretrain.trainer.faults import Diverged, StopSignals, stop_requested
from leviathan_pretrain.trainer.geometry_log import geometry_stats, id_groups
from leviathan_pretrain.trainer.guard import Guard, is_finite
from leviathan_pretrain.trainer.metrics import (
    Metrics,
    check_tensorboard,
    memory_stats,
    peak_flops,
    perplexity,
    throughput,
    validation_set,
)
from leviathan_pretrain.trainer.peers import record_peers
from leviathan_pretrain.trainer.schedule import lr_at
from leviathan_pretrain.trainer.state import TrainState


def collective_check(fn, *args):
    """Run a check on rank 0 only; every rank gets its (small) result or raises its error (same type and
    message), so a bad input fails all ranks at once instead of leaving them waiting in a collective."""
    box = [None, None]
    if dist.get_rank() == 0:
        try:
            box[1] = fn(*args)
        except (ConfigError, ShardError, ckpt.CheckpointError) as e:
            box[0] = (type(e).__name__, str(e))
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        kind, msg = box[0]
        raise {"ConfigError": ConfigError, "ShardError": ShardError}.get(kind, ckpt.CheckpointError)(msg)
    return box[1]


def lev_stats(cfg: Config, eng, dims: ParallelDims) -> dict:
    """LEV health (collective over the first stage's TP group), delivered to the writer rank."""
    stats = {}
    if dims.first_stage and cfg.model.variant == "lev":
        layer = lev_layer(eng.module())
        if layer is not None:
            if cfg.parallel.zero_stage == 3:
                with deepspeed.zero.GatheredParameters(list(layer.parameters())):
                    stats = lev_health(layer, gather=True)
            else:
                stats = lev_health(layer, gather=True)  # includes lev/unique_ratio (FLOPs accounting)
    if dims.pp > 1:
        box = [stats]
        dist.broadcast_object_list(
            box, src=ps.get_pipeline_model_parallel_first_rank(), group=ps.get_pipeline_model_parallel_group()
        )
        stats = box[0]
    return stats


def run(cfg: Config) -> int:
    signals = StopSignals().install()  # from the start: a preemption during set-up stops after step 1
    try:
        trainer = Trainer(cfg, signals)
        try:
            return trainer.train()
        finally:
            trainer.close()
    finally:
        signals.settle()  # whichever way it ends: the code is decided, a SIGTERM now must not change it


class Trainer:
    """One run: set-up (checks, engine, data) in ``__init__``, then :meth:`train`; collective throughout."""

    def __init__(self, cfg: Config, signals: StopSignals):
        self.cfg, self.signals = cfg, signals
        self.denv = init_distributed(cfg.parallel)
        self.locks: RunLocks | None = None  # rank 0's lease on the run directory (trainer/checkpoint/run_lock.py)
        # the run directory's one owner first: nothing is read or removed before (a live holder: every rank stops)
        collective_check(self._take_locks, cfg)
        try:
            self._set_up(cfg)
        except BaseException:
            self.release_locks()
            raise

    def _take_locks(self, cfg: Config) -> None:
        layout, c = RunLayout.from_config(cfg), cfg.checkpoint
        say = lambda line: print(line, flush=True)  # noqa: E731
        self.locks = RunLocks.for_run(layout.root, layout.checkpoints, c.lock_heartbeat_s, c.lock_timeout_s, say)
        self.locks.acquire()

    def release_locks(self) -> None:
        if self.locks is not None:
            self.locks.release()
            self.locks = None

    def _set_up(self, cfg: Config) -> None:
        t = cfg.train
        self.dims = dims = parallel_dims(t.micro_batch_size, t.global_batch_size)
        self.t0 = time.monotonic()
        layout = RunLayout.from_config(cfg)
        self.out_dir, self.cdir = layout.root, layout.checkpoints

        # checks before anything expensive (rank 0 checks, every rank raises the same error)
        collective_check(check_tensorboard, cfg)
        summary = collective_check(data_summary, cfg)
        # checked against the shards, recorded in checkpoints (the fingerprint is what must match)
        self.tok_fp, self.tok_sha = summary["tokenizer_fingerprint"], summary["tokenizer_sha256"]
        # the checkpoint to resume from, its files checked (rank 0, under the lock: trainer/checkpoint/resume.py)
        resume = collective_check(self._choose, cfg)
        self.latest, self.record = resume.tag, resume.record  # the record: leviathan.json of the one resumed from
        self.resume_note = resume.note
        if self.latest is not None:
            ckpt.check_compatible(cfg, self.record, self.tok_fp, self.cdir / self.latest, dims)
        if dims.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.cdir.mkdir(parents=True, exist_ok=True)
            removed = ckpt.remove_incomplete(self.cdir, keep=self.latest)
            if removed:
                print(
                    f"[train] removed interrupted checkpoint save(s) {', '.join(removed)} (marked "
                    f"{ckpt.SAVING}, never completed)",
                    flush=True,
                )
            layout.config.write_text(json.dumps(to_dict(cfg), indent=1))
        dist.barrier()

        seed_everything(t.seed, self.denv.device)
        self.eng = build_engine(cfg, self.denv.device)
        train_ds, valid_ds = build_datasets(cfg, summary["eod_id"], self.eng.needs_data)
        # PP = 1: micro-batches prepared for the device as they are read (packed, unique ids; data/transfer.py)
        prep = getattr(self.eng, "prepare", None)
        batch_args = (t.micro_batch_size, dims.dp, dims.dp_rank, t.global_batch_size, cfg.model.vocab_size, prep)
        self.train_batches = Batches(train_ds, *batch_args) if self.eng.needs_data else None
        self.valid_batches = Batches(valid_ds, *batch_args) if self.eng.needs_data and valid_ds is not None else None
        self.prefetch: Prefetcher | None = None  # data.prefetch: the next global batch built ahead, during train()
        self.state = TrainState()
        if self.latest is not None:
            self.state = ckpt.load(self.eng.ds, self.cdir, self.latest, self.record)
        self.guard = Guard(t)
        # the newest checkpoint of this run saved (None: none yet) and the newest confirmed by a healthy step after it
        self.saved: str | None = self.latest
        self.confirmed: str | None = self.latest
        self.save_due = False  # a save fell due at an unhealthy step: made at the next healthy one
        tb = RunLayout.from_config(cfg).events
        self.metrics = Metrics(self.out_dir, tb, dims.writer, self.state.step, cfg.logging.log_interval, t.steps)
        self.peak, self.peak_source = peak_flops(self.denv.device, cfg.parallel.precision, cfg.logging.peak_flops)
        # set-up done: from here a peer that stops answering (dead, stalled, cut off) fails every collective,
        # the per-step stop vote's on the world group included, after parallel.timeout_minutes
        self.peers = record_peers(cfg.parallel.timeout_minutes)
        set_group_timeouts(cfg.parallel.timeout_minutes)
        self.geometry_ids = id_groups(cfg) if cfg.logging.geometry_interval else None

    def _choose(self, cfg: Config) -> ckpt_resume.Resume:
        ckpt.check_no_foreign(self.cdir)
        return ckpt_resume.choose(cfg, self.cdir)  # its note: said in the "resumed" event

    def close(self) -> None:
        try:
            self.close_prefetch()
            self.peers.stop()
            set_group_timeouts(self.cfg.parallel.init_timeout_minutes)  # the next run in this process starts up again
            self.metrics.close()
            self.eng.ds.destroy()
        finally:
            self.release_locks()

    def close_prefetch(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
            self.prefetch = None

    def save(self) -> None:
        cfg, dims, step = self.cfg, self.dims, self.state.step
        record = CheckpointRecord(
            config=to_dict(cfg),
            **self.state.state_dict(),
            tag=ckpt.tag_for(step),
            tokenizer_sha256=self.tok_sha,
            tokenizer_fingerprint=self.tok_fp,
            model_layout=LAYOUT_VERSION,
            layout=ParallelLayout(tp=dims.tp, pp=dims.pp, dp=dims.dp, zero_stage=cfg.parallel.zero_stage),
        )
        set_group_timeouts(cfg.parallel.init_timeout_minutes)  # a save waits for the slowest writer
        check = self.locks.check if self.locks is not None else None  # rank 0: still the run directory's owner
        ckpt.save(self.eng.ds, self.cdir, record, cfg.checkpoint.keep_last, check=check, protect=self.confirmed)
        set_group_timeouts(cfg.parallel.timeout_minutes)
        self.saved, self.save_due = ckpt.tag_for(step), False
        self.metrics.event(step, "checkpoint", dir=str(self.cdir / ckpt.tag_for(step)))

    def validate(self) -> float:
        t = self.cfg.train
        batches = (
            [self.valid_batches.global_batch(i * t.global_batch_size) for i in range(t.eval_iters)]
            if self.valid_batches is not None
            else None
        )
        loss = self.eng.eval_loss(batches, t.eval_iters)
        self.metrics.valid(self.state.step, loss, validation_set(self.cfg))
        return loss

    def diverged(self, why: str) -> Diverged:
        """Stop: the guard fired (every rank decides the same). ``latest`` goes back to the newest confirmed
        checkpoint when the newest one is not confirmed (rank 0, still the owner); the message names it."""
        st, keep = self.state, self.confirmed
        if self.saved != keep and keep is not None and self.dims.rank == 0:
            if self.locks is not None:
                self.locks.check()
            ckpt.point_latest(self.cdir, keep)
        window = self.guard.window(st.consumed_samples)
        if keep is None and self.saved is None:
            kept = "no checkpoint of this run was saved yet"
        elif keep is None:  # the only checkpoint is unconfirmed: it stays named, said as such
            kept = (
                f"latest names {self.saved}, saved just before the first unhealthy step (no earlier checkpoint): its "
                "weights may already be the diverged ones"
            )
        else:
            kept = f"latest names {keep}, the newest checkpoint confirmed by a healthy step after it"
            if keep != self.saved:
                kept += f" ({self.saved}, saved just before the first unhealthy step, is kept but not named)"
        msg = (
            f"stopped at step {st.step}: {why}; {window + '; ' if window else ''}nothing was saved after the last "
            f"healthy step; {kept}. Re-running resumes from it: change what diverged first (e.g. a lower optim.lr), "
            "or pick an earlier checkpoint with checkpoint.resume_from=<tag>"
        )
        self.metrics.event(st.step, "diverged", error=msg)
        return Diverged(msg)

    def log_extra(self, loss: float, seconds_per_step: float) -> dict:
        """The log-interval scalars (collective: LEV health)."""
        cfg, dims, consumed = self.cfg, self.dims, self.state.consumed_samples
        health = lev_stats(cfg, self.eng, dims)
        flops = model_flops_per_token(cfg, health.get("lev/unique_ratio", 1.0))
        tokens = cfg.train.global_batch_size * cfg.model.seq_length
        return {
            "train/perplexity": perplexity(loss),
            "train/loss_scale": self.eng.loss_scale(),
            "train/samples_consumed": consumed,
            "train/tokens_consumed": consumed * cfg.model.seq_length,
            **throughput(tokens, seconds_per_step, flops, dims.world, self.peak),
            **memory_stats(self.denv.device),
            **health,
        }

    def log_geometry(self) -> None:
        """The token vectors' geometry now (collective; ``logging.geometry_interval``, trainer/geometry_log.py)."""
        if self.geometry_ids is not None:
            stats = geometry_stats(self.cfg, self.eng.module(), self.dims, self.geometry_ids)
            self.metrics.geometry(self.state.step, stats)

    def train_step(self) -> tuple[dict, float]:
        """One optimizer step (``state.step`` already advanced)."""
        cfg, t, eng, st = self.cfg, self.cfg.train, self.eng, self.state
        # the schedule advances with applied updates only: a skipped (non-finite) step consumes no LR step
        lr = lr_at(st.lr_step - 1, cfg.optim, t.steps)
        eng.set_lr(lr)
        t_step = time.perf_counter()
        if self.prefetch is not None:  # the same batch, built while the previous step ran (data.prefetch)
            mbs = self.prefetch.take(st.consumed_samples)
        else:
            mbs = self.train_batches.global_batch(st.consumed_samples) if self.train_batches is not None else None
        loss, applied = eng.train_step(mbs)
        before = st.consumed_samples
        st.consumed_samples += t.global_batch_size
        gnorm = eng.grad_norm()
        bad = not applied or not is_finite(loss)
        st.skipped_steps += bad
        stop = self.guard.update(st.step, before, applied, loss, gnorm)
        if self.guard.healthy and self.saved is not None and step_of(self.saved) == st.step - 1:
            self.confirmed = self.saved  # its weights gave a healthy step
        if stop is not None:
            raise self.diverged(stop)
        return {
            "loss": loss,
            "lr": lr,
            "grad_norm": gnorm if gnorm is None or math.isfinite(gnorm) else None,
            "skipped": not applied,
            "skipped_total": st.skipped_steps,
            "consumed_samples": st.consumed_samples,
            "step_time_s": time.perf_counter() - t_step,
        }, loss

    def train(self) -> int:
        cfg, t, dims, m, st = self.cfg, self.cfg.train, self.dims, self.metrics, self.state
        params = param_counts.param_summary(cfg.model, dims.tp)  # as `params` and `evaluate` count them
        m.record(
            {
                "step": st.step,
                "event": "layout",
                "world": dims.world,
                "tp": dims.tp,
                "pp": dims.pp,
                "dp": dims.dp,
                "gas": dims.gas,
                "zero_stage": cfg.parallel.zero_stage,
                "precision": cfg.parallel.precision,
                "device": self.denv.device.type,
                "peak_flops": self.peak,
                "machine": host.describe(self.denv.device.type),
                "params": {k: params[k] for k in ("input", "body", "head", "total", "padding")},
            }
        )
        if dims.writer:
            print(f"[train] {param_counts.trained_text(params)}", flush=True)
        if self.latest is not None:
            note = {"note": self.resume_note} if self.resume_note else {}
            m.event(st.step, "resumed", tag=self.latest, consumed_samples=st.consumed_samples, **note)
        elif self.resume_note:
            m.event(st.step, "start over", note=self.resume_note)
        elif dims.writer:
            print(
                f"[train] {cfg.model.variant} model, TP={dims.tp} PP={dims.pp} DP={dims.dp}, ZeRO "
                f"{cfg.parallel.zero_stage}, {cfg.parallel.precision}, micro-batch {t.micro_batch_size} x "
                f"accumulation {dims.gas} x DP {dims.dp} = global batch {t.global_batch_size}, {t.steps} steps; "
                f"MFU: "
                + (
                    f"peak {self.peak / 1e12:g} TFLOP/s per device ({self.peak_source})"
                    if self.peak is not None
                    else f"not reported ({self.peak_source})"
                ),
                flush=True,
            )
        if st.step >= t.steps:
            m.event(st.step, "already complete", steps=t.steps)
            return EXIT_OK
        if self.latest is None:
            self.log_geometry()  # the model as initialised: step 0
        if cfg.data.resolved_prefetch(self.denv.device.type) and self.train_batches is not None:
            # the next global batch read, checked and prepared on one background thread while this step runs:
            # by position, so the same batches as without; never past the run's last sample
            g = t.global_batch_size
            self.prefetch = Prefetcher(self.train_batches.global_batch, g, t.steps * g, self.denv.device)
        try:
            return self.run_steps()
        finally:  # every way out (the end, a stop, an exception, a lost peer): no worker left behind
            self.close_prefetch()

    def save_or_defer(self, loss: float, valid: float | None, stop_reason: str | None) -> bool:
        """Save when one is due (the interval, the last step, a stop) and the step is healthy (trainer/guard.py);
        a save due at an unhealthy step waits for the next healthy one. The last step saves when its loss is finite
        (a spike not yet confirmed is said); a non-finite last step or validation stops with exit 3. Returns whether
        a checkpoint was saved."""
        st, t, m = self.state, self.cfg.train, self.metrics
        valid_ok = valid is None or is_finite(valid)
        healthy = self.guard.healthy and valid_ok
        final = st.step == t.steps
        if final and (self.guard.bad_run or not valid_ok):
            raise self.diverged(f"the last step is not finite (loss={loss}, validation loss={valid})")
        due = self.save_due or st.step % self.cfg.checkpoint.save_interval == 0 or final or stop_reason is not None
        if not due:
            return False
        if healthy or final:
            if not healthy:
                m.event(
                    st.step, "warning", message=f"the last step is saved inside a suspected spike: {self.guard.why}"
                )
            self.save()
            return True
        self.save_due = True
        why = self.guard.why if not self.guard.healthy else f"validation loss {valid}"
        m.event(st.step, "save deferred", reason=why, latest=self.saved)
        return False

    def run_steps(self) -> int:
        """The training steps from ``state.step`` to the end or an early stop; the exit code."""
        cfg, t, dims, m, st = self.cfg, self.cfg.train, self.dims, self.metrics, self.state
        interval_t, interval_steps = time.perf_counter(), 0
        while st.step < t.steps:
            st.step += 1
            self.peers.beat(st.step)
            rec, loss = self.train_step()
            interval_steps += 1
            extra = None
            if st.step % cfg.logging.log_interval == 0 or st.step == t.steps:
                extra = self.log_extra(loss, (time.perf_counter() - interval_t) / interval_steps)
                interval_t, interval_steps = time.perf_counter(), 0
            m.train_step(st.step, rec, extra)
            every = cfg.logging.geometry_interval
            if every and (st.step % every == 0 or st.step == t.steps):
                self.log_geometry()
            valid = None
            if t.eval_interval and (st.step % t.eval_interval == 0 or st.step == t.steps):
                valid = self.validate()
            lost = self.locks is not None and self.locks.lost is not None
            stop_reason = stop_requested(t, self.signals, st.step, self.t0, self.denv.device, lock_lost=lost)
            if stop_reason == "lock lost":  # a stalled trainer whose run directory was taken over: no more writes
                raise LockLost(
                    f"{self.out_dir}: this trainer lost its run lock at step {st.step} (another trainer took the run "
                    "directory over while this one was stalled); stopped without saving"
                )
            saved = self.save_or_defer(loss, valid, stop_reason)
            if stop_reason and st.step < t.steps:
                # not saved (an unhealthy step): the next start resumes from the last good checkpoint
                m.event(st.step, "stopped", reason=stop_reason, exit_code=EXIT_REQUEUE, saved=saved, latest=self.saved)
                return EXIT_REQUEUE
        m.event(st.step, "finished", steps=t.steps)
        if dims.writer and m.tb is not None:
            print(f"[train] TensorBoard: tensorboard --logdir {m.tb.log_dir}", flush=True)
        return EXIT_OK
