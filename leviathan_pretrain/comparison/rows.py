"""The rows of ``lev compare``: each run's numbers (its report's, else what its training log and config give, noted),
their change vs the baseline, and the tokens each run takes to reach the baseline's final validation loss, as a
:class:`~.tables.Comparison` (:func:`build_comparison`).
"""

from __future__ import annotations

import math

from leviathan_pretrain.comparison import geometry
from leviathan_pretrain.comparison.runs import Run
from leviathan_pretrain.comparison.tables import COLUMNS, Comparison, RunRow
from leviathan_pretrain.config import Config
from leviathan_pretrain.config.loader import build
from leviathan_pretrain.model.counts import param_breakdown


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def config_params(run: Run) -> dict | None:
    """``{"input", "total"}`` from the run config (model/sizes.py's closed form), None when it does not load."""
    try:
        cfg = build(Config, run.config)
        return param_breakdown(cfg.model, cfg.parallel.tensor_parallel)
    except Exception:  # a config of another version: the counts stay empty
        return None


def run_metrics(run: Run) -> dict:
    """``{column: value}``: the report's numbers, else what the training log and config give (noted)."""
    rep, m = run.report, {}
    if rep is not None:
        m["total_params"], m["input_params"] = rep.params["total"], rep.params["input_layer"]
        m["tokens_seen"] = rep.tokens_seen
    else:
        if run.config and (counts := config_params(run)):
            m["total_params"], m["input_params"] = counts["total"], counts["input"]
            run.notes.append("params from config")
        seq = ((run.config or {}).get("model") or {}).get("seq_length")
        if run.train and run.tokens_per_step:  # as far as the log goes (its last validation is the val loss)
            m["tokens_seen"] = run.train[-1][0] * run.tokens_per_step
        elif run.consumed_samples is not None and _is_num(seq):
            m["tokens_seen"] = run.consumed_samples * seq
    heldout = rep.heldout if rep is not None else []
    if heldout:
        m["val_loss"], m["val_ppl"] = heldout[0]["loss"], heldout[0]["ppl"]
        for h in heldout[1:]:
            m[f"{h['name']} ppl"] = h["ppl"]
    elif run.valid:
        step, loss = run.valid[-1]
        m["val_loss"], m["val_ppl"] = loss, math.exp(min(loss, 80.0))
        run.notes.append(f"val from {run.curve_source} step {step}")
    for b in ((rep and rep.frequency) or {}).get("buckets", []):
        m[f"ppl[{b['name']}]"] = b["ppl"]
    wiki, lam = (rep and rep.wikitext) or {}, (rep and rep.lambada) or {}
    m["wikitext_token_ppl"], m["wikitext_word_ppl"] = wiki.get("token_ppl"), wiki.get("word_ppl")
    m["lambada_acc"] = lam.get("accuracy")
    m.update(geometry.metrics(rep, run.geometry))  # the report's (end) and the training log's step 0 (init)
    return {k: v if v is not None and math.isfinite(v) else None for k, v in m.items()}  # NaN/inf/null: empty


def tokens_to_reach(points: list, target: float) -> float | None:
    """First tokens where the curve [(tokens, loss)] is <= target, linear between the points around the crossing."""
    prev = None
    for t, loss in points:
        if loss <= target:
            if prev is None:
                return float(t)
            (t0, l0) = prev
            return t0 + (l0 - target) / (l0 - loss) * (t - t0)
        prev = (t, loss)
    return None


def relative(v, base) -> float | None:
    """(v - base) / base in percent, None where either is missing or base is 0."""
    if not (_is_num(v) and _is_num(base)) or base == 0:
        return None
    return 100.0 * (v - base) / base


def metric_keys(metrics: list) -> tuple[list, list, list]:
    """The columns of every run's metrics, in table order, which of them are frequency buckets and which are
    geometry columns (last; only those some run has a value for)."""
    extra = list(dict.fromkeys(k for m in metrics for k in m if k not in COLUMNS and k not in geometry.GEOMETRY))
    buckets, geo = [k for k in extra if k.startswith("ppl[")], geometry.present(metrics)
    keys = [*list(COLUMNS)[:5], *(k for k in extra if k not in buckets), *buckets, *list(COLUMNS)[5:], *geo]
    return keys, buckets, geo


def build_comparison(runs: list, base_i: int, why: str) -> Comparison:
    """The rows: each run's metrics, their change vs ``runs[base_i]``, the tokens it takes to reach the baseline's
    final validation loss (the last point of its validation curve). The geometry columns get no change."""
    metrics = [run_metrics(r) for r in runs]
    keys, buckets, geo = metric_keys(metrics)
    curves = [r.curve(r.valid) for r in runs]
    target = curves[base_i][-1][1] if curves[base_i] else None
    reach = [tokens_to_reach(c, target) if target is not None else None for c in curves]
    rows, base = [], metrics[base_i]
    for i, (r, m, curve, x) in enumerate(zip(runs, metrics, curves, reach)):
        change = {k: None if i == base_i or k in geo else relative(m.get(k), base.get(k)) for k in keys}
        ratio = reach[base_i] / x if x and reach[base_i] is not None else None
        rows.append(RunRow(r, i == base_i, m, change, curve, x, ratio))
    return Comparison(rows, base_i, why, keys, buckets, target, geo)
