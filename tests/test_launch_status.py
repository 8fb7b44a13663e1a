"""``launchers.status``: the ``status RUN_DIR`` report, on run directories built for real (records, TensorBoard
events, checkpoints, a log). SLURM is not faked: PATH lacks ``squeue`` here, so the state is reported unknown;
the real SLURM path is tested against a real cluster elsewhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launchers import records, run_status, slurm_query, status
from leviathan_pretrain.rundir.layout import LOGS as LOGS_DIR
from leviathan_pretrain.trainer.checkpoint import names as ckpt

ROOT = Path(__file__).resolve().parents[1]
LOSSES = {step: 4.0 - 0.05 * step + 1e-3 / 3 for step in range(1, 26)}  # not exact in float32


@pytest.fixture(autouse=True)
def no_slurm(tmp_path, monkeypatch):
    empty = tmp_path / "no-slurm-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def make_run(run: Path, config: Path | None = None, jobs=("1000", "1001"), steps=25, ckpt_dir: Path | None = None):
    """A run directory as launchers.slurm and the trainer leave it (``steps=0``: nothing written yet)."""
    log = run / LOGS_DIR / f"train-{jobs[-1]}.out"
    for i, job in enumerate(jobs):
        rec = {"job_id": job, "kind": "train", "submitted": f"2025-01-0{i + 1}T10:00:00", "log": str(log)}
        records.append_record(run, {**rec, "config": str(config or run / "slurm" / "none.yaml"), "argv": []})
    if not steps:
        return run
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run / "tensorboard"))
    for step in range(1, steps + 1):  # the trainer's tags (trainer/metrics.py)
        writer.add_scalar("train/loss", LOSSES[step], step)
        writer.add_scalar("train/lr", 1e-4, step)
        if step % 10 == 0:
            writer.add_scalar("perf/tokens_per_s", 1000.0 * step, step)
            writer.add_scalar("valid/loss", LOSSES[step] + 0.25, step)
    writer.close()
    cdir = ckpt_dir or run / "checkpoints"
    (cdir / ckpt.tag_for(20)).mkdir(parents=True)
    (cdir / ckpt.tag_for(20) / ckpt.META).write_text(json.dumps({"step": 20}))
    (cdir / ckpt.LATEST).write_text(ckpt.tag_for(20))
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(f"log line {i}\n" for i in range(1, 31)))
    return run


def test_report_text(tmp_path):
    run = make_run(tmp_path / "run")
    text = run_status.report(run)
    print(text)
    assert "1001 (train), submitted 2025-01-02T10:00:00" in text.splitlines()[1]
    assert "state     unknown: squeue not found" in text
    assert "earlier   1000 (train), submitted 2025-01-01T10:00:00" in text
    assert f"progress  step 20 (checkpoint global_step20 in {run / 'checkpoints'})" in text
    assert f"train/loss {LOSSES[25]:.4f} @ step 25" in text
    assert "perf/tokens_per_s 20,000 @ step 20" in text and f"valid/loss {LOSSES[20] + 0.25:.4f} @ step 20" in text
    assert "(last 20 lines):" in text and text.endswith("  log line 30")
    assert "  log line 11\n" in text and "log line 10\n" not in text
    assert "config " in text and "assuming the default directories" in text


def test_json_values_read_back(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    assert status.main([str(run), "--json", "--lines", "3"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["job"]["job_id"] == "1001" and [j["job_id"] for j in info["earlier_jobs"]] == ["1000"]
    assert info["job"]["slurm"]["state"] == "unknown" and info["job"]["slurm"]["note"] == "squeue not found"
    progress = {"checkpoint_dir": str(run / "checkpoints"), "tag": "global_step20", "step": 20, "error": None}
    assert info["progress"] == progress
    met = info["metrics"]
    assert met["train/loss"]["step"] == 25 and met["train/loss"]["value"] == pytest.approx(LOSSES[25], rel=1e-6)
    assert met["perf/tokens_per_s"] == {"step": 20, "value": 20000.0}
    assert met["valid/loss"]["step"] == 20 and met["valid/loss"]["value"] == pytest.approx(LOSSES[20] + 0.25)
    assert info["log"]["lines"] == ["log line 28", "log line 29", "log line 30"]


def test_slurm_state_without_squeue():
    s = slurm_query.slurm_state("1234")
    assert (s["state"], s["known"], s["note"]) == ("unknown", None, "squeue not found")
    keys = {"state", "known", "note", "reason", "elapsed", "time_limit", "restarts", "exit_code", "nodes", "source"}
    assert set(s) == keys and s["nodes"] is None


def test_nothing_yet(tmp_path):
    run = make_run(tmp_path / "run", jobs=("7",), steps=0)
    text = run_status.report(run)
    assert "earlier" not in text
    assert f"progress  none yet (no checkpoint in {run / 'checkpoints'})" in text
    assert f"metrics   nothing logged yet in {run / 'tensorboard'}" in text
    assert "not there (yet: the job may not have started)" in text


def test_broken_latest(tmp_path):
    run = make_run(tmp_path / "run")
    (run / "checkpoints" / ckpt.LATEST).write_text("global_step30")  # no global_step30/leviathan.json
    assert "progress  checkpoint unreadable:" in run_status.report(run) and "global_step30" in run_status.report(run)


def test_config_dirs(tmp_path):
    """checkpoint.dir / logging.tensorboard_dir from the record's config; relative ones from the job's cwd."""
    work = tmp_path / "work"
    cfg = tmp_path / "config.yaml"
    cfg.write_text("train:\n  out_dir: runs/a\ncheckpoint:\n  dir: ckpts/a\n")
    run = make_run(work / "runs" / "a", config=cfg, ckpt_dir=work / "ckpts" / "a")
    info = run_status.collect(run)
    assert info["config_note"] is None
    assert info["progress"]["checkpoint_dir"] == str((work / "ckpts" / "a").resolve())
    assert info["progress"]["step"] == 20
    cfg.write_text(f"train:\n  out_dir: runs/a\nlogging:\n  tensorboard: false\ncheckpoint:\n  dir: {work}/ckpts/a\n")
    info = run_status.collect(run)
    assert info["progress"]["step"] == 20 and info["metrics"]["train/loss"] is None
    assert "TensorBoard logging is off" in run_status.format_run(info)


def test_sweep(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    make_run(sweep / "lev", jobs=("11",))
    make_run(sweep / "tied", jobs=("12",), steps=0)
    (sweep / "not-a-run").mkdir()
    text = run_status.report(sweep)
    lines = text.splitlines()
    assert lines[0] == f"sweep {sweep.resolve()}" and lines[1].split() == ["run", "job", "state", "step", "train/loss"]
    assert lines[2].split() == ["lev", "11", "unknown", "20", f"{LOSSES[25]:.4f}"]
    assert lines[3].split() == ["tied", "12", "unknown", "-", "-"]
    assert "squeue not found" in text and lines[-1] == f"status {sweep.resolve()}/<run> for details"
    assert status.main([str(sweep), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in info["runs"]] == ["lev", "tied"] and info["runs"][0]["progress"]["step"] == 20


def test_errors(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert status.main([str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err and err.count("\n") == 1
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    assert status.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(tmp_path / "empty") in err and "jobs.jsonl" in err
    with pytest.raises(run_status.StatusError):
        run_status.report(missing)


def test_tail_of_large_file(tmp_path):
    p = tmp_path / "big.log"
    p.write_text("".join(f"{i:08d} " + "x" * 100 + "\n" for i in range(5000)))
    assert [ln[:8] for ln in run_status.tail(p, 700)] == [f"{i:08d}" for i in range(4300, 5000)]
    assert run_status.tail(p, 0) == [] and run_status.tail(tmp_path / "big.log", 1)[0].startswith("00004999")


def test_command_line(tmp_path):
    """As a command: --help, exit 2 on a bad path, and no torch import on the way."""
    py = [sys.executable, "-m", "launchers.status"]
    out = subprocess.run([*py, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and "example:" in out.stdout and "--json" in out.stdout
    out = subprocess.run([*py, str(tmp_path / "nope")], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("error: ")
    code = "import sys, launchers.status; print(sorted({'torch', 'yaml', 'tensorboard'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
