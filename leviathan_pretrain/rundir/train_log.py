"""``train_log.jsonl``: one JSON object per line, appended by rank 0 (:class:`~leviathan_pretrain.trainer.metrics.
Metrics` writes it): ``{"step", "loss", "lr", ...}`` per logged step, ``{"step", "valid_loss", ...}`` per
validation, ``{"step", "event", ...}`` for events (checkpoint, stop). A run still writing may leave a torn last
line; the readers here skip it. Torch-free."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

from leviathan_pretrain.rundir.layout import TRAIN_LOG

LOG_NAME = TRAIN_LOG


class TrainLogError(ValueError):
    """``train_log.jsonl`` cannot be read at all (names the file)."""


def records(path: Path) -> Iterator[dict]:
    """The JSON objects of ``path`` in order; lines that do not parse (a torn last line) are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TrainLogError(f"{path}: not readable ({e})") from None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            yield rec


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_log_values(path: Path, *keys: str) -> list[list]:
    """For each key, the ``[(step, value)]`` points of the step records (not events) that carry a finite value of
    it, by step; the last record of a step wins (a resume)."""
    found: list[dict] = [{} for _ in keys]
    for rec in records(path):
        if "event" in rec or not isinstance(rec.get("step"), int):
            continue
        for key, into in zip(keys, found):
            v = rec.get(key)
            if _is_num(v) and math.isfinite(v):
                into[rec["step"]] = float(v)
    return [sorted(points.items()) for points in found]


def machines(path: Path) -> list[str]:
    """The machines the run trained on (rank 0's), in order, each once: its ``layout`` records' ``machine``
    (:func:`leviathan_pretrain.rundir.host.describe`; one record per segment of a resumed run). Empty for a log
    written before the trainer recorded it."""
    out: list[str] = []
    for rec in records(path):
        m = rec.get("machine") if rec.get("event") == "layout" else None
        if isinstance(m, str) and m not in out:
            out.append(m)
    return out
