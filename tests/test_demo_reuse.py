"""A second ``make demo`` does nothing when everything is done: the training (the latest checkpoint is the last step
of this request), the evaluation report and the export of that checkpoint are each reused and said so; anything
else (another checkpoint, WikiText asked for now, an export of another run, overrides) runs again. WikiText is
evaluated only when the user names the file."""

from __future__ import annotations

import json
from pathlib import Path

from leviathan_pretrain import demo


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
    assert demo.training_complete(req) == "global_step120"
    assert demo.training_complete(demo.parse(["--out", str(tmp_path / "demo"), "--steps", "200"])) is None
    assert demo.training_complete(demo.parse(["--out", str(tmp_path / "demo"), "optim.lr=1e-3"])) is None
    assert demo.training_complete(demo.parse(["--out", str(tmp_path / "demo"), "--overwrite"])) is None
    assert demo.training_complete(demo.parse(["--out", str(tmp_path / "elsewhere")])) is None
    partial = tmp_path / "p"
    _run(partial, step=60)
    assert demo.training_complete(demo.parse(["--out", str(partial / "demo")])) is None  # stopped early: resume


def test_the_report_is_reused_for_the_same_checkpoint_and_the_same_wikitext_request(tmp_path):
    run = _run(tmp_path)
    assert not demo.report_up_to_date(run, "global_step120", None)  # none yet
    (run / "eval").mkdir()
    (run / "eval" / "global_step120.json").write_text(json.dumps({"tag": "global_step120", "wikitext": None}))
    assert demo.report_up_to_date(run, "global_step120", None)
    assert not demo.report_up_to_date(run, "global_step120", "wiki.test.raw")  # asked for now: evaluate again
    assert not demo.report_up_to_date(run, "global_step140", None)
    (run / "eval" / "global_step120.json").write_text(json.dumps({"tag": "global_step120", "wikitext": {"ppl": 1}}))
    assert demo.report_up_to_date(run, "global_step120", "wiki.test.raw")
    assert demo.report_up_to_date(run, "global_step120", None)  # more than asked for: kept
    (run / "eval" / "global_step120.json").write_text("{broken")
    assert not demo.report_up_to_date(run, "global_step120", None)


def test_the_export_is_reused_when_it_is_ours_of_this_checkpoint(tmp_path):
    run, hf = _run(tmp_path), tmp_path / "demo" / "hf"
    assert not demo.export_up_to_date(run, hf, "global_step120")
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    mark = {"source_run": str(run), "tag": "global_step120"}
    (hf / "leviathan_export.json").write_text(json.dumps(mark))
    assert demo.export_up_to_date(run, hf, "global_step120")
    assert not demo.export_up_to_date(run, hf, "global_step140")
    (hf / "leviathan_export.json").write_text(json.dumps({**mark, "source_run": str(tmp_path / "other")}))
    assert not demo.export_up_to_date(run, hf, "global_step120")


def test_wikitext_only_when_named():
    assert demo.parse([]).wikitext is None
    assert demo.parse(["--wikitext", "wiki.test.raw"]).wikitext == "wiki.test.raw"
