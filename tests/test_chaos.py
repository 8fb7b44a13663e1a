"""Chaos: a two-rank run (DP 2, ZeRO 1, a checkpoint every 2 steps, the last 2 kept) is SIGKILLed at random moments
(a fixed seed) and resumed with the same command each time; it must end exactly as an uninterrupted run.

The kill points (tests/workers/train_chaos.py, injected from outside the product code), on a random rank at a random
step: ``step`` (in the middle of a training step), ``save`` (half-way through writing one of DeepSpeed's checkpoint
files), ``commit`` (rank 0: ``leviathan.json`` written, ``latest`` not yet replaced; rank 1: its files written, before
the commit barrier), ``prune`` (rank 0 deleting an old checkpoint, before one of its deletions). After every kill:
the kill fired, ``latest`` names a complete checkpoint that loads (the newest one completed before the kill), and
the next launch resumes from it. At the end: every loss any attempt logged and the final weights equal the
uninterrupted run's exactly, and the user's own files in the run and checkpoint directories were never touched.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from leviathan_pretrain.trainer.checkpoint import names as ckpt_names
from leviathan_pretrain.trainer.checkpoint import safe_io
from tests.multiproc import REPO, base_env
from tests.workers.train_common import CONFIG, overrides

# The seed's plan (simulated before it was picked, as the test draws it): every (phase, rank), both of rank 0's save
# files, a save killed before any checkpoint exists, prunes killed before their first and before their last deletion,
# kills at the last step. It is: save 0 (file 0) at step 2, prune before deletion 8 at 6, prune before deletion 1 at
# 10, commit 0 at 14, save 1 at 16, step 0 at 18, save 0 (file 1), commit 1 and step 1 at 20. Nine kills, the fewest
# that can hold all of it (a launch less for CI); seed 79's ten held the same list plus a third prune and a commit
# killed at step 2.
SEED = 38895
STEPS = 20
SAVE_EVERY = 2
KILLS = 9  # each (phase, rank) once, prune twice, the rest at random
WINDOW = 4  # a kill's step: at most this many steps past the checkpoint its attempt resumes from
PHASES = ("step", "save", "commit", "prune")
# (phase, rank): only rank 0 prunes; prune twice (a kill before any of its 8 deletions: the most distinct moments)
KINDS = [(p, r) for p in PHASES for r in (0, 1) if (p, r) != ("prune", 1)] + [("prune", 0)]
PRUNE_DELETIONS = 8  # a prune kill comes before deletion 1..8: leviathan.json, the 6 other files, the folder
LAUNCH_TIMEOUT = 120  # seconds; one launch takes ~10 s on 2 idle cores
ARGS = (
    f"train.steps={STEPS}",
    "train.eval_interval=0",
    "logging.log_interval=1",
    "logging.tensorboard=false",
    "parallel.zero_stage=1",
    f"checkpoint.save_interval={SAVE_EVERY}",
    "checkpoint.keep_last=2",
)
SAVES = [s for s in range(1, STEPS + 1) if s % SAVE_EVERY == 0 or s == STEPS]
# DeepSpeed's files of one DP 2 ZeRO 1 checkpoint, and ours
CKPT_FILES = {
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "rng_rank00000.pt",
    "rng_rank00001.pt",
}
# The user's own files in the run directory and the checkpoint directory, some with names close to ours.
USER_FILES = {
    "notes.txt": b"my notes on this run\n",
    "checkpoints/README.user": b"do not delete\n",
    "checkpoints/latest.bak": b"global_step999\n",
    "checkpoints/latest.tmp": b"not write_bytes_atomic's (no pid)\n",
    "checkpoints/mine/data.bin": bytes(range(256)) * 4,
    "checkpoints/.global_step4.saving-user/keep.txt": b"no leviathan.saving mark: not ours\n",
}
USER_MTIME_NS = 1_600_000_000 * 10**9


def _steps(phase: str, done: int) -> list[int]:
    """The steps a ``phase`` kill can come at in an attempt resuming at step ``done``: within :data:`WINDOW` steps
    (else the next one possible); none where the phase cannot happen."""
    window = range(done + 1, min(done + WINDOW, STEPS) + 1)
    if phase == "step":
        return list(window)
    later = [s for s in SAVES if s > done]
    if phase == "prune":  # a save with an old checkpoint to delete, not the last one (the run would be complete)
        later = [s for s in later if s >= 3 * SAVE_EVERY and s < STEPS]
    return [s for s in later if s in window] or later[:1]


def _choose(rng: random.Random, phase: str, rank: int, done: int) -> tuple[int, int]:
    """(step, nth) of a ``phase`` kill of ``rank`` in an attempt resuming at step ``done``."""
    step = rng.choice(_steps(phase, done))
    if phase == "save" and rank == 0:  # rank 0 writes the model states, then its optimizer states
        return step, rng.randrange(2)
    if phase == "prune":
        return step, rng.randint(1, PRUNE_DELETIONS)
    return step, 0  # rank 1 writes one file: its optimizer states


def _reap(pids: Path) -> list[str]:
    """Kill every rank a launch left running (each rank wrote its pid there; each is its own process group)."""
    left = []
    for f in sorted(pids.iterdir()):
        pid = int(f.name)
        try:
            alive = b"train_chaos.py" in Path(f"/proc/{pid}/cmdline").read_bytes()  # a zombie's is empty
        except OSError:
            alive = False
        if alive:
            left.append(f"pid {pid} ({f.read_text().strip()})")
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 10
            while Path(f"/proc/{pid}/cmdline").exists() and time.monotonic() < deadline:
                try:
                    if not Path(f"/proc/{pid}/cmdline").read_bytes():
                        break  # killed; its parent reaps it
                except OSError:
                    break
                time.sleep(0.1)
        f.unlink()
    return left


def _quiet(text: str, n: int = 4000) -> str:
    """The tail of a launch's output without the import warnings."""
    lines = [ln for ln in text.splitlines() if "warn" not in ln.lower() and "Apex" not in ln]
    return "\n".join(lines)[-n:]


