"""A real multi-node SLURM cluster (Debian ``slurm-wlm`` + ``munge``) on one machine, in a private state folder.

Each node is a separate "machine" (tests/netns_nodes.py): a network namespace with its own address on a private
bridge and its own host name, running its own ``slurmd``; ``slurmctld`` and a private ``munged`` run in the root
namespace. A job's processes live in their node's namespaces, so killing a node's processes or taking its link
down is a real node loss or network partition for the job. Used by the ``slurm_cluster`` session fixture
(tests/conftest.py, two nodes) and by hand::

    python tests/slurm_cluster.py start /tmp/lev-slurm --nodes 2   # prints: export SLURM_CONF=.../slurm.conf
    python tests/slurm_cluster.py stop /tmp/lev-slurm

Everything it starts lives in the state folder (daemons stopped by their pid files) or carries the cluster's tag
(namespaces, bridge, veths, /etc/hosts lines: see netns_nodes); a cluster whose session was killed is cleaned at
the next start. The machine's short host name is added to /etc/hosts when it does not resolve (slurmctld must
find itself). Client commands (``sbatch``, ``squeue``, ``scontrol``, ``srun``) reach the cluster through
``SLURM_CONF``. Recipes and pitfalls: shared/notes/field-notes.md ("A real single-node SLURM cluster for tests",
"A real multi-node SLURM cluster on one machine").
"""

from __future__ import annotations

import json
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
from leviathan_pretrain.parallel.ports import free_port  # noqa: E402
from tests import netns_nodes  # noqa: E402

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
        with netns_nodes.hosts_lock(), open("/etc/hosts", "a") as f:
            f.write(f"127.0.0.1 {host}\n")


def _real_memory_mb() -> int:
    out = _run([_need("slurmd"), "-C"]).stdout
    for tok in out.split():
        if tok.startswith("RealMemory="):
            return max(256, int(tok.split("=", 1)[1]) - 256)
    return 1024


