"""One owner of a run directory at a time: a lease file with a heartbeat, ``<dir>/leviathan.lock``.

Rank 0 takes it before the trainer reads or removes anything (the start-up clean-up of interrupted saves runs
under it) and holds it for the run's life. It relies on what every shared file system of a cluster gives (NFSv3+,
Lustre, GPFS, BeeGFS), not on ``flock``/``fcntl`` locks, which some of them do not honour across nodes:

- **creation with** ``O_CREAT | O_EXCL`` is atomic: of two trainers starting together exactly one creates the file;
- **the record** (host, pid and its start time, SLURM job id, start time, a heartbeat counter) is a fixed-size
  JSON block the holder rewrites in place every ``checkpoint.lock_heartbeat_s`` seconds (``pwrite`` + ``fsync``:
  close-to-open consistency shows it to a reader that opens the file afresh);
- **a stale lease** is recognised without comparing clocks across nodes: a holder on this host whose process is
  gone (its pid is free, or now belongs to a process started at another time) is stale at once; a holder on another
  host is watched, and it is stale only when its counter does not move for ``checkpoint.lock_timeout_s`` seconds.
  A live holder is refused at once (this host) or as soon as one heartbeat is seen (another host);
- **a takeover** renames the stale file to ``leviathan.lock.stale-<pid>`` (rename is atomic: of two contenders
  one wins), checks that what it moved is the record it judged, deletes it and creates its own;
- **a stale holder cannot keep it**: every heartbeat first checks that the file at the path is still the one it
  created (same inode, its own token); if not, the lease is *lost* and the trainer stops at its next step's vote
  without saving (and :meth:`RunLock.check` refuses a checkpoint commit), so a stalled job that wakes after a
  takeover never writes over the new owner's checkpoints.

Torch-free. The window that remains: between the holder's last check and its commit a takeover can happen; the
check runs right before every commit, so that window is milliseconds against a lease timeout of a minute.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from leviathan_pretrain.trainer.checkpoint.names import CheckpointError

LOCK = "leviathan.lock"
RECORD_BYTES = 1024  # the record is rewritten in place at this fixed size: a heartbeat never grows the file
_HELD: list[RunLock] = []  # this process's leases: released by release_held() on the way out of any exit


def release_held() -> None:
    """Release every lease this process holds (:func:`.faults.abort_rank` calls it before ``os._exit``: the next
    start on this host takes over at once anyway, but one on another host would wait for the lease timeout)."""
    for lock in list(_HELD):
        try:
            lock.release()
        except OSError:
            pass


class RunLocked(CheckpointError):
    """Another live trainer holds the run directory."""


class LockLost(CheckpointError):
    """This trainer's lease was taken over (it stalled longer than the lease timeout)."""


def proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, /proc/<pid>/stat field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def process_alive(host: str | None, pid, pid_start: str | None) -> bool | None:
    """Whether process ``pid`` (started at ``pid_start``, /proc's clock ticks, when known) still runs, when ``host``
    is this host; None for another host (nothing here can tell). This very process counts as gone (what an earlier
    run in it left), and so does a pid now held by a process started at another time (reused)."""
    if host != socket.gethostname():
        return None
    if not isinstance(pid, int) or isinstance(pid, bool) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    start = proc_start(pid)
    return not (pid_start and start and start != pid_start)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class Holder:
    """A lock file's record."""

    host: str
    pid: int
    token: str
    pid_start: str | None = None
    job: str | None = None
    started: str | None = None
    beat: int = 0
    beat_time: str | None = None

    @classmethod
    def me(cls) -> Holder:
        job = os.environ.get("SLURM_JOB_ID")
        if job and os.environ.get("SLURM_RESTART_COUNT"):
            job += f" (restart {os.environ['SLURM_RESTART_COUNT']})"
        return cls(socket.gethostname(), os.getpid(), uuid.uuid4().hex, proc_start(os.getpid()), job, _now())

    def dumps(self) -> bytes:
        text = json.dumps(self.__dict__).encode()
        if len(text) >= RECORD_BYTES:
            raise ValueError(f"lock record over {RECORD_BYTES} bytes")
        return text + b" " * (RECORD_BYTES - len(text) - 1) + b"\n"

    @classmethod
    def read(cls, path: Path) -> Holder | None:
        """The record at ``path``; None when it is empty or not a record (a creator between its create and its
        first write, or one that crashed there). FileNotFoundError when there is no file."""
        with open(path, "rb") as f:
            raw = f.read(4 * RECORD_BYTES)
        try:
            data = json.loads(raw.decode() or "null")
            return cls(**data) if isinstance(data, dict) else None
        except (ValueError, TypeError):
            return None

    def describe(self) -> str:
        job = f", SLURM job {self.job}" if self.job else ""
        return f"host {self.host} pid {self.pid}{job}, started {self.started}, last heartbeat {self.beat_time}"

    def alive_here(self) -> bool | None:
        """Whether the holder's process is alive, when it ran on this host; None for another host."""
        return process_alive(self.host, self.pid, self.pid_start)


