"""Which checkpoint a start resumes from, checked before any tensor is loaded: the rules of ``latest``.

- ``latest`` names the newest checkpoint committed by this run; a start resumes from it.
- ``latest`` missing, empty, unreadable, or naming a folder that is not a complete checkpoint, while complete
  checkpoints exist (a user tidying up, a copy without the small file, a file system that lost it): the start
  resumes from the newest complete checkpoint and says so in one line. Never from scratch: a complete checkpoint is
  only ever written by a commit (every rank's files written and flushed, then ``leviathan.json``), so the newest one
  is as trustworthy as the one ``latest`` would have named, and the next save rewrites ``latest``.
- ``checkpoint.resume_from=<tag>`` picks a complete checkpoint by hand (e.g. one before a loss spike); the newer
  checkpoints of the abandoned continuation are moved into ``abandoned-<UTC time>/`` (kept, out of pruning's way).
- before loading, the chosen checkpoint is checked: its ``leviathan.json`` reads, every file it lists has the size
  recorded, and every ``*.pt`` is a whole zip archive (its central directory is read: a truncated file has none).
  An unusable checkpoint stops the start with the file and the cause, naming the older complete checkpoint and the
  key that resumes from it; with ``checkpoint.fallback=true`` the start moves the unusable one aside (never deletes
  it) into ``unusable-<tag>-<UTC time>/`` and resumes from the newest older one that is intact, saying so.
- a new run in a directory holding checkpoints needs ``checkpoint.start_over=true``: the old checkpoints are moved
  into ``replaced-<UTC time>/`` beside them, not deleted. ``checkpoint.resume=false`` alone refuses.
- ``start_over`` and ``resume_from`` are one-shot: applying one is recorded in ``leviathan.applied.json``, and a later
  start with the same value (a SLURM requeue, a re-run of the same command) resumes the run as usual, saying so.
- whatever the start resumes from, ``latest`` is pointed at it before anything else happens.

Torch-free; runs on rank 0 under the run lock (:mod:`.run_lock`).
"""

from __future__ import annotations

import json
import os
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from common.fileio import read_json, write_bytes_atomic
from leviathan_pretrain.config.loader import ConfigError
from leviathan_pretrain.trainer.checkpoint.names import (
    LATEST,
    META,
    SAVING,
    TAG_PREFIX,
    CheckpointError,
    complete_tags,
    is_ours,
    step_of,
)
from leviathan_pretrain.trainer.checkpoint.record import CheckpointRecord

APPLIED = "leviathan.applied.json"  # the one-shot keys this directory applied (start_over, resume_from)


@dataclass
class Resume:
    """The start's choice: ``tag`` (None: a new run), its record, and the one line to say about it (or None)."""

    tag: str | None = None
    record: CheckpointRecord | None = None
    note: str | None = None


def read_latest_lenient(ckpt_dir: Path) -> tuple[str | None, str | None]:
    """``(tag, None)`` when ``latest`` names a complete checkpoint, else ``(None, what is wrong with it)``."""
    p = Path(ckpt_dir) / LATEST
    if p.is_dir():
        raise CheckpointError(f"{p} is a folder, not the file naming the latest checkpoint: move it away and re-run")
    if not p.exists():
        return None, f"{p} is missing"
    try:
        tag = p.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{p} is unreadable ({e})"
    if not tag:
        return None, f"{p} is empty"
    if step_of(tag) is None or not (Path(ckpt_dir) / tag / META).is_file():
        return None, f"{p} names {tag[:80]!r}, which is not a complete checkpoint"
    return tag, None


def manifest(tag_dir: Path) -> dict[str, int]:
    """Every file below ``tag_dir`` (relative name -> size) but our marks: what ``leviathan.json`` records."""
    tag_dir = Path(tag_dir)
    out = {}
    for f in sorted(tag_dir.rglob("*")):
        if f.is_file() and f.name not in (META, SAVING):
            out[str(f.relative_to(tag_dir))] = f.stat().st_size
    return out


