"""The training loop: set-up checks, resume, steps, validation, checkpoints, stop conditions.

``run(cfg)`` is everything ``python -m leviathan_pretrain.train`` does after parsing; it returns the exit
code (see :mod:`.faults`). It is re-entrant within one process (tests run several configurations per
launch): process groups are re-initialised when the parallel layout changes.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from leviathan_pretrain.config import Config, ConfigError, to_dict
from leviathan_pretrain.trainer import checkpoint as ckpt
from leviathan_pretrain.trainer.data import Batches, ShardError, build_datasets, data_summary, file_sha256
from leviathan_pretrain.trainer.faults import (EXIT_OK, EXIT_REQUEUE, BadStepCounter, Diverged, StopSignals,
                                               is_finite)
from leviathan_pretrain.trainer.metrics import Metrics, memory_stats, perplexity, throughput
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


def check_tokenizer(cfg: Config) -> str | None:
    """sha256 of ``data.tokenizer``, recorded in checkpoints (its vocabulary is checked at config load)."""
    path = cfg.data.tokenizer
    if not path:
        return None
    if not Path(path).is_file():
        raise ConfigError(f"data.tokenizer: {path} does not exist")
    return file_sha256(path)


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
                stats = lev_health(layer, gather=True)
            if getattr(layer, "last_unique_ratio", None) is not None:
                stats["lev/unique_ratio"] = float(layer.last_unique_ratio)
    if lay.pp > 1:
        box = [stats]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_first_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        stats = box[0]
    return stats


def run(cfg: Config) -> int:
    signals = StopSignals().install()     # from the start: a preemption during set-up stops after step 1
    try:
        return _run(cfg, signals)
    finally:
        signals.uninstall()


def _run(cfg: Config, signals: StopSignals) -> int:
    from leviathan_pretrain.parallel import init_distributed, seed_everything
    denv = init_distributed(cfg.parallel, timeout_s=cfg.parallel.timeout_minutes * 60)
    lay = layout(cfg)
    t0 = time.monotonic()
    out_dir = Path(cfg.train.out_dir)
    cdir = checkpoint_dir(cfg)

    # --- checks before anything expensive (rank 0 checks, every rank raises the same error) ---
    summary = collective_check(data_summary, cfg)
    tok_sha = collective_check(check_tokenizer, cfg)
    latest = collective_check(lambda: ckpt.read_latest(cdir) if cfg.checkpoint.resume else None)
    if lay.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        cdir.mkdir(parents=True, exist_ok=True)
        removed = ckpt.remove_incomplete(cdir, keep=latest)
        if removed:
            print(f"[train] removed incomplete checkpoint(s) {', '.join(removed)} (interrupted saves)", flush=True)
        (out_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
    dist.barrier()

    seed_everything(cfg.train.seed, denv.device)
    from leviathan_pretrain.trainer.engine import build_engine
    eng = build_engine(cfg, denv.device)
    train_ds, valid_ds = build_datasets(cfg, summary["eod_id"], eng.needs_data)
    t, steps = cfg.train, cfg.train.steps
    train_batches = Batches(train_ds, t.micro_batch_size, lay.dp, lay.dp_rank, t.global_batch_size) \
        if eng.needs_data else None
    valid_batches = Batches(valid_ds, t.micro_batch_size, lay.dp, lay.dp_rank, t.global_batch_size) \
        if eng.needs_data and valid_ds is not None else None

    # --- resume ---
    step, consumed, skipped_total = 0, 0, 0
    if latest is not None:
        meta, client = ckpt.load(eng.ds, cdir, latest)
        check_compatible(cfg, meta, tok_sha, cdir / latest, lay)
        step, consumed, skipped_total = meta["step"], meta["consumed_samples"], meta.get("skipped_steps", 0)
    metrics = Metrics(out_dir, (Path(cfg.logging.tensorboard_dir or out_dir / "tensorboard")
                                if cfg.logging.tensorboard else None), lay.writer, step,
                      cfg.logging.log_interval, steps)
    metrics.record({"step": step, "event": "layout", "world": lay.world, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp,
                    "gas": lay.gas, "zero_stage": cfg.parallel.zero_stage, "precision": cfg.parallel.precision,
                    "device": denv.device.type})
    if latest is not None:
        metrics.event(step, "resumed", tag=latest, consumed_samples=consumed)
    elif lay.writer:
        print(f"[train] {cfg.model.variant} model, TP={lay.tp} PP={lay.pp} DP={lay.dp}, ZeRO {cfg.parallel.zero_stage}, "
              f"{cfg.parallel.precision}, micro-batch {t.micro_batch_size} x accumulation {lay.gas} x DP {lay.dp} "
              f"= global batch {t.global_batch_size}, {steps} steps", flush=True)
    if step >= steps:
        metrics.event(step, "already complete", steps=steps)
        metrics.close()
        return EXIT_OK

    from leviathan_pretrain.model import model_flops_per_token
    bad = BadStepCounter(t.max_bad_steps, skipped_total)
    tokens_per_step = t.global_batch_size * cfg.model.seq_length
    interval_t, interval_steps = time.perf_counter(), 0
    meta_base = {"config": to_dict(cfg), "tokenizer_sha256": tok_sha,
                 "layout": {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "zero_stage": cfg.parallel.zero_stage}}

    def save(at_step: int) -> None:
        kill = cfg.checkpoint.inject_kill_in_save_step == at_step
        ckpt.save(eng.ds, cdir, at_step, {**meta_base, "consumed_samples": consumed, "skipped_steps": bad.total},
                  cfg.checkpoint.keep_last, client_state={"step": at_step, "consumed_samples": consumed,
                                                          "tokenizer_sha256": tok_sha, "model": to_dict(cfg.model)},
                  kill_during_save=kill)
        metrics.event(at_step, "checkpoint", dir=str(cdir / ckpt.tag_for(at_step)))

    def validate(at_step: int) -> None:
        n = t.eval_iters
        batches = [valid_batches.global_batch(i * t.global_batch_size) for i in range(n)] \
            if valid_batches is not None else None
        metrics.valid(at_step, eng.eval_loss(batches, n))

    try:
        while step < steps:
            step += 1
            lr = lr_at(step - 1, cfg.optim, steps)
            eng.set_lr(lr)
            t_step = time.perf_counter()
            mbs = train_batches.global_batch(consumed) if train_batches is not None else None
            eng.nan_next = step in t.inject_nan_steps and t.inject_nan_rank in (None, lay.rank)
            loss, applied = eng.train_step(mbs)
            t_step = time.perf_counter() - t_step
            eng.nan_next = False
            consumed += t.global_batch_size
            gnorm = eng.grad_norm()
            interval_steps += 1
            try:
                bad.update(step, not applied or not is_finite(loss), loss, gnorm)
            except Diverged as e:
                metrics.event(step, "diverged", error=str(e))
                raise
            rec = {"loss": loss, "lr": lr, "grad_norm": gnorm if gnorm is None or math.isfinite(gnorm) else None,
                   "skipped": not applied, "skipped_total": bad.total, "consumed_samples": consumed,
                   "step_time_s": t_step}
            extra = None
            if step % cfg.logging.log_interval == 0 or step == steps:
                dt = (time.perf_counter() - interval_t) / interval_steps
                health = lev_stats(cfg, eng, lay)
                flops = model_flops_per_token(cfg, health.get("lev/unique_ratio", 1.0))
                extra = {"train/perplexity": perplexity(loss), "train/loss_scale": eng.loss_scale(),
                         "train/samples_consumed": consumed, "train/tokens_consumed": consumed * cfg.model.seq_length,
                         **throughput(tokens_per_step, dt, flops, lay.world, cfg.logging.peak_flops),
                         **memory_stats(denv.device), **health}
                interval_t, interval_steps = time.perf_counter(), 0
            metrics.train_step(step, rec, extra)
            if t.eval_interval and (step % t.eval_interval == 0 or step == steps):
                validate(step)
            stop_reason = stop_requested(cfg, signals, step, t0, denv.device)
            if step % cfg.checkpoint.save_interval == 0 or step == steps or stop_reason:
                save(step)
            if stop_reason and step < steps:
                metrics.event(step, "stopped", reason=stop_reason, exit_code=EXIT_REQUEUE)
                return EXIT_REQUEUE
        metrics.event(step, "finished", steps=steps)
        if lay.writer and cfg.logging.tensorboard:
            print(f"[train] TensorBoard: tensorboard --logdir {metrics.tb.log_dir if metrics.tb else out_dir}",
                  flush=True)
        return EXIT_OK
    finally:
        metrics.close()
        eng.ds.destroy()


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


def check_compatible(cfg: Config, meta: dict, tok_sha: str | None, where: Path, lay: Layout) -> None:
    saved = meta.get("config", {}).get("model", {})
    now = to_dict(cfg.model)
    diff = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if diff:
        k = diff[0]
        raise ckpt.CheckpointError(f"{where}: written for model.{k}={saved.get(k)!r}, the config says "
                                   f"{now.get(k)!r}; use the same model config or another checkpoint.dir")
    if meta.get("tokenizer_sha256") and tok_sha and meta["tokenizer_sha256"] != tok_sha:
        raise ckpt.CheckpointError(f"{where}: written with a different tokenizer (sha256 "
                                   f"{meta['tokenizer_sha256'][:12]}...) than data.tokenizer={cfg.data.tokenizer}")
    old = meta.get("layout", {})
    if (old.get("tp"), old.get("pp"), old.get("dp")) != (lay.tp, lay.pp, lay.dp):
        raise ckpt.CheckpointError(f"{where}: written with TP={old.get('tp')} PP={old.get('pp')} DP={old.get('dp')}, "
                                   f"this run has TP={lay.tp} PP={lay.pp} DP={lay.dp}; resume with the same layout")
