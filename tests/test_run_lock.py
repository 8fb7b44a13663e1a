"""The run-directory lease (trainer/checkpoint/run_lock.py): one owner at a time, live holders refused, stale ones
taken over, a holder whose file was replaced loses the lease; and the lock keys of the config (config/run.py)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from leviathan_pretrain.config import ConfigError, load_config
from leviathan_pretrain.trainer.checkpoint import run_lock
from leviathan_pretrain.trainer.checkpoint.run_lock import LOCK, Holder, LockLost, RunLock, RunLocked, RunLocks

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu-lev.yaml"
HB, TIMEOUT = 0.2, 0.6  # tiny lease timings: every test takes about a second at most
HOST = socket.gethostname()


@pytest.fixture(autouse=True)
def no_heartbeat_left():
    """Every test releases what it took: no heartbeat thread outlives it."""
    yield
    deadline = time.monotonic() + 2
    while any(t.name == "run-lock" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [t for t in threading.enumerate() if t.name == "run-lock"], "a heartbeat thread was left running"


def lock(directory: Path, notes: list | None = None, hb: float = HB, timeout: float = TIMEOUT) -> RunLock:
    """``hb``/``timeout`` larger than the defaults where only a slow machine would make the test wait for them."""
    return RunLock(directory, hb, timeout, say=(notes.append if notes is not None else print))


def write_record(path: Path, holder: Holder) -> bytes:
    data = holder.dumps()
    path.write_bytes(data)
    return data


def dead_pid() -> int:
    """A pid no process has now."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(top - 1, 1000, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    raise AssertionError("no free pid found")


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(f"{LOCK}.stale"))


class Beater:
    """Another host's live holder: rewrites its record with beat + 1 every 0.1 s (in place)."""

    def __init__(self, path: Path, holder: Holder):
        self.path, self.holder = path, holder
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="beater", daemon=True)

    def _run(self):
        while not self.stop.wait(0.1):
            self.holder.beat += 1
            with open(self.path, "r+b") as f:
                f.write(self.holder.dumps())

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=5)


# ---- taking and releasing ----


def test_acquire_creates_the_record_beats_and_release_deletes_it(tmp_path):
    lk = lock(tmp_path / "run").acquire()  # the directory is created
    try:
        path = tmp_path / "run" / LOCK
        assert lk.path == path and lk.owned()
        rec = Holder.read(path)
        assert (rec.host, rec.pid, rec.token) == (HOST, os.getpid(), lk.me.token)
        assert rec.pid_start == run_lock.proc_start(os.getpid()) is not None
        assert path.stat().st_size == run_lock.RECORD_BYTES  # fixed size, rewritten in place
        ino = path.stat().st_ino
        deadline = time.monotonic() + 5
        while Holder.read(path).beat < 2 and time.monotonic() < deadline:  # a beat every HB seconds
            time.sleep(HB / 4)
        rec = Holder.read(path)
        assert rec.beat >= 2 and rec.token == lk.me.token and rec.beat_time
        assert path.stat().st_ino == ino and path.stat().st_size == run_lock.RECORD_BYTES
        lk.check()  # still ours: no error
    finally:
        lk.release()
    assert not path.exists() and lk.fd is None and not lk._thread.is_alive()
    lk.release()  # twice: harmless
    assert os.listdir(tmp_path / "run") == []


def test_a_live_holder_on_this_host_is_refused_at_once(tmp_path):
    path = tmp_path / LOCK
    parent = os.getppid()  # a process that lives as long as this test
    before = write_record(path, Holder(HOST, parent, "t", run_lock.proc_start(parent), "77 (restart 1)", "then"))
    notes = []
    t0 = time.monotonic()
    with pytest.raises(RunLocked) as e:
        lock(tmp_path, notes).acquire()
    assert time.monotonic() - t0 < TIMEOUT and notes == []  # no watching
    msg = str(e.value)
    assert msg.startswith(f"{path}: this run directory is in use by host {HOST} pid {parent}, SLURM job 77 (restart 1)")
    assert "its process is alive on this host" in msg and "train.out_dir / checkpoint.dir" in msg
    assert "\n" not in msg and notes == []
    assert path.read_bytes() == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("case", ["dead pid", "pid reused", "this process"])