def verify(ckpt_dir: Path, tag: str) -> CheckpointRecord:
    """The record of checkpoint ``tag`` once its files check out; :class:`CheckpointError` naming the first file
    that does not (missing, another size than recorded, a ``*.pt`` that is not a whole zip archive)."""
    d = Path(ckpt_dir) / tag
    record = CheckpointRecord.read(d)
    for name, size in sorted((record.files or {}).items()):
        f = d / name
        try:
            got = f.stat().st_size
        except OSError as e:
            raise CheckpointError(f"{f}: {e.strerror or e} (listed in {d / META})") from None
        if got != size:
            raise CheckpointError(f"{f}: {got} bytes where {META} recorded {size}: the file was truncated or replaced")
    for f in sorted(d.glob("*.pt")):
        try:
            with zipfile.ZipFile(f) as z:  # reads the central directory at the file's end
                z.infolist()
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise CheckpointError(f"{f}: not a whole torch file ({e}): the file is truncated or corrupt") from None
    return record


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def move_aside(ckpt_dir: Path, tags: list[str], prefix: str) -> Path:
    """Move our checkpoint folders ``tags`` (and ``latest`` when ``prefix`` is ``replaced``) into a new folder
    ``<ckpt_dir>/<prefix>-<UTC time>/``; nothing is deleted. Returns the folder."""
    dest = Path(ckpt_dir) / f"{prefix}-{_stamp()}"
    n = 0
    while dest.exists():
        n += 1
        dest = Path(ckpt_dir) / f"{prefix}-{_stamp()}-{n}"
    dest.mkdir()
    for t in tags:
        if is_ours(Path(ckpt_dir) / t):
            os.replace(Path(ckpt_dir) / t, dest / t)
    if prefix == "replaced" and (Path(ckpt_dir) / LATEST).exists():
        os.replace(Path(ckpt_dir) / LATEST, dest / LATEST)
    return dest


def _ours_all(ckpt_dir: Path) -> list[str]:
    return sorted(d.name for d in Path(ckpt_dir).glob(f"{TAG_PREFIX}*") if d.is_dir() and is_ours(d))


def _applied(ckpt_dir: Path) -> dict:
    return read_json(Path(ckpt_dir) / APPLIED)


