"""A second ``make demo`` does nothing when everything is done: the training (the latest checkpoint is the last step
of this request), the evaluation report and the export of that checkpoint are each reused and said so; anything
else (another checkpoint, WikiText asked for now, an export of another run, overrides) runs again. WikiText is
evaluated only when the user names the file."""

from __future__ import annotations

import json
from pathlib import Path

from leviathan_pretrain import demo
from leviathan_pretrain.walkthrough.results import explain
from leviathan_pretrain.walkthrough.steps import (
    Clock,
    _mmss,
    evaluation_command,
    export_up_to_date,
    report_up_to_date,
    training_complete,
)


def _run(tmp_path: Path, step: int = 120, steps: int = 120) -> Path:
    run = tmp_path / "demo" / "train"
    tag = run / "checkpoints" / f"global_step{step}"
    tag.mkdir(parents=True)
    (tag / "leviathan.json").write_text(json.dumps({"step": step, "config": {"train": {"steps": steps}}}))
    (run / "checkpoints" / "latest").write_text(f"global_step{step}")
    return run


def test_training_is_reused_only_when_it_reached_the_requested_steps(tmp_path):
    _run(tmp_path)
    req = demo.parse(["--out", str(tmp_path / "demo")])
    assert training_complete(req) == "global_step120"
    assert training_complete(demo.parse(["--out", str(tmp_path / "demo"), "--steps", "200"])) is None
    assert training_complete(demo.parse(["--out", str(tmp_path / "demo"), "optim.lr=1e-3"])) is None
    assert training_complete(demo.parse(["--out", str(tmp_path / "demo"), "--overwrite"])) is None
    assert training_complete(demo.parse(["--out", str(tmp_path / "elsewhere")])) is None
    partial = tmp_path / "p"
    _run(partial, step=60)
    assert training_complete(demo.parse(["--out", str(partial / "demo")])) is None  # stopped early: resume


def test_the_report_is_reused_for_the_same_checkpoint_and_the_same_wikitext_request(tmp_path):
    run = _run(tmp_path)
    assert not report_up_to_date(run, "global_step120", None)  # none yet
    (run / "eval").mkdir()
    (run / "eval" / "global_step120.json").write_text(json.dumps({"tag": "global_step120", "wikitext": None}))
    assert report_up_to_date(run, "global_step120", None)
    assert not report_up_to_date(run, "global_step120", "wiki.test.raw")  # asked for now: evaluate again
    assert not report_up_to_date(run, "global_step140", None)
    (run / "eval" / "global_step120.json").write_text(json.dumps({"tag": "global_step120", "wikitext": {"ppl": 1}}))
    assert report_up_to_date(run, "global_step120", "wiki.test.raw")
    assert report_up_to_date(run, "global_step120", None)  # more than asked for: kept
    (run / "eval" / "global_step120.json").write_text("{broken")
    assert not report_up_to_date(run, "global_step120", None)


def test_the_export_is_reused_when_it_is_ours_of_this_checkpoint(tmp_path):
    run, hf = _run(tmp_path), tmp_path / "demo" / "hf"
    assert not export_up_to_date(run, hf, "global_step120")
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    mark = {"source_run": str(run), "tag": "global_step120"}
    (hf / "leviathan_export.json").write_text(json.dumps(mark))
    assert export_up_to_date(run, hf, "global_step120")
    assert not export_up_to_date(run, hf, "global_step140")
    (hf / "leviathan_export.json").write_text(json.dumps({**mark, "source_run": str(tmp_path / "other")}))
    assert not export_up_to_date(run, hf, "global_step120")


def test_wikitext_only_when_named():
    assert demo.parse([]).wikitext is None
    assert demo.parse(["--wikitext", "wiki.test.raw"]).wikitext == "wiki.test.raw"


def test_the_evaluation_runs_on_the_trainings_local_processes():
    cmd = evaluation_command(demo.parse(["--out", "runs/x", "--nprocs", "3", "--wikitext", "w.raw"]))
    i = cmd.index("--")
    assert cmd[1].endswith("launchers/local.py") and cmd[2:i] == ["-n", "3"]
    assert cmd[i + 1 :] == ["-m", "leviathan_pretrain.evaluate", "--run", "runs/x/train", "--wikitext", "w.raw"]


def test_the_end_says_how_long_each_step_took_and_what_the_figures_mean(tmp_path, capsys):
    clock = Clock(t0=0.0)
    clock.lap("data", -6.0)
    clock.lap("training", -95.0)
    steps = clock.summary().split("(after set-up; ")[1]
    assert steps.startswith("data ") and ", training " in steps and steps.endswith(")")
    assert _mmss(95) == "1 min 35 s" and _mmss(6.44) == "6.4 s" and _mmss(42.2) == "42 s"
    run = _run(tmp_path)
    buckets = [{"name": "unseen", "tokens": 6, "ppl": 2e5}, {"name": "1e-06..1e-05", "tokens": 2381, "ppl": 72876.0},
               {"name": ">=1e-03", "tokens": 126165, "ppl": 17.74}]  # fmt: skip
    report = {"tag": "global_step120", "tokens_seen": 245760, "frequency": {"buckets": buckets},
              "heldout": [{"tokens": 206491, "ppl": 159.06}], "wikitext": {"word_ppl": 4708022.6}}  # fmt: skip
    (run / "eval").mkdir()
    (run / "eval" / "global_step120.json").write_text(json.dumps(report))
    explain(run)
    out = capsys.readouterr().out.splitlines()
    assert "206,491 held-out tokens" in out[0] and "perplexity is 159.1" in out[0] and "245,760 training" in out[0]
    assert "(>=1e-03 of the training tokens) have perplexity 17.7, rare ones (1e-06..1e-05) 72,876" in out[1]
    assert "WikiText word perplexity 4,708,023" in out[2] and "expected" in out[2] and len(out) == 3
