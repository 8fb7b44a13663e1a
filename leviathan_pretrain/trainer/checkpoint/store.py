"""Checkpoints: DeepSpeed's own files plus what a run needs to continue exactly, committed atomically.

Layout of ``checkpoint.dir`` (default ``<train.out_dir>/checkpoints``)::

    latest                      the tag of the newest *complete* checkpoint (replaced atomically)
    global_step30/              one checkpoint (DeepSpeed's model/optimizer/ZeRO files for every rank)
        rng_rank00000.pt        this rank's RNG states (python, numpy, torch CPU and CUDA)
        leviathan.saving        our in-progress mark: present from the directory's creation until commit
        leviathan.json          step, consumed samples, config, tokenizer sha256, layout, every file's size;
                                written last
    leviathan.lock              the run lock (run_lock.py), when the checkpoints live outside train.out_dir
    leviathan.applied.json      the one-shot keys applied here (checkpoint.start_over, resume_from)
    replaced-*/ abandoned-*/ unusable-*/   checkpoints moved aside by those keys and checkpoint.fallback, never deleted

Saving (collective): rank 0 creates the tag directory *with* the in-progress mark (built under a hidden
temporary name, then renamed), every rank writes its DeepSpeed files and RNG state and fsyncs each file it
wrote itself (on Lustre/GPFS only the writing node can flush its pages), then a barrier; rank 0 writes
``leviathan.json``, removes the mark, points ``latest`` at the new tag (write-to-temp, fsync, rename) and
deletes all but the newest ``keep_last`` complete checkpoints (never the newest one a healthy step confirmed:
trainer/guard.py). A crash at any point leaves ``latest`` naming the previous complete checkpoint. Rank 0 checks it
still holds the run lock before the save and before the commit. Which checkpoint a start resumes from, and the
checks before loading it: :mod:`.resume`.

What is ever deleted: only directories we marked — an interrupted save (``leviathan.saving`` without
``leviathan.json``) at the next start, our own hidden temporary directories and ``latest.tmp<pid>``, and complete
checkpoints of this run beyond ``keep_last``. A ``global_step*`` folder without either file (another run's
DeepSpeed checkpoint) is never touched: the trainer refuses to start in a directory holding one.

Loading uses ``torch.load(weights_only=True)`` for every file, DeepSpeed's included (its checkpoint
engine is replaced by :class:`SafeCheckpointEngine`); only the few DeepSpeed classes its optimizer
states contain are allow-listed. Anything else in a file fails with an error naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

import torch.distributed as dist

from common.fileio import fsync_path, write_bytes_atomic
from leviathan_pretrain.config import Config, to_dict
from leviathan_pretrain.model.assembly import LAYOUT_VERSION
from leviathan_pretrain.parallel.groups import ParallelDims
from leviathan_pretrain.trainer.checkpoint import reshard
from leviathan_pretrain.trainer.checkpoint.errors import writing
from leviathan_pretrain.trainer.checkpoint.names import (
    LATEST,
    META,
    SAVING,
    TAG_PREFIX,
    CheckpointError,
    complete_tags,
    is_ours,
    read_latest,
    tag_for,
)
from leviathan_pretrain.trainer.checkpoint.record import CheckpointRecord
from leviathan_pretrain.trainer.checkpoint.resume import manifest
from leviathan_pretrain.trainer.checkpoint.run_lock import proc_start, process_alive
from leviathan_pretrain.trainer.checkpoint.safe_io import SafeCheckpointEngine, safe_load, safe_save
from leviathan_pretrain.trainer.state import TrainState

# ---- directory bookkeeping (names, tag_for, step_of, read_latest, complete_tags, checkpoint_dir: in .names) ----


def _atomic_write(path: Path, text: str) -> None:
    with writing(path):  # a full disk, permissions: one line naming the file and the cause
        write_bytes_atomic(path, text.encode(), sync_dir=True)


def _empty_dir(d: Path) -> bool:
    try:
        return d.is_dir() and not any(d.iterdir())
    except OSError:
        return False


def foreign_tags(ckpt_dir: Path) -> list[str]:
    """``global_step*`` folders we did not write (neither ``leviathan.json`` nor our in-progress mark), empty ones
    aside (nothing in them to mix with: what an older version's pruning, killed at its end, left)."""
    return sorted(
        d.name for d in Path(ckpt_dir).glob(f"{TAG_PREFIX}*") if d.is_dir() and not is_ours(d) and not _empty_dir(d)
    )


def _discard(d: Path) -> None:
    """Delete our folder ``d`` so that a crash at any moment leaves nothing that looks like another run's: renamed
    (atomically) out of the ``global_step*`` names to ``.<tag>.saving-<pid>`` carrying our in-progress mark, then
    emptied, the mark last, then removed (:func:`remove_incomplete` finishes what a crash left)."""
    if not (d / SAVING).is_file():
        (d / SAVING).write_text("{}")
    hidden = d.parent / f".{d.name}.saving-{os.getpid()}"
    if hidden.exists():
        _empty_out(hidden)
    os.rename(d, hidden)
    _empty_out(hidden)


def _empty_out(hidden: Path) -> None:
    for child in hidden.iterdir():
        if child.name != SAVING:
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    (hidden / SAVING).unlink(missing_ok=True)
    hidden.rmdir()


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


def _writer_alive(d: Path) -> bool:
    """Whether the process named in ``d``'s in-progress mark still runs on this host (it cannot be known for another
    host: there the run lock is what says the writer is gone)."""
    try:
        mark = json.loads((d / SAVING).read_text() or "{}")
    except (OSError, ValueError):
        return False
    if not isinstance(mark, dict):
        return False
    return process_alive(mark.get("host"), mark.get("pid"), mark.get("pid_start")) is True


def remove_incomplete(ckpt_dir: Path, keep: str | None = None) -> list[str]:
    """Delete our interrupted saves (in-progress mark, no ``leviathan.json``) and our temporary files; rank 0
    only, under the run lock. Nothing without our mark is touched, nor a save whose writer is alive on this host."""
    ckpt_dir = Path(ckpt_dir)
    removed = []
    for d in ckpt_dir.glob(f"{TAG_PREFIX}*"):
        if d.is_dir() and (d / SAVING).is_file() and not (d / META).is_file() and d.name != keep:
            if _writer_alive(d):
                continue
            _discard(d)
            removed.append(d.name)
    for d in ckpt_dir.glob(f".{TAG_PREFIX}*.saving-*"):  # a crash between mkdir and rename, or mid-delete
        if d.is_dir() and ((d / SAVING).is_file() or _empty_dir(d)) and not _writer_alive(d):
            _empty_out(d)
    for tmp in ckpt_dir.glob(LATEST + ".tmp*"):  # ours: write_bytes_atomic's temporary name
        if tmp.name[len(LATEST) + 4 :].isdigit():
            tmp.unlink(missing_ok=True)
    return removed


def prune(ckpt_dir: Path, keep_last: int, protect: str | None = None) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints; never the one ``latest`` names, nor
    ``protect`` (the newest checkpoint confirmed by a healthy step after it: trainer/guard.py)."""
    latest = read_latest(ckpt_dir)
    tags = complete_tags(ckpt_dir)
    doomed = [t for t in tags[:-keep_last] if t not in (latest, protect)] if keep_last < len(tags) else []
    for t in doomed:
        # Mark in progress, then drop the completion marker: a crash from here on leaves an interrupted save
        d = Path(ckpt_dir) / t
        (d / SAVING).write_text("{}")
        (d / META).unlink(missing_ok=True)
        _discard(d)
    return doomed


def _begin(ckpt_dir: Path, tag: str, step: int) -> str:
    """Rank 0: create ``ckpt_dir/tag`` carrying the in-progress mark from its first moment; returns the mark's text
    (unique to this save)."""
    final = ckpt_dir / tag
    if final.exists():
        if _empty_dir(final):
            final.rmdir()  # empty: nothing to lose
        elif not is_ours(final):
            raise CheckpointError(f"{final} exists and was not written by leviathan_pretrain; left alone")
        else:
            _discard(final)  # our own leftover of this step (e.g. a re-run after a crash)
    tmp = ckpt_dir / f".{tag}.saving-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    text = json.dumps(
        {
            "step": step,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": proc_start(os.getpid()),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "token": uuid.uuid4().hex,
        }
    )
    (tmp / SAVING).write_text(text)
    os.replace(tmp, final)
    fsync_path(ckpt_dir)
    return text


def point_latest(ckpt_dir: Path, tag: str) -> None:
    """Rank 0: point ``latest`` at the complete checkpoint ``tag`` (atomically)."""
    if not (Path(ckpt_dir) / tag / META).is_file():
        raise CheckpointError(f"{Path(ckpt_dir) / tag}: not a complete checkpoint; {LATEST} left as it was")
    _atomic_write(Path(ckpt_dir) / LATEST, tag)


def save(
    ds_engine, ckpt_dir: Path, record: CheckpointRecord, keep_last: int, check=None, protect: str | None = None
) -> str:
    """Collective: write checkpoint ``global_step<record.step>`` and commit it (see the module docstring) with
    ``record`` as its ``leviathan.json``, listing every file of it with its size. ``check`` (rank 0): raises unless
    this process still owns the run directory (the run lock), called before the save and before the commit;
    ``protect``: a tag pruning keeps."""
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(record.step)
    if record.tag != tag:
        raise ValueError(f"record for {record.tag!r} saved as {tag!r}")
    rank = dist.get_rank()
    box = [None]
    if rank == 0:
        if check is not None:
            check()
        with writing(ckpt_dir / tag):
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            box[0] = _begin(ckpt_dir, tag, record.step)
    dist.broadcast_object_list(box, src=0)  # the mark's text: every rank checks it before each file it writes
    engine = ds_engine.checkpoint_engine
    mark = (ckpt_dir / tag / SAVING, box[0])
    written = engine.start_recording(mark) if isinstance(engine, SafeCheckpointEngine) else []
    with writing(ckpt_dir / tag):  # a full disk, permissions: one line naming the file and the cause, this rank
        ds_engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False)  # (its files: SafeCheckpointEngine)
        rng_path = ckpt_dir / tag / f"rng_rank{rank:05d}.pt"
        safe_save(TrainState.rng_state_dict(), rng_path)
    written.append(str(rng_path))
    if rank == 0:  # DeepSpeed's recovery scripts, copied by global rank 0
        written += [str(p) for p in (ckpt_dir / tag).glob("zero_to_*.py")]
    with writing(ckpt_dir / tag):  # (NFS and Lustre report a full disk at the flush)
        for f in written:  # each rank flushes what it wrote itself
            fsync_path(Path(f))
        fsync_path(ckpt_dir / tag)
    dist.barrier()
    if rank == 0:
        if check is not None:
            check()
        with writing(ckpt_dir / tag):
            record = dataclasses.replace(record, files=manifest(ckpt_dir / tag))
            _atomic_write(ckpt_dir / tag / META, record.dumps())
            (ckpt_dir / tag / SAVING).unlink()
            fsync_path(ckpt_dir / tag)
            _atomic_write(ckpt_dir / LATEST, tag)
            prune(ckpt_dir, keep_last, protect)
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
# became ``auto`` with the Liger loss).
RESUME_FREE = {
    "attention_backend",
    "loss_impl",
    "loss_chunk_tokens",
    "compile",
    "activation_fusion",
    "recompute",
    "recompute_modules",
    "recompute_layers",
    "lev.token_chunk",
    "lev.chunk_mib",
    "lev.chunk_elements",
    "lev.recompute",
    "lev.kernel",
    "lev.gemm_dtype",
}


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