def _launch(tmp: Path, out: Path, name: str, chaos: str | None = None) -> tuple[int, str]:
    """One launch (launchers/local.py, 2 ranks) of the chaos worker; its exit code and output. Nothing is left
    running: on a timeout the launcher and every rank are killed (and the test fails)."""
    pids = tmp / "pids"
    pids.mkdir(exist_ok=True)
    env = {"LEV_TEST_CHAOS_PIDS": pids}
    if chaos:
        env.update(LEV_TEST_CHAOS=chaos, LEV_TEST_CHAOS_MARK=tmp / f"{name}.killed")
    cmd = [sys.executable, "launchers/local.py", "-n", "2", "--grace", "10", "--", "tests/workers/train_chaos.py"]
    cmd += ["--config", CONFIG, *overrides("unused", f"train.out_dir={out}", *ARGS)]
    log = tmp / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=base_env(env), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            left = _reap(pids)
    text = log.read_text()
    if rc is None:
        pytest.fail(f"{name} ({chaos}): no end within {LAUNCH_TIMEOUT} s; killed\n{_quiet(text)}", pytrace=False)
    assert not left, f"{name} ({chaos}): the launcher exited ({rc}) leaving ranks running: {left}\n{_quiet(text)}"
    return rc, text


def _describe(ck: Path) -> str:
    """The checkpoint directory, for failure messages."""
    if not ck.is_dir():
        return f"{ck}: absent"
    lines = [f"{ck}:"]
    for p in sorted(ck.iterdir()):
        if p.is_dir():
            lines.append(f"  {p.name}/ " + " ".join(sorted(c.name for c in p.iterdir())))
        else:
            lines.append(f"  {p.name}" + (f" -> {p.read_text().strip()!r}" if p.name == ckpt_names.LATEST else ""))
    return "\n".join(lines)


