"""The training loop: set-up checks, resume, steps, validation, checkpoints, stop conditions.

``run(cfg)`` is everything ``python -m leviathan_pretrain.train`` does after parsing; it returns the exit
code (see :mod:`.faults`). :class:`Trainer` holds one run's state (engine, batches, step, samples consumed). It is re-entrant within one process (tests run several configurations per
launch): process groups are re-initialised when the parallel layout changes.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from leviathan_pretrain.config import Config, ConfigError, to_dict
from leviathan_pretrain.trainer import checkpoint as ckpt
from leviathan_pretrain.trainer import reshard
from leviathan_pretrain.trainer.data import Batches, ShardError, build_datasets, data_summary
from leviathan_pretrain.trainer.faults import (EXIT_OK, EXIT_REQUEUE, BadStepCounter, Diverged, StopSignals,
                                               is_finite)
from leviathan_pretrain.trainer.metrics import Metrics, memory_stats, peak_flops, perplexity, throughput
from leviathan_pretrain.trainer.schedule import lr_at


@dataclass
class Layout:
    rank: int
    world: int
    tp: int
    pp: int
    dp: int
    dp_rank: int
    gas: int
    first_stage: bool
    last_stage: bool
    writer: bool       # last stage, TP rank 0, DP rank 0: TensorBoard, console, train_log.jsonl


def layout(cfg: Config) -> Layout:
    from megatron.core import parallel_state as ps
    t = cfg.train
    dp = ps.get_data_parallel_world_size()
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"train.global_batch_size: {t.global_batch_size} is not a multiple of "
                          f"train.micro_batch_size x data-parallel size = {t.micro_batch_size} x {dp}")
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    return Layout(dist.get_rank(), dist.get_world_size(), ps.get_tensor_model_parallel_world_size(), pp, dp,
                  ps.get_data_parallel_rank(), t.global_batch_size // (t.micro_batch_size * dp),
                  pp_rank == 0, pp_rank == pp - 1, pp_rank == pp - 1 and tp_rank == 0 and ps.get_data_parallel_rank() == 0)


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


def latest_checkpoint(cfg: Config, cdir: Path) -> str | None:
    """The tag to resume from; with ``checkpoint.resume=false`` the directory must hold no checkpoint (a new
    run's checkpoints would mix with the old ones, and pruning keeps the highest steps)."""
    ckpt.check_no_foreign(cdir)
    if cfg.checkpoint.resume:
        return ckpt.read_latest(cdir)
    if cdir.is_dir() and ckpt.complete_tags(cdir):
        raise ConfigError(f"checkpoint.resume: false, but {cdir} already holds checkpoints "
                          f"({', '.join(ckpt.complete_tags(cdir)[-3:])}); use another train.out_dir or "
                          "checkpoint.dir, or delete it")
    return None


def checkpoint_dir(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.train.out_dir) / "checkpoints")


def find_lev(module: torch.nn.Module):
    return next((m for m in module.modules() if type(m).__name__ == "LEVInput"), None)


def lev_stats(cfg: Config, eng, lay: Layout) -> dict:
    """LEV health (collective over the first stage's TP group), delivered to the writer rank."""
    from megatron.core import parallel_state as ps

    from leviathan_pretrain.model import lev_health
    stats = {}
    if lay.first_stage and cfg.model.variant == "lev":
        layer = find_lev(eng.module())
        if layer is not None:
            if cfg.parallel.zero_stage == 3:
                import deepspeed
                with deepspeed.zero.GatheredParameters(list(layer.parameters())):
                    stats = lev_health(layer, gather=True)
            else:
                stats = lev_health(layer, gather=True)      # includes lev/unique_ratio (FLOPs accounting)
    if lay.pp > 1:
        box = [stats]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_first_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        stats = box[0]
    return stats


def run(cfg: Config) -> int:
    signals = StopSignals().install()     # from the start: a preemption during set-up stops after step 1
    try:
        trainer = Trainer(cfg, signals)
        try:
            return trainer.train()
        finally:
            trainer.close()
    finally:
        signals.uninstall()


