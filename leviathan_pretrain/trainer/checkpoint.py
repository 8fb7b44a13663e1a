"""Checkpoints: DeepSpeed's own files plus what a run needs to continue exactly, committed atomically.

Layout of ``checkpoint.dir`` (default ``<train.out_dir>/checkpoints``)::

    latest                      the tag of the newest *complete* checkpoint (replaced atomically)
    global_step30/              one checkpoint (DeepSpeed's model/optimizer/ZeRO files for every rank)
        rng_rank00000.pt        this rank's RNG states (python, numpy, torch CPU and CUDA)
        leviathan.saving        our in-progress mark: present from the directory's creation until commit
        leviathan.json          step, consumed samples, config, tokenizer sha256, layout; written last

Saving (collective): rank 0 creates the tag directory *with* the in-progress mark (built under a hidden
temporary name, then renamed), every rank writes its DeepSpeed files and RNG state and fsyncs each file it
wrote itself (on Lustre/GPFS only the writing node can flush its pages), then a barrier; rank 0 writes
``leviathan.json``, removes the mark, points ``latest`` at the new tag (write-to-temp, fsync, rename) and
deletes all but the newest ``keep_last`` complete checkpoints. A crash at any point leaves ``latest`` naming
the previous complete checkpoint.

What is ever deleted: only directories we marked — an interrupted save (``leviathan.saving`` without
``leviathan.json``) at the next start, our own hidden temporary directories and ``latest.tmp<pid>``, and complete
checkpoints of this run beyond ``keep_last``. A ``global_step*`` folder without either file (another run's
DeepSpeed checkpoint) is never touched: the trainer refuses to start in a directory holding one.

Loading uses ``torch.load(weights_only=True)`` for every file, DeepSpeed's included (its checkpoint
engine is replaced by :class:`SafeCheckpointEngine`); only the few DeepSpeed classes its optimizer
states contain are allow-listed. Anything else in a file fails with an error naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from data_prep.fileio import fsync_path, write_bytes_atomic
from leviathan_pretrain.config import Config, ConfigError, to_dict
from leviathan_pretrain.model import LAYOUT_VERSION
from leviathan_pretrain.parallel import ParallelDims
from leviathan_pretrain.trainer import reshard
from leviathan_pretrain.trainer.ckpt_names import (  # noqa: F401  (re-exported: the one definition)
    LATEST,
    META,
    SAVING,
    TAG_PREFIX,
    checkpoint_dir,
    complete_tags,
    read_latest,
    step_of,
    tag_for,
)
from leviathan_pretrain.trainer.ckpt_record import CheckpointRecord
from leviathan_pretrain.trainer.safe_io import CheckpointError, SafeCheckpointEngine, safe_load
from leviathan_pretrain.trainer.state import TrainState

# ---- directory bookkeeping (names, tag_for, step_of, read_latest, complete_tags, checkpoint_dir: in .ckpt_names) ----


def _atomic_write(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode(), sync_dir=True)


def _is_ours(d: Path) -> bool:
    return (d / META).is_file() or (d / SAVING).is_file()


def foreign_tags(ckpt_dir: Path) -> list[str]:
    """``global_step*`` folders we did not write (neither ``leviathan.json`` nor our in-progress mark)."""
    return sorted(d.name for d in Path(ckpt_dir).glob(f"{TAG_PREFIX}*") if d.is_dir() and not _is_ours(d))


def check_no_foreign(ckpt_dir: Path) -> None:
    """Refuse a checkpoint directory that holds another run's checkpoints: saving there would mix with them
    (and DeepSpeed's ``latest`` is the same file name)."""
    foreign = foreign_tags(ckpt_dir) if Path(ckpt_dir).is_dir() else []
    if foreign:
        raise CheckpointError(
            f"{ckpt_dir} holds checkpoint folder(s) not written by leviathan_pretrain "
            f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}: no {META} or "
            f"{SAVING}); they were left alone. Use another checkpoint.dir / train.out_dir"
        )


