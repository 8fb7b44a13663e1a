"""What ``lev compare`` writes to ``--out``: ``comparison.md``, ``comparison.csv`` and the plots (docs/compare.md)."""

from __future__ import annotations

from pathlib import Path

from common.fileio import write_bytes_atomic
from leviathan_pretrain.comparison import geometry, plots, tables
from leviathan_pretrain.comparison.rows import build_comparison
from leviathan_pretrain.comparison.tables import Comparison


def write_atomic(path: Path, text: str) -> Path:
    write_bytes_atomic(path, text.encode())
    return path


def write_outputs(comp: Comparison, text: str, csv_text: str, out: Path) -> list:
    """``comparison.md`` (``text``), ``comparison.csv`` and the plots in ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [write_atomic(out / "comparison.md", text), write_atomic(out / "comparison.csv", csv_text)]
    rows, base = comp.rows, comp.base.run
    pts = [{"name": w.run.name, "valid": w.curve, "train": w.run.curve(w.run.train), "reach": w.reach} for w in rows]
    written.append(plots.loss_vs_tokens(pts, comp.target, base.name, out / "val_loss_vs_tokens.png"))
    series = [(w.run.name, [w.metrics.get(k) for k in comp.buckets]) for w in rows]
    written.append(plots.ppl_by_frequency(comp.bucket_names, series, out / "ppl_by_frequency.png"))
    if any(w.run.report and w.run.report.wikitext for w in rows):
        wiki = [(w.run.name, w.metrics.get("wikitext_token_ppl"), w.metrics.get("wikitext_word_ppl")) for w in rows]
        written.append(plots.wikitext_ppl(wiki, out / "wikitext_ppl.png"))
    runs = [w.run for w in rows]
    if geometry.has_records(runs):
        written.append(plots.geometry_vs_tokens(geometry.series(runs), out / "geometry_vs_tokens.png"))
    return written


def write_comparison(runs: list, base_i: int, why: str, out: Path) -> tuple[str, list]:
    """The comparison of ``runs`` against ``runs[base_i]`` (``why``: how it was chosen): every output written to
    ``out``; the Markdown and the paths written."""
    comp = build_comparison(runs, base_i, why)
    text = tables.markdown(comp)
    return text, write_outputs(comp, text, tables.csv_text(comp), out)