def test_a_gone_holder_on_this_host_is_taken_over_at_once(tmp_path, case):
    path = tmp_path / LOCK
    pid = {"dead pid": dead_pid(), "pid reused": os.getppid(), "this process": os.getpid()}[case]
    start = "1" if case == "pid reused" else run_lock.proc_start(pid)  # another start time: another process
    write_record(path, Holder(HOST, pid, "old", start))
    notes = []
    t0 = time.monotonic()
    lk = lock(tmp_path, notes).acquire()
    try:
        assert time.monotonic() - t0 < TIMEOUT  # no watching (and no "waiting" note: below)
        assert lk.owned() and Holder.read(path).token == lk.me.token
        assert notes == [
            f"[train] took over {path} from host {HOST} pid {pid}, started None, last heartbeat None: "
            f"its process {pid} on this host is gone"
        ]
        assert leftovers(tmp_path) == []
    finally:
        lk.release()
    assert not path.exists()


def test_a_live_holder_on_another_host_is_refused_once_its_heartbeat_moves(tmp_path):
    path = tmp_path / LOCK
    holder = Holder("elsewhere", 1, "t", job="42", started="then")
    write_record(path, holder)
    notes = []
    with Beater(path, holder):
        t0 = time.monotonic()
        with pytest.raises(RunLocked) as e:
            lock(tmp_path, notes, timeout=10).acquire()
        waited = time.monotonic() - t0
    assert waited < 5  # refused as soon as a beat is seen (~0.2 s), not after the timeout
    msg = str(e.value)
    assert msg.startswith(f"{path}: this run directory is in use by host elsewhere pid 1, SLURM job 42")
    assert "its heartbeat is moving" in msg and "\n" not in msg
    assert len(notes) == 1 and notes[0].startswith(f"[train] {path} is held by host elsewhere pid 1, SLURM job 42")
    assert "on another host: waiting up to 10 s" in notes[0] and "checkpoint.lock_timeout_s" in notes[0]
    got = Holder.read(path)
    assert (got.token, got.host) == ("t", "elsewhere") and got.beat >= 1  # left as it was
    assert leftovers(tmp_path) == []


def test_a_silent_holder_on_another_host_is_taken_over_after_the_timeout(tmp_path):
    path = tmp_path / LOCK
    write_record(path, Holder("elsewhere", 1, "t", beat=7))
    notes = []
    t0 = time.monotonic()
    lk = lock(tmp_path, notes).acquire()
    try:
        assert TIMEOUT <= time.monotonic() - t0 < TIMEOUT + 1
        assert lk.owned() and Holder.read(path).host == HOST
        assert len(notes) == 2 and "waiting up to" in notes[0]
        assert notes[1].startswith(f"[train] took over {path} from host elsewhere pid 1")
        assert notes[1].endswith(f": no heartbeat for {TIMEOUT:g} s")
        assert leftovers(tmp_path) == []
    finally:
        lk.release()
    assert os.listdir(tmp_path) == []


def test_a_holder_released_while_watched_is_no_takeover(tmp_path):
    path = tmp_path / LOCK
    write_record(path, Holder("elsewhere", 1, "t"))
    remover = threading.Timer(0.15, path.unlink)
    remover.start()
    notes = []
    try:
        lk = lock(tmp_path, notes, timeout=10).acquire()  # released after 0.15 s: no waiting for 10
    finally:
        remover.join()
    try:
        assert lk.owned() and len(notes) == 1 and "waiting up to" in notes[0]  # no "took over"
    finally:
        lk.release()


def test_an_unreadable_record_is_taken_over_after_two_heartbeats(tmp_path):
    path = tmp_path / LOCK
    path.write_bytes(b"")  # a creator that crashed before its first write
    notes = []
    t0 = time.monotonic()
    lk = lock(tmp_path, notes).acquire()
    try:
        assert 2 * HB <= time.monotonic() - t0 < 2 * HB + 2
        assert lk.owned()
        assert notes == [f"[train] took over {path} from an unreadable record: its record stayed unreadable"]
        assert leftovers(tmp_path) == []
    finally:
        lk.release()