def _mark_applied(ckpt_dir: Path, key: str, value) -> None:
    data = _applied(ckpt_dir)
    data[key] = {"value": value, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(Path(ckpt_dir) / APPLIED, (json.dumps(data, indent=1) + "\n").encode(), sync_dir=True)


def _one_shot(ckpt_dir: Path, key: str, value, notes: list[str]) -> bool:
    """Whether the one-shot key ``checkpoint.<key>=value`` is to be applied now: not when this directory already
    applied it (a SLURM requeue or a re-run of the same command must resume the run it started, not redo it)."""
    done = _applied(ckpt_dir).get(key)
    if isinstance(done, dict) and done.get("value") == value:
        notes.append(
            f"checkpoint.{key}={value} was already applied here at {done.get('time')} ({Path(ckpt_dir) / APPLIED}): "
            "resuming this run as usual"
        )
        return False
    return True


def choose(cfg, ckpt_dir: Path) -> Resume:
    """Rank 0: the checkpoint this start resumes from (see the module docstring)."""
    c, ckpt_dir = cfg.checkpoint, Path(ckpt_dir)
    tags = complete_tags(ckpt_dir) if ckpt_dir.is_dir() else []
    notes: list[str] = []
    if c.start_over and _one_shot(ckpt_dir, "start_over", True, notes):
        moved = _ours_all(ckpt_dir) if ckpt_dir.is_dir() else []
        note = "checkpoint.start_over: a new run starts"
        if moved or (ckpt_dir / LATEST).exists():
            note += f"; the earlier checkpoints were moved into {move_aside(ckpt_dir, moved, 'replaced')}"
        _mark_applied(ckpt_dir, "start_over", True)
        return Resume(note=note)
    if not c.resume and not c.start_over:  # start_over already applied: this is its run, resumed as usual
        if tags:
            raise ConfigError(
                f"checkpoint.resume: false, but {ckpt_dir} already holds checkpoints "
                f"({', '.join(tags[-3:])}); to start a new run over them (they are moved aside, not deleted) set "
                "checkpoint.start_over=true; or use another train.out_dir or checkpoint.dir"
            )
        return Resume()
    latest, problem = read_latest_lenient(ckpt_dir)
    by_hand = bool(c.resume_from) and _one_shot(ckpt_dir, "resume_from", c.resume_from, notes)
    if by_hand:
        if c.resume_from not in tags:
            raise ConfigError(
                f"checkpoint.resume_from: {ckpt_dir / c.resume_from} is not a complete checkpoint (complete: "
                f"{', '.join(tags[-5:]) or 'none'})"
            )
        first = c.resume_from
        notes.append(f"resuming from {first} (checkpoint.resume_from)")
    elif latest is not None:
        first = latest
    elif tags:
        first = tags[-1]
        notes.append(f"{problem}; resuming from the newest complete checkpoint {first}")
    elif problem.endswith("is missing"):
        return Resume(note="; ".join(notes) or None)  # a new run
    else:
        raise CheckpointError(
            f"{problem}, and {ckpt_dir} holds no complete checkpoint: this run's checkpoints are gone. To start "
            "a new run here set checkpoint.start_over=true (what is there is moved aside), or use another "
            "train.out_dir"
        )
    tag, record = _first_usable(
        ckpt_dir, [first] + [t for t in reversed(tags) if step_of(t) < step_of(first)], c, notes
    )
    if by_hand:  # applied only now that a usable checkpoint is found: a refusal above changed nothing
        newer = sorted((t for t in _ours_all(ckpt_dir) if step_of(t) > step_of(first)), key=step_of)
        if newer:  # the abandoned continuation: kept, out of the way of pruning and of "the newest complete"
            notes.append(f"the newer {', '.join(newer)} moved into {move_aside(ckpt_dir, newer, 'abandoned')}")
        _mark_applied(ckpt_dir, "resume_from", first)
    if tag != latest:  # latest names what this start resumes from: consistent before the first save
        write_bytes_atomic(ckpt_dir / LATEST, tag.encode(), sync_dir=True)
    return Resume(tag, record, "; ".join(notes) or None)


def _first_usable(ckpt_dir: Path, order: list[str], c, notes: list[str]) -> tuple[str, CheckpointRecord]:
    """The first of ``order`` whose files check out; an unusable one stops the start naming the older one and the
    keys, or with ``checkpoint.fallback`` is moved aside (said in ``notes``) and the next one tried."""
    for i, tag in enumerate(order):
        try:
            record = verify(ckpt_dir, tag)
        except CheckpointError as e:
            older = order[i + 1] if i + 1 < len(order) else None
            if not c.fallback:
                then = (
                    f"to resume from the older complete checkpoint {older}, re-run with checkpoint.fallback=true (it "
                    f"moves {tag} aside, nothing is deleted) or checkpoint.resume_from={older}"
                    if older
                    else "there is no older complete checkpoint"
                )
                raise CheckpointError(f"checkpoint {tag} is unusable: {e}. Nothing was changed; {then}") from None
            dest = move_aside(ckpt_dir, [tag], f"unusable-{tag}")
            notes.append(f"checkpoint.fallback: {tag} is unusable ({e}), moved into {dest}")
            continue
        if i:
            notes.append(f"resuming from {tag}")
        return tag, record
    raise CheckpointError(f"no usable checkpoint in {ckpt_dir}: {'; '.join(notes)}")