def remove_incomplete(ckpt_dir: Path, keep: str | None = None) -> list[str]:
    """Delete our interrupted saves (in-progress mark, no ``leviathan.json``) and our temporary files; rank 0
    only. Nothing without our mark is touched."""
    ckpt_dir = Path(ckpt_dir)
    removed = []
    for d in ckpt_dir.glob(f"{TAG_PREFIX}*"):
        if d.is_dir() and (d / SAVING).is_file() and not (d / META).is_file() and d.name != keep:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    for d in ckpt_dir.glob(f".{TAG_PREFIX}*.saving-*"):  # a crash between mkdir and rename
        if d.is_dir() and (d / SAVING).is_file():
            shutil.rmtree(d, ignore_errors=True)
    for tmp in ckpt_dir.glob(LATEST + ".tmp*"):  # ours: write_bytes_atomic's temporary name
        if tmp.name[len(LATEST) + 4 :].isdigit():
            tmp.unlink(missing_ok=True)
    return removed


def prune(ckpt_dir: Path, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints (never the one ``latest`` names)."""
    latest = read_latest(ckpt_dir)
    tags = complete_tags(ckpt_dir)
    doomed = [t for t in tags[:-keep_last] if t != latest] if keep_last < len(tags) else []
    for t in doomed:
        # Mark in progress, then drop the completion marker: a crash mid-delete leaves an interrupted save.
        d = Path(ckpt_dir) / t
        (d / SAVING).write_text("{}")
        (d / META).unlink(missing_ok=True)
        shutil.rmtree(d, ignore_errors=True)
    return doomed


def _begin(ckpt_dir: Path, tag: str, step: int) -> None:
    """Rank 0: create ``ckpt_dir/tag`` carrying the in-progress mark from its first moment."""
    final = ckpt_dir / tag
    if final.exists():
        if not _is_ours(final):
            raise CheckpointError(f"{final} exists and was not written by leviathan_pretrain; left alone")
        shutil.rmtree(final)  # our own leftover of this step (e.g. a re-run after a crash)
    tmp = ckpt_dir / f".{tag}.saving-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / SAVING).write_text(
        json.dumps(
            {
                "step": step,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        )
    )
    os.replace(tmp, final)
    fsync_path(ckpt_dir)


def save(ds_engine, ckpt_dir: Path, record: CheckpointRecord, keep_last: int) -> str:
    """Collective: write checkpoint ``global_step<record.step>`` and commit it (see the module docstring) with
    ``record`` as its ``leviathan.json``."""
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(record.step)
    if record.tag != tag:
        raise ValueError(f"record for {record.tag!r} saved as {tag!r}")
    rank = dist.get_rank()
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        _begin(ckpt_dir, tag, record.step)
    dist.barrier()
    engine = ds_engine.checkpoint_engine
    written = engine.start_recording() if isinstance(engine, SafeCheckpointEngine) else []
    ds_engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False)
    rng_path = ckpt_dir / tag / f"rng_rank{rank:05d}.pt"
    torch.save(TrainState.rng_state_dict(), rng_path)
    written.append(str(rng_path))
    if rank == 0:  # DeepSpeed's recovery scripts, copied by global rank 0
        written += [str(p) for p in (ckpt_dir / tag).glob("zero_to_*.py")]
    for f in written:  # each rank flushes what it wrote itself
        fsync_path(Path(f))
    fsync_path(ckpt_dir / tag)
    dist.barrier()
    if rank == 0:
        _atomic_write(ckpt_dir / tag / META, record.dumps())
        (ckpt_dir / tag / SAVING).unlink()
        fsync_path(ckpt_dir / tag)
        _atomic_write(ckpt_dir / LATEST, tag)
        prune(ckpt_dir, keep_last)
    dist.barrier()
    return tag


def load(ds_engine, ckpt_dir: Path, tag: str, record: CheckpointRecord) -> TrainState:
    """Collective: load checkpoint ``tag`` (model, optimizer, this rank's RNG) into the engine; returns its
    :class:`TrainState`. A checkpoint written at another data-parallel size whose optimizer state is
    partitioned over DP (ZeRO 1-3; DeepSpeed's bf16 optimizer) goes through DeepSpeed's universal checkpoint
    (:mod:`.reshard`); an unpartitioned one (ZeRO 0) loads at any DP size as it is."""
    from megatron.core import parallel_state as ps

    ckpt_dir = Path(ckpt_dir)
    saved = record.layout
    partitioned = any((ckpt_dir / tag).glob("*zero_pp_rank_*"))
    if saved.dp not in (None, ps.get_data_parallel_world_size()) and partitioned:
        path, _ = reshard.load_universal(ds_engine, ckpt_dir, tag, saved.zero_stage or 0)
    else:
        path, _ = ds_engine.load_checkpoint(
            str(ckpt_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
        )
    if path is None:
        raise CheckpointError(f"{ckpt_dir / tag}: DeepSpeed could not load this checkpoint")
    rng_path = ckpt_dir / tag / f"rng_rank{dist.get_rank():05d}.pt"
    if rng_path.is_file():  # per global rank: after a DP change new ranks keep their fresh seeding
        TrainState.load_rng_state_dict(safe_load(rng_path))
    state = TrainState()
    state.load_state_dict(record.state_fields())
    return state


# ---- resume rules ----

# Model settings that change speed or memory but not the weights: a run may resume with other values (and from a
# checkpoint written before the key existed: ``compile`` and ``activation_fusion`` came later; ``loss_impl``'s default
# became ``auto``, with issue 44).
RESUME_FREE = {
    "attention_backend",
    "loss_impl",
    "loss_chunk_tokens",
    "compile",
    "activation_fusion",
    "lev.token_chunk",
    "lev.chunk_mib",
    "lev.chunk_elements",
    "lev.recompute",
    "lev.kernel",
    "lev.gemm_dtype",
}


def latest_checkpoint(cfg: Config, cdir: Path) -> str | None:
    """The tag to resume from; with ``checkpoint.resume=false`` the directory must hold no checkpoint (a new
    run's checkpoints would mix with the old ones, and pruning keeps the highest steps). A directory with
    another run's ``global_step*`` folders is refused either way."""
    check_no_foreign(cdir)
    if cfg.checkpoint.resume:
        return read_latest(cdir)
    if cdir.is_dir() and complete_tags(cdir):
        raise ConfigError(
            f"checkpoint.resume: false, but {cdir} already holds checkpoints "
            f"({', '.join(complete_tags(cdir)[-3:])}); use another train.out_dir or "
            "checkpoint.dir, or delete it"
        )
    return None


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_compatible(
    cfg: Config, record: CheckpointRecord, tok_fp: str | None, where: Path, dims: ParallelDims
) -> None:
    """The checkpoint's model config and tokenizer match this run, and its parallel layout can be loaded: the
    same TP, PP and ZeRO stage; another data-parallel size with ``checkpoint.reshard`` (before loading it)."""
    if record.model_layout != LAYOUT_VERSION:
        raise CheckpointError(
            f"{where}: written with model layout {record.model_layout} (the state-dict "
            f"names of another leviathan_pretrain version); this code reads layout {LAYOUT_VERSION}"
        )
    saved = _flat(record.config.get("model") or {})
    now = _flat(to_dict(cfg.model))
    diff = [k for k in sorted(set(saved) | set(now)) if k not in RESUME_FREE and saved.get(k) != now.get(k)]
    if diff:
        k = diff[0]
        raise CheckpointError(
            f"{where}: written for model.{k}={saved.get(k)!r}, the config says "
            f"{now.get(k)!r}; use the same model config or another checkpoint.dir"
        )
    saved_fp = record.tokenizer_fp
    if saved_fp and tok_fp and saved_fp != tok_fp:
        raise CheckpointError(
            f"{where}: written with a different tokenizer (fingerprint {saved_fp[:12]}..., "
            f"{(record.config.get('data') or {}).get('tokenizer')}) than data.tokenizer={cfg.data.tokenizer} "
            f"({tok_fp[:12]}...)"
        )
    reshard.check_layout(
        record.layout, dims.tp, dims.pp, dims.dp, cfg.parallel.zero_stage, cfg.checkpoint.reshard, where
    )