def _check_latest(ck: Path, where: str) -> int:
    """``latest``, if any, names a complete checkpoint that loads; its step (0: none)."""
    p = ck / ckpt_names.LATEST
    if not p.exists():
        return 0
    tag = p.read_text().strip()
    d = ck / tag
    assert ckpt_names.step_of(tag) is not None, f"{where}: latest names {tag!r}\n{_describe(ck)}"
    assert (d / ckpt_names.META).is_file(), (
        f"{where}: latest names {tag}, which has no {ckpt_names.META}\n{_describe(ck)}"
    )
    assert not (d / ckpt_names.SAVING).exists(), (
        f"{where}: latest names {tag}, still marked {ckpt_names.SAVING}\n{_describe(ck)}"
    )
    missing = CKPT_FILES - {f.name for f in d.iterdir()}
    assert not missing, f"{where}: latest names {tag}, which lacks {sorted(missing)}\n{_describe(ck)}"
    files = json.loads((d / ckpt_names.META).read_text()).get("files")
    for name, size in (files or {}).items():  # leviathan.json's {name: size}, where written
        size = size.get("size") if isinstance(size, dict) else size
        assert (d / name).is_file(), f"{where}: {tag}/{ckpt_names.META} lists {name}, which is missing\n{_describe(ck)}"
        got = (d / name).stat().st_size
        assert got == size, f"{where}: {tag}/{name} has {got} bytes, {ckpt_names.META} says {size}"
    for f in sorted(d.glob("*.pt")):
        try:
            safe_io.safe_load(f)
        except Exception as e:  # noqa: BLE001 - the message names the file
            pytest.fail(f"{where}: latest names {tag}, whose {f.name} does not load: {e!r}", pytrace=False)
    assert ckpt_names.read_latest(ck) == tag
    return ckpt_names.step_of(tag)


