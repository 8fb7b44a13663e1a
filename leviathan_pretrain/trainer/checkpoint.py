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
``leviathan.json``) at the next start, our own hidden temporary directories and ``latest.tmp``, and complete
checkpoints of this run beyond ``keep_last``. A ``global_step*`` folder without either file (another run's
DeepSpeed checkpoint) is never touched: the trainer refuses to start in a directory holding one.

Loading uses ``torch.load(weights_only=True)`` for every file, DeepSpeed's included (its checkpoint
engine is replaced by :class:`SafeCheckpointEngine`); only the few DeepSpeed classes its optimizer
states contain are allow-listed. Anything else in a file fails with an error naming it.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

TAG_PREFIX = "global_step"
META = "leviathan.json"
SAVING = "leviathan.saving"
LATEST = "latest"
# Classes DeepSpeed pickles into its optimizer states (checked with torch.load(weights_only=True)).
SAFE_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                "deepspeed.runtime.zero.config.ZeroStageEnum",
                "deepspeed.utils.tensor_fragment.fragment_address")


class CheckpointError(RuntimeError):
    """A checkpoint is unusable (incomplete, unsafe to load, or from an incompatible run); names it."""


def _safe_globals() -> list:
    import importlib
    out = []
    for name in SAFE_GLOBALS:
        mod, _, attr = name.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(mod), attr))
        except (ImportError, AttributeError):
            pass
    return out


def safe_load(path, map_location="cpu"):
    """``torch.load(weights_only=True)`` with DeepSpeed's allow-listed classes; never arbitrary unpickling."""
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(f"{path}: refused by weights_only loading ({first[-1] if first else e}); "
                              "this file holds objects other than tensors and plain containers") from None


class SafeCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine with weights-only loading that records the files it writes
    (:func:`save` fsyncs them on the writing rank)."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.written: list[str] = []

    def start_recording(self) -> list[str]:
        self.written = []
        return self.written

    def load(self, path: str, map_location=None):
        return safe_load(path, map_location)

    def save(self, state_dict, path: str):
        super().save(state_dict, path)
        self.written.append(str(path))


def install_safe_engine(ds_engine) -> SafeCheckpointEngine:
    eng = SafeCheckpointEngine(ds_engine._config)
    ds_engine.checkpoint_engine = eng
    return eng


# ---- RNG state (weights_only-loadable: tensors and plain numbers only) ----

def rng_state() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    out = {"python_version": py[0], "python_state": torch.tensor(py[1], dtype=torch.int64),
           "python_gauss": py[2] if py[2] is not None else float("nan"),
           "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)), "numpy_pos": int(np_state[2]),
           "numpy_has_gauss": int(np_state[3]), "numpy_gauss": float(np_state[4]),
           "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
        try:
            from megatron.core import tensor_parallel
            tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
            out["cuda_tracker"] = {k: v for k, v in tracker.items()}
        except Exception:   # no tracker states (CPU-initialised run)
            pass
    return out


def set_rng_state(s: dict) -> None:
    gauss = s["python_gauss"]
    random.setstate((int(s["python_version"]), tuple(int(x) for x in s["python_state"].tolist()),
                     None if gauss != gauss else gauss))
    np.random.set_state(("MT19937", s["numpy_keys"].numpy().astype(np.uint32), int(s["numpy_pos"]),
                         int(s["numpy_has_gauss"]), float(s["numpy_gauss"])))
    torch.set_rng_state(s["torch"])
    if torch.cuda.is_available() and "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"])
        if s.get("cuda_tracker"):
            from megatron.core import tensor_parallel
            tensor_parallel.get_cuda_rng_tracker().set_states(s["cuda_tracker"])


# ---- directory bookkeeping ----

def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step}"


def step_of(tag: str) -> int | None:
    rest = tag[len(TAG_PREFIX):] if tag.startswith(TAG_PREFIX) else ""
    return int(rest) if rest.isdigit() else None


def read_latest(ckpt_dir: Path) -> str | None:
    p = Path(ckpt_dir) / LATEST
    if not p.is_file():
        return None
    tag = p.read_text().strip()
    if not tag:
        return None
    if not (Path(ckpt_dir) / tag / META).is_file():
        raise CheckpointError(f"{p} names {tag!r}, which is not a complete checkpoint (no {tag}/{META})")
    return tag


def complete_tags(ckpt_dir: Path) -> list[str]:
    tags = [d.name for d in Path(ckpt_dir).glob(f"{TAG_PREFIX}*") if d.is_dir() and (d / META).is_file()]
    return sorted((t for t in tags if step_of(t) is not None), key=step_of)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


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
        raise CheckpointError(f"{ckpt_dir} holds checkpoint folder(s) not written by leviathan_pretrain "
                              f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}: no {META} or "
                              f"{SAVING}); they were left alone. Use another checkpoint.dir / train.out_dir")


