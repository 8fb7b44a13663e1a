"""The trainer end to end on CPU/gloo: parallel layouts reproduce the single-process loss trajectory,
non-finite steps are skipped and counted, divergence stops the run, and the CLI fails clearly."""

import math
import subprocess
import sys

import pytest
import torch

from leviathan_pretrain.rundir import host
from leviathan_pretrain.trainer.checkpoint import names as ckpt_names
from leviathan_pretrain.trainer.checkpoint.safe_io import safe_load
from tests.multiproc import REPO, base_env
from tests.workers.train_common import (
    CONFIG,
    SCHEDULE,
    dp_tp_runs,
    events,
    four_process_runs,
    losses,
    overrides,
    pipe_runs,
    records,
    single_process_runs,
    workdir,
)

TOL = 2e-4  # observed <= 1e-6: only the order of floating-point sums differs
GN_TOL = 1e-3  # relative, per step


def first20(name, key="loss"):
    recs = {r["step"]: r[key] for r in records(name) if key in r}
    return [recs[s] for s in range(1, 21)]


def assert_matches_and_falls(name, ref):
    got, want = first20(name), first20(ref)
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert diff <= TOL, f"{name} vs {ref}: max |loss difference| over 20 steps = {diff}\n{got}\n{want}"
    # the clipped global gradient norm too: a doubled replicated gradient or a norm counted over the wrong
    # group changes it at once, while AdamW's scale invariance can hide it in the losses
    gn, gn_ref = first20(name, "grad_norm"), first20(ref, "grad_norm")
    rel = max(abs(a - b) / b for a, b in zip(gn, gn_ref))
    assert rel <= GN_TOL, f"{name} vs {ref}: max relative grad-norm difference {rel}\n{gn}\n{gn_ref}"
    assert all(math.isfinite(x) for x in got)
    assert sum(got[-5:]) / 5 < sum(got[:5]) / 5 - 0.5, f"{name}: loss does not go down: {got}"


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["dp2_z0", "dp2_z1", "dp2_z2", "dp2_z2_full", "dp2_z3", "tp2"])
def test_dp_zero_and_tp_match_single_process(name):
    """DP=2 with ZeRO 0/1/2/3 and TP=2 (2 processes) follow the 1-process run (the PP = 1 model of
    model/assembly.py)."""
    single_process_runs()
    runs = dp_tp_runs()
    assert set(runs["codes"][name].values()) <= {0, 75}
    assert_matches_and_falls(name, "ref")
    # the run stopped at step 20 (train.exit_at_step) with a checkpoint; exit code 75 = "re-run to continue"
    if name != "dp2_z2_full":
        assert runs["codes"][name] == {0: 75, 1: 75}
        assert events(name, "stopped")[-1]["reason"] == "exit_at_step"


@pytest.mark.multiproc
def test_batch_sizes_must_fit_the_data_parallel_size():
    errors = dp_tp_runs()["errors"]["bad_batch"]
    assert errors == {
        r: "ConfigError: train.global_batch_size: 6 is not a multiple of train.micro_batch_size x "
        "data-parallel size = 2 x 2 = 4; set it to a multiple of 4 (e.g. 8) or change train.micro_batch_size or "
        "the number of ranks"
        for r in (0, 1)
    }


@pytest.mark.multiproc
@pytest.mark.parametrize("name, ref", [("pp2_full", "ref_pipe"), ("pp2_tied", "ref_pipe_tied")])
def test_pipeline_parallel_matches_single_process(name, ref):
    """PP=2 (DeepSpeed PipelineModule, 2 stages; TIED: embedding and head tied across stages with
    TiedLayerSpec) follows the same PipelineModule on one process (parallel.pipeline_engine=true)."""
    single_process_runs()
    pipe_runs()
    assert_matches_and_falls(name, ref)


