"""Checkpoints: bitwise resume (DP=2 ZeRO-2, PP=2), keep-last-K, atomic ``latest`` under a crash during a
write, SIGTERM -> checkpoint + exit 75, weights-only loading, RNG state round trip."""
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from leviathan_pretrain.trainer import checkpoint as ckpt
from tests.multiproc import REPO, base_env
from tests.workers.train_common import (CONFIG, dp_tp_runs, events, losses, overrides, pipe_resume_runs, pipe_runs,
                                        workdir)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))     # would create the marker file if unpickled


def test_loading_refuses_arbitrary_objects(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.pt"
    with open(bad, "wb") as f:
        pickle.dump({"module": _Payload(str(marker))}, f)
    torch.save({"w": torch.ones(2), "state": {"step": 3}}, tmp_path / "good.pt")
    with pytest.raises(ckpt.CheckpointError, match="evil.pt: refused by weights_only loading"):
        ckpt.safe_load(bad)
    assert not marker.exists()
    assert ckpt.safe_load(tmp_path / "good.pt")["state"] == {"step": 3}


def test_rng_state_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()     # leaves a cached gaussian in numpy's state
    torch.save(ckpt.rng_state(), tmp_path / "rng.pt")
    before = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ckpt.set_rng_state(ckpt.safe_load(tmp_path / "rng.pt"))
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == before


def test_latest_prune_and_incomplete(tmp_path):
    for s in (10, 20, 30, 40):
        d = tmp_path / ckpt.tag_for(s)
        d.mkdir()
        (d / "x.pt").write_bytes(b"x")
        if s != 40:
            (d / ckpt.META).write_text("{}")
    (tmp_path / "latest").write_text("global_step30")
    assert ckpt.read_latest(tmp_path) == "global_step30"
    assert ckpt.prune(tmp_path, keep_last=2) == ["global_step10"]
    assert ckpt.complete_tags(tmp_path) == ["global_step20", "global_step30"]
    assert ckpt.remove_incomplete(tmp_path) == ["global_step40"] and not (tmp_path / "global_step40").exists()
    (tmp_path / "latest").write_text("global_step40")
    with pytest.raises(ckpt.CheckpointError, match="not a complete checkpoint"):
        ckpt.read_latest(tmp_path)


def assert_bitwise_resume(full, part):
    a, b = losses(full), losses(part)
    assert sorted(a) == sorted(b) == list(range(1, 61))
    assert [a[s] for s in range(31, 61)] == [b[s] for s in range(31, 61)]      # exact float equality
    assert events(part, "resumed")[-1]["tag"] == "global_step30"
    assert events(part, "finished")


@pytest.mark.multiproc
def test_resume_is_bitwise_dp2_zero2():
    """A DP=2 ZeRO-2 run stopped at step 30 and resumed (fresh processes) logs the uninterrupted losses."""
    assert dp_tp_runs()["codes"]["dp2_z2_part"] == {0: 75, 1: 75}
    pipe_runs()
    assert_bitwise_resume("dp2_z2_full", "dp2_z2_part")


@pytest.mark.multiproc
def test_resume_is_bitwise_pp2():
    assert pipe_runs()["codes"]["pp2_part"] == {0: 75, 1: 75}
    pipe_resume_runs()
    assert_bitwise_resume("pp2_full", "pp2_part")


@pytest.mark.multiproc
def test_keep_last_and_contents():
    dp_tp_runs()
    d = workdir() / "dp2_z2_full" / "checkpoints"
    assert ckpt.complete_tags(d) == ["global_step50", "global_step60"]         # keep_last=2
    assert (d / "latest").read_text() == "global_step60"
    meta = json.loads((d / "global_step60" / ckpt.META).read_text())
    assert (meta["step"], meta["consumed_samples"], meta["layout"]) == (60, 480, {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 2})
    assert meta["config"]["model"]["variant"] == "lev"
    assert {p.name for p in (d / "global_step60").glob("rng_rank*.pt")} == {"rng_rank00000.pt", "rng_rank00001.pt"}
    client = ckpt.safe_load(d / "global_step60" / "mp_rank_00_model_states.pt")
    assert client["consumed_samples"] == 480 and client["model"]["hidden_size"] == 64


@pytest.mark.multiproc
def test_fresh_start_into_old_checkpoints_is_refused():
    err = dp_tp_runs()["errors"]["resume_false"]
    assert set(err.values()) == {err[0]} and err[0].startswith("ConfigError: checkpoint.resume: false, but ")
    assert "already holds checkpoints (global_step10, global_step20)" in err[0]


def _launch(out, *extra):
    args = [sys.executable, "launchers/local.py", "-n", "2", "--grace", "10", "--", "-m", "leviathan_pretrain.train",
            "--config", CONFIG, *overrides("unused", f"train.out_dir={out}", "train.steps=1000",
                                          "train.eval_interval=0", "logging.log_interval=1", *extra)]
    return subprocess.Popen(args, cwd=REPO, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _stop(proc):
    if proc.poll() is None:             # the launcher kills every rank on a second interrupt
        proc.send_signal(signal.SIGINT)
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


@pytest.mark.multiproc
def test_crash_during_checkpoint_write_then_sigterm(tmp_path):
    """SIGKILL half-way through writing step 4's checkpoint: `latest` still names step 2, which loads; the
    next run resumes from it (same losses), and SIGTERM then ends it with a checkpoint and exit code 75."""
    out = tmp_path / "run"
    ck = out / "checkpoints"
    proc = _launch(out, "checkpoint.save_interval=2", "checkpoint.inject_kill_in_save_step=4")
    try:
        log, _ = proc.communicate(timeout=300)
    finally:
        _stop(proc)
    assert proc.returncode == 128 + signal.SIGKILL, log[-3000:]
    assert (ck / "latest").read_text() == "global_step2"
    assert not (ck / "global_step4" / ckpt.META).exists()
    with pytest.raises(Exception):      # the half-written file is unreadable ...
        torch.load(ck / "global_step4" / "mp_rank_00_model_states.pt", weights_only=True)
    ckpt.safe_load(ck / "global_step2" / "mp_rank_00_model_states.pt")       # ... the previous one loads
    first = losses(out)
    assert sorted(first) == [1, 2, 3, 4]

    proc = _launch(out, "checkpoint.save_interval=1000")
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "train_log.jsonl").exists() and max(losses(out), default=0) >= 6:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=240)
    finally:
        _stop(proc)
    assert proc.returncode == 75, log[-3000:]
    assert "removed incomplete checkpoint(s) global_step4" in log
    assert events(out, "resumed")[0]["tag"] == "global_step2"
    stopped = events(out, "stopped")[-1]
    assert stopped["reason"] == "signal"
    second = losses(out)
    assert [second[s] for s in (1, 2, 3, 4)] == [first[s] for s in (1, 2, 3, 4)]   # 3, 4 redone identically
    assert (ck / "latest").read_text() == f"global_step{stopped['step']}" and max(second) == stopped["step"]
    assert ckpt.complete_tags(ck) == ["global_step2", f"global_step{stopped['step']}"]
    assert not any(p.name.endswith(".tmp") for p in ck.iterdir())
