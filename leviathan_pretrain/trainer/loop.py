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

from leviathan_pretrain.config import Config, ConfigError, to_dict
from leviathan_pretrain.model import LAYOUT_VERSION, lev_health, lev_layer, model_flops_per_token
from leviathan_pretrain.parallel import (
    ParallelDims,
    init_distributed,
    parallel_dims,
    seed_everything,
    set_group_timeouts,
)
from leviathan_pretrain.rundir import host
from leviathan_pretrain.rundir.layout import RunLayout
from leviathan_pretrain.trainer import checkpoint as ckpt
from leviathan_pretrain.trainer.ckpt_record import CheckpointRecord, ParallelLayout
from leviathan_pretrain.trainer.data import Batches, ShardError, build_datasets, data_summary
from leviathan_pretrain.trainer.engine import build_engine
from leviathan_pretrain.trainer.faults import (
    EXIT_OK,
    EXIT_REQUEUE,
    BadStepCounter,
    Diverged,
    StopSignals,
    is_finite,
    stop_requested,
)
from leviathan_pretrain.trainer.geometry_log import geometry_stats, id_groups
from leviathan_pretrain.trainer.metrics import (
    Metrics,
    check_tensorboard,
    memory_stats,
    peak_flops,
    perplexity,
    throughput,
)
from leviathan_pretrain.trainer.peers import record_peers
from leviathan_pretrain.trainer.prefetch import Prefetcher
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
        t = cfg.train
        self.denv = init_distributed(cfg.parallel)
        self.dims = dims = parallel_dims(t.micro_batch_size, t.global_batch_size)
        self.t0 = time.monotonic()
        layout = RunLayout.from_config(cfg)
        self.out_dir, self.cdir = layout.root, layout.checkpoints

        # checks before anything expensive (rank 0 checks, every rank raises the same error)
        collective_check(check_tensorboard, cfg)
        summary = collective_check(data_summary, cfg)
        # checked against the shards, recorded in checkpoints (the fingerprint is what must match)
        self.tok_fp, self.tok_sha = summary["tokenizer_fingerprint"], summary["tokenizer_sha256"]
        self.latest = collective_check(ckpt.latest_checkpoint, cfg, self.cdir)
        self.record = None  # leviathan.json of the checkpoint resumed from
        if self.latest is not None:
            self.record = CheckpointRecord.read(self.cdir / self.latest)
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
        # PP = 1: micro-batches prepared for the device as they are read (packed, unique ids; trainer/transfer.py)
        prep = getattr(self.eng, "prepare", None)
        batch_args = (t.micro_batch_size, dims.dp, dims.dp_rank, t.global_batch_size, cfg.model.vocab_size, prep)
        self.train_batches = Batches(train_ds, *batch_args) if self.eng.needs_data else None
        self.valid_batches = Batches(valid_ds, *batch_args) if self.eng.needs_data and valid_ds is not None else None
        self.prefetch: Prefetcher | None = None  # data.prefetch: the next global batch built ahead, during train()
        self.state = TrainState()
        if self.latest is not None:
            self.state = ckpt.load(self.eng.ds, self.cdir, self.latest, self.record)
        self.bad = BadStepCounter(t.max_bad_steps)
        tb = RunLayout.from_config(cfg).events
        self.metrics = Metrics(self.out_dir, tb, dims.writer, self.state.step, cfg.logging.log_interval, t.steps)
        self.peak, self.peak_source = peak_flops(self.denv.device, cfg.parallel.precision, cfg.logging.peak_flops)
        # set-up done: from here a peer that stops answering (dead, stalled, cut off) fails every collective,
        # the per-step stop vote's on the world group included, after parallel.timeout_minutes
        self.peers = record_peers(cfg.parallel.timeout_minutes)
        set_group_timeouts(cfg.parallel.timeout_minutes)
        self.geometry_ids = id_groups(cfg) if cfg.logging.geometry_interval else None

    def close(self) -> None:
        self.close_prefetch()
        self.peers.stop()
        set_group_timeouts(self.cfg.parallel.init_timeout_minutes)  # the next run in this process starts up again
        self.metrics.close()
        self.eng.ds.destroy()

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
        ckpt.save(self.eng.ds, self.cdir, record, cfg.checkpoint.keep_last)
        set_group_timeouts(cfg.parallel.timeout_minutes)
        self.metrics.event(step, "checkpoint", dir=str(self.cdir / ckpt.tag_for(step)))

    def validate(self) -> None:
        t = self.cfg.train
        batches = (
            [self.valid_batches.global_batch(i * t.global_batch_size) for i in range(t.eval_iters)]
            if self.valid_batches is not None
            else None
        )
        self.metrics.valid(self.state.step, self.eng.eval_loss(batches, t.eval_iters))

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
        st.consumed_samples += t.global_batch_size
        gnorm = eng.grad_norm()
        bad = not applied or not is_finite(loss)
        st.skipped_steps += bad
        try:
            self.bad.update(st.step, bad, loss, gnorm)
        except Diverged as e:
            self.metrics.event(st.step, "diverged", error=str(e))
            raise
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
            }
        )
        if self.latest is not None:
            m.event(st.step, "resumed", tag=self.latest, consumed_samples=st.consumed_samples)
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
            if t.eval_interval and (st.step % t.eval_interval == 0 or st.step == t.steps):
                self.validate()
            stop_reason = stop_requested(t, self.signals, st.step, self.t0, self.denv.device)
            if st.step % cfg.checkpoint.save_interval == 0 or st.step == t.steps or stop_reason:
                self.save()
            if stop_reason and st.step < t.steps:
                m.event(st.step, "stopped", reason=stop_reason, exit_code=EXIT_REQUEUE)
                return EXIT_REQUEUE
        m.event(st.step, "finished", steps=t.steps)
        if dims.writer and m.tb is not None:
            print(f"[train] TensorBoard: tensorboard --logdir {m.tb.log_dir}", flush=True)
        return EXIT_OK
