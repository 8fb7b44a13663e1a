"""``python -m leviathan_pretrain.compare``: real run directories (train_log.jsonl, TensorBoard events written by
torch's SummaryWriter, checkpoint records, evaluation reports in the fixed schema) compared in a subprocess; the
CSV parsed back against the reports, the relative changes and tokens-to-reach worked out by hand, bad input."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from leviathan_pretrain.comparison.rows import relative, tokens_to_reach

REPO = Path(__file__).resolve().parents[1]
BUCKETS = ["unseen", "<1e-07", "1e-07..1e-06", "1e-06..1e-05", "1e-05..1e-04", "1e-04..1e-03", ">=1e-03"]
EDGES = [(0.0, 0.0), (0.0, 1e-7), (1e-7, 1e-6), (1e-6, 1e-5), (1e-5, 1e-4), (1e-4, 1e-3), (1e-3, 1.0)]
PNG = b"\x89PNG\r\n\x1a\n"


def compare(*args, cwd=None, timeout=180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), MPLBACKEND="Agg")
    cmd = [sys.executable, "-m", "leviathan_pretrain.compare", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd or REPO)


def ok(*args, **kw) -> subprocess.CompletedProcess:
    p = compare(*args, **kw)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    return p


def config(variant: str, gbs: int, seq: int, out_dir: Path) -> dict:
    return {
        "model": {"variant": variant, "vocab_size": 8000, "hidden_size": 128, "num_layers": 2, "seq_length": seq},
        "train": {"global_batch_size": gbs, "micro_batch_size": 4, "steps": 300, "out_dir": str(out_dir)},
        "parallel": {"tensor_parallel": 1},
    }


def geometry_record(step: int, cosine: float, eff_rank: float) -> dict:
    """A trainer's geometry step record (flat keys, no "loss"): the input rows' ``cosine`` and ``eff_rank`` as
    given, the other numbers and a bucket's (which compare ignores) made up."""
    rec = {"step": step}
    for part, c, r in (("input", cosine, eff_rank), ("head", cosine / 2, eff_rank * 2)):
        rec.update({f"geometry/{part}/rms": 0.02, f"geometry/{part}/cosine": c, f"geometry/{part}/mean_share": c})
        rec.update({f"geometry/{part}/eff_rank": r, f"geometry/{part}/rare/cosine": 0.999})
    return rec


