"""Checkpoints: bitwise resume (DP=2 ZeRO-2, PP=2), keep-last-K, atomic ``latest`` under a crash during a
write, SIGTERM -> checkpoint + exit 75, weights-only loading, RNG state round trip."""

import json
import pickle
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from leviathan_pretrain.trainer.checkpoint import names as ckpt_names
from leviathan_pretrain.trainer.checkpoint import safe_io
from leviathan_pretrain.trainer.checkpoint import store as ckpt
from leviathan_pretrain.trainer.state import TrainState
from tests.multiproc import REPO, base_env
from tests.workers.train_common import (
    CONFIG,
    PART,
    RESHARD_STOP,
    SCHEDULE,
    dp_tp_runs,
    events,
    losses,
    overrides,
    pipe_resume_runs,
    pipe_runs,
    records,
    reshard_runs,
    workdir,
)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # would create the marker file if unpickled


def test_loading_refuses_arbitrary_objects(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.pt"
    with open(bad, "wb") as f:
        pickle.dump({"module": _Payload(str(marker))}, f)
    torch.save({"w": torch.ones(2), "state": {"step": 3}}, tmp_path / "good.pt")
    with pytest.raises(ckpt_names.CheckpointError, match="evil.pt: refused by weights_only loading"):
        safe_io.safe_load(bad)
    assert not marker.exists()
    assert safe_io.safe_load(tmp_path / "good.pt")["state"] == {"step": 3}


def test_rng_state_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    torch.save(TrainState.rng_state_dict(), tmp_path / "rng.pt")
    before = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    TrainState.load_rng_state_dict(safe_io.safe_load(tmp_path / "rng.pt"))
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == before


def test_latest_prune_and_incomplete(tmp_path):
    for s in (10, 20, 30, 40):
        d = tmp_path / ckpt_names.tag_for(s)
        d.mkdir()
        (d / "x.pt").write_bytes(b"x")
        (d / (ckpt_names.META if s != 40 else ckpt_names.SAVING)).write_text("{}")  # 40: an interrupted save of ours
    (tmp_path / "latest").write_text("global_step30")
    assert ckpt_names.read_latest(tmp_path) == "global_step30"
    assert ckpt.prune(tmp_path, keep_last=2) == ["global_step10"]
    assert ckpt_names.complete_tags(tmp_path) == ["global_step20", "global_step30"]
    assert ckpt.remove_incomplete(tmp_path) == ["global_step40"] and not (tmp_path / "global_step40").exists()
    (tmp_path / "latest").write_text("global_step40")
    with pytest.raises(ckpt_names.CheckpointError, match="not a complete checkpoint"):
        ckpt_names.read_latest(tmp_path)


def test_cleanup_never_touches_what_is_not_ours(tmp_path):
    """Another run's DeepSpeed checkpoint (global_step* without our files) and a user's *.tmp survive the
    start-up clean-up, and the trainer refuses to start there instead of mixing checkpoints."""
    foreign = tmp_path / "global_step7"
    foreign.mkdir()
    (foreign / "mp_rank_00_model_states.pt").write_bytes(b"their weights")
    (tmp_path / "notes.tmp").write_text("mine")
    ours = tmp_path / ".global_step9.saving-123"  # our crash between mkdir and rename
    ours.mkdir()
    (ours / ckpt_names.SAVING).write_text("{}")
    (tmp_path / "latest.tmp4242").write_text("global_step9")  # write_bytes_atomic's temporary name
    assert ckpt.remove_incomplete(tmp_path) == []
    assert (foreign / "mp_rank_00_model_states.pt").read_bytes() == b"their weights"
    assert (tmp_path / "notes.tmp").read_text() == "mine"
    assert not ours.exists() and not (tmp_path / "latest.tmp4242").exists()
    assert ckpt.foreign_tags(tmp_path) == ["global_step7"]
    with pytest.raises(ckpt_names.CheckpointError, match=r"global_step7: no leviathan\.json or leviathan\.saving"):
        ckpt.check_no_foreign(tmp_path)  # the trainer's first check (resume or not), before choosing a checkpoint
    assert (foreign / "mp_rank_00_model_states.pt").exists()
    with pytest.raises(ckpt_names.CheckpointError, match="not written by leviathan_pretrain"):
        ckpt._begin(tmp_path, "global_step7", 7)  # never replaced by a save either
    assert (foreign / "mp_rank_00_model_states.pt").exists()


def assert_bitwise_resume(full, part):
    a, b = losses(full), losses(part)
    assert sorted(a) == sorted(b) == list(range(1, SCHEDULE + 1))
    after = range(PART + 1, SCHEDULE + 1)
    assert [a[s] for s in after] == [b[s] for s in after]  # exact float equality
    assert events(part, "resumed")[-1]["tag"] == f"global_step{PART}"
    assert events(part, "finished")


@pytest.mark.multiproc
def test_resume_is_bitwise_dp2_zero2():
    """A DP=2 ZeRO-2 run stopped at step 20 of 40 and resumed (fresh processes) logs the uninterrupted losses."""
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
    assert ckpt_names.complete_tags(d) == ["global_step30", "global_step40"]  # keep_last=2
    assert (d / "latest").read_text() == "global_step40"
    meta = json.loads((d / "global_step40" / ckpt_names.META).read_text())
    assert (meta["step"], meta["consumed_samples"], meta["layout"]) == (
        40,
        320,
        {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 2},
    )
    assert meta["config"]["model"]["variant"] == "lev"
    assert {p.name for p in (d / "global_step40").glob("rng_rank*.pt")} == {"rng_rank00000.pt", "rng_rank00001.pt"}
    assert (meta["skipped_steps"], meta["tag"]) == (0, "global_step40")
    assert "module" in safe_io.safe_load(d / "global_step40" / "mp_rank_00_model_states.pt")  # DeepSpeed's own


@pytest.mark.multiproc
def test_fresh_start_into_old_checkpoints_is_refused():
    err = dp_tp_runs()["errors"]["resume_false"]
    assert set(err.values()) == {err[0]} and err[0].startswith("ConfigError: checkpoint.resume: false, but ")
    assert "already holds checkpoints (global_step10, global_step20)" in err[0]


def _launch(out, *extra, env=None):
    args = [
        sys.executable,
        "launchers/local.py",
        "-n",
        "2",
        "--grace",
        "10",
        "--",
        "tests/workers/train_faults.py",
        "--config",
        CONFIG,
        *overrides(
            "unused",
            f"train.out_dir={out}",
            "train.steps=1000",
            "train.eval_interval=0",
            "logging.log_interval=1",
            *extra,
        ),
    ]
    return subprocess.Popen(
        args,
        cwd=REPO,
        env=base_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _stop(proc):
    if proc.poll() is None:  # the launcher kills every rank on a second interrupt
        proc.send_signal(signal.SIGINT)
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


@pytest.mark.multiproc
@pytest.mark.parametrize("prefetch", ["false", "true"])
def test_crash_during_checkpoint_write_then_sigterm(tmp_path, prefetch):
    """SIGKILL half-way through writing step 4's checkpoint: `latest` still names step 2, which loads; the
    next run resumes from it (same losses), and SIGTERM then ends it with a checkpoint and exit code 75. With the
    next batch prefetched on its thread (data.prefetch, the CUDA default) and without (the CPU's)."""
    out = tmp_path / "run"
    ck = out / "checkpoints"
    pf = f"data.prefetch={prefetch}"
    proc = _launch(out, "checkpoint.save_interval=2", pf, env={"LEV_TEST_KILL_IN_SAVE_STEP": 4})
    try:
        log, _ = proc.communicate(timeout=300)
    finally:
        _stop(proc)
    assert proc.returncode == 128 + signal.SIGKILL, log[-3000:]
    assert (ck / "latest").read_text() == "global_step2"
    assert not (ck / "global_step4" / ckpt_names.META).exists()
    with pytest.raises(RuntimeError):  # the half-written file is unreadable (torch's zip reader) ...
        torch.load(ck / "global_step4" / "mp_rank_00_model_states.pt", weights_only=True)
    safe_io.safe_load(ck / "global_step2" / "mp_rank_00_model_states.pt")  # ... the previous one loads
    first = losses(out)
    assert sorted(first) == [1, 2, 3, 4]

    proc = _launch(out, "checkpoint.save_interval=1000", pf)
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
    assert "removed interrupted checkpoint save(s) global_step4" in log
    assert events(out, "resumed")[0]["tag"] == "global_step2"
    stopped = events(out, "stopped")[-1]
    assert stopped["reason"] == "signal"
    second = losses(out)
    assert [second[s] for s in (1, 2, 3, 4)] == [first[s] for s in (1, 2, 3, 4)]  # 3, 4 redone identically
    assert (ck / "latest").read_text() == f"global_step{stopped['step']}" and max(second) == stopped["step"]
    assert ckpt_names.complete_tags(ck) == ["global_step2", f"global_step{stopped['step']}"]
    assert not any(p.name.endswith(".tmp") for p in ck.iterdir())


@pytest.mark.multiproc
def test_every_rank_fsyncs_its_own_checkpoint_files(tmp_path):
    """Durability on parallel filesystems: each rank flushes the files it wrote (rank 0 cannot flush another
    node's pages), before the barrier after which rank 0 commits leviathan.json and latest."""
    out, log = tmp_path / "run", tmp_path / "fsync"
    log.mkdir()
    proc = _launch(
        out, "train.steps=2", "checkpoint.save_interval=2", "parallel.zero_stage=1", env={"LEV_TEST_FSYNC_LOG": log}
    )
    try:
        text, _ = proc.communicate(timeout=300)
    finally:
        _stop(proc)
    assert proc.returncode == 0, text[-3000:]
    tag = out / "checkpoints" / "global_step2"
    synced = {
        r: {Path(p).name for p in (log / f"fsync-rank{r}.txt").read_text().split() if Path(p).parent == tag}
        for r in (0, 1)
    }
    assert {"zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_rank00001.pt"} <= synced[1]
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt", "rng_rank00000.pt"} <= synced[0]
    assert not synced[0] & {"zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_rank00001.pt"}  # no walking all
    written = {p.name for p in tag.iterdir() if p.is_file()} - {ckpt_names.META}
    assert written <= synced[0] | synced[1], written - synced[0] - synced[1]


def two_ranks_with_a_fault(tmp_path, extra: list[str], env: dict, grace: float):
    """tests/workers/train_faults.py on two ranks (DP 2) with the fault ``env`` picks; the ranks' results, whatever
    their exit codes (``grace``: how long the other rank may live on after one fails)."""
    from tests.multiproc import run_ranks

    args = overrides("unused", f"train.out_dir={tmp_path / 'run'}", "train.eval_interval=0", *extra)
    return run_ranks(
        ["tests/workers/train_faults.py", "--config", CONFIG, *args],
        nprocs=2,
        timeout=300,
        check=False,
        grace=grace,
        env=env,
    )


@pytest.mark.multiproc
@pytest.mark.parametrize("where", ["model", "data"])
def test_an_error_on_one_rank_ends_every_rank_promptly(tmp_path, where):
    """A bad token id on rank 1 of 2 (DP=2) while rank 0 waits in the gradient all-reduce: both exit non-zero
    by themselves within seconds (the collective timeout is 10 minutes), the error printed once. ``model``: put
    into the prepared batch, raised by the model; ``data``: in the samples themselves, raised by the data loader's
    host check while building step 3's batch, which data.prefetch (on here) does on its thread during step 2: raised
    at step 3 all the same (rank 0 lost its peer in step 3)."""
    t0 = time.monotonic()
    fault = "TOKEN" if where == "model" else "SAMPLE"
    res = two_ranks_with_a_fault(
        tmp_path,
        ["train.steps=6", "parallel.zero_stage=1", "data.prefetch=true"],
        {f"LEV_TEST_BAD_{fault}_RANK": 1, f"LEV_TEST_BAD_{fault}_STEP": 3},
        grace=90,
    )
    elapsed = time.monotonic() - t0
    assert res[1].returncode == 2, res[1].output[-3000:]  # bad data, by itself
    assert res[0].returncode == 1, res[0].output[-3000:]  # lost its peer, by itself (not killed)
    assert elapsed < 80, elapsed  # start-up ~20 s; no timeout waited out
    assert "[rank 1] error: " in res[1].output and "token id" in res[1].output
    assert sum("token id 1000000" in r.output for r in res) == 1  # printed once
    lost = re.search(
        r"\[rank 0 on \S+\] lost a peer in step 3: a peer's connection closed: .*\(rank 1 on ",
        res[0].output,
    )
    assert lost and "Traceback" not in res[0].output, res[0].output[-3000:]  # one line naming the rank it lost


@pytest.mark.multiproc
def test_a_stalled_rank_ends_its_peer_after_the_step_timeout(tmp_path):
    """Rank 1 of 2 stops (SIGSTOP) just before a step's stop vote, the one collective on the world group, whose
    timeout used to be parallel.init_timeout_minutes (an hour by default): rank 0 waits there no longer than
    parallel.timeout_minutes (set to 0.1 here, 6 s; start-up keeps its own 2 minutes), then exits 76 naming rank
    1 as not answering. The stopped rank is left to the launcher (here: killed by run_ranks)."""
    res = two_ranks_with_a_fault(
        tmp_path,
        ["train.steps=10", "parallel.timeout_minutes=0.1", "parallel.init_timeout_minutes=2"],
        {"LEV_TEST_STALL_RANK": 1, "LEV_TEST_STALL_STEP": 3},
        grace=5,
    )
    out = res[0].output
    assert res[0].returncode == 76, out[-3000:]
    line = re.search(
        r"\[rank 0 on (\S+)\] lost a peer in step 3: a collective timed out: not answering: rank 1 on (\S+)", out
    )
    assert line and line.group(1) == line.group(2), out[-3000:]  # both ranks on this host
    waited = re.search(r"Timed out waiting (\d+)ms", out)
    assert waited and int(waited.group(1)) == 6000, out[-3000:]  # the step timeout, not the start-up one
    assert res[1].returncode != 0  # killed by run_ranks once rank 0 had exited: it never woke up


@pytest.mark.multiproc
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_resume_on_fewer_nodes_continues_exactly(zero):
    """Train DP=2, stop at step 20, resume on one process (DP=1): ZeRO 0 loads as it is, ZeRO 1-3 through
    DeepSpeed's universal checkpoint. The consumed-sample position carries over, and losses and gradient norms
    continue as the uninterrupted DP=2 run's (which equal DP=1's up to summation order)."""
    name = f"dp2_z{zero}"
    runs = reshard_runs()
    assert runs["codes"][name] == {0: 75}, runs["outputs"][0][-3000:]
    resumed = events(name, "resumed")[-1]
    assert (resumed["tag"], resumed["consumed_samples"]) == ("global_step20", 160)
    ref = {r["step"]: r for r in records("dp2_z2_full") if "loss" in r}
    got = {r["step"]: r for r in records(name) if "loss" in r}
    assert sorted(got) == list(range(1, RESHARD_STOP + 1))
    for s in range(21, RESHARD_STOP + 1):
        assert abs(got[s]["loss"] - ref[s]["loss"]) <= 2e-4, (s, got[s], ref[s])
        assert abs(got[s]["grad_norm"] - ref[s]["grad_norm"]) <= 1e-3 * ref[s]["grad_norm"], (s, got[s], ref[s])
        assert got[s]["consumed_samples"] == ref[s]["consumed_samples"] == 8 * s
    d = workdir() / name / "checkpoints"
    meta = json.loads((d / f"global_step{RESHARD_STOP}" / ckpt_names.META).read_text())
    assert (meta["consumed_samples"], meta["layout"]["dp"]) == (8 * RESHARD_STOP, 1)
    assert (d / "global_step20" / "universal" / "CONVERTED").is_file() == (zero > 0)


@pytest.mark.multiproc
def test_a_different_tensor_parallel_size_is_refused_naming_both_layouts():
    err = reshard_runs()["errors"]["tp2"][0]
    assert (
        err.startswith("CheckpointError: ")
        and "written with TP=2 PP=1 DP=1 ZeRO 1, this run has TP=1 PP=1 "
        "DP=1 ZeRO 1; changing tensor or pipeline parallelism on resume is not supported"
        in err
    ), err


def record(fields: dict):
    """A checkpoint record at step 0 with ``fields``."""
    from leviathan_pretrain.trainer.checkpoint.record import CheckpointRecord

    return CheckpointRecord.from_json({"step": 0, "consumed_samples": 0, **fields}, "leviathan.json")


def test_a_checkpoint_of_another_model_layout_is_refused(tmp_path):
    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.model.assembly import LAYOUT_VERSION
    from leviathan_pretrain.parallel.groups import ParallelDims

    cfg = load_config(CONFIG, [])
    dims = ParallelDims(rank=0, world=1, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0, gas=1)
    meta = record({"config": {"model": {}}, "layout": {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 1}})
    with pytest.raises(ckpt_names.CheckpointError, match=f"model layout 1 .* this code reads layout {LAYOUT_VERSION}"):
        ckpt.check_compatible(cfg, meta, None, tmp_path, dims)


def test_speed_only_model_keys_may_differ_on_resume_and_older_checkpoints_resume(tmp_path):
    """``model.compile`` / ``model.activation_fusion`` change speed, not the weights: a checkpoint written before
    the keys existed, or with other values, resumes; a key that shapes the weights is still refused."""
    from leviathan_pretrain.config import load_config, to_dict
    from leviathan_pretrain.model.assembly import LAYOUT_VERSION
    from leviathan_pretrain.parallel.groups import ParallelDims

    cfg = load_config(CONFIG, [])
    dims = ParallelDims(rank=0, world=1, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0, gas=1)
    layout = {"tp": 1, "pp": 1, "dp": 1, "zero_stage": cfg.parallel.zero_stage}

    def meta(**model):
        return record({"model_layout": LAYOUT_VERSION, "config": {"model": model}, "layout": layout})

    older = {k: v for k, v in to_dict(cfg.model).items() if k not in ("compile", "activation_fusion")}
    ckpt.check_compatible(cfg, meta(**older), None, tmp_path, dims)
    ckpt.check_compatible(cfg, meta(**older, compile=True, activation_fusion=True), None, tmp_path, dims)
    # the loss's implementation and chunk change how it is computed, not the model: a run written with the fused
    # loss (the default before model.loss_impl became auto) resumes under auto, liger or another chunk
    assert cfg.model.loss_impl == "auto"
    ckpt.check_compatible(cfg, meta(**{**older, "loss_impl": "fused", "loss_chunk_tokens": 2048}), None, tmp_path, dims)
    with pytest.raises(ckpt_names.CheckpointError, match="written for model.hidden_size=.*the config says"):
        ckpt.check_compatible(cfg, meta(**{**older, "hidden_size": cfg.model.hidden_size * 2}), None, tmp_path, dims)


def test_layout_rules_without_reshard():
    from leviathan_pretrain.trainer.checkpoint.record import ParallelLayout
    from leviathan_pretrain.trainer.checkpoint.reshard import check_layout

    saved = ParallelLayout(tp=1, pp=2, dp=4, zero_stage=1)
    check_layout(saved, 1, 2, 2, 1, True, "ck")  # fewer nodes: fine
    with pytest.raises(ckpt_names.CheckpointError, match="checkpoint.reshard=true"):
        check_layout(saved, 1, 2, 2, 1, False, "ck")
    with pytest.raises(ckpt_names.CheckpointError, match="parallel.zero_stage=1"):
        check_layout(saved, 1, 2, 4, 0, True, "ck")
    with pytest.raises(ckpt_names.CheckpointError, match="pipeline_parallel=2"):
        check_layout(saved, 1, 1, 8, 1, True, "ck")
