"""Test-only: ``python -m leviathan_pretrain.train`` that SIGKILLs one of its ranks at a chosen moment (the chaos test,
tests/test_chaos.py), the kill injected from outside the product code.

Run as ``python tests/workers/train_chaos.py --config ... key=value ...`` under ``launchers/local.py``;
``LEV_TEST_CHAOS=RANK:PHASE:STEP:NTH`` picks the kill and ``LEV_TEST_CHAOS_MARK=PATH`` the marker file the killed rank
writes (and fsyncs) just before it SIGKILLs itself (the test's proof that the kill fired). The phases:

- ``step``: in the middle of training step STEP: after ``Trainer.train_step`` returned (the engine's step applied,
  the weights updated in memory), before the step is logged.
- ``save``: half-way through writing the NTH (0-based) of the rank's DeepSpeed checkpoint files of step STEP
  (``SafeCheckpointEngine.save``): half the bytes written and fsynced, then killed.
- ``commit``: rank 0: when ``store._atomic_write`` is about to replace ``latest`` with step STEP's tag (after
  ``leviathan.json`` was written); rank 1 (which commits nothing): right after its NTH DeepSpeed file of step STEP
  was written in full, before the barrier after which rank 0 commits.
- ``prune``: rank 0, inside ``store.prune`` after step STEP's save, deleting an old checkpoint: just before its
  NTH (1-based) deletion (``os.unlink`` / ``os.rmdir``, which ``shutil.rmtree`` and ``Path.unlink`` call).

Every rank writes its pid into ``LEV_TEST_CHAOS_PIDS/`` (when set): the test kills whatever a launch left behind.

The hooked names are looked up where the product code looks them up at call time (module attributes and class
attributes), so their bodies may change; a hook that never fires leaves no marker, and the test fails.
"""

import io
import os
import signal
import sys
import threading
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from leviathan_pretrain.trainer import loop  # noqa: E402
from leviathan_pretrain.trainer.checkpoint import names as ckpt_names  # noqa: E402
from leviathan_pretrain.trainer.checkpoint import safe_io, store  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
PHASES = ("step", "save", "commit", "prune")
STATE = {"step": None, "saves": 0, "deletions": 0}  # the step being trained/saved; counters of the chosen step


def die(what: str) -> None:
    """Write the marker (the test's proof that this kill point was reached), then SIGKILL this rank."""
    mark = os.environ["LEV_TEST_CHAOS_MARK"]
    with open(mark, "w") as f:
        f.write(f"rank {RANK} pid {os.getpid()}: {what}\n")
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def install(rank: int, phase: str, step: int, nth: int) -> None:
    if phase not in PHASES:
        raise SystemExit(f"LEV_TEST_CHAOS: unknown phase {phase!r} (one of {', '.join(PHASES)})")
    tag = ckpt_names.tag_for(step)

    train_step = loop.Trainer.train_step

    def trainer_step(self):
        STATE["step"] = self.state.step
        out = train_step(self)
        if phase == "step" and RANK == rank and self.state.step == step:
            die(f"step {step}: after Trainer.train_step returned, before logging")
        return out

    loop.Trainer.train_step = trainer_step

    if RANK != rank:
        return

    if phase in ("save", "commit"):
        engine_save = safe_io.SafeCheckpointEngine.save

        def save(self, state_dict, path):
            if Path(path).parent.name != tag:
                return engine_save(self, state_dict, path)
            n, STATE["saves"] = STATE["saves"], STATE["saves"] + 1
            if n != nth:
                return engine_save(self, state_dict, path)
            if phase == "save":
                buf = io.BytesIO()
                torch.save(state_dict, buf)
                data = buf.getvalue()
                with open(path, "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                die(f"save {tag}: half of {Path(path).name} ({len(data) // 2} of {len(data)} bytes) written")
            out = engine_save(self, state_dict, path)
            if phase == "commit" and rank != 0:
                die(f"commit {tag}: {Path(path).name} written in full, before the commit barrier")
            return out

        safe_io.SafeCheckpointEngine.save = save  # the class object store.py imports too

    if phase == "commit" and rank == 0:
        atomic_write = store._atomic_write

        def _atomic_write(path, text, *a, **k):
            if Path(path).name == ckpt_names.LATEST and str(text).strip() == tag:
                meta = (Path(path).parent / tag / ckpt_names.META).is_file()
                die(f"commit {tag}: before replacing latest ({ckpt_names.META} written: {meta})")
            return atomic_write(path, text, *a, **k)

        store._atomic_write = _atomic_write

    if phase == "prune":
        if rank != 0:
            raise SystemExit("LEV_TEST_CHAOS: only rank 0 prunes")
        prune, unlink, rmdir = store.prune, os.unlink, os.rmdir

        def deleting(real, me):
            def op(p, *a, **k):
                if threading.get_ident() != me:  # another thread's (e.g. the run lock's heartbeat): not prune's
                    return real(p, *a, **k)
                STATE["deletions"] += 1
                if STATE["deletions"] == nth:
                    did = f"{nth - 1} deletion(s) done"
                    die(f"prune after step {step}: {did}, about to {real.__name__} {os.fspath(p)}")
                return real(p, *a, **k)

            return op

        def pruning(*a, **k):
            if STATE["step"] != step:
                return prune(*a, **k)
            # shutil.rmtree and Path.unlink look os.unlink / os.rmdir up at call time
            me = threading.get_ident()
            os.unlink, os.rmdir = deleting(unlink, me), deleting(rmdir, me)
            try:
                return prune(*a, **k)
            finally:
                os.unlink, os.rmdir = unlink, rmdir

        store.prune = pruning


if os.environ.get("LEV_TEST_CHAOS_PIDS"):
    Path(os.environ["LEV_TEST_CHAOS_PIDS"], f"{os.getpid()}").write_text(f"rank {RANK}\n")
spec = os.environ.get("LEV_TEST_CHAOS")
if spec:
    r, ph, s, n = spec.split(":")
    install(int(r), ph, int(s), int(n))

from leviathan_pretrain.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