def _losses(out: Path) -> dict[int, float]:
    path = out / "train_log.jsonl"
    if not path.is_file():
        return {}
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def _differences(a, b, where: str) -> list[str]:
    """Where two loaded checkpoint files differ: tensors by torch.equal, objects by their attributes, everything else
    by == (NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        return [] if same and a.shape == b.shape and torch.equal(a, b) else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []  # e.g. the RNG states' python_gauss when no gaussian is cached
    if type(a) is type(b) and hasattr(a, "__dict__") and not isinstance(a, type):
        return _differences(vars(a), vars(b), where)  # e.g. DeepSpeed's LossScaler (no __eq__)
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _user_files(root: Path) -> dict[str, tuple[bytes, int]]:
    return {name: ((root / name).read_bytes(), (root / name).stat().st_mtime_ns) for name in USER_FILES}


@pytest.mark.multiproc
def test_sigkill_at_random_moments_then_resume_ends_as_an_uninterrupted_run(tmp_path):
    t_start = time.monotonic()
    ref_out, out = tmp_path / "ref", tmp_path / "chaos"
    ck = out / "checkpoints"
    for name, data in USER_FILES.items():
        p = out / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.utime(p, ns=(USER_MTIME_NS, USER_MTIME_NS))
    user_before = _user_files(out)

    rc, text = _launch(tmp_path, ref_out, "reference")
    assert rc == 0, _quiet(text)
    ref = _losses(ref_out)
    assert sorted(ref) == list(range(1, STEPS + 1)), _quiet(text)

    rng = random.Random(SEED)
    plan = [*KINDS, *(rng.choice(KINDS) for _ in range(KILLS - len(KINDS)))]
    rng.shuffle(plan)
    history: list[str] = []  # one line per kill, for the failure messages
    logged: list[tuple[str, int, float]] = []  # (attempt, step, loss) of every loss any attempt logged
    done = 0  # the step `latest` names
    for i, (phase, rank) in enumerate(plan):
        if not _steps(phase, done):  # e.g. no old checkpoint left to prune this close to the end
            phase, rank = rng.choice([k for k in KINDS if _steps(k[0], done)])
        step, nth = _choose(rng, phase, rank, done)
        name = f"attempt{i}"
        spec = f"{rank}:{phase}:{step}:{nth}"
        t0 = time.monotonic()
        rc, text = _launch(tmp_path, out, name, spec)
        mark = tmp_path / f"{name}.killed"
        fired = mark.read_text().strip() if mark.is_file() else None
        history.append(f"{name}: from step {done}, kill {spec} -> exit {rc} in {time.monotonic() - t0:.0f} s: {fired}")
        story = "\n".join(history)
        where = f"after {name}'s kill ({spec})"
        assert fired, f"{name}: the kill {spec} never fired (exit code {rc})\n{story}\n{_describe(ck)}\n{_quiet(text)}"
        assert fired.startswith(f"rank {rank} "), fired
        assert rc != 0, f"{name}: a rank was SIGKILLed, yet the launcher exited 0\n{story}\n{_quiet(text)}"
        logged += [(name, s, loss) for s, loss in _losses(out).items()]

        # the newest checkpoint completed before the kill, complete and loadable
        latest = _check_latest(ck, where)
        want = step if phase == "prune" else max([s for s in SAVES if s < step], default=0)
        assert latest == want, f"{where}: latest names step {latest}, expected {want}\n{story}\n{_describe(ck)}"
        d = ck / ckpt_names.tag_for(step)
        if phase == "commit" and rank == 0:  # committed, not yet named by latest
            assert (d / ckpt_names.META).is_file() and not (d / ckpt_names.SAVING).exists(), f"{where}\n{_describe(ck)}"
        elif phase in ("save", "commit"):  # an interrupted save, marked as ours
            assert (d / ckpt_names.SAVING).is_file() and not (d / ckpt_names.META).exists(), f"{where}\n{_describe(ck)}"
        done = latest

    t0 = time.monotonic()
    rc, text = _launch(tmp_path, out, "final")
    history.append(f"final: from step {done} -> exit {rc} in {time.monotonic() - t0:.0f} s")
    story = "\n".join(history)
    assert rc == 0, f"the final resume failed (exit code {rc})\n{story}\n{_describe(ck)}\n{_quiet(text)}"
    print(f"[chaos] {len(plan)} kills, {time.monotonic() - t_start:.0f} s in all:\n{story}")

    # the losses: the final log is the uninterrupted run's; so is every loss any attempt logged
    assert _losses(out) == ref, f"{story}\n" + "\n".join(
        f"step {s}: {_losses(out).get(s)!r} vs {ref.get(s)!r}" for s in range(1, STEPS + 1)
    )
    wrong = [(a, s, loss, ref[s]) for a, s, loss in logged if loss != ref[s]]
    assert not wrong, f"losses logged by the attempts differ from the uninterrupted run's: {wrong}\n{story}"

    # the final weights (and optimizer and RNG states): the uninterrupted run's, exactly
    final = ckpt_names.tag_for(STEPS)
    assert _check_latest(ck, "at the end") == STEPS
    got_dir, ref_dir = ck / final, ref_out / "checkpoints" / final
    model = "mp_rank_00_model_states.pt"
    ours, theirs = safe_io.safe_load(got_dir / model)["module"], safe_io.safe_load(ref_dir / model)["module"]
    assert ours.keys() == theirs.keys() and any(isinstance(v, torch.Tensor) for v in ours.values())
    assert _differences(ours, theirs, "module") == [], story
    diffs = [
        d
        for f in sorted(CKPT_FILES)
        for d in _differences(safe_io.safe_load(got_dir / f), safe_io.safe_load(ref_dir / f), f)
    ]
    assert not diffs, f"the final checkpoint differs from the uninterrupted run's: {diffs[:20]}\n{story}"

    # what is left: the last two checkpoints, no interrupted save, no temporary file of ours
    tags = sorted((p.name for p in ck.glob(f"{ckpt_names.TAG_PREFIX}*") if p.is_dir()), key=ckpt_names.step_of)
    assert tags == [ckpt_names.tag_for(s) for s in SAVES[-2:]], f"{story}\n{_describe(ck)}"
    leftovers = [p.name for p in ck.glob(f".{ckpt_names.TAG_PREFIX}*.saving-*") if p.name.rsplit("-", 1)[1].isdigit()]
    leftovers += [
        p.name for p in ck.glob(f"{ckpt_names.LATEST}.tmp*") if p.name[len(ckpt_names.LATEST) + 4 :].isdigit()
    ]
    assert not leftovers, f"{story}\n{_describe(ck)}"

    # the user's files: same contents, same mtimes; nothing added to their folder
    assert _user_files(out) == user_before, f"{story}\n{_describe(ck)}"
    assert sorted(p.name for p in (ck / "mine").iterdir()) == ["data.bin"]
    assert sorted(p.name for p in (ck / ".global_step4.saving-user").iterdir()) == ["keep.txt"]
