"""The LEV section of docs/results-small.md: every LEV run of the study against TIED and plain LEV at the
same tokens, its rarest and most frequent frequency bucket, and its input rows' geometry at init and at the end,
with the seed-to-seed spread beside it. Used by ``benchmarks/results_small.py``; reads the evaluation reports and
the training logs only.
"""

from __future__ import annotations

from pathlib import Path

TIED, LEV = "sweep/tiny-cpu-tied", "sweep/tiny-cpu-lev"
MIN_SHARE = 0.01  # of the scored tokens: the least a bucket holds to be shown
PAIRS = [(TIED, "tied-seed2"), (LEV, "lev-seed2"), ("lev-center", "lev-center-seed2")]  # seed 1234, seed 1235


def pct(v, base) -> str:
    from leviathan_pretrain.comparison.rows import relative

    change = relative(v, base)
    return "" if change is None else f"{change:+.1f}%"


def paper_form(cfg) -> bool:
    """A LEV config in the paper's form: neither of the options this project added (``center``, ``out_init_std``)."""
    if cfg is None or cfg.model.variant != "lev":
        return False
    return not cfg.model.lev.center and cfg.model.lev.out_init_std is None


def reference(reports: dict, seeds: dict, name: str, variant: str, prefer: frozenset = frozenset()) -> str | None:
    """The run of ``variant`` trained on as many tokens as ``name`` to compare it with: one in ``prefer`` (for LEV,
    the paper's form: a centred run is compared with a plain one where there is one), then the sweep's run, else one
    at the sweep's seed, else the first by name (``None`` when there is none)."""
    tokens = reports[name].get("tokens_seen")
    base_seed = seeds.get(TIED)
    cands = [n for n, r in reports.items() if r.get("variant") == variant and r.get("tokens_seen") == tokens]
    cands.sort(key=lambda n: (n not in prefer, not n.startswith("sweep/"), seeds.get(n) != base_seed, n))
    return cands[0] if cands else None


def versus(ppl: float, reports: dict, ref: str | None, name: str) -> str:
    """``ppl``'s change vs run ``ref``'s, naming it (empty for no reference or the run itself)."""
    return f"{pct(ppl, reports[ref]['heldout'][0]['ppl'])} ({ref})" if ref and ref != name else ""


def buckets(report: dict) -> dict:
    return {b["name"]: b for b in (report.get("frequency") or {}).get("buckets", [])}


def ends(report: dict) -> tuple[str | None, str | None]:
    """The rarest and the most frequent bucket holding at least :data:`MIN_SHARE` of the scored tokens in ``report``
    (the TIED reference's): a rarer one holds a few hundred tokens (129 in the study: TIED's two seeds differ by 65%
    there)."""
    scored = buckets(report).values()
    total = sum(b.get("tokens") or 0 for b in scored)
    names = [b["name"] for b in scored if (b.get("tokens") or 0) >= MIN_SHARE * total and b.get("ppl") is not None]
    return (names[0], names[-1]) if names else (None, None)


def ppl_cell(v) -> str:
    """A perplexity with four significant digits or more (5.54, 192.8, 3690, 42,774)."""
    return "" if v is None else f"{v:,.0f}" if v >= 1000 else f"{v:.1f}" if v >= 100 else f"{v:.2f}"


def init_cosine(run: Path) -> float | None:
    """The input rows' mean pairwise cosine at step 0 of the run's training log (as ``compare`` reads it)."""
    from leviathan_pretrain.comparison.geometry import LOG_KEYS, init_value
    from leviathan_pretrain.rundir.train_log import LOG_NAME, read_log_values

    (points,) = read_log_values(run / LOG_NAME, LOG_KEYS["cosine"])
    return init_value(points)


def fmt(v, spec: str) -> str:
    return "" if v is None else format(v, spec)


def section(study: Path, reports: dict, configs: dict) -> list[str]:
    """Markdown lines of the section from ``reports`` (run name -> its evaluation report) and ``configs`` (run name
    -> its config or None); ``[]`` when the study has no evaluated LEV run and TIED."""
    seeds = {n: c.train.seed for n, c in configs.items() if c is not None}
    plain = frozenset(n for n, c in configs.items() if paper_form(c))
    if TIED not in reports:
        return []
    rare, freq = ends(reports[TIED])
    lev_runs = sorted((n for n, r in reports.items() if r.get("variant") == "lev"), key=lambda n: (n != LEV, n))
    if not lev_runs or rare is None:
        return []
    tok = {k: buckets(reports[TIED])[k]["tokens"] for k in (rare, freq)}
    lines = [
        "## LEV without its common mode, and at equal total parameters",
        "",
        "Every LEV run against the TIED, UNTIED (equal total parameters for lev-iso) and LEV (the paper's form) run "
        "trained on as many tokens (the sweep's where there is one). "
        f"Buckets: the rarest and the most frequent holding at least {MIN_SHARE:.0%} of the scored tokens ({rare}: "
        f"{tok[rare]:,} tokens; {freq}: {tok[freq]:,}; a rarer bucket holds too few to compare: see its seed-to-seed "
        "spread above), their ppl and the change vs TIED. Geometry of the input rows (model/geometry.py): mean "
        "pairwise cosine at init (the training log's step 0) and at the end (the evaluation report), effective rank "
        "at the end.",
        "",
        f"| run | input layer | layers | params | val ppl | vs TIED | vs UNTIED | vs LEV | {rare} | {freq} | input "
        "cosine init -> end | input eff. rank |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    from leviathan_pretrain.model import variants

    for n in lev_runs:
        r, cfg = reports[n], configs.get(n)
        t, u = (reference(reports, seeds, n, v) for v in ("tied", "untied"))
        lv = reference(reports, seeds, n, "lev", plain)
        ppl = r["heldout"][0]["ppl"]
        cells = []
        for b in (rare, freq):
            mine, base = buckets(r).get(b, {}).get("ppl"), buckets(reports[t]).get(b, {}).get("ppl") if t else None
            cells.append(f"{ppl_cell(mine)} ({pct(mine, base)})" if mine is not None else "")
        g = (r.get("geometry") or {}).get("input") or {}
        cos0, cos1 = init_cosine(study / "runs" / n), g.get("cosine")
        shape = variants.get(cfg.model.variant).describe(cfg.model) if cfg else "?"
        layers = cfg.model.num_layers if cfg else "?"
        lines.append(
            f"| {n} | {shape} | {layers} | {r['params']['total'] / 1e6:.3f}M | {ppl:.2f} | "
            f"{versus(ppl, reports, t, n)} | {versus(ppl, reports, u, n)} | {versus(ppl, reports, lv, n)} | "
            f"{' | '.join(cells)} | {fmt(cos0, '.3f') or '-'} -> {fmt(cos1, '.3f') or '-'} | "
            f"{fmt(g.get('eff_rank'), '.1f')} |"
        )
    spread = []
    for a, b in PAIRS:
        if a in reports and b in reports:
            ra, rb = reports[a], reports[b]
            parts = [f"val ppl {pct(rb['heldout'][0]['ppl'], ra['heldout'][0]['ppl'])}"]
            for k in (rare, freq):
                parts.append(f"{k} {pct(buckets(rb).get(k, {}).get('ppl'), buckets(ra).get(k, {}).get('ppl'))}")
            spread.append(f"{a.split('/')[-1]} {', '.join(parts)}")
    measured = "; ".join(spread) or "not measured yet"
    lines += ["", f"Seed spread (seed 1235 vs 1234, the same data order): {measured}."]
    return lines
