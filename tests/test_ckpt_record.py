"""The checkpoint record (leviathan.json) and the run layout: one owner each, torch-free, defaults in one place."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from leviathan_pretrain.rundir import train_log
from leviathan_pretrain.rundir.layout import RunLayout, is_run_dir
from leviathan_pretrain.trainer.checkpoint.names import CheckpointError
from leviathan_pretrain.trainer.checkpoint.record import ALWAYS_WRITTEN, CheckpointRecord, ParallelLayout

REPO = Path(__file__).resolve().parents[1]
WRITTEN = {  # what the trainer writes, in its key order (tests/test_checkpoint.py reads a real one)
    "config": {"model": {"variant": "lev"}, "data": {"tokenizer": "tok.model"}},
    "tokenizer_sha256": "a" * 64,
    "tokenizer_fingerprint": "b" * 64,
    "model_layout": 2,
    "layout": {"tp": 2, "pp": 1, "dp": 4, "zero_stage": 1},
    "step": 60,
    "consumed_samples": 480,
    "skipped_steps": 1,
    "tag": "global_step60",
}


def test_record_round_trips_byte_for_byte(tmp_path):
    rec = CheckpointRecord.from_json(WRITTEN, "x")
    assert rec.dumps() == json.dumps(WRITTEN, indent=1)
    assert rec.layout == ParallelLayout(tp=2, pp=1, dp=4, zero_stage=1)
    assert rec.state_fields() == {"step": 60, "consumed_samples": 480, "skipped_steps": 1}
    (tmp_path / "global_step60").mkdir()
    (tmp_path / "global_step60" / "leviathan.json").write_text(rec.dumps())
    assert CheckpointRecord.read(tmp_path / "global_step60") == rec


def test_older_records_get_the_documented_defaults():
    """A record from before model_layout / skipped_steps / the fingerprint existed."""
    old = {k: WRITTEN[k] for k in ("config", "tokenizer_sha256", "step", "consumed_samples")}
    rec = CheckpointRecord.from_json(old, "x")
    assert (rec.model_layout, rec.skipped_steps, rec.layout) == (1, 0, ParallelLayout())
    assert rec.tokenizer_fp == "a" * 64  # the sha256 was a SentencePiece model's fingerprint
    assert CheckpointRecord.from_json(WRITTEN, "x").tokenizer_fp == "b" * 64


@pytest.mark.parametrize(
    "change, message",
    [
        ({"config": None}, "no 'config' recorded"),
        ({"step": "60"}, "'step' is '60', not a int"),
        ({"consumed_samples": True}, "'consumed_samples' is True"),
        ({"layout": {"tp": 1.5}}, "'layout.tp' is 1.5, not an int"),
    ],
)
def test_a_bad_record_names_the_file_and_the_key(change, message):
    with pytest.raises(CheckpointError, match=f"^ck/leviathan.json: .*{message}"):
        CheckpointRecord.from_json({**WRITTEN, **change}, "ck/leviathan.json")


def test_unreadable_record(tmp_path):
    (tmp_path / "leviathan.json").write_text('{"step": ')
    with pytest.raises(CheckpointError, match="leviathan.json: unreadable"):
        CheckpointRecord.read(tmp_path)


def test_the_records_of_every_trainer_version_are_read(tmp_path):
    """Before model_layout (layout 1), before tokenizer_fingerprint, today's: the keys each version wrote."""
    first = {k: WRITTEN[k] for k in ALWAYS_WRITTEN}
    for data, layout in ((first, 1), ({**first, "model_layout": 2}, 2), (WRITTEN, 2)):
        (tmp_path / "leviathan.json").write_text(json.dumps(data))
        assert CheckpointRecord.read(tmp_path).model_layout == layout