def remove_incomplete(ckpt_dir: Path, keep: str | None = None) -> list[str]:
    """Delete our interrupted saves (in-progress mark, no ``leviathan.json``) and our temporary files; rank 0
    only. Nothing without our mark is touched."""
    ckpt_dir = Path(ckpt_dir)
    removed = []
    for d in ckpt_dir.glob(f"{TAG_PREFIX}*"):
        if d.is_dir() and (d / SAVING).is_file() and not (d / META).is_file() and d.name != keep:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    for d in ckpt_dir.glob(f".{TAG_PREFIX}*.saving-*"):          # a crash between mkdir and rename
        if d.is_dir() and (d / SAVING).is_file():
            shutil.rmtree(d, ignore_errors=True)
    (ckpt_dir / (LATEST + ".tmp")).unlink(missing_ok=True)
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
        shutil.rmtree(final)                      # our own leftover of this step (e.g. a re-run after a crash)
    tmp = ckpt_dir / f".{tag}.saving-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / SAVING).write_text(json.dumps({"step": step, "host": socket.gethostname(), "pid": os.getpid(),
                                          "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
    os.replace(tmp, final)
    _fsync_path(ckpt_dir)


def save(ds_engine, ckpt_dir: Path, step: int, meta: dict, keep_last: int, client_state: dict) -> str:
    """Collective: write checkpoint ``global_step<step>`` and commit it (see the module docstring)."""
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(step)
    rank = dist.get_rank()
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        _begin(ckpt_dir, tag, step)
    dist.barrier()
    engine = ds_engine.checkpoint_engine
    written = engine.start_recording() if isinstance(engine, SafeCheckpointEngine) else []
    ds_engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    rng_path = ckpt_dir / tag / f"rng_rank{rank:05d}.pt"
    torch.save(rng_state(), rng_path)
    written.append(str(rng_path))
    if rank == 0:                                 # DeepSpeed's recovery scripts, copied by global rank 0
        written += [str(p) for p in (ckpt_dir / tag).glob("zero_to_*.py")]
    for f in written:                             # each rank flushes what it wrote itself
        _fsync_path(Path(f))
    _fsync_path(ckpt_dir / tag)
    dist.barrier()
    if rank == 0:
        _atomic_write(ckpt_dir / tag / META, json.dumps({**meta, "tag": tag, "step": step}, indent=1))
        (ckpt_dir / tag / SAVING).unlink()
        _fsync_path(ckpt_dir / tag)
        _atomic_write(ckpt_dir / LATEST, tag)
        prune(ckpt_dir, keep_last)
    dist.barrier()
    return tag


def read_meta(ckpt_dir: Path, tag: str) -> dict:
    return json.loads((Path(ckpt_dir) / tag / META).read_text())


def load(ds_engine, ckpt_dir: Path, tag: str, saved_layout: dict | None = None) -> dict:
    """Collective: load checkpoint ``tag`` (model, optimizer, this rank's RNG) into the engine; returns the
    DeepSpeed client state. A checkpoint written at another data-parallel size whose optimizer state is
    partitioned over DP (ZeRO 1-3; DeepSpeed's bf16 optimizer) goes through DeepSpeed's universal checkpoint
    (:mod:`.reshard`); an unpartitioned one (ZeRO 0) loads at any DP size as it is."""
    from megatron.core import parallel_state as ps

    from leviathan_pretrain.trainer import reshard
    ckpt_dir = Path(ckpt_dir)
    saved = saved_layout or {}
    # optimizer state partitioned over DP: ZeRO 1-3, and DeepSpeed's bf16 optimizer (pipeline / ZeRO-1 bf16)
    partitioned = any((ckpt_dir / tag).glob("*zero_pp_rank_*"))
    if saved.get("dp") not in (None, ps.get_data_parallel_world_size()) and partitioned:
        path, client = reshard.load_universal(ds_engine, ckpt_dir, tag, saved.get("zero_stage", 0) or 0)
    else:
        path, client = ds_engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True,
                                                 load_lr_scheduler_states=False)
    if path is None:
        raise CheckpointError(f"{ckpt_dir / tag}: DeepSpeed could not load this checkpoint")
    rng_path = ckpt_dir / tag / f"rng_rank{dist.get_rank():05d}.pt"
    if rng_path.is_file():        # per global rank: after a DP change new ranks keep their fresh seeding
        set_rng_state(safe_load(rng_path))
    return client or {}
