"""A real single-node SLURM cluster (Debian ``slurm-wlm`` + ``munge``) in a private state folder.

Used by the ``slurm_cluster`` session fixture (tests/conftest.py) and by hand::

    python tests/slurm_cluster.py start /tmp/lev-slurm     # prints: export SLURM_CONF=/tmp/lev-slurm/slurm.conf
    python tests/slurm_cluster.py stop /tmp/lev-slurm

Everything it starts (a private ``munged`` on its own socket and key, ``slurmctld``, ``slurmd``, on free ports)
lives in the state folder and is stopped by the pids in that folder; nothing else on the machine is touched,
except that the short host name is added to /etc/hosts when it does not resolve (slurmd must find itself).
Client commands (``sbatch``, ``squeue``, ``scontrol``, ``srun``) reach this cluster through ``SLURM_CONF``.
Recipe and pitfalls: shared/notes/field-notes.md ("A real single-node SLURM cluster for tests").
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from leviathan_pretrain.ports import free_port  # noqa: E402

DAEMONS = ("slurmd", "slurmctld", "munged")


class ClusterError(RuntimeError):
    pass


def _need(cmd: str) -> str:
    path = shutil.which(cmd) or (f"/usr/sbin/{cmd}" if os.path.exists(f"/usr/sbin/{cmd}") else None)
    if path is None:
        raise ClusterError(f"{cmd} not found: install Debian's slurm-wlm and munge (scripts/setup.sh does)")
    return path


def _run(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, **kw)


def _ensure_hostname_resolves(host: str) -> None:
    try:
        socket.gethostbyname(host)
    except OSError:
        with open("/etc/hosts", "a") as f:
            f.write(f"127.0.0.1 {host}\n")


def _real_memory_mb() -> int:
    out = _run([_need("slurmd"), "-C"]).stdout
    for tok in out.split():
        if tok.startswith("RealMemory="):
            return max(256, int(tok.split("=", 1)[1]) - 256)
    return 1024


def _write_conf(state: Path, host: str) -> Path:
    ctld_port, slurmd_port = free_port(), free_port()
    conf = state / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=levtest",
                f"SlurmctldHost={host}",
                "SlurmUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={state}/munge/munge.socket,cred_expire=10",  # a requeued job starts after this
                f"SlurmctldPort={ctld_port}",
                f"SlurmdPort={slurmd_port}",
                f"StateSaveLocation={state}/ctld",
                f"SlurmdSpoolDir={state}/slurmd",
                f"SlurmctldPidFile={state}/slurmctld.pid",
                f"SlurmdPidFile={state}/slurmd.pid",
                f"SlurmctldLogFile={state}/slurmctld.log",
                f"SlurmdLogFile={state}/slurmd.log",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                f"JobCompType=jobcomp/filetxt\nJobCompLoc={state}/jobcomp.txt",
                "MpiDefault=none",
                "ReturnToService=2",
                "MinJobAge=600",
                "KillWait=10",
                "SchedulerParameters=sched_interval=1",
                "SlurmctldDebug=info",
                "SlurmdDebug=info",
                f"NodeName={host} CPUs={os.cpu_count()} RealMemory={_real_memory_mb()} State=UNKNOWN",
                f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
                "",
            ]
        )
    )
    return conf


def start(state: Path, timeout: float = 60.0) -> dict:
    """Start munged, slurmctld and slurmd in ``state``; return the environment clients need."""
    if os.geteuid() != 0:
        raise ClusterError("starting slurmd needs root (CI runs as root)")
    state = Path(state).resolve()
    if (state / "slurm.conf").exists():
        stop(state)
    host = socket.gethostname().split(".")[0]
    _ensure_hostname_resolves(host)
    for sub in ("munge", "ctld", "slurmd"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    munge = state / "munge"
    user = pwd.getpwnam("munge")
    key = munge / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
    for p in (munge, key):
        os.chown(p, user.pw_uid, user.pw_gid)
    os.chmod(munge, 0o755)  # munged: the socket folder must be searchable by all
    os.chmod(key, 0o600)
    state.chmod(0o755)
    p = _run(
        [
            "runuser",
            "-u",
            "munge",
            "--",
            _need("munged"),
            f"--socket={munge}/munge.socket",
            f"--key-file={key}",
            f"--pid-file={munge}/munged.pid",
            f"--log-file={munge}/munged.log",
            f"--seed-file={munge}/munged.seed",
        ]
    )
    if p.returncode != 0:
        raise ClusterError(f"munged failed to start: {p.stderr.strip()}")
    conf = _write_conf(state, host)
    env = {"SLURM_CONF": str(conf)}
    for daemon in ("slurmctld", "slurmd"):
        args = [_need(daemon), "-f", str(conf)] + (["-i"] if daemon == "slurmctld" else [])
        p = _run(args, env={**os.environ, **env})  # slurmstepd and the jobs inherit SLURM_CONF: see stop()
        if p.returncode != 0:
            raise ClusterError(f"{daemon} failed to start ({p.returncode}): {p.stderr.strip()}\n{_log_tail(state)}")
    deadline = time.monotonic() + timeout
    state_seen = ""
    while time.monotonic() < deadline:
        p = _run([_need("sinfo"), "-h", "-o", "%T"], env={**os.environ, **env})
        state_seen = p.stdout.strip() or p.stderr.strip()
        if state_seen == "idle":
            return env
        time.sleep(0.5)
    raise ClusterError(f"the node did not become idle within {timeout:.0f} s (sinfo: {state_seen})\n{_log_tail(state)}")


def drain(timeout: float = 60.0) -> None:
    """Cancel every job of the cluster ``SLURM_CONF`` names and wait until SLURM has none running."""
    _run(["scancel", "--full", "--state=RUNNING"])
    _run(["scancel", "--state=PENDING"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = _run(["squeue", "-h", "-o", "%i"])
        if p.returncode != 0 or not p.stdout.strip():
            return
        time.sleep(0.5)


def _log_tail(state: Path) -> str:
    out = []
    for name in ("slurmctld.log", "slurmd.log", "munge/munged.log"):
        f = state / name
        if f.exists():
            out.append(f"--- {f}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(out)


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def stop(state: Path, timeout: float = 20.0) -> None:
    """Stop what :func:`start` started in ``state``, by its pid files (SIGTERM, then SIGKILL)."""
    state = Path(state)
    pids = [
        _pid(state / "slurmd.pid"),
        _pid(state / "slurmctld.pid"),
        _pid(state / "munge" / "munged.pid"),
    ]
    pids = [p for p in pids if p]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    for pid in pids + _processes_of(state / "slurm.conf"):  # and any slurmstepd or job process left behind
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _processes_of(conf: Path) -> list[int]:
    """Processes whose environment names this cluster's ``SLURM_CONF`` (its slurmstepd and job processes)."""
    needle = f"SLURM_CONF={conf}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie (nothing reaps it) is gone
    except (OSError, IndexError):
        return False


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("start", "stop"):
        sys.exit("usage: python tests/slurm_cluster.py start|stop STATE_DIR")
    if sys.argv[1] == "start":
        env = start(Path(sys.argv[2]))
        print(f"export SLURM_CONF={env['SLURM_CONF']}")
    else:
        stop(Path(sys.argv[2]))
