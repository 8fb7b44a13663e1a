"""What protects a run's checkpoints (docs/training.md), replayed as a user and a cluster would: ``latest`` missing
or empty, a truncated checkpoint file (refused naming it; ``checkpoint.fallback=true`` resumes from the older one), a
run diverging without a NaN (``optim.lr=1e6``), two trainings on one directory. Each on the tiny model, 2 ranks (DP 2,
ZeRO 1), checkpoints at steps 2, 4 and 6 before the trial; every resumed run's losses equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from leviathan_pretrain.trainer.checkpoint import names as ckpt_names
from tests.multiproc import REPO, base_env
from tests.workers.train_common import CONFIG, events, launch, losses, overrides, records, spec, workdir

BASE = ("train.steps=8", "train.eval_interval=0", "parallel.zero_stage=1", "checkpoint.save_interval=2")
BASE += ("checkpoint.keep_last=3", "logging.log_interval=1")
TRIALS = ("missing", "empty", "truncated", "truncated_fallback", "diverge")


def _copy_base(name: str) -> str:
    src, dst = workdir() / "safety_base", workdir() / f"safety_{name}"
    shutil.copytree(src, dst)
    return f"safety_{name}"


@pytest.fixture(scope="module")
def trials():
    """One launch: the run stopped at step 6 and the uninterrupted one; then the copies, each with its fault, all
    resumed in a second launch (every rank raises the same error where one is expected)."""
    first = launch(
        "safety_first", [spec("safety_base", *BASE, "train.exit_at_step=6"), spec("safety_ref", *BASE)], nprocs=2
    )
    assert first["codes"]["safety_base"] == {0: 75, 1: 75} and first["codes"]["safety_ref"] == {0: 0, 1: 0}
    ck = workdir() / "safety_base" / "checkpoints"
    assert ckpt_names.complete_tags(ck) == ["global_step2", "global_step4", "global_step6"]
    names = {t: _copy_base(t) for t in TRIALS}
    (workdir() / names["missing"] / "checkpoints" / "latest").unlink()
    (workdir() / names["empty"] / "checkpoints" / "latest").write_text("")
    for t in ("truncated", "truncated_fallback"):
        model = workdir() / names[t] / "checkpoints" / "global_step6" / "mp_rank_00_model_states.pt"
        os.truncate(model, model.stat().st_size // 2)
    specs = [spec(names[t], *BASE) for t in ("missing", "empty", "truncated")]
    specs.append(spec(names["truncated_fallback"], *BASE, "checkpoint.fallback=true"))
    spike = ("train.steps=12", "train.spike_window=3", "train.spike_patience=2")
    specs.append({**spec("safety_spike", *BASE, *spike), "spike_steps": [7, 8, 9], "spike_factor": 10})
    specs.append({**spec("safety_nan_last", *BASE), "nan_steps": [8]})  # the last step's loss NaN
    specs.append(spec(names["diverge"], *BASE, "train.steps=20", "optim.lr=1e6"))  # last: ends the launch's use
    second = launch("safety_second", specs, nprocs=2)
    return {"names": names, "first": first, "second": second}


def _ck(name: str):
    return workdir() / name / "checkpoints"


@pytest.mark.multiproc
@pytest.mark.parametrize("fault", ["missing", "empty"])
def test_a_lost_latest_resumes_from_the_newest_complete_checkpoint(trials, fault):
    """``latest`` deleted or emptied beside complete checkpoints: the start resumes from global_step6 and says so in
    one line; before, it started again from step 1 and wrote over global_step4 and global_step6."""
    name = trials["names"][fault]
    assert trials["second"]["codes"][name] == {0: 0, 1: 0}
    resumed = events(name, "resumed")
    assert [r["tag"] for r in resumed] == ["global_step6"]
    word = "missing" if fault == "missing" else "empty"
    assert resumed[0]["note"] == (
        f"{_ck(name) / 'latest'} is {word}; resuming from the newest complete checkpoint global_step6"
    )
    out = trials["second"]["outputs"][0]
    assert sum(f"{_ck(name) / 'latest'} is {word}" in line for line in out.splitlines()) == 1
    ref, got = losses("safety_ref"), losses(name)
    assert [got[s] for s in (7, 8)] == [ref[s] for s in (7, 8)]  # exact: resumed, not restarted
    assert (_ck(name) / "latest").read_text() == "global_step8"
    assert ckpt_names.complete_tags(_ck(name)) == ["global_step4", "global_step6", "global_step8"]


@pytest.mark.multiproc
def test_a_truncated_checkpoint_is_refused_naming_the_file(trials):
    """Half of global_step6's model file cut off: every rank stops with one line naming the file, the sizes, the
    older checkpoint and the key that resumes from it; nothing on disk changed."""
    name = trials["names"]["truncated"]
    errors = trials["second"]["errors"][name]
    assert set(errors.values()) == {errors[0]}
    model = _ck(name) / "global_step6" / "mp_rank_00_model_states.pt"
    assert errors[0].startswith(f"CheckpointError: checkpoint global_step6 is unusable: {model}: ")
    assert "the file was truncated or replaced" in errors[0] and "\n" not in errors[0]
    assert "re-run with checkpoint.fallback=true" in errors[0] and "checkpoint.resume_from=global_step4" in errors[0]
    assert ckpt_names.complete_tags(_ck(name)) == ["global_step2", "global_step4", "global_step6"]
    assert (_ck(name) / "latest").read_text() == "global_step6"


@pytest.mark.multiproc
def test_fallback_resumes_from_the_older_checkpoint_and_keeps_the_bad_one(trials):
    name = trials["names"]["truncated_fallback"]
    assert trials["second"]["codes"][name] == {0: 0, 1: 0}
    resumed = events(name, "resumed")
    assert [r["tag"] for r in resumed] == ["global_step4"]
    assert resumed[0]["note"].startswith("checkpoint.fallback: global_step6 is unusable (")
    aside = [p for p in _ck(name).iterdir() if p.name.startswith("unusable-global_step6-")]
    assert len(aside) == 1 and (aside[0] / "global_step6" / ckpt_names.META).is_file()  # moved, not deleted
    ref, got = losses("safety_ref"), losses(name)
    assert [got[s] for s in (5, 6, 7, 8)] == [ref[s] for s in (5, 6, 7, 8)]


@pytest.mark.multiproc
def test_a_loss_spike_stops_the_run_and_keeps_the_checkpoint_before_it(trials):
    """The loss times 10 from step 7 (finite: nothing is skipped; a 3-step window, patience 2): the guard stops at
    step 8 (exit 3 on every rank) naming the spike and its training samples. global_step6 was saved just before the
    first spiking step, so no healthy step confirmed it: ``latest`` goes back to global_step4 and 6 is kept, unnamed."""
    errors = trials["second"]["errors"]["safety_spike"]
    assert set(errors.values()) == {errors[0]}, errors
    msg = errors[0]
    assert msg.startswith(
        "Diverged: stopped at step 8: a loss spike for 2 steps (train.spike_patience=2); step 8: loss "
    )
    assert (
        "above train.spike_factor=2 x its running mean" in msg
        and "unhealthy since step 7 (training samples 48..63)" in msg
    )
    ck = _ck("safety_spike")
    assert (ck / "latest").read_text() == "global_step4" and "latest names global_step4" in msg
    assert ckpt_names.complete_tags(ck) == [
        "global_step2",
        "global_step4",
        "global_step6",
    ]  # nothing pruned, nothing after
    assert "(global_step6, saved just before the first unhealthy step, is kept but not named)" in msg


@pytest.mark.multiproc
def test_a_non_finite_last_step_never_reports_finished(trials):
    """The last step skipped as non-finite (one NaN, below train.max_bad_steps): before, the run saved it, reported
    ``finished`` and exited 0; now it stops with exit 3 (Diverged on every rank), nothing saved at step 8."""
    errors = trials["second"]["errors"]["safety_nan_last"]
    assert set(errors.values()) == {errors[0]}, errors
    assert errors[0].startswith("Diverged: stopped at step 8: the last step is not finite (loss=nan")
    assert "latest names global_step6" in errors[0]
    assert not events("safety_nan_last", "finished")
    ck = _ck("safety_nan_last")
    assert (ck / "latest").read_text() == "global_step6" and "global_step8" not in ckpt_names.complete_tags(ck)


@pytest.mark.multiproc
def test_a_divergence_without_nan_keeps_the_last_good_checkpoint(trials):
    """``optim.lr=1e6`` resumed from step 6: the weights blow up (finite) and the following steps are skipped as
    non-finite. Before: checkpoints saved during the skipped steps, the good ones pruned, ``latest`` naming the broken
    one. Now: no save while skipping, the guard stops with exit 3 (Diverged on every rank), ``latest`` names the newest
    checkpoint a healthy step confirmed, and every checkpoint before the trouble is still there."""
    name = trials["names"]["diverge"]
    errors = trials["second"]["errors"][name]
    assert set(errors.values()) == {errors[0]} and errors[0].startswith("Diverged: stopped at step ")
    latest = (_ck(name) / "latest").read_text()
    assert latest == "global_step6" and f"latest names {latest}" in errors[0]
    tags = ckpt_names.complete_tags(_ck(name))
    assert {"global_step4", "global_step6"} <= set(tags)
    last_good = max(r["step"] for r in events(name, "checkpoint"))
    skipped = [r["step"] for r in records(name) if r.get("skipped")]
    assert skipped and last_good < skipped[0]  # nothing saved once steps were being skipped
    assert all(ckpt_names.step_of(t) <= last_good for t in tags)
    assert events(name, "save deferred")  # saves that fell due while skipping waited, and never came


def _launch(out, *extra):
    args = [sys.executable, "launchers/local.py", "-n", "2", "--grace", "10", "--", "tests/workers/train_faults.py"]
    args += ["--config", CONFIG, *overrides("unused", f"train.out_dir={out}", *BASE, *extra)]
    return subprocess.Popen(
        args,
        cwd=REPO,
        env=base_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait(proc, timeout):
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.multiproc
def test_a_second_training_on_the_same_directory_is_refused(tmp_path):
    """A user's second submission (or a stale SLURM attempt) while a run is training: the second stops at once with
    one line naming the holder (host, pid), touching nothing; the first finishes untouched. Started together: exactly
    one trains. Before: no lock; the second's start-up deleted the first's save in progress."""
    out = tmp_path / "run"
    first = _launch(out, "train.steps=400", "checkpoint.save_interval=5")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "train_log.jsonl").exists():
            time.sleep(0.2)
        while time.monotonic() < deadline and max(losses_at(out), default=0) < 3:
            time.sleep(0.2)
        holder = (out / "leviathan.lock").read_text()
        t0 = time.monotonic()
        second = _wait(_launch(out, "train.steps=400", "checkpoint.save_interval=5"), 120)
        assert time.monotonic() - t0 < 60
        lines = [ln for ln in second.splitlines() if "this run directory is in use by" in ln]
        assert len(lines) == 2, second[-3000:]  # one per rank
        pid = json.loads(holder)["pid"]
        assert f"{out / 'leviathan.lock'}: this run directory is in use by host " in lines[0]
        assert f" pid {pid}" in lines[0] and "its process is alive on this host" in lines[0]
        assert "Traceback" not in second
    finally:
        first.send_signal(signal.SIGTERM)  # the launcher forwards it: the first stops with a checkpoint
        log = _wait(first, 180)
    assert "stopped reason=signal" in log or "finished" in log, log[-3000:]
    assert not (out / "leviathan.lock").exists()  # released at the end
    assert (out / "checkpoints" / "latest").read_text() in ckpt_names.complete_tags(out / "checkpoints")

    # started together: one trains, the other is refused at once
    out2 = tmp_path / "together"
    procs = [_launch(out2, "train.steps=400"), _launch(out2, "train.steps=400")]
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.2)
        loser = next(p for p in procs if p.poll() is not None)
        winner = procs[1 - procs.index(loser)]
        assert loser.returncode == 2 and winner.poll() is None
        assert "this run directory is in use by" in loser.communicate()[0]
        while time.monotonic() < deadline and max(losses_at(out2), default=0) < 3:
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        logs = [_wait(p, 180) for p in procs]
    assert winner.returncode == 75, logs[procs.index(winner)][-3000:]
    steps = [r["step"] for r in map(json.loads, (out2 / "train_log.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == list(range(1, len(steps) + 1))  # one run's steps, once each


def losses_at(out) -> dict:
    path = out / "train_log.jsonl"
    if not path.exists():
        return {}
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


@pytest.mark.multiproc
def test_a_stalled_holder_loses_the_directory_and_writes_nothing(tmp_path):
    """The lease on a shared file system: a trainer stalled (SIGSTOP, as a hung node) whose record says it runs on
    another host is silent for checkpoint.lock_timeout_s; a requeued attempt takes the directory over (one line),
    trains and saves. When the stalled one wakes, its heartbeat finds the lease gone: it stops at its next step with
    exit 2 and "lost its run lock", saving nothing over the new owner's checkpoints."""
    from leviathan_pretrain.trainer.checkpoint.run_lock import Holder

    out = tmp_path / "run"
    lease = ("checkpoint.lock_heartbeat_s=0.5", "checkpoint.lock_timeout_s=3")
    stale = _launch(out, "train.steps=400", "checkpoint.save_interval=1000", *lease)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and max(losses_at(out), default=0) < 3:
            time.sleep(0.2)
        tree = _tree(stale.pid)  # the launcher and its ranks (each rank in a session of its own)
        for pid in tree:
            os.kill(pid, signal.SIGSTOP)
        lock = out / "leviathan.lock"
        holder = Holder.read(lock)
        holder.host = "elsewhere"  # as if it ran on another node: only its silence can tell it is gone
        with open(lock, "r+b") as f:
            f.write(holder.dumps())
        new = _wait(_launch(out, "train.steps=400", "train.exit_at_step=2", *lease), 180)
        assert "is held by host elsewhere pid" in new and "waiting up to 3 s for a heartbeat" in new, new[-3000:]
        assert f"took over {lock} from host elsewhere pid {holder.pid}" in new and "no heartbeat for 3 s" in new
        ck = out / "checkpoints"
        assert (ck / "latest").read_text() == "global_step2"
        before = {p.name: p.stat().st_mtime_ns for p in (ck / "global_step2").iterdir()}
        for pid in tree:
            os.kill(pid, signal.SIGCONT)
        log = _wait(stale, 120)
    finally:
        if stale.poll() is None:
            for pid in _tree(stale.pid):
                os.kill(pid, signal.SIGKILL)
            _wait(stale, 5)
    assert stale.returncode == 2, log[-3000:]
    assert "this trainer lost its run lock" in log and "stopped without saving" in log, log[-3000:]
    assert {p.name: p.stat().st_mtime_ns for p in (ck / "global_step2").iterdir()} == before
    assert ckpt_names.complete_tags(ck) == ["global_step2"] and (ck / "latest").read_text() == "global_step2"


def _tree(root: int) -> list[int]:
    """``root`` and every process below it (from /proc: the ranks run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out
