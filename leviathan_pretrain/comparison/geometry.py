"""The token-vector geometry in ``python -m leviathan_pretrain.compare`` (model/geometry.py's numbers): the columns
from each run's evaluation report (``geometry.input``/``geometry.head``, the end of training) and from its training
log (``geometry/input/...`` step records: step 0 is the model at init), and the curves of the geometry plot.
A report without ``geometry`` (older, or ``evaluate --no-geometry``) and a log without such records give empty
cells. Imports nothing of :mod:`.runs` or :mod:`.rows`."""

from __future__ import annotations

import math

GEOMETRY = {  # key -> (Markdown header, number format): plain values, no change vs the baseline
    "input_cosine_init": ("input cosine at init", "cosine"), "input_cosine": ("input cosine", "cosine"),
    "input_eff_rank": ("input eff. rank", "rank"), "head_cosine": ("head cosine", "cosine"),
}  # fmt: skip
LOG_KEYS = {"cosine": "geometry/input/cosine", "eff_rank": "geometry/input/eff_rank"}  # train_log.jsonl keys


def _value(v) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


def report_values(geometry) -> dict:
    """``{input_cosine, input_eff_rank, head_cosine}`` of a report's ``geometry`` (None where it has none)."""
    g = geometry if isinstance(geometry, dict) else {}

    def part(name: str) -> dict:
        return g[name] if isinstance(g.get(name), dict) else {}

    inp, head = part("input"), part("head")
    return {
        "input_cosine": _value(inp.get("cosine")),
        "input_eff_rank": _value(inp.get("eff_rank")),
        "head_cosine": _value(head.get("cosine")),
    }


def init_value(points: list) -> float | None:
    """The value at step 0 of ``[(step, value)]`` (the model before any training step); None without one (a run
    resumed from a checkpoint of older code logs none)."""
    return next((v for s, v in points if s == 0), None)


def metrics(report, log: dict) -> dict:
    """The geometry columns of one run: ``report`` (an EvalReport or None), ``log`` ({"cosine", "eff_rank":
    [(step, value)]} of its training log, possibly empty)."""
    m = report_values(report.geometry if report is not None else None)
    m["input_cosine_init"] = init_value(log.get("cosine", []))
    return m


def present(all_metrics: list) -> list:
    """The geometry columns, in table order, that at least one run has a value for ([] when none has any)."""
    return [k for k in GEOMETRY if any(m.get(k) is not None for m in all_metrics)]


def series(runs: list) -> list:
    """The plot's curves, one entry per run (also the runs without records, so the colours match the other plots):
    ``[{"name", "cosine": [(tokens, value)], "eff_rank": [(tokens, value)]}]``, steps to tokens by ``run.curve``."""
    return [{"name": r.name, **{k: r.curve(r.geometry.get(k, [])) for k in LOG_KEYS}} for r in runs]


def has_records(runs: list) -> bool:
    """Whether a run's training log has geometry records (the plot is written only then)."""
    return any(points for r in runs for points in r.geometry.values())
