"""tests/trained.py's cache deletes only the run directories it trained (marked :data:`tests.trained.MARK`): an older
build of a run is pruned, a killed build replaced; anything else in the cache directory, a directory named like a
build included, is left as it is, and a build's place held by such a directory is refused."""

from __future__ import annotations

import pytest

from tests import trained


def build(path, marked=True):
    (path / "checkpoints").mkdir(parents=True)
    (path / "checkpoints" / "latest").write_text("global_step30")
    if marked:
        (path / trained.MARK).write_text("ours\n")
    return path


def test_prune_deletes_older_marked_builds_only(tmp_path):
    final = build(tmp_path / "lev-tp2-0123456789ab")
    old = build(tmp_path / "lev-tp2-ba9876543210")
    unmarked = build(tmp_path / "lev-tp2-fedcba987654", marked=False)  # named like a build, not made by the cache
    other_run = build(tmp_path / "lev-z3dp2-ba9876543210")  # another run's build: only its own name prunes it
    user = tmp_path / "lev-tp2-notes"
    user.mkdir()
    (user / "mine.txt").write_text("keep")
    trained.prune(tmp_path, {"lev-tp2": final})
    assert not old.exists()
    assert final.is_dir() and unmarked.is_dir() and other_run.is_dir()
    assert (user / "mine.txt").read_text() == "keep"


def test_claim_replaces_a_killed_build_and_refuses_a_directory_it_did_not_make(tmp_path):
    killed = tmp_path / "lev-tp2-0123456789ab"
    killed.mkdir()
    (killed / trained.MARK).write_text("ours\n")
    (killed / "half-written.pt").write_bytes(b"x")
    trained.claim(killed)
    assert sorted(p.name for p in killed.iterdir()) == [trained.MARK]
    theirs = tmp_path / "untied-pp2-0123456789ab"
    theirs.mkdir()
    (theirs / "mine.txt").write_text("keep")
    with pytest.raises(AssertionError, match="not a run this test cache trained"):
        trained.claim(theirs)
    assert (theirs / "mine.txt").read_text() == "keep"
    fresh = tmp_path / "tied-tp2-0123456789ab"
    trained.claim(fresh)
    assert (fresh / trained.MARK).is_file()