def test_an_unreadable_record_that_becomes_a_live_one_is_refused(tmp_path):
    path = tmp_path / LOCK
    path.write_bytes(b"")
    writer = threading.Timer(0.1, write_record, (path, Holder("elsewhere", 3, "t")))  # the creator's first write
    writer.start()
    try:
        with pytest.raises(RunLocked, match=r"in use by host elsewhere pid 3.*its heartbeat is moving"):
            lock(tmp_path, hb=1.0, timeout=3.0).acquire()  # watched for 2 s at most; the record comes at 0.1 s
    finally:
        writer.join()
    assert Holder.read(path).token == "t" and leftovers(tmp_path) == []


def test_holder_read_and_record_size(tmp_path):
    p = tmp_path / "rec"
    p.write_bytes(b'{"host": "h", "pid": 1, "token": "t", "unknown_field": 1}')
    assert Holder.read(p) is None  # not a record
    p.write_bytes(b"[1, 2]")
    assert Holder.read(p) is None
    p.write_bytes(b"\xff\xfe")
    assert Holder.read(p) is None
    with pytest.raises(FileNotFoundError):
        Holder.read(tmp_path / "missing")
    with pytest.raises(ValueError, match="over 1024 bytes"):
        Holder("h" * 2000, 1, "t").dumps()


# ---- losing it ----


def test_a_holder_whose_file_was_replaced_loses_the_lease(tmp_path):
    path = tmp_path / LOCK
    lk = lock(tmp_path).acquire()
    try:
        newer = tmp_path / "newer"
        write_record(newer, Holder("elsewhere", 9, "theirs"))
        os.replace(newer, path)  # another trainer took it over while this one was stalled
        assert not lk.owned()
        with pytest.raises(LockLost) as e:
            lk.check()  # before the heartbeat noticed
        assert str(e.value).startswith(f"{path}: this trainer lost its run lock (the lock file was replaced)")
        assert "stopping without saving" in str(e.value)
        lk._thread.join(timeout=5)  # the heartbeat notices and stops beating
        assert not lk._thread.is_alive()
    finally:
        lk.release()
    assert Holder.read(path).token == "theirs"  # release leaves the new owner's file alone


def test_the_heartbeat_marks_a_lost_lease(tmp_path):
    path = tmp_path / LOCK
    lk = lock(tmp_path).acquire()
    try:
        path.unlink()
        write_record(path, Holder(HOST, lk.me.pid, lk.me.token))  # even our own token: another file is not ours
        lk._thread.join(timeout=5)
        assert lk.lost == "another trainer took it over"
        with pytest.raises(LockLost, match="another trainer took it over"):
            lk.check()
    finally:
        lk.release()
    assert path.exists()


def test_a_second_lock_in_this_process_takes_over_and_the_first_loses(tmp_path):
    """A lease this very process left behind is stale (an earlier run in it failed to release)."""
    notes = []
    first = lock(tmp_path).acquire()
    second = lock(tmp_path, notes).acquire()
    try:
        assert second.owned() and not first.owned()
        assert len(notes) == 1 and f"its process {os.getpid()} on this host is gone" in notes[0]
        first._thread.join(timeout=5)
        assert first.lost
        first.release()
        assert second.owned()  # the loser's release did not delete the winner's file
    finally:
        first.release()
        second.release()
    assert os.listdir(tmp_path) == []


def test_check_without_the_lease_raises(tmp_path):
    lk = lock(tmp_path)
    with pytest.raises(LockLost):
        lk.check()


# ---- RunLocks ----


def test_run_locks_lock_the_checkpoint_dir_when_it_lies_outside(tmp_path):
    root = tmp_path / "run"
    assert [lk.path for lk in RunLocks.for_run(root, root / "checkpoints", HB, TIMEOUT).locks] == [root / LOCK]
    assert [lk.path for lk in RunLocks.for_run(root, root, HB, TIMEOUT).locks] == [root / LOCK]
    outside = tmp_path / "scratch" / "ckpt"
    locks = RunLocks.for_run(root, outside, HB, TIMEOUT).acquire()
    try:
        assert [lk.path for lk in locks.locks] == [root / LOCK, outside / LOCK]
        assert (root / LOCK).exists() and (outside / LOCK).exists()
        assert locks.lost is None
        locks.check()
        (outside / LOCK).unlink()
        write_record(outside / LOCK, Holder("elsewhere", 2, "x"))
        locks.locks[1]._thread.join(timeout=5)
        assert locks.lost == f"{outside / LOCK}: another trainer took it over"
        with pytest.raises(LockLost, match=str(outside / LOCK)):
            locks.check()
    finally:
        locks.release()
    assert not (root / LOCK).exists() and (outside / LOCK).exists()


