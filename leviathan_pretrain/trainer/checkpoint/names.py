"""The names in a checkpoint directory and the pure functions that read them: torch-free, so that light tools
(``python -m launchers.slurm status``) can read a run's progress in milliseconds. :mod:`.checkpoint` imports
and re-exports everything here; the layout is described there.
"""

from __future__ import annotations

from pathlib import Path

from leviathan_pretrain.rundir.layout import RunLayout

TAG_PREFIX = "global_step"
META = "leviathan.json"
SAVING = "leviathan.saving"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint is unusable (incomplete, unsafe to load, or from an incompatible run); names it."""


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step}"


def step_of(tag: str) -> int | None:
    rest = tag[len(TAG_PREFIX) :] if tag.startswith(TAG_PREFIX) else ""
    return int(rest) if rest.isdigit() else None


def is_ours(d: Path) -> bool:
    """Whether folder ``d`` was written by this trainer: committed (``leviathan.json``) or marked in progress."""
    return (d / META).is_file() or (d / SAVING).is_file()


def complete_tags(ckpt_dir: Path) -> list[str]:
    """The ``global_step<N>`` folders holding ``leviathan.json`` (committed checkpoints), oldest first."""
    tags = [d.name for d in Path(ckpt_dir).glob(f"{TAG_PREFIX}*") if d.is_dir() and (d / META).is_file()]
    return sorted((t for t in tags if step_of(t) is not None), key=step_of)


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


def checkpoint_dir(cfg) -> Path:
    """``checkpoint.dir`` of a :class:`~leviathan_pretrain.config.Config`, default ``<train.out_dir>/checkpoints``."""
    return RunLayout.from_config(cfg).checkpoints
