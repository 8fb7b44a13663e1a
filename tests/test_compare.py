"""``python -m leviathan_pretrain.compare``: real run directories (tests/compare_runs.py) compared in a subprocess;
the CSV parsed back against the reports, the relative changes and tokens-to-reach worked out by hand, bad input.
The token-vector geometry columns and plots: tests/test_compare_geometry.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from leviathan_pretrain.comparison.rows import relative, tokens_to_reach
from tests.compare_runs import (
    BUCKETS,
    LEV_B,
    LEV_REACH,
    LEV_VALID,
    PNG,
    TIED_B,
    TIED_VALID,
    UNTIED_VALID,
    compare,
    make_report,
    make_run,
    ok,
    read_csv,
)
from tests.trained import STEPS


@pytest.fixture
def runs(tmp_path) -> dict:
    root = tmp_path / "runs"
    lev = make_run(root, "lev-a", "lev", LEV_VALID)
    tied = make_run(root, "tied-b", "tied", TIED_VALID)
    untied = make_run(root, "untied-tb", "untied", UNTIED_VALID, gbs=2, seq=256, log="tensorboard")
    reports = {
        "tied": make_report(
            tied,
            "tied",
            total=1_500_000,
            inp=1_000_000,
            val=(4.1, 60.3),
            test_ppl=70.0,
            bucket_ppl=TIED_B,
            wiki=(181.3, 392.1),
            lambada=0.12,
        ),  # fmt: skip
        "lev": make_report(
            lev,
            "lev",
            total=1_200_000,
            inp=10_000,
            val=(4.0, 54.75),
            test_ppl=63.0,
            bucket_ppl=LEV_B,
            wiki=(170.0, 360.0),
            lambada=0.15,
        ),  # fmt: skip
    }
    # an older report of the baseline with other numbers: the highest step (300) must be the one used
    make_report(tied, "tied", step=100, val=(9.0, 8103.0), bucket_ppl=[1.0] * 7)
    return {"lev": lev, "tied": tied, "untied": untied, "reports": reports, "root": root}


def test_compare_three_runs(runs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("not compare's")
    p = ok(runs["lev"], runs["tied"], runs["untied"], "--out", out)

    for name in ("comparison.md", "comparison.csv", "val_loss_vs_tokens.png", "ppl_by_frequency.png",
                 "wikitext_ppl.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
        assert str(out / name) in p.stdout  # the console says where each file went
    for name in ("val_loss_vs_tokens.png", "ppl_by_frequency.png", "wikitext_ppl.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width >= 1000 and height >= 600, (name, width, height)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "keep.txt",
            "comparison.md",
            "comparison.csv",
            "val_loss_vs_tokens.png",
            "ppl_by_frequency.png",
            "wikitext_ppl.png",
        ]  # fmt: skip
    ), "a temporary file was left behind or something else was written"
    assert (out / "keep.txt").read_text() == "not compare's"

    md = (out / "comparison.md").read_text()
    assert p.stdout.startswith(md.rstrip("\n"))  # the console: the table first
    assert md.count("| lev-a |") == 3 and "tied-b (baseline)" in md  # default baseline: the first tied run
    assert "cosine" not in md and "rank" not in md  # no report or log has geometry: no geometry columns
    assert "54.75 (-9.2%)" in md  # val ppl vs the baseline's 60.3
    assert "no eval report" in md and "curves from TensorBoard events" in md
    assert all(b in md for b in BUCKETS)

    rows = read_csv(out)
    assert list(rows) == ["lev-a", "tied-b", "untied-tb"]
    assert not [k for k in rows["lev-a"] if "cosine" in k or "rank" in k]
    assert [rows[r]["baseline"] for r in rows] == ["False", "True", "False"]
    assert [rows[r]["variant"] for r in rows] == ["lev", "tied", "untied"]
    for run, key in (("lev-a", "lev"), ("tied-b", "tied")):
        rep, row = json.loads(runs["reports"][key].read_text()), rows[run]
        assert row["report_step"] == "300"
        assert int(row["total_params"]) == rep["params"]["total"]
        assert int(row["input_params"]) == rep["params"]["input_layer"]
        assert float(row["tokens_seen"]) == rep["tokens_seen"]
        assert float(row["val_loss"]) == rep["heldout"][0]["loss"]
        assert float(row["val_ppl"]) == rep["heldout"][0]["ppl"]
        assert float(row["test ppl"]) == rep["heldout"][1]["ppl"]
        for b in rep["frequency"]["buckets"]:
            assert float(row[f"ppl[{b['name']}]"]) == b["ppl"]
        assert float(row["wikitext_token_ppl"]) == rep["wikitext"]["token_ppl"]
        assert float(row["wikitext_word_ppl"]) == rep["wikitext"]["word_ppl"]
        assert float(row["lambada_acc"]) == rep["lambada"]["accuracy"]

    lev, tied, untied = rows["lev-a"], rows["tied-b"], rows["untied-tb"]
    assert float(lev["val_ppl_vs_baseline_pct"]) == pytest.approx(100 * (54.75 - 60.3) / 60.3)
    assert float(lev["lambada_acc_vs_baseline_pct"]) == pytest.approx(25.0)
    assert float(lev["total_params_vs_baseline_pct"]) == pytest.approx(-20.0)
    assert float(lev["ppl[unseen]_vs_baseline_pct"]) == pytest.approx(100 * (700 - 900) / 900)
    assert all(tied[k] == "" for k in tied if k.endswith("_vs_baseline_pct"))

    # the TensorBoard-only run without a report: curves and final val loss from the events, no eval columns
    assert float(untied["val_loss"]) == pytest.approx(4.4, abs=1e-6)  # events hold float32
    assert float(untied["val_ppl"]) == pytest.approx(math.exp(4.4), rel=1e-6)
    assert float(untied["tokens_seen"]) == 300 * 2 * 256
    assert untied["wikitext_token_ppl"] == untied["lambada_acc"] == untied["ppl[unseen]"] == ""
    assert "no eval report" in untied["notes"] and "TensorBoard" in untied["notes"]

    # tokens to reach the baseline's final validation loss (4.2)
    assert float(tied["tokens_to_baseline_loss"]) == 300 * 1024
    assert float(tied["baseline_tokens_over_run_tokens"]) == 1.0
    assert float(lev["tokens_to_baseline_loss"]) == pytest.approx(LEV_REACH)
    assert float(lev["baseline_tokens_over_run_tokens"]) == pytest.approx(307200 / LEV_REACH)
    assert float(lev["baseline_tokens_over_run_tokens"]) == pytest.approx(1.8)
    assert untied["tokens_to_baseline_loss"] == "not reached" and untied["baseline_tokens_over_run_tokens"] == ""
    assert "| 1.80x |" in md and "not reached" in md


def test_baseline_option_report_path_and_default_out(runs, tmp_path):
    cwd = tmp_path / "here"
    cwd.mkdir()
    # a report file given directly (its run's curves still come from the run directory), --baseline by name
    p = ok(runs["reports"]["lev"], runs["tied"], "--baseline", "lev-a", cwd=cwd)
    (out,) = list(cwd.glob("compare-*"))
    rows = read_csv(out)
    assert rows["lev-a"]["baseline"] == "True" and rows["lev-a"]["report_step"] == "300"
    assert float(rows["tied-b"]["val_ppl_vs_baseline_pct"]) == pytest.approx(100 * (60.3 - 54.75) / 54.75)
    # lev's final val loss (3.8) is never reached by tied (4.2 at best); lev reaches it at its last point
    assert rows["tied-b"]["tokens_to_baseline_loss"] == "not reached"
    assert float(rows["lev-a"]["tokens_to_baseline_loss"]) == 300 * 1024
    assert "lev-a (baseline)" in p.stdout

    # without a tied run the first run is the baseline; --baseline by path; no WikiText -> no wikitext plot
    out2 = tmp_path / "o2"
    ok(runs["untied"], runs["lev"], "--out", out2)
    assert read_csv(out2)["untied-tb"]["baseline"] == "True"
    out3 = tmp_path / "o3"
    ok(runs["untied"], runs["tied"], "--baseline", runs["untied"], "--out", out3)
    assert read_csv(out3)["untied-tb"]["baseline"] == "True"
    assert (out3 / "wikitext_ppl.png").is_file()
    out4 = tmp_path / "o4"
    ok(runs["untied"], "--out", out4)
    assert not (out4 / "wikitext_ppl.png").exists() and (out4 / "ppl_by_frequency.png").stat().st_size > 0

    # a report copied away from its run (which is gone), next to a second report of the same run: numbers from
    # the reports, no curve, same-named runs told apart by their tags
    away = tmp_path / "away" / "lev-report.json"
    away.parent.mkdir()
    rep = json.loads(runs["reports"]["lev"].read_text())
    rep["run"] = str(tmp_path / "gone" / "lev-a")
    away.write_text(json.dumps(rep))
    old = make_report(runs["lev"], "lev", step=100, val=(5.0, 148.4))
    out5 = tmp_path / "o5"
    p = ok(away, old, runs["tied"], "--out", out5)
    rows = read_csv(out5)
    assert list(rows) == ["lev-a", "lev-a@global_step100", "tied-b"]
    assert rows["lev-a"]["path"] == "" and float(rows["lev-a"]["val_ppl"]) == 54.75
    assert rows["lev-a"]["tokens_to_baseline_loss"] == "" and "no validation curve in tokens" in p.stdout
    assert float(rows["lev-a@global_step100"]["val_ppl"]) == 148.4
    assert float(rows["lev-a@global_step100"]["tokens_to_baseline_loss"]) == pytest.approx(LEV_REACH)


def test_report_without_heldout_and_empty_buckets(runs, tmp_path):
    """An evaluate --no-heldout report (heldout []), a bucket without tokens (ppl null) and a NaN: empty cells,
    the final val loss from the training log."""
    run = make_run(tmp_path / "more", "albert-c", "albert", {150: 4.9, 300: 4.3})
    path = make_report(run, "albert", bucket_ppl=[None, 600.0, 350.0, 160.0, 90.0, 45.0, float("nan")])
    rep = json.loads(path.read_text())
    rep["heldout"] = []
    path.write_text(json.dumps(rep))
    out = tmp_path / "out"
    ok(runs["tied"], run, "--out", out)
    row = read_csv(out)["albert-c"]
    assert float(row["val_loss"]) == 4.3 and "val from train_log.jsonl step 300" in row["notes"]
    assert row["ppl[unseen]"] == row["ppl[>=1e-03]"] == "" and float(row["ppl[<1e-07]"]) == 600.0
    assert float(row["ppl[<1e-07]_vs_baseline_pct"]) == pytest.approx(20.0)
    assert row["tokens_to_baseline_loss"] == "not reached"


# Geometry records of the input rows, {step: (cosine, eff_rank)}: lev from init (step 0); tied resumed from a
# checkpoint of older code (no step 0 record); untied logs none.
def test_tokens_to_reach_by_hand():
    pts = [(1000, 5.0), (2000, 4.0), (3000, 3.0)]
    assert tokens_to_reach(pts, 4.5) == pytest.approx(1500.0)
    assert tokens_to_reach(pts, 4.0) == 2000.0  # exactly on a point
    assert tokens_to_reach(pts, 5.5) == 1000.0  # already below at the first evaluation
    assert tokens_to_reach(pts, 2.9) is None  # not reached
    assert tokens_to_reach([(1000, 5.0), (2000, 3.0), (3000, 4.0), (4000, 2.0)], 3.5) == pytest.approx(1750.0)
    assert tokens_to_reach([], 1.0) is None
    assert relative(54.75, 60.3) == pytest.approx(-9.2039801)
    assert relative(1.0, 0.0) is None and relative(None, 1.0) is None


def test_help():
    p = ok("--help")
    assert "--baseline" in p.stdout and "--out" in p.stdout and "tied" in p.stdout


def bad(*args, **kw) -> str:
    p = compare(*args, **kw)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    return lines[0]


def test_bad_input(runs, tmp_path):
    out = ["--out", tmp_path / "never"]
    msg = bad(tmp_path / "missing", *out)
    assert str(tmp_path / "missing") in msg

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("hello")
    assert "neither a run directory" in bad(runs["tied"], empty, *out)

    bare = tmp_path / "bare"  # checkpoints only: no train_log, no events, no report
    (bare / "checkpoints").mkdir(parents=True)
    assert "no train_log.jsonl, no TensorBoard events and no eval report" in bad(bare, *out)

    rep = json.loads(runs["reports"]["lev"].read_text())
    del rep["heldout"][0]["ppl"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(rep))
    msg = bad(broken, *out)
    assert str(broken) in msg and "heldout[0].ppl" in msg

    rep = json.loads(runs["reports"]["lev"].read_text())
    rep["params"]["total"] = "many"
    runs["reports"]["lev"].write_text(json.dumps(rep))  # found through its run directory
    msg = bad(runs["lev"], runs["tied"], *out)
    assert str(runs["reports"]["lev"]) in msg and "params.total" in msg

    (tmp_path / "junk.json").write_text("{not json")
    assert str(tmp_path / "junk.json") in bad(tmp_path / "junk.json", *out)
    assert "missing-base" in bad(runs["tied"], "--baseline", tmp_path / "missing-base", *out)
    assert not (tmp_path / "never").exists()


def _valid_tokens(run: Path) -> tuple[list, dict]:
    """The validation curve and config of a real run, read by hand from its files."""
    meta_dir = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    cfg = json.loads((meta_dir / "leviathan.json").read_text())["config"]
    per_step = cfg["train"]["global_batch_size"] * cfg["model"]["seq_length"]
    recs = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines() if line]
    return [(r["step"] * per_step, r["valid_loss"]) for r in recs if "valid_loss" in r], cfg


def test_real_trained_runs(trained_run, tmp_path):
    from leviathan_pretrain.config import Config
    from leviathan_pretrain.config.loader import build
    from leviathan_pretrain.model import counts

    lev, tied = trained_run("lev-tp2"), trained_run("tied-tp2")
    out = tmp_path / "real"
    p = ok(lev, tied, "--out", out)
    rows = read_csv(out)
    assert list(rows) == [lev.name, tied.name] and rows[tied.name]["baseline"] == "True"
    base_curve, _ = _valid_tokens(tied)
    target = base_curve[-1][1]
    for run in (lev, tied):
        row = rows[run.name]
        curve, cfg = _valid_tokens(run)
        assert float(row["val_loss"]) == curve[-1][1]
        assert "no eval report" in row["notes"] and row["report"] == "" and row["wikitext_token_ppl"] == ""
        c = build(Config, cfg)
        parts = counts.param_breakdown(c.model, c.parallel.tensor_parallel)
        assert int(row["total_params"]) == parts["total"] and int(row["input_params"]) == parts["input"]
        assert int(row["tokens_seen"]) == STEPS * cfg["train"]["global_batch_size"] * cfg["model"]["seq_length"]
        # tokens to reach, by hand: the first evaluation at or below the target, linear from the one before
        want = None
        for i, (t, v) in enumerate(curve):
            if v <= target:
                want = (
                    t
                    if i == 0
                    else curve[i - 1][0] + (curve[i - 1][1] - target) / (curve[i - 1][1] - v) * (t - curve[i - 1][0])
                )
                break
        got = row["tokens_to_baseline_loss"]
        assert (got == "not reached") if want is None else float(got) == pytest.approx(want)
    for name in ("comparison.md", "comparison.csv", "val_loss_vs_tokens.png", "ppl_by_frequency.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "val_loss_vs_tokens.png").read_bytes()[:8] == PNG
    assert not (out / "wikitext_ppl.png").exists()
    assert f"{tied.name} (baseline)" in p.stdout