class RunLock:
    """The lease on one directory (see the module docstring). ``say``: where one-line notes go (rank 0's
    stdout)."""

    def __init__(self, directory: Path, heartbeat_s: float, timeout_s: float, say=print):
        self.path = Path(directory) / LOCK
        self.heartbeat_s, self.timeout_s, self.say = heartbeat_s, timeout_s, say
        self.me = Holder.me()
        self.fd: int | None = None
        self.lost: str | None = None  # why the lease was lost (set by the heartbeat thread)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- taking it ----

    def acquire(self) -> RunLock:
        """Create the lease, or take over a stale one; :class:`RunLocked` naming a live holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(8):
            if self._create():
                self._thread = threading.Thread(target=self._beat, name="run-lock", daemon=True)
                self._thread.start()
                _HELD.append(self)
                return self
            try:
                holder = Holder.read(self.path)
            except FileNotFoundError:
                continue  # released meanwhile: try again
            why = self._stale(holder)
            self._take_over(holder, why)
        raise RunLocked(f"{self.path}: could not take the run lock (contended by several starting trainers)")

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        except FileExistsError:
            return False
        self.me.beat_time = _now()
        os.pwrite(fd, self.me.dumps(), 0)
        os.fsync(fd)
        self.fd = fd
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return True

    def _refuse(self, holder: Holder, how: str) -> RunLocked:
        return RunLocked(
            f"{self.path}: this run directory is in use by {holder.describe()} ({how}); stop that run first "
            "(or wait for it to end), or use another train.out_dir / checkpoint.dir"
        )

    def _stale(self, holder: Holder | None) -> str:
        """Why ``holder``'s lease is stale, after watching it if need be; raises :class:`RunLocked` if it lives."""
        if holder is not None:
            alive = holder.alive_here()
            if alive:
                raise self._refuse(holder, "its process is alive on this host")
            if alive is False:
                return f"its process {holder.pid} on this host is gone"
            self.say(
                f"[train] {self.path} is held by {holder.describe()}, on another host: waiting up to "
                f"{self.timeout_s:g} s for a heartbeat (checkpoint.lock_timeout_s) before taking it over",
            )
        deadline = time.monotonic() + (self.timeout_s if holder is not None else 2 * self.heartbeat_s)
        while time.monotonic() < deadline:
            time.sleep(min(1.0, self.heartbeat_s / 2))
            try:
                now = Holder.read(self.path)
            except FileNotFoundError:
                return "released while watched"
            if now is not None and (holder is None or (now.token, now.beat) != (holder.token, holder.beat)):
                raise self._refuse(now, "its heartbeat is moving")
        if holder is None:
            return "its record stayed unreadable"
        return f"no heartbeat for {self.timeout_s:g} s"

    def _take_over(self, holder: Holder | None, why: str) -> None:
        if why == "released while watched":
            return
        aside = self.path.with_name(f"{LOCK}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another contender moved it first: start again
        moved = Holder.read(aside)
        if holder is not None and (moved is None or moved.token != holder.token):
            # between our reading and our rename a new holder appeared: put its file back, untouched
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            os.unlink(aside)
            return
        os.unlink(aside)
        who = holder.describe() if holder is not None else "an unreadable record"
        self.say(f"[train] took over {self.path} from {who}: {why}")

    # ---- holding it ----

    def owned(self) -> bool:
        """Whether the file at the path is still the one this process created, holding its token."""
        if self.fd is None:
            return False
        try:
            if os.stat(self.path).st_ino != os.fstat(self.fd).st_ino:
                return False
            holder = Holder.read(self.path)
        except OSError:
            return False
        return holder is not None and holder.token == self.me.token

    def check(self) -> None:
        """Raise :class:`LockLost` unless this process still holds the lease (before every checkpoint commit)."""
        if self.lost is None and not self.owned():
            self.lost = "the lock file was replaced"
        if self.lost is not None:
            raise LockLost(
                f"{self.path}: this trainer lost its run lock ({self.lost}): another trainer took the run directory "
                "over while this one was stalled; stopping without saving"
            )

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if not self.owned():
                self.lost = "another trainer took it over"
                return
            self.me.beat += 1
            self.me.beat_time = _now()
            try:
                os.pwrite(self.fd, self.me.dumps(), 0)
                os.fsync(self.fd)
            except OSError:
                pass  # a full or flaky file system: the next beat tries again; a takeover needs a whole timeout

    def release(self) -> None:
        """Stop the heartbeat and delete the lock file if it is still ours."""
        if self in _HELD:
            _HELD.remove(self)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.fd is not None:
            if self.owned():
                self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


class RunLocks:
    """The leases of a run: its ``train.out_dir`` and, when it lies elsewhere, its checkpoint directory."""

    def __init__(self, dirs: list[Path], heartbeat_s: float, timeout_s: float, say=print):
        self.locks = [RunLock(d, heartbeat_s, timeout_s, say) for d in dirs]

    @classmethod
    def for_run(cls, root: Path, ckpt_dir: Path, heartbeat_s: float, timeout_s: float, say=print) -> RunLocks:
        # resolved: a checkpoint.dir naming out_dir through a symlink or '..' must not get a second lease on the
        # same file (this process would take its own lease over), nor one outside it go unlocked
        root, ckpt_dir = Path(root).resolve(), Path(ckpt_dir).resolve()
        dirs = [root] if ckpt_dir == root or root in ckpt_dir.parents else [root, ckpt_dir]
        return cls(dirs, heartbeat_s, timeout_s, say)

    def acquire(self) -> RunLocks:
        taken = []
        try:
            for lock in self.locks:
                taken.append(lock.acquire())
        except BaseException:
            for lock in taken:
                lock.release()
            raise
        return self

    @property
    def lost(self) -> str | None:
        return next((f"{lk.path}: {lk.lost}" for lk in self.locks if lk.lost), None)

    def check(self) -> None:
        for lock in self.locks:
            lock.check()

    def release(self) -> None:
        for lock in self.locks:
            lock.release()
