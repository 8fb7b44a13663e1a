"""The comparison plots of ``python -m leviathan_pretrain.compare`` (matplotlib, Agg backend, imported on use).

Every function writes one PNG atomically (a temporary name in the same directory, then a rename) and returns
its path. A plot with nothing to show still gets written, with a line saying why, so a comparison always has
the same files.
"""

from __future__ import annotations

import os
from pathlib import Path

SIZE, DPI = (11, 6.5), 120


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.tight_layout()
        fig.savefig(tmp, format="png", dpi=DPI)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path


def colors(n: int) -> list:
    """One colour per run: matplotlib's default cycle up to 10 runs; above that tab20 (dark hues first, then the
    light ones, so run i and run i + 10 share a hue but not a shade), whose 20 colours repeat only past 20 runs."""
    if n <= 10:
        return [f"C{i}" for i in range(n)]
    import matplotlib

    tab20 = matplotlib.colormaps["tab20"]
    return [tab20((2 * i) % 20 + (i // 10) % 2) for i in range(n)]


def _empty(ax, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=13, color="0.4", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def loss_vs_tokens(curves: list, target: float | None, baseline: str, path: Path) -> Path:
    """Validation loss (solid, markers) and training loss (same colour, light) vs tokens, one colour per run;
    the baseline's final validation loss as a dotted line and each run's first crossing of it as a ring.
    ``curves``: [{"name", "valid": [(tokens, loss)], "train": [(tokens, loss)], "reach": tokens | None}]."""
    plt = _pyplot()
    from matplotlib.ticker import EngFormatter

    fig, ax = plt.subplots(figsize=SIZE)
    drawn = False
    for c, color in zip(curves, colors(len(curves))):
        if c["train"]:
            x, y = zip(*c["train"])
            ax.plot(x, y, color=color, alpha=0.3, linewidth=1, label=f"{c['name']} (training loss)")
        if c["valid"]:
            x, y = zip(*c["valid"])
            ax.plot(x, y, color=color, linewidth=2.2, marker="o", markersize=4, label=f"{c['name']} (validation)")
        if c["reach"] is not None and target is not None:
            ax.plot([c["reach"]], [target], marker="o", markersize=11, markerfacecolor="none", color=color, mew=2)
        drawn = drawn or bool(c["train"] or c["valid"])
    if not drawn:
        _empty(ax, "no run has a loss curve in tokens (training log + config)")
    else:
        if target is not None:
            ax.axhline(target, color="0.35", linestyle=":", linewidth=1.5, label=f"{baseline} final val loss")
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        ax.set_xlabel("training tokens seen (step x global batch x sequence length)")
        ax.set_ylabel("loss (nats per token)")
        ax.grid(True, alpha=0.35)
        ax.legend(fontsize=9, ncols=2 if len(curves) > 3 else 1)
    ax.set_title("Validation loss vs training tokens (rings: first reach of the baseline's final val loss)")
    return _save(fig, path)


def _grouped_bars(ax, groups: list, series: list, log: bool, label_fmt: str | None) -> None:
    """One group of bars per entry of ``groups``, one bar per (name, values) of ``series``; None: no bar."""
    n = max(len(series), 1)
    width = 0.8 / n
    for i, ((name, values), color) in enumerate(zip(series, colors(len(series)))):
        xs = [g + (i - (n - 1) / 2) * width for g, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        bars = ax.bar(xs, ys, width=width * 0.95, label=name, color=color)
        if label_fmt:
            ax.bar_label(bars, fmt=label_fmt, fontsize=8, padding=2)
    for g in range(len(groups)):
        if all(values[g] is None for _, values in series):
            ax.text(g, 0.03, "no data", ha="center", color="0.45", transform=ax.get_xaxis_transform())
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    if log:
        ax.set_yscale("log")
    ax.grid(True, axis="y", which="both" if log else "major", alpha=0.35)
    ax.legend(fontsize=9)


def ppl_by_frequency(buckets: list, series: list, path: Path) -> Path:
    """Grouped bars: perplexity per training-frequency bucket (x), one bar per run, log y.
    ``series``: [(run name, [ppl or None per bucket])]."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=SIZE)
    shown = [(n, v) for n, v in series if any(x is not None for x in v)]
    if not buckets or not shown:
        _empty(ax, "no evaluation report has frequency buckets")
    else:
        _grouped_bars(ax, buckets, shown, log=True, label_fmt=None)
        plt.setp(ax.get_xticklabels(), rotation=25, ha="right")
        ax.set_xlabel("frequency of the target token in the training data (fraction of training tokens)")
        ax.set_ylabel("held-out perplexity (log scale)")
    ax.set_title("Perplexity by token-frequency bucket (lower is better)")
    return _save(fig, path)


def wikitext_ppl(series: list, path: Path) -> Path:
    """Bars: WikiText token and word perplexity, one bar per run. ``series``: [(name, token_ppl, word_ppl)]."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=SIZE)
    shown = [(n, [t, w]) for n, t, w in series if t is not None or w is not None]
    _grouped_bars(ax, ["token perplexity", "word perplexity"], shown, log=False, label_fmt="%.1f")
    ax.set_xlabel("WikiText metric")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title("WikiText perplexity")
    return _save(fig, path)


def geometry_vs_tokens(series: list, path: Path) -> Path:
    """Two panels: the input rows' mean pairwise cosine (left) and effective rank (right) vs training tokens, one
    colour per run (the training log's geometry records: step 0 is the model at init).
    ``series``: [{"name", "cosine": [(tokens, value)], "eff_rank": [(tokens, value)]}], a run without records too."""
    plt = _pyplot()
    from matplotlib.ticker import EngFormatter

    fig, axes = plt.subplots(1, 2, figsize=SIZE)
    panels = (("cosine", "Input cosine", "mean pairwise cosine of the input rows"),
              ("eff_rank", "Input effective rank", "effective rank of the input rows"))  # fmt: skip
    for ax, (key, title, label) in zip(axes, panels):
        drawn = [s for s in series if s[key]]
        for s, color in zip(series, colors(len(series))):
            if s[key]:
                x, y = zip(*s[key])
                ax.plot(x, y, color=color, linewidth=2, marker="o", markersize=3, label=s["name"])
        if not drawn:
            _empty(ax, "no geometry records in tokens\n(training log + config)")
        else:
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))
            ax.set_xlabel("training tokens seen (step x global batch x sequence length)")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.35)
            ax.legend(fontsize=9)
        ax.set_title(title)
    fig.suptitle("Token-vector geometry of the input rows vs training tokens (step 0: the model at init)")
    return _save(fig, path)
