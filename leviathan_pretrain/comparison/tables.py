"""The comparison of ``python -m leviathan_pretrain.compare``: its rows (:class:`RunRow`, :class:`Comparison`) and
their text, the Markdown tables and the CSV. :mod:`.rows` builds the rows; this one imports nothing of it."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field

from leviathan_pretrain.comparison.geometry import GEOMETRY

COLUMNS = {  # key -> (Markdown header, number format); the other heldout sets and the buckets go after val_ppl
    "total_params": ("params", "count"), "input_params": ("input params", "count"), "tokens_seen": ("tokens", "count"),
    "val_loss": ("val loss", "loss"), "val_ppl": ("val ppl", "ppl"),
    "wikitext_token_ppl": ("WikiText token ppl", "ppl"), "wikitext_word_ppl": ("WikiText word ppl", "ppl"),
    "lambada_acc": ("LAMBADA acc", "acc"),
}  # fmt: skip


@dataclass
class RunRow:
    """One run's line of the comparison: its metrics, their change vs the baseline and its tokens to the target."""

    run: object  # comparison.runs.Run: name, its reports and curves
    is_baseline: bool
    metrics: dict  # {column: value} (run_metrics)
    change: dict  # {column: percent vs the baseline}, None for the baseline itself or a missing value
    curve: list  # the validation curve [(tokens, loss)]
    reach: float | None  # tokens to reach the target
    ratio: float | None  # the baseline's tokens to the target / this run's

    @property
    def label(self) -> str:
        return f"{self.run.name} (baseline)" if self.is_baseline else self.run.name


@dataclass
class Comparison:
    """What the tables and plots show: a row per run, the baseline and the validation loss the runs race to."""

    rows: list  # [RunRow], in the order of the runs
    base_i: int
    why: str  # how the baseline was chosen
    keys: list  # the metric columns: COLUMNS' first five, the other heldout sets, the buckets, the rest of COLUMNS,
    # the geometry columns
    buckets: list  # the ``ppl[<bucket>]`` keys
    target: float | None  # the last point of the baseline's validation curve in tokens
    geometry: list = field(default_factory=list)  # the GEOMETRY keys some run has a value for, in GEOMETRY's order

    @property
    def base(self) -> RunRow:
        return self.rows[self.base_i]

    @property
    def bucket_names(self) -> list:
        return [k[4:-1] for k in self.buckets]


def fmt(v, kind: str) -> str:
    if v is None:
        return ""
    if kind == "count":
        for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
            if abs(v) >= scale:
                return f"{v / scale:.4g}{suffix}"
        return f"{v:g}"
    if kind == "rank":
        return f"{v:.1f}"
    if kind == "ppl":
        return f"{v:.2f}" if v < 100 else f"{v:.1f}" if v < 1e4 else f"{v:,.0f}"
    return f"{v:.4f}" if kind == "loss" else f"{v:.2f}x" if kind == "ratio" else f"{v:.3f}"


def md_table(header: list, rows: list, left: tuple = (0,)) -> str:
    """A Markdown table; columns other than ``left`` (indices) are right-aligned (numbers)."""

    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    rule = ["---" if i in left or i - len(header) in left else "---:" for i in range(len(header))]
    return "\n".join([line(header), line(rule), *map(line, rows)])


def _unreached(row: RunRow, comp: Comparison) -> str:
    """ "not reached" for a run with a validation curve when there is a target, else empty."""
    return "not reached" if row.curve and comp.target is not None else ""


def csv_text(comp: Comparison) -> str:
    """``comparison.csv``: one line per run, every metric with its change vs the baseline in percent (the geometry
    columns without one)."""
    lines = []
    for row in comp.rows:
        r = row.run
        line = {"run": r.name, "baseline": row.is_baseline, "variant": r.variant, "path": str(r.path or "")}
        line.update(report=str(r.report_path or ""), report_step=r.report.step if r.report else "")
        for k in comp.keys:
            v, change = row.metrics.get(k), row.change[k]
            line[k] = "" if v is None else v
            if k not in comp.geometry:
                line[f"{k}_vs_baseline_pct"] = "" if change is None else change
        line["curve_final_val_loss"] = row.curve[-1][1] if row.curve else ""
        line["tokens_to_baseline_loss"] = _unreached(row, comp) if row.reach is None else row.reach
        line["baseline_tokens_over_run_tokens"] = "" if row.ratio is None else row.ratio
        line["notes"] = "; ".join(r.notes)
        lines.append(line)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(lines[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(lines)
    return buf.getvalue()


def _cells(row: RunRow, keys: list) -> dict:
    """``{key: formatted value}``, with the change vs the baseline in parentheses."""
    cells = {}
    for k in keys:
        change = row.change[k]
        shown = fmt(row.metrics.get(k), {**COLUMNS, **GEOMETRY}.get(k, ("", "ppl"))[1])
        cells[k] = shown + ("" if change is None else f" ({change:+.1f}%)")
    return cells


def markdown(comp: Comparison) -> str:
    """``comparison.md`` (also printed): the main table, the frequency buckets, the token-vector geometry, the tokens
    to the target, the reports."""
    main_rows, freq_rows, geo_rows, reach_rows = [], [], [], []
    plain = [k for k in comp.keys if k not in comp.buckets and k not in comp.geometry]
    for row in comp.rows:
        cells, name = _cells(row, comp.keys), row.label
        main_rows.append([name, row.run.variant, *(cells[k] for k in plain), "; ".join(row.run.notes)])
        freq_rows.append([name, *(cells[k] for k in comp.buckets)])
        geo_rows.append([name, *(cells[k] for k in comp.geometry)])
        missing = _unreached(row, comp)
        got = fmt(row.reach, "count") if row.reach is not None else missing or "no validation curve in tokens"
        final = fmt(row.curve[-1][1] if row.curve else None, "loss")
        reach_rows.append([name, final, got, fmt(row.ratio, "ratio")])

    base = comp.base
    heads = [COLUMNS.get(k, (k, ""))[0] for k in plain]
    md = [
        "# Run comparison\n",
        f"Baseline: **{base.run.name}** ({comp.why}). "
        "In parentheses: the change vs the baseline, (run - base) / base.\n",
        md_table(["run", "variant", *heads, "notes"], main_rows, left=(0, 1, -1)),
    ]
    if comp.buckets:
        md += ["\n## Perplexity by training-frequency bucket of the target token\n"]
        md += [md_table(["run", *comp.bucket_names], freq_rows)]
    if comp.geometry:
        md += [
            "\n## Token-vector geometry\n",
            "Mean pairwise cosine and effective rank of the input rows and the output head's rows (docs/evaluation.md, "
            "Token-vector geometry): at the end from the eval report, at init from the training log's step 0; plain "
            "values, no change vs the baseline.\n",
            md_table(["run", *(GEOMETRY[k][0] for k in comp.geometry)], geo_rows),
        ]
    md += ["\n## Tokens to reach the baseline's final validation loss\n"]
    if comp.target is None:
        md.append(f"Not computed: the baseline {base.run.name} has no validation curve in tokens.")
    else:
        md.append(
            f"Target: {comp.target:.4f}, the last point of the baseline's validation curve ({base.run.curve_source}), "
            f"first reached at {fmt(base.reach, 'count')} tokens. Ratio: baseline tokens / run tokens (> 1: fewer).\n"
        )
        md.append(md_table(["run", "final val loss", "tokens to reach", "baseline / run"], reach_rows))
    md += ["\n## Reports\n", *(f"- {row.run.name}: {row.run.report_path or 'no eval report'}" for row in comp.rows)]
    return "\n".join(md) + "\n"
