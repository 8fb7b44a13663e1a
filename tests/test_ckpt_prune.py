"""Pruning and the start-up clean-up of interrupted saves (trainer/checkpoint/store.py) never touch what they must keep:
the newest checkpoints, the one ``latest`` names, the newest confirmed one (``protect``), a save whose writer is alive
on this host (its pid and that process's start time), anything not ours."""

from __future__ import annotations

import os
import socket

import pytest

from leviathan_pretrain.trainer.checkpoint.names import LATEST, SAVING
from leviathan_pretrain.trainer.checkpoint.run_lock import proc_start
from tests.test_ckpt_resume import make_interrupted, run_dir
from tests.test_run_lock import dead_pid


@pytest.fixture(scope="module")
def ckpt():
    from leviathan_pretrain.trainer.checkpoint import store

    return store


def test_prune_keeps_the_newest_latest_and_protect(tmp_path, ckpt):
    c = run_dir(tmp_path, steps=(10, 20, 30, 40, 50))
    assert ckpt.prune(c, 2) == ["global_step10", "global_step20", "global_step30"]
    assert ckpt.complete_tags(c) == ["global_step40", "global_step50"] and (c / LATEST).read_text() == "global_step50"
    c = run_dir(tmp_path / "b", steps=(10, 20, 30, 40, 50), latest="global_step20")
    make_interrupted(c, 60)
    (c / "global_step99").mkdir()
    assert ckpt.prune(c, 1, protect="global_step30") == ["global_step10", "global_step40"]
    assert ckpt.complete_tags(c) == ["global_step20", "global_step30", "global_step50"]
    assert (c / "global_step60" / SAVING).is_file() and (c / "global_step99").is_dir()  # not complete: not pruned
    assert ckpt.prune(c, 5) == [] and ckpt.prune(c, 3) == []


def test_remove_incomplete_spares_a_live_writer_on_this_host(tmp_path, ckpt):
    c = run_dir(tmp_path, steps=(10,))
    host = socket.gethostname()
    dead = dead_pid()
    parent = os.getppid()
    make_interrupted(c, 20, {"step": 20, "host": host, "pid": parent, "pid_start": proc_start(parent)})  # alive: kept
    make_interrupted(c, 25, {"step": 25, "host": host, "pid": parent, "pid_start": "1"})  # the pid reused: gone
    make_interrupted(c, 30, {"step": 30, "host": host, "pid": dead})
    make_interrupted(c, 40, {"step": 40, "host": "elsewhere", "pid": os.getppid()})  # the run lock said: gone
    make_interrupted(c, 50, {"step": 50, "host": host, "pid": os.getpid()})  # this process: an earlier run's
    make_interrupted(c, 60, {})  # prune's mark
    (make_interrupted(c, 70) / SAVING).write_bytes(b"\xff")  # unreadable
    make_interrupted(c, 80)  # kept by name
    (c / "global_step90").mkdir()  # not ours
    hidden = c / ".global_step95.saving-123"
    hidden.mkdir()
    (hidden / SAVING).write_text("{}")
    (c / "latest.tmp123").write_text("x")
    (c / "latest.tmpabc").write_text("x")
    removed = ckpt.remove_incomplete(c, keep="global_step80")
    assert sorted(removed) == [f"global_step{s}" for s in (25, 30, 40, 50, 60, 70)]
    assert sorted(os.listdir(c)) == [*(f"global_step{s}" for s in (10, 20, 80, 90)), LATEST, "latest.tmpabc"]


def test_a_delete_killed_half_way_leaves_nothing_that_looks_foreign(tmp_path, ckpt, monkeypatch):
    """Pruning (and every delete of ours) first renames the folder out of the ``global_step*`` names, so a SIGKILL
    while its files go (``leviathan.saving`` removed last) leaves a hidden folder the next start finishes; before,
    ``rmtree`` could remove the mark first and leave ``global_step6/`` looking like another run's: every start
    refused. An empty ``global_step*`` folder (what that old prune left) is not foreign, and a save replaces it."""
    c = run_dir(tmp_path, steps=(2, 4, 6))
    real_unlink, calls = os.unlink, []

    def dying_unlink(path, *a, **k):
        calls.append(str(path))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")  # as a SIGKILL: nothing after this runs
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(os, "unlink", dying_unlink)
    with pytest.raises(KeyboardInterrupt):
        ckpt.prune(c, 2)
    monkeypatch.setattr(os, "unlink", real_unlink)
    hidden = [p for p in c.iterdir() if p.name.startswith(".global_step2.saving-")]
    assert len(hidden) == 1 and (hidden[0] / SAVING).is_file() and not (c / "global_step2").exists()
    assert ckpt.foreign_tags(c) == [] and ckpt.complete_tags(c) == ["global_step4", "global_step6"]
    ckpt.remove_incomplete(c)
    assert not hidden[0].exists()
    (c / "global_step8").mkdir()  # empty: an older version's prune killed before its rmdir
    assert ckpt.foreign_tags(c) == []
    ckpt.check_no_foreign(c)
    ckpt._begin(c, "global_step8", 8)
    assert (c / "global_step8" / SAVING).is_file()