@pytest.mark.multiproc
def test_pipeline_combined_with_tp_and_dp():
    """PP=2 x TP=2 and PP=2 x DP=2 (4 processes) follow the PP=2 run: the pipeline engine's grid and
    megatron-core's groups put the same ranks together."""
    single_process_runs()
    pipe_runs()
    four_process_runs()
    ref = losses("ref_pipe")
    for name in ("pp2_tp2", "pp2_dp2"):
        got = losses(name)
        assert sorted(got) == list(range(1, 7))
        assert max(abs(got[s] - ref[s]) for s in got) <= TOL, (name, got, ref)
        gn = {r["step"]: r["grad_norm"] for r in records(name) if "grad_norm" in r}
        gn_ref = {r["step"]: r["grad_norm"] for r in records("ref_pipe") if "grad_norm" in r}
        assert max(abs(gn[s] - gn_ref[s]) / gn_ref[s] for s in got) <= GN_TOL, (name, gn, gn_ref)


def geometry_at(name: str, step: int) -> dict:
    recs = [r for r in records(name) if r.get("step") == step and "geometry/input/cosine" in r]
    assert len(recs) == 1, f"{name}: {len(recs)} geometry records at step {step}"
    return {k: v for k, v in recs[0].items() if k.startswith("geometry/")}


@pytest.mark.multiproc
def test_geometry_at_init_is_read_the_same_at_every_layout():
    """The token vectors' geometry the trainer logs at step 0 (trainer/geometry_log.py, the model as initialised),
    read off the training model in place: TP 2 (LEV's rows partial over TP, the head's vocab-parallel rows), ZeRO 3
    (parameters gathered) and PP 2 (input rows on the first stage, head rows on the last; TIED's head its tied
    copy there) give the one-process values; LEV starts with its common mode, a N(0, 0.02^2) table without."""
    single_process_runs()
    dp_tp_runs()
    pipe_runs()
    keys = {f"geometry/{part}/{m}" for part in ("input", "head") for m in ("rms", "cosine", "mean_share", "eff_rank")}
    for name, ref in (("tp2", "ref"), ("dp2_z3", "ref"), ("ref_pipe", "ref"), ("pp2_full", "ref_pipe"),
                      ("pp2_tied", "ref_pipe_tied")):  # fmt: skip
        got, want = geometry_at(name, 0), geometry_at(ref, 0)
        assert set(got) == set(want) == keys, (name, sorted(got))
        bad = {k: (got[k], want[k]) for k in keys if abs(got[k] - want[k]) > 1e-5 * max(1.0, abs(want[k]))}
        assert not bad, f"{name} vs {ref}: {bad}"
    lev, tied = geometry_at("ref", 0), geometry_at("ref_pipe_tied", 0)
    assert lev["geometry/input/cosine"] > 0.5 and lev["geometry/input/mean_share"] > 0.5  # docs/lev.md
    assert abs(lev["geometry/head/cosine"]) < 0.01  # the untied head: a N(0, 0.02^2) table
    assert abs(tied["geometry/input/rms"] - 0.02) < 0.002 and abs(tied["geometry/input/cosine"]) < 0.01
    assert all(tied[f"geometry/input/{m}"] == tied[f"geometry/head/{m}"] for m in ("rms", "cosine", "eff_rank"))
    # every logging.geometry_interval steps (100 by default) and at the last step: the full run's last
    start, end = geometry_at("dp2_z2_full", 0), geometry_at("dp2_z2_full", SCHEDULE)
    assert end["geometry/input/cosine"] != start["geometry/input/cosine"]


@pytest.mark.multiproc
def test_non_finite_steps_are_skipped_and_counted():
    single_process_runs()
    recs = [r for r in records("nan_skip") if "loss" in r]
    assert [r["skipped"] for r in recs] == [False, False, True, True, False, False, False, False]
    assert [r["skipped_total"] for r in recs] == [0, 0, 1, 2, 2, 2, 2, 2]
    # a skipped step consumes no LR step: the schedule index is the number of updates applied so far
    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.trainer.schedule import lr_at

    cfg = load_config(CONFIG, overrides("nan_skip", "train.steps=8"))
    assert [r["lr"] for r in recs] == [lr_at(i, cfg.optim, 8) for i in (0, 1, 2, 2, 2, 3, 4, 5)]
    assert all(math.isnan(r["loss"]) for r in recs[2:4]) and all(math.isfinite(r["loss"]) for r in recs[4:])
    assert recs[2]["grad_norm"] is None
    # one rank's NaN (DP=2, ZeRO-1) skips the step on every rank
    recs = [r for r in records("nan_one_rank") if "loss" in r]
    assert [r["skipped"] for r in recs] == [False, False, True, False, False, False]
    assert math.isfinite(recs[-1]["loss"])