def make_run(root: Path, name: str, variant: str, valid: dict, *, gbs=8, seq=128, log="jsonl", step=300,
             geometry=None) -> Path:  # fmt: skip
    """A run directory: training loss every 10 steps + ``valid`` ({step: loss}) in train_log.jsonl (log="jsonl")
    or in TensorBoard events only (log="tensorboard"), and ``checkpoints/global_step<step>`` with its record;
    ``geometry`` ({step: (input cosine, input eff_rank)}): geometry records in train_log.jsonl."""
    run = root / name
    train = {s: 7.0 - 2.0 * s / step for s in range(10, step + 1, 10)}
    geometry = geometry or {}
    if log == "jsonl":
        recs = [{"step": 0, "event": "layout", "world": 1}]
        recs += [geometry_record(0, *geometry[0])] if 0 in geometry else []
        for s in range(10, step + 1, 10):
            recs.append({"step": s, "loss": train[s], "lr": 1e-3, "grad_norm": 1.0, "consumed_samples": s * gbs})
            if s in valid:
                recs.append({"step": s, "valid_loss": valid[s], "valid_perplexity": math.exp(valid[s])})
            if s in geometry:
                recs.append(geometry_record(s, *geometry[s]))
        recs.append({"step": step, "event": "finished", "steps": step})
        run.mkdir(parents=True)
        (run / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    else:
        from torch.utils.tensorboard import SummaryWriter

        w = SummaryWriter(str(run / "tensorboard"))
        for s, v in train.items():
            w.add_scalar("train/loss", v, s)
        for s, v in valid.items():
            w.add_scalar("valid/loss", v, s)
            w.add_scalar("valid/perplexity", math.exp(v), s)
        w.close()
    ckpt = run / "checkpoints" / f"global_step{step}"
    ckpt.mkdir(parents=True)
    meta = {"config": config(variant, gbs, seq, run), "step": step, "consumed_samples": step * gbs}
    (ckpt / "leviathan.json").write_text(json.dumps(meta))
    (run / "checkpoints" / "latest").write_text(f"global_step{step}")
    return run


def make_report(run: Path, variant: str, *, step=300, total=1_000_000, inp=100_000, val=(4.1, 60.3), test_ppl=None,
                bucket_ppl=None, wiki=None, lambada=None, geometry="absent") -> Path:  # fmt: skip
    """An evaluation report in run/eval/; ``geometry``: "absent" (no key: an older report), None (null: evaluate
    --no-geometry) or (input cosine, input eff_rank, head cosine)."""
    heldout = [{"name": "val", "prefix": "/d/val", "tokens": 100000, "documents": 120, "loss": val[0], "ppl": val[1]}]
    if test_ppl is not None:
        heldout.append(
            {"name": "test", "prefix": "/d/test", "tokens": 9000, "documents": 9, "loss": 4.2, "ppl": test_ppl}
        )
    rep = {
        "schema": 1,
        "run": str(run.resolve()),
        "checkpoint": str((run / "checkpoints" / f"global_step{step}").resolve()),
        "tag": f"global_step{step}",
        "step": step,
        "variant": variant,
        "params": {"total": total, "input_layer": inp, "non_input": total - inp},
        "tokens_seen": step * 1024,
        "created": "2026-12-01T18:00:00Z",
        "heldout": heldout,
        "frequency": None,
        "wikitext": None,
        "lambada": None,
    }
    if bucket_ppl is not None:
        buckets = [
            {
                "name": n,
                "lo": lo,
                "hi": hi,
                "tokens": 100 * (i + 1),
                "types": 3 + i,
                "loss": p and math.log(p),
                "ppl": p,
            }
            for i, (n, (lo, hi), p) in enumerate(zip(BUCKETS, EDGES, bucket_ppl))
        ]
        rep["frequency"] = {"counts": ["/d/train.counts.npy"], "training_tokens": 123456789, "mode": "decades",
                            "buckets": buckets}  # fmt: skip
    if wiki is not None:
        rep["wikitext"] = {"path": "/d/wiki", "articles": 60, "skipped": {"empty": 0}, "tokens": 280000,
                           "words": 245000, "context": 256, "stride": 128, "token_loss": math.log(wiki[0]),
                           "token_ppl": wiki[0], "word_ppl": wiki[1]}  # fmt: skip
    if lambada is not None:
        rep["lambada"] = {"path": "/d/lambada", "examples": 100, "skipped": {}, "accuracy": lambada, "ppl": 850.0}
    if geometry is None:
        rep["geometry"] = None
    elif geometry != "absent":

        def part(cosine, eff_rank):
            numbers = {"rows": 2048, "width": 128, "rms": 0.05, "cosine": cosine, "mean_share": 0.5}
            return {**numbers, "eff_rank": eff_rank, "buckets": [{"name": "unseen", "types": 9, **numbers,
                                                                  "cosine": 0.999, "eff_rank": 1.5}]}  # fmt: skip

        rep["geometry"] = {"sample": 2048, "seed": 0, "input": part(*geometry[:2]), "head": part(geometry[2], 99.0)}
    path = run / "eval" / f"global_step{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rep, indent=1))
    return path


# Designed validation curves (tokens per step = 8 x 128 = 1024 for tied/lev; 2 x 256 = 512 for untied):
# the baseline (tied) ends at 4.2 after 300 steps = 307200 tokens; lev crosses 4.2 between steps 100 (4.6) and
# 200 (4.0): step 100 + 100 x 0.4 / 0.6 -> 170666.67 tokens, ratio 1.8; untied never goes below 4.4.
TIED_VALID = {100: 5.0, 200: 4.5, 300: 4.2}
LEV_VALID = {100: 4.6, 200: 4.0, 300: 3.8}
UNTIED_VALID = {100: 5.1, 200: 4.8, 300: 4.4}
LEV_REACH = 100 * 1024 + (4.6 - 4.2) / (4.6 - 4.0) * 100 * 1024
TIED_B = [900.0, 500.0, 300.0, 150.0, 80.0, 40.0, 12.0]
LEV_B = [700.0, 420.0, 280.0, 140.0, 78.0, 41.0, 12.5]


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


def read_csv(out: Path) -> dict:
    with open(out / "comparison.csv", newline="") as f:
        return {row["run"]: row for row in csv.DictReader(f)}


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
LEV_GEO = {0: (0.9, 3.0), 100: (0.6, 20.0), 200: (0.4, 40.0), 300: (0.3, 55.5)}
TIED_GEO = {200: (0.05, 100.0), 300: (0.04, 110.0)}


def md_section(md: str, title: str) -> str:
    """The text of ``## title`` up to the next section."""
    return md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


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


def test_plot_colours_stay_distinct_past_ten_runs():
    # the 13-run study drew TIED and a LEV run in the same blue, ALBERT and lev-long in the same green
    from matplotlib.colors import to_rgba

    from leviathan_pretrain.comparison.plots import colors

    for n in (1, 3, 10, 11, 13, 20):
        assert len({to_rgba(c) for c in colors(n)}) == n, n
    assert colors(3) == ["C0", "C1", "C2"]  # the default cycle up to 10 runs
    assert len({to_rgba(c) for c in colors(25)}) == 20  # tab20's colours repeat only past 20


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
        assert int(row["tokens_seen"]) == 30 * cfg["train"]["global_batch_size"] * cfg["model"]["seq_length"]
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