def test_run_locks_relative_paths_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    locks = RunLocks.for_run(Path("run"), Path("run/checkpoints"), HB, TIMEOUT)
    assert [lk.path for lk in locks.locks] == [tmp_path / "run" / LOCK]


@pytest.mark.parametrize("spelling", ["symlink", "dotdot"])
def test_run_locks_one_lock_when_the_checkpoint_dir_is_the_run_dir_spelled_otherwise(tmp_path, spelling):
    """checkpoint.dir naming out_dir by another path: one lease, not two on the same file (the second would take
    the first over: same process, so 'gone')."""
    root = tmp_path / "run"
    root.mkdir()
    if spelling == "symlink":
        other = tmp_path / "alias"
        other.symlink_to(root)
    else:
        other = tmp_path / "elsewhere" / ".." / "run"
    notes = []
    locks = RunLocks.for_run(root, other, HB, TIMEOUT, say=notes.append)
    assert len(locks.locks) == 1
    locks.acquire()
    try:
        time.sleep(2 * HB)
        assert notes == [] and locks.lost is None
        locks.check()
    finally:
        locks.release()
    assert not (root / LOCK).exists()


def test_run_locks_lock_a_checkpoint_dir_outside_named_through_the_run_dir(tmp_path):
    root = tmp_path / "run"
    locks = RunLocks.for_run(root, root / ".." / "shared", HB, TIMEOUT)
    assert [lk.path for lk in locks.locks] == [root / LOCK, tmp_path / "shared" / LOCK]


def test_run_locks_release_what_they_took_when_one_is_refused(tmp_path):
    root, outside = tmp_path / "run", tmp_path / "ckpt"
    outside.mkdir()
    parent = os.getppid()
    write_record(outside / LOCK, Holder(HOST, parent, "t", run_lock.proc_start(parent)))
    with pytest.raises(RunLocked, match=f"{outside / LOCK}: this run directory is in use by host {HOST} pid {parent}"):
        RunLocks.for_run(root, outside, HB, TIMEOUT).acquire()
    assert not (root / LOCK).exists()  # the first lease was given back
    assert Holder.read(outside / LOCK).token == "t"


# ---- the config keys ----


@pytest.mark.parametrize(
    "over, key",
    [
        (["checkpoint.lock_heartbeat_s=0"], "checkpoint.lock_heartbeat_s"),
        (["checkpoint.lock_heartbeat_s=-1"], "checkpoint.lock_heartbeat_s"),
        (["checkpoint.lock_heartbeat_s=10", "checkpoint.lock_timeout_s=29.9"], "checkpoint.lock_timeout_s"),
        (["checkpoint.lock_heartbeat_s=inf"], "checkpoint.lock_heartbeat_s"),
        (["checkpoint.lock_timeout_s=nan"], "checkpoint.lock_timeout_s"),
    ],
)
def test_lock_keys_are_checked(over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_config(CONFIG, over)
    if key == "checkpoint.lock_timeout_s" and "nan" not in over[-1]:
        assert "must be >= 3 x checkpoint.lock_heartbeat_s (30)" in str(e.value)


def test_lock_key_defaults_and_the_smallest_timeout():
    c = load_config(CONFIG).checkpoint
    assert (c.lock_heartbeat_s, c.lock_timeout_s) == (10.0, 60.0)
    c = load_config(CONFIG, ["checkpoint.lock_heartbeat_s=0.2", "checkpoint.lock_timeout_s=0.6"]).checkpoint
    assert (c.lock_heartbeat_s, c.lock_timeout_s) == (0.2, 0.6)