@pytest.mark.multiproc
def test_skipped_step_leaves_weights_untouched():
    """The skipped steps 3-4 (ZeRO 0 fp32: the explicit check) leave the weights bitwise as they were: the validation
    loss (every step, the same held-out batches) is identical after steps 2, 3 and 4 and moves after step 5. No
    checkpoint is saved while skipping (checkpoint.save_interval=1): the saves due at 3 and 4 wait for step 5."""
    single_process_runs()
    valid = {r["step"]: r["valid_loss"] for r in records("nan_skip") if "valid_loss" in r}
    assert valid[2] == valid[3] == valid[4] != valid[5]
    ck = workdir() / "nan_skip" / "checkpoints"
    assert [e["step"] for e in events("nan_skip", "save deferred")] == [3, 4]
    assert ckpt_names.complete_tags(ck)[:3] == ["global_step1", "global_step2", "global_step5"]
    first = safe_load(ck / "global_step5/mp_rank_00_model_states.pt")["module"]
    assert sum(torch.is_tensor(v) for v in first.values()) > 10


@pytest.mark.multiproc
def test_divergence_stops_without_saving(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "tests/workers/train_faults.py",
            "--config",
            CONFIG,
            *overrides(
                "unused",
                "train.steps=10",
                "train.eval_interval=0",
                "train.max_bad_steps=3",
                "parallel.zero_stage=0",
                "checkpoint.save_interval=1",
                "checkpoint.keep_last=9",
                f"train.out_dir={out}",
            ),
        ],
        cwd=REPO,
        env=base_env({"LEV_TEST_NAN_STEPS": "3,4,5"}),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stopped at step 5: 3 consecutive non-finite steps"), last
    # nothing saved while skipping (3, 4, 5); step 3 was the first measured with step 2's weights and it was not
    # healthy, so latest goes back to global_step1, the newest confirmed checkpoint; global_step2 stays on disk
    assert ckpt_names.complete_tags(out / "checkpoints") == ["global_step1", "global_step2"]
    assert (out / "checkpoints/latest").read_text() == "global_step1"
    assert "latest names global_step1" in last and "(global_step2, saved just before" in last


def test_lr_schedule_warmup_cosine_floor():
    from leviathan_pretrain.config import OptimConfig
    from leviathan_pretrain.trainer.schedule import lr_at

    o = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert [lr_at(s, o, 110) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])  # linear warmup
    assert lr_at(60, o, 110) == pytest.approx(0.55)  # cosine midpoint
    assert lr_at(110, o, 110) == pytest.approx(0.1) and lr_at(500, o, 110) == pytest.approx(0.1)  # floor
    assert all(lr_at(s, o, 110) >= lr_at(s + 1, o, 110) for s in range(9, 120))
    lin = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, decay_style="linear", decay_steps=50)
    assert lr_at(25, lin, 1000) == pytest.approx(0.5)


def test_stage0_optimizer_clips_and_skips_non_finite():
    """ZeRO 0 in fp32 (DeepSpeed hands grads straight to the optimizer): clip to the global norm, skip NaN."""
    from leviathan_pretrain.trainer.faults import AdamWSkipNonFinite

    w = torch.nn.Parameter(torch.ones(4))
    opt = AdamWSkipNonFinite([w], clip_grad=1.0, lr=0.1, foreach=False)
    w.grad = torch.full((4,), 5.0)  # norm 10
    opt.step()
    assert not opt.overflow and opt._global_grad_norm == pytest.approx(10.0)
    assert w.grad.norm().item() == pytest.approx(1.0, rel=1e-4) and (w.data < 1).all()
    before = w.data.clone()
    w.grad = torch.tensor([1.0, float("nan"), 0.0, 0.0])
    opt.step()
    assert opt.overflow and torch.equal(w.data, before) and w.grad is None
    assert opt.state[w]["step"].item() == 1  # the skipped step left Adam's state alone


