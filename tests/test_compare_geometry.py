"""``python -m leviathan_pretrain.compare``'s token-vector geometry: its columns from the evaluation reports and
the training logs' geometry records, its Markdown section and its plot (run directories: tests/compare_runs.py);
the plots' colours past ten runs."""

from __future__ import annotations

import pytest

from tests.compare_runs import LEV_VALID, PNG, TIED_VALID, UNTIED_VALID, make_report, make_run, md_section, ok, read_csv

LEV_GEO = {0: (0.9, 3.0), 100: (0.6, 20.0), 200: (0.4, 40.0), 300: (0.3, 55.5)}
TIED_GEO = {200: (0.05, 100.0), 300: (0.04, 110.0)}


def test_geometry_columns_and_plot(tmp_path):
    root = tmp_path / "runs"
    lev = make_run(root, "lev-a", "lev", LEV_VALID, geometry=LEV_GEO)
    tied = make_run(root, "tied-b", "tied", TIED_VALID, geometry=TIED_GEO)
    untied = make_run(root, "untied-c", "untied", UNTIED_VALID, gbs=2, seq=256)
    make_report(lev, "lev", val=(4.0, 54.75), geometry=(0.2874, 57.04, 0.0512))
    make_report(tied, "tied", geometry=(0.0123, 120.44, 0.0123))
    make_report(untied, "untied", val=(4.3, 73.7), geometry=None)  # evaluate --no-geometry: null
    out = tmp_path / "out"
    p = ok(lev, tied, untied, "--out", out)

    rows = read_csv(out)
    keys = ("input_cosine_init", "input_cosine", "input_eff_rank", "head_cosine")
    assert list(rows["lev-a"])[-len(keys) - 4 : -4] == list(keys)  # after the other metrics, before the curve's
    got = {run: {k: row[k] for k in keys} for run, row in rows.items()}
    assert got["lev-a"] == {"input_cosine_init": "0.9", "input_cosine": "0.2874", "input_eff_rank": "57.04",
                            "head_cosine": "0.0512"}  # fmt: skip
    assert got["tied-b"] == {"input_cosine_init": "", "input_cosine": "0.0123", "input_eff_rank": "120.44",
                             "head_cosine": "0.0123"}  # fmt: skip
    assert got["untied-c"] == dict.fromkeys(keys, "")
    assert not any(k.endswith("_vs_baseline_pct") and ("cosine" in k or "rank" in k) for k in rows["lev-a"])
    assert float(rows["lev-a"]["val_ppl_vs_baseline_pct"]) == pytest.approx(100 * (54.75 - 60.3) / 60.3)

    md = (out / "comparison.md").read_text()
    assert "cosine" not in md.split("\n## ")[0]  # the run table: as before
    geo = md_section(md, "Token-vector geometry")
    assert "| run | input cosine at init | input cosine | input eff. rank | head cosine |" in geo
    assert "| lev-a | 0.900 | 0.287 | 57.0 | 0.051 |" in geo  # plain values: no (+x%)
    assert "| tied-b (baseline) |  | 0.012 | 120.4 | 0.012 |" in geo
    assert "| untied-c |  |  |  |  |" in geo

    png = out / "geometry_vs_tokens.png"
    assert f"wrote {png}" in p.stdout
    data = png.read_bytes()
    assert data[:8] == PNG and int.from_bytes(data[16:20], "big") >= 1000 and int.from_bytes(data[20:24], "big") >= 600
    assert not [q.name for q in out.iterdir() if q.name.startswith(".")]  # no temporary file left

    # what the plot draws: steps to tokens as for the loss curves (x 8 x 128), a line per run, none for untied
    from leviathan_pretrain.comparison.geometry import series
    from leviathan_pretrain.comparison.runs import load_run

    drawn = series([load_run(str(r)) for r in (lev, tied, untied)])
    assert drawn[0] == {"name": "lev-a", "cosine": [(s * 1024, c) for s, (c, _) in LEV_GEO.items()],
                        "eff_rank": [(s * 1024, r) for s, (_, r) in LEV_GEO.items()]}  # fmt: skip
    assert drawn[1]["cosine"] == [(204800, 0.05), (307200, 0.04)] and drawn[1]["eff_rank"][-1] == (307200, 110.0)
    assert drawn[2] == {"name": "untied-c", "cosine": [], "eff_rank": []}

    # report geometry but no geometry records: the report's columns (no "at init"), no plot; an old report
    # without the key: empty cells
    albert = make_run(root, "albert-d", "albert", {300: 4.3})
    make_report(albert, "albert", geometry=(0.5, 30.26, 0.125))
    flat = make_run(root, "flat-e", "flat", {300: 4.5})
    make_report(flat, "flat")
    out2 = tmp_path / "out2"
    p = ok(untied, albert, flat, "--out", out2)
    rows = read_csv(out2)
    assert "input_cosine_init" not in rows["albert-d"]
    assert [rows["albert-d"][k] for k in keys[1:]] == ["0.5", "30.26", "0.125"]
    assert [rows["flat-e"][k] for k in keys[1:]] == ["", "", ""]
    assert not (out2 / "geometry_vs_tokens.png").exists() and "geometry_vs_tokens" not in p.stdout
    geo = md_section((out2 / "comparison.md").read_text(), "Token-vector geometry")
    assert "| run | input cosine | input eff. rank | head cosine |" in geo
    assert "| albert-d | 0.500 | 30.3 | 0.125 |" in geo and "| flat-e |  |  |  |" in geo


def test_plot_colours_stay_distinct_past_ten_runs():
    # the 13-run study drew TIED and a LEV run in the same blue, ALBERT and lev-long in the same green
    from matplotlib.colors import to_rgba

    from leviathan_pretrain.comparison.plots import colors

    for n in (1, 3, 10, 11, 13, 20):
        assert len({to_rgba(c) for c in colors(n)}) == n, n
    assert colors(3) == ["C0", "C1", "C2"]  # the default cycle up to 10 runs
    assert len({to_rgba(c) for c in colors(25)}) == 20  # tab20's colours repeat only past 20