@pytest.mark.parametrize(
    "drop, said",
    [
        (
            ("tokenizer_sha256", "tokenizer_fingerprint", "model_layout", "layout", "skipped_steps", "tag"),
            "no 'tokenizer_sha256', 'layout', 'skipped_steps', 'tag' (every version of the trainer wrote them)",
        ),
        (("tag",), "no 'tag' (every version of the trainer wrote them)"),
        (
            ("model_layout",),
            "'tokenizer_fingerprint' without 'model_layout' (the trainer wrote 'tokenizer_fingerprint'",
        ),
    ],
)
def test_a_record_no_trainer_wrote_names_the_file_and_the_missing_keys(tmp_path, drop, said):
    """Fields missing (a hand-edited or cut record) used to read as "written with model layout 1" at resume."""
    data = {k: v for k, v in WRITTEN.items() if k not in drop}
    (tmp_path / "leviathan.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as e:
        CheckpointRecord.read(tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'leviathan.json'}: an incomplete or hand-edited record: {said}"), msg
    assert msg.endswith("restore the file, or resume from an older complete checkpoint") and "\n" not in msg
    assert CheckpointRecord.from_json(data, "x").step == 60  # tools reading what they can (compare) still may


def test_run_layout_defaults_and_the_config_overrides(tmp_path):
    from leviathan_pretrain.config import load_config

    cfg = load_config(str(REPO / "configs/tiny-cpu-lev.yaml"), [f"train.out_dir={tmp_path}/run"])
    lay = RunLayout.from_config(cfg)
    assert (lay.checkpoints, lay.events, lay.report("global_step5")) == (
        tmp_path / "run/checkpoints",
        tmp_path / "run/tensorboard",
        tmp_path / "run/eval/global_step5.json",
    )
    cfg = load_config(
        str(REPO / "configs/tiny-cpu-lev.yaml"),
        [f"train.out_dir={tmp_path}/run", f"checkpoint.dir={tmp_path}/ck", "logging.tensorboard=false"],
    )
    lay = RunLayout.from_config(cfg)
    assert (lay.checkpoints, lay.events) == (tmp_path / "ck", None)
    assert not is_run_dir(tmp_path)
    (tmp_path / "train_log.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}\n{"step": 2, "lo')
    assert is_run_dir(tmp_path)
    # a torn last line (a run still writing) is skipped; the last record of a step wins
    (tmp_path / "train_log.jsonl").write_text(
        '{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo'
    )
    assert train_log.read_log_values(tmp_path / "train_log.jsonl", "loss") == [[(1, 2.5), (2, 1.5)]]


def test_the_record_and_layout_modules_do_not_import_torch():
    code = (
        "import sys, leviathan_pretrain.trainer.checkpoint.record, leviathan_pretrain.rundir.layout, "
        "leviathan_pretrain.rundir.train_log, leviathan_pretrain.rundir.tb_events, common.exit_codes; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_eval_report_round_trip_and_its_checks(tmp_path):
    """The evaluation report's one owner: evaluate's key order on write, compare's checks on read."""
    from leviathan_pretrain.evaluation.report import EvalReport, ReportError

    heldout = [{"name": "val", "prefix": "/d/val", "documents": 3, "documents_left_out": 0, "tokens": 90}]
    heldout[0].update(loss=4.0, ppl=54.6)
    rep = EvalReport(step=30, variant="lev", params={"total": 10, "input_layer": 2, "non_input": 8}, tokens_seen=960)
    rep.heldout, rep.tag, rep.settings = heldout, "global_step30", {"context": 128}
    rep.write(tmp_path / "eval" / "global_step30.json")
    written = json.loads((tmp_path / "eval" / "global_step30.json").read_text())
    assert list(written) == [
        *("schema", "run", "checkpoint", "tag", "step", "variant", "params", "tokens_seen", "created"),
        *("heldout", "frequency", "wikitext", "lambada", "geometry", "settings", "seconds"),
    ]
    assert EvalReport.read(tmp_path / "eval" / "global_step30.json") == rep
    brief = {k: written[k] for k in ("schema", "step", "variant", "params", "tokens_seen", "heldout")}
    assert EvalReport.from_json(brief, "r.json").wikitext is None  # the optional sections may be absent
    with pytest.raises(ReportError, match=r"r.json: malformed report: key 'heldout\[0\].ppl' is 'x'"):
        EvalReport.from_json({**brief, "heldout": [{**heldout[0], "ppl": "x"}]}, "r.json")
    with pytest.raises(ReportError, match="key 'schema' is 2, this tool reads 1"):
        EvalReport.from_json({**brief, "schema": 2}, "r.json")