def test_stop_conditions():
    """SIGUSR1/SIGTERM set the stop flag (agreed over ranks); exit_at_step; exit_after_minutes."""
    import os
    import signal
    import time

    import torch.distributed as dist

    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.parallel.ports import free_port
    from leviathan_pretrain.trainer.faults import StopSignals, stop_requested

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        cfg = load_config(CONFIG, ["train.exit_at_step=5"])
        sig = StopSignals().install()
        try:
            now = time.monotonic()
            assert stop_requested(cfg.train, sig, 4, now, torch.device("cpu")) is None
            assert stop_requested(cfg.train, sig, 5, now, torch.device("cpu")) == "exit_at_step"
            os.kill(os.getpid(), signal.SIGUSR1)
            assert (
                sig.received == signal.SIGUSR1
                and stop_requested(cfg.train, sig, 1, now, torch.device("cpu")) == "signal"
            )
        finally:
            sig.uninstall()
        cfg = load_config(CONFIG, ["train.exit_after_minutes=0.5"])
        assert stop_requested(cfg.train, StopSignals(), 1, time.monotonic() - 29, torch.device("cpu")) is None
        assert (
            stop_requested(cfg.train, StopSignals(), 1, time.monotonic() - 31, torch.device("cpu"))
            == "exit_after_minutes"
        )
    finally:
        dist.destroy_process_group()


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=timeout
    )


def test_help_everywhere():
    for cmd in (
        ["-m", "leviathan_pretrain.train"],
        ["launchers/local.py"],
        ["-m", "leviathan_pretrain.demo"],
        ["benchmarks/bench_train.py"],
    ):
        proc = run_cli(*cmd, "--help")
        assert proc.returncode == 0 and "usage:" in proc.stdout, (cmd, proc.stderr)
    assert "exit codes" in run_cli("-m", "leviathan_pretrain.train", "--help").stdout


def test_bad_config_is_one_line_naming_the_key():
    proc = run_cli("-m", "leviathan_pretrain.train", "--config", CONFIG, "train.stepz=3")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "train.stepz" in proc.stderr


@pytest.mark.multiproc
def test_missing_shard_fails_before_training(tmp_path):
    missing = str(tmp_path / "nope")
    proc = run_cli(
        "-m",
        "leviathan_pretrain.train",
        "--config",
        CONFIG,
        *overrides("unused", f"data.prefixes=[{missing}]", f"train.out_dir={tmp_path / 'o'}"),
        timeout=240,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == f"error: data shard {missing}: {missing}.idx does not exist"
    assert not (tmp_path / "o" / "train_log.jsonl").exists()


@pytest.mark.multiproc
def test_real_shards_tp2_with_held_out_set(tmp_path, minipile_shards, tokenizer_model):
    """data_prep's real shards (8k SentencePiece, counts + manifest) through the launcher at TP=2, with the
    held-out set as data.valid_prefixes; the tokenizer checksum lands in the checkpoint."""
    import hashlib
    import json

    out = tmp_path / "run"
    over = [o for o in overrides("unused") if not o.startswith(("data.prefixes", "model.vocab_size", "data.split"))]
    proc = subprocess.run(
        [
            sys.executable,
            "launchers/local.py",
            "-n",
            "2",
            "--",
            "-m",
            "leviathan_pretrain.train",
            "--config",
            CONFIG,
            *over,
            "model.vocab_size=8000",
            f"data.prefixes=[{minipile_shards['train']}]",
            f"data.valid_prefixes=[{minipile_shards['val']}]",
            f"data.tokenizer={tokenizer_model}",
            "parallel.tensor_parallel=2",
            "train.steps=8",
            "train.eval_interval=4",
            "train.eval_iters=1",
            f"train.out_dir={out}",
        ],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    loss = [r["loss"] for r in recs if "loss" in r]
    assert len(loss) == 8 and all(math.isfinite(x) for x in loss) and loss[-1] < loss[0] - 0.3
    assert [r["step"] for r in recs if "valid_loss" in r] == [4, 8]
    assert [r["machine"] for r in recs if r.get("event") == "layout"] == [host.describe("cpu")]  # where it trained
    meta = json.loads((out / "checkpoints/global_step8/leviathan.json").read_text())
    assert meta["tokenizer_sha256"] == hashlib.sha256(tokenizer_model.read_bytes()).hexdigest()