def _write_conf(state: Path, host: str, nodes: netns_nodes.Nodes) -> Path:
    ctld_port, slurmd_port = free_port(), free_port()
    conf = state / "slurm.conf"
    mem = max(256, _real_memory_mb() // nodes.count)
    node_lines = [
        f"NodeName={name} NodeAddr={nodes.addr(i)} CPUs={os.cpu_count()} RealMemory={mem} State=UNKNOWN"
        for i, name in enumerate(nodes.names)
    ]
    conf.write_text(
        "\n".join(
            [
                "ClusterName=levtest",
                f"SlurmctldHost={host}({nodes.gateway})",  # the real host name: any other is "not a valid controller"
                "SlurmUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={state}/munge/munge.socket,cred_expire=10",  # a requeued job starts after this
                f"SlurmctldPort={ctld_port}",
                f"SlurmdPort={slurmd_port}",
                f"StateSaveLocation={state}/ctld",
                f"SlurmdSpoolDir={state}/slurmd-%n",
                f"SlurmctldPidFile={state}/slurmctld.pid",
                f"SlurmdPidFile={state}/slurmd-%n.pid",
                f"SlurmctldLogFile={state}/slurmctld.log",
                f"SlurmdLogFile={state}/slurmd-%n.log",
                f"TmpFS={state}/tmp-%n",  # per node: srun --mpi=pmix makes its step folders there, one name per step
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
                "SlurmdTimeout=30",  # a lost node is DOWN (its jobs ended, requeued) after 30 s, not the default 300
                "SchedulerParameters=sched_interval=1",
                "SlurmctldDebug=info",
                "SlurmdDebug=info",
                *node_lines,
                f"PartitionName=debug Nodes={','.join(nodes.names)} Default=YES MaxTime=INFINITE State=UP "
                "OverSubscribe=NO",
                "",
            ]
        )
    )
    return conf


def _start_munged(state: Path) -> None:
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


def clean_stale() -> list[str]:
    """Stop and remove the clusters of killed sessions (their nodes' records name them); returns their tags."""
    tags = []
    for nodes in netns_nodes.stale():
        stop(Path(nodes.state), nodes=nodes)
        tags.append(nodes.tag)
    return tags


def start(state: Path, nodes: int = 2, timeout: float = 60.0, owner: int | None = None) -> dict:
    """Start munged, slurmctld and ``nodes`` slurmd nodes in ``state``; return the environment clients need.
    ``owner``: the pid whose death makes the cluster stale, cleaned by the next start (default: this process;
    0: never, a cluster started by hand)."""
    if os.geteuid() != 0:
        raise ClusterError("starting slurmd needs root (CI runs as root)")
    state = Path(state).resolve()
    clean_stale()
    if (state / "slurm.conf").exists():
        stop(state)
    host = socket.gethostname().split(".")[0]
    _ensure_hostname_resolves(host)
    state.mkdir(parents=True, exist_ok=True)
    for sub in ("munge", "ctld"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    _start_munged(state)
    try:
        made = netns_nodes.create(nodes, state, os.getpid() if owner is None else owner)
    except netns_nodes.NodesError as e:
        raise ClusterError(f"the nodes could not be made: {e}") from e
    (state / "nodes.json").write_text(json.dumps({"tag": made.tag}))
    for name in made.names:  # the nodes share this machine's file system: each its own spool and TmpFS
        for sub in (f"slurmd-{name}", f"tmp-{name}"):
            (state / sub).mkdir(exist_ok=True)
    conf = _write_conf(state, host, made)
    env = {"SLURM_CONF": str(conf)}
    denv = {**os.environ, **env}  # slurmstepd and the jobs inherit SLURM_CONF: see stop()
    p = _run([_need("slurmctld"), "-f", str(conf), "-i"], env=denv)
    if p.returncode != 0:
        raise ClusterError(f"slurmctld failed to start ({p.returncode}): {p.stderr.strip()}\n{_log_tail(state)}")
    for name in made.names:
        p = _run(netns_nodes.enter(made, name, [_need("slurmd"), "-f", str(conf), "-N", name]), env=denv)
        if p.returncode != 0:
            raise ClusterError(
                f"slurmd of {name} failed to start ({p.returncode}): {p.stderr.strip()}\n{_log_tail(state)}"
            )
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        p = _run([_need("sinfo"), "-h", "-N", "-o", "%N %T"], env=denv)
        seen = p.stdout.strip() or p.stderr.strip()
        states = dict(line.split() for line in p.stdout.splitlines() if len(line.split()) == 2)
        if sorted(states) == sorted(made.names) and set(states.values()) == {"idle"}:
            return {**env, "LEV_TEST_NODES": ",".join(made.names)}
        time.sleep(0.5)
    raise ClusterError(f"the nodes did not become idle within {timeout:.0f} s (sinfo: {seen})\n{_log_tail(state)}")


def nodes_of(state: Path) -> netns_nodes.Nodes | None:
    """The nodes of the cluster in ``state`` (None: none recorded, or already removed)."""
    try:
        tag = json.loads((Path(state) / "nodes.json").read_text())["tag"]
        return netns_nodes.Nodes(**json.loads((netns_nodes.REGISTRY / f"{tag}.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
    for f in [state / "slurmctld.log", *sorted(state.glob("slurmd-*.log")), state / "munge" / "munged.log"]:
        if f.exists():
            out.append(f"--- {f}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(out)


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def stop(state: Path, timeout: float = 20.0, nodes: netns_nodes.Nodes | None = None) -> None:
    """Stop what :func:`start` started in ``state``, by its pid files (SIGTERM, then SIGKILL), every process
    left in its nodes, and remove the nodes (``nodes``: given when the state folder may be gone)."""
    state = Path(state)
    nodes = nodes or nodes_of(state)
    pids = [
        *(_pid(f) for f in state.glob("slurmd-*.pid")),
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
    while time.monotonic() < deadline and any(netns_nodes.alive(p) for p in pids):
        time.sleep(0.2)
    in_nodes = [p for name in (nodes.names if nodes else []) for p in netns_nodes.pids(name)]
    for pid in pids + _processes_of(state / "slurm.conf") + in_nodes:  # any slurmstepd or job process left
        if netns_nodes.alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if nodes is not None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(netns_nodes.alive(p) for p in in_nodes):
            time.sleep(0.2)
        netns_nodes.destroy(nodes)


def _processes_of(conf: Path) -> list[int]:
    """Processes whose environment names this cluster's ``SLURM_CONF`` (its daemons, slurmstepd and job processes)
    or whose command line names its munge socket (its munged, when the pid files are gone with the state folder)."""
    needle = f"SLURM_CONF={conf}".encode()
    socket_arg = f"--socket={conf.parent / 'munge' / 'munge.socket'}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0") or socket_arg in (
                    d / "cmdline"
                ).read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python tests/slurm_cluster.py", description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=("start", "stop"))
    ap.add_argument("state", type=Path, help="the cluster's state folder")
    ap.add_argument("--nodes", type=int, default=2, help="start: nodes (default 2)")
    args = ap.parse_args(argv)
    if args.action == "start":
        env = start(args.state, nodes=args.nodes, owner=0)  # by hand: stopped by hand
        print(f"export SLURM_CONF={env['SLURM_CONF']}  # nodes: {env['LEV_TEST_NODES']}")
    else:
        stop(args.state)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