class Trainer:
    """One run: set-up (checks, engine, data) in ``__init__``, then :meth:`train`; collective throughout."""

    def __init__(self, cfg: Config, signals: StopSignals):
        from leviathan_pretrain.parallel import init_distributed, seed_everything
        self.cfg, self.signals = cfg, signals
        self.denv = init_distributed(cfg.parallel)
        self.lay = lay = layout(cfg)
        self.t0 = time.monotonic()
        self.out_dir, self.cdir = Path(cfg.train.out_dir), checkpoint_dir(cfg)

        # checks before anything expensive (rank 0 checks, every rank raises the same error)
        summary = collective_check(data_summary, cfg)
        self.tok_sha = summary["tokenizer_sha256"]       # checked against the shards, recorded in checkpoints
        self.latest = collective_check(latest_checkpoint, cfg, self.cdir)
        self.meta = None
        if self.latest is not None:
            self.meta = ckpt.read_meta(self.cdir, self.latest)
            check_compatible(cfg, self.meta, self.tok_sha, self.cdir / self.latest, lay)
        if lay.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.cdir.mkdir(parents=True, exist_ok=True)
            removed = ckpt.remove_incomplete(self.cdir, keep=self.latest)
            if removed:
                print(f"[train] removed interrupted checkpoint save(s) {', '.join(removed)} (marked "
                      f"{ckpt.SAVING}, never completed)", flush=True)
            (self.out_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
        dist.barrier()

        seed_everything(cfg.train.seed, self.denv.device)
        from leviathan_pretrain.trainer.engine import build_engine
        self.eng = build_engine(cfg, self.denv.device)
        train_ds, valid_ds = build_datasets(cfg, summary["eod_id"], self.eng.needs_data)
        t = cfg.train
        self.train_batches = Batches(train_ds, t.micro_batch_size, lay.dp, lay.dp_rank, t.global_batch_size) \
            if self.eng.needs_data else None
        self.valid_batches = Batches(valid_ds, t.micro_batch_size, lay.dp, lay.dp_rank, t.global_batch_size) \
            if self.eng.needs_data and valid_ds is not None else None
        self.step, self.consumed, skipped = 0, 0, 0
        if self.latest is not None:
            ckpt.load(self.eng.ds, self.cdir, self.latest, self.meta.get("layout"))
            self.step, self.consumed = self.meta["step"], self.meta["consumed_samples"]
            skipped = self.meta.get("skipped_steps", 0)
        self.bad = BadStepCounter(t.max_bad_steps, skipped)
        tb = Path(cfg.logging.tensorboard_dir or self.out_dir / "tensorboard") if cfg.logging.tensorboard else None
        self.metrics = Metrics(self.out_dir, tb, lay.writer, self.step, cfg.logging.log_interval, t.steps)
        self.peak, self.peak_source = peak_flops(self.denv.device, cfg.parallel.precision, cfg.logging.peak_flops)

    def close(self) -> None:
        self.metrics.close()
        self.eng.ds.destroy()

    def save(self) -> None:
        cfg, lay, step = self.cfg, self.lay, self.step
        meta = {"config": to_dict(cfg), "tokenizer_sha256": self.tok_sha, "consumed_samples": self.consumed,
                "skipped_steps": self.bad.total,
                "layout": {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "zero_stage": cfg.parallel.zero_stage}}
        client = {"step": step, "consumed_samples": self.consumed, "tokenizer_sha256": self.tok_sha,
                  "model": to_dict(cfg.model)}
        ckpt.save(self.eng.ds, self.cdir, step, meta, cfg.checkpoint.keep_last, client_state=client)
        self.metrics.event(step, "checkpoint", dir=str(self.cdir / ckpt.tag_for(step)))

    def validate(self) -> None:
        t = self.cfg.train
        batches = [self.valid_batches.global_batch(i * t.global_batch_size) for i in range(t.eval_iters)] \
            if self.valid_batches is not None else None
        self.metrics.valid(self.step, self.eng.eval_loss(batches, t.eval_iters))

    def log_extra(self, loss: float, seconds_per_step: float) -> dict:
        """The log-interval scalars (collective: LEV health)."""
        from leviathan_pretrain.model import model_flops_per_token
        cfg, lay = self.cfg, self.lay
        health = lev_stats(cfg, self.eng, lay)
        flops = model_flops_per_token(cfg, health.get("lev/unique_ratio", 1.0))
        tokens = cfg.train.global_batch_size * cfg.model.seq_length
        return {"train/perplexity": perplexity(loss), "train/loss_scale": self.eng.loss_scale(),
                "train/samples_consumed": self.consumed,
                "train/tokens_consumed": self.consumed * cfg.model.seq_length,
                **throughput(tokens, seconds_per_step, flops, lay.world, self.peak),
                **memory_stats(self.denv.device), **health}

    def train_step(self) -> tuple[dict, float]:
        cfg, t, eng = self.cfg, self.cfg.train, self.eng
        # the schedule advances with applied updates only: a skipped (non-finite) step consumes no LR step
        lr = lr_at(self.step - 1 - self.bad.total, cfg.optim, t.steps)
        eng.set_lr(lr)
        t_step = time.perf_counter()
        mbs = self.train_batches.global_batch(self.consumed) if self.train_batches is not None else None
        eng.nan_next = self.step in t.inject_nan_steps and t.inject_nan_rank in (None, self.lay.rank)
        loss, applied = eng.train_step(mbs)
        eng.nan_next = False
        self.consumed += t.global_batch_size
        gnorm = eng.grad_norm()
        try:
            self.bad.update(self.step, not applied or not is_finite(loss), loss, gnorm)
        except Diverged as e:
            self.metrics.event(self.step, "diverged", error=str(e))
            raise
        return {"loss": loss, "lr": lr, "grad_norm": gnorm if gnorm is None or math.isfinite(gnorm) else None,
                "skipped": not applied, "skipped_total": self.bad.total, "consumed_samples": self.consumed,
                "step_time_s": time.perf_counter() - t_step}, loss

    def train(self) -> int:
        cfg, t, lay, m = self.cfg, self.cfg.train, self.lay, self.metrics
        m.record({"step": self.step, "event": "layout", "world": lay.world, "tp": lay.tp, "pp": lay.pp,
                  "dp": lay.dp, "gas": lay.gas, "zero_stage": cfg.parallel.zero_stage,
                  "precision": cfg.parallel.precision, "device": self.denv.device.type, "peak_flops": self.peak})
        if self.latest is not None:
            m.event(self.step, "resumed", tag=self.latest, consumed_samples=self.consumed)
        elif lay.writer:
            print(f"[train] {cfg.model.variant} model, TP={lay.tp} PP={lay.pp} DP={lay.dp}, ZeRO "
                  f"{cfg.parallel.zero_stage}, {cfg.parallel.precision}, micro-batch {t.micro_batch_size} x "
                  f"accumulation {lay.gas} x DP {lay.dp} = global batch {t.global_batch_size}, {t.steps} steps; "
                  f"MFU: " + (f"peak {self.peak / 1e12:g} TFLOP/s per device ({self.peak_source})"
                              if self.peak is not None else f"not reported ({self.peak_source})"), flush=True)
        if self.step >= t.steps:
            m.event(self.step, "already complete", steps=t.steps)
            return EXIT_OK
        interval_t, interval_steps = time.perf_counter(), 0
        while self.step < t.steps:
            self.step += 1
            rec, loss = self.train_step()
            interval_steps += 1
            extra = None
            if self.step % cfg.logging.log_interval == 0 or self.step == t.steps:
                extra = self.log_extra(loss, (time.perf_counter() - interval_t) / interval_steps)
                interval_t, interval_steps = time.perf_counter(), 0
            m.train_step(self.step, rec, extra)
            if t.eval_interval and (self.step % t.eval_interval == 0 or self.step == t.steps):
                self.validate()
            stop_reason = stop_requested(cfg, self.signals, self.step, self.t0, self.denv.device)
            if self.step % cfg.checkpoint.save_interval == 0 or self.step == t.steps or stop_reason:
                self.save()
            if stop_reason and self.step < t.steps:
                m.event(self.step, "stopped", reason=stop_reason, exit_code=EXIT_REQUEUE)
                return EXIT_REQUEUE
        m.event(self.step, "finished", steps=t.steps)
        if lay.writer and m.tb is not None:
            print(f"[train] TensorBoard: tensorboard --logdir {m.tb.log_dir}", flush=True)
        return EXIT_OK


def stop_requested(cfg: Config, signals: StopSignals, step: int, t0: float, device) -> str | None:
    """Collective: why to stop now (a signal on any rank, exit_at_step, exit_after_minutes), or None."""
    t = cfg.train
    timed_out = t.exit_after_minutes is not None and time.monotonic() - t0 > 60 * t.exit_after_minutes
    flags = torch.tensor([1.0 if signals.received is not None else 0.0, 1.0 if timed_out else 0.0], device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[0] > 0:
        return "signal"
    if t.exit_at_step is not None and step >= t.exit_at_step:
        return "exit_at_step"
    if flags[1] > 0:
        return "exit_after_minutes"
    return None


# Model settings that change speed or memory but not the weights: a run may resume with other values.
RESUME_FREE = {"attention_backend", "lev.token_chunk", "lev.chunk_elements", "lev.recompute"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_compatible(cfg: Config, meta: dict, tok_sha: str | None, where: Path, lay: Layout) -> None:
    """The checkpoint's model config and tokenizer match this run, and its parallel layout can be loaded: the
    same TP, PP and ZeRO stage; another data-parallel size with ``checkpoint.reshard`` (before loading it)."""
    saved = _flat(meta.get("config", {}).get("model", {}))
    now = _flat(to_dict(cfg.model))
    diff = [k for k in sorted(set(saved) | set(now)) if k not in RESUME_FREE and saved.get(k) != now.get(k)]
    if diff:
        k = diff[0]
        raise ckpt.CheckpointError(f"{where}: written for model.{k}={saved.get(k)!r}, the config says "
                                   f"{now.get(k)!r}; use the same model config or another checkpoint.dir")
    if meta.get("tokenizer_sha256") and tok_sha and meta["tokenizer_sha256"] != tok_sha:
        raise ckpt.CheckpointError(f"{where}: written with a different tokenizer (sha256 "
                                   f"{meta['tokenizer_sha256'][:12]}...) than data.tokenizer={cfg.data.tokenizer}")
    reshard.check_layout(meta.get("layout", {}), lay.tp, lay.pp, lay.dp, cfg.parallel.zero_stage,
                         cfg.checkpoint.reshard, where)
