"""Separate "machines" on one host for the test SLURM cluster: each node a network namespace with its own address
on a private bridge and its own host name (a UTS namespace, entered where its ``slurmd`` starts).

Everything made here carries one tag, unique to the cluster, and is written down before it is made, in
``REGISTRY/<tag>.json`` (with the creating process's pid and the cluster's state folder): the bridge ``lvb<tag>``,
namespaces and host names ``lev<tag>n<i>``, host-side veths ``lvv<tag><i>``, and ``/etc/hosts`` lines ending in
``# lev-test-nodes <tag>``. :func:`destroy` removes exactly what its record names (each step tolerates "already
gone"); :func:`stale` lists the records whose owner (the test session's process) is dead, which the cluster
cleans before it starts; nodes made by hand (owner 0) are removed only by their own ``stop``. Nothing without our
tag and record is ever removed.

Faults for the tests: :func:`pids` (every process in a node's namespace: kill them all for a node loss) and
:func:`set_link` (a node's link down: a network partition; its processes keep running and their sockets stay open).
Recipe: shared/notes/field-notes.md ("A real multi-node SLURM cluster on one machine").
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

REGISTRY = Path("/run/lev-test-nodes")
HOSTS = Path("/etc/hosts")
NETNS_DIR = Path("/var/run/netns")


class NodesError(RuntimeError):
    pass


@dataclass
class Nodes:
    tag: str
    subnet: str  # the first three octets, e.g. "10.123.45"
    count: int
    owner: int  # pid of the process whose death makes them stale (0: made by hand, never stale)
    state: str  # the cluster's state folder (its daemons' pid files)

    @property
    def bridge(self) -> str:
        return f"lvb{self.tag}"

    @property
    def names(self) -> list[str]:
        return [f"lev{self.tag}n{i + 1}" for i in range(self.count)]

    def veth(self, i: int) -> str:
        return f"lvv{self.tag}{i + 1}"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{11 + i}"

    @property
    def gateway(self) -> str:
        """The bridge's own address in the root namespace (where slurmctld listens)."""
        return f"{self.subnet}.1"

    @property
    def hosts_mark(self) -> str:
        return f"# lev-test-nodes {self.tag}"

    def index(self, name: str) -> int:
        return self.names.index(name)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise NodesError(f"ip {' '.join(args)}: {p.stderr.strip()}")
    return p


def _used_subnets() -> set[str]:
    out = _ip("-o", "-4", "addr", "show").stdout + _ip("-4", "route", "show").stdout
    return {".".join(a.split(".")[:3]) for a in re.findall(r"\b(\d+\.\d+\.\d+\.\d+)", out)}


@contextlib.contextmanager
def hosts_lock():
    """/etc/hosts is edited in place (read, filter, write): test processes side by side (xdist workers, each with a
    cluster of its own) take turns, or one could write back a file without the other's new lines."""
    REGISTRY.mkdir(parents=True, exist_ok=True)
    with open(REGISTRY / ".hosts.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _record_path(tag: str) -> Path:
    return REGISTRY / f"{tag}.json"


def _write_record(nodes: Nodes) -> None:
    REGISTRY.mkdir(parents=True, exist_ok=True)
    tmp = _record_path(nodes.tag).with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(nodes)))
    tmp.replace(_record_path(nodes.tag))


def create(count: int, state: Path, owner: int) -> Nodes:
    """``count`` nodes on a fresh bridge and subnet; their names resolve everywhere through /etc/hosts. ``owner``:
    the pid whose death makes them stale (0: never)."""
    if os.geteuid() != 0:
        raise NodesError("network namespaces need root (CI runs as root)")
    used = _used_subnets()
    rng = random.SystemRandom()
    for _ in range(200):
        subnet = f"10.{rng.randrange(64, 250)}.{rng.randrange(0, 256)}"
        tag = f"{rng.randrange(16**4):04x}"
        if subnet not in used and not _record_path(tag).exists():
            break
    else:
        raise NodesError("no free 10.x.y.0/24 subnet found")
    nodes = Nodes(tag=tag, subnet=subnet, count=count, owner=owner, state=str(Path(state).resolve()))
    _write_record(nodes)  # before anything is made: a crash from here on leaves a record to clean by
    try:
        _ip("link", "add", nodes.bridge, "type", "bridge")
        _ip("addr", "add", f"{nodes.gateway}/24", "dev", nodes.bridge)
        _ip("link", "set", nodes.bridge, "up")
        for i, name in enumerate(nodes.names):
            _ip("netns", "add", name)
            _ip("link", "add", nodes.veth(i), "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", nodes.veth(i), "master", nodes.bridge, "up")
            _ip("-n", name, "addr", "add", f"{nodes.addr(i)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
        with hosts_lock(), HOSTS.open("a") as f:
            f.write("".join(f"{nodes.addr(i)} {name} {nodes.hosts_mark}\n" for i, name in enumerate(nodes.names)))
    except BaseException:
        destroy(nodes)
        raise
    return nodes


def enter(nodes: Nodes, name: str, argv: list[str]) -> list[str]:
    """``argv`` run inside node ``name``: its network namespace, a UTS namespace of its own with its host name.
    Not ``ip netns exec``: that also makes a mount namespace with a fresh /sys, where slurmd finds no cgroups."""
    script = 'hostname "$1"; shift; exec "$@"'
    return ["nsenter", f"--net={NETNS_DIR / name}", "unshare", "--uts", "sh", "-c", script, "sh", name, *argv]


def pids(name: str) -> list[int]:
    """Every process in node ``name``'s network namespace."""
    p = _ip("netns", "pids", name, check=False)
    return [int(x) for x in p.stdout.split()]


def set_link(nodes: Nodes, name: str, up: bool) -> None:
    """Node ``name``'s cable in or out: its end of the veth pair on the bridge, up or down."""
    _ip("link", "set", nodes.veth(nodes.index(name)), "up" if up else "down")


def _remove_hosts_lines(mark: str) -> None:
    with hosts_lock():
        try:
            lines = HOSTS.read_text().splitlines(keepends=True)
        except OSError:
            return
        kept = [line for line in lines if not line.rstrip("\n").endswith(mark)]
        if len(kept) != len(lines):
            with HOSTS.open("w") as f:  # in place: /etc/hosts may be a bind mount, which a rename cannot replace
                f.writelines(kept)


def destroy(nodes: Nodes) -> None:
    """Remove what ``nodes``' record names: hosts lines, namespaces (with their veth ends), veths, bridge, record.
    Processes still in a namespace are the caller's to stop first (the namespace lingers while they live)."""
    _remove_hosts_lines(nodes.hosts_mark)
    for i, name in enumerate(nodes.names):
        _ip("link", "del", nodes.veth(i), check=False)
        _ip("netns", "del", name, check=False)
    _ip("link", "del", nodes.bridge, check=False)
    _record_path(nodes.tag).unlink(missing_ok=True)


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, which nothing here reaps, is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def stale() -> list[Nodes]:
    """The records whose creating process is gone: a killed session's nodes, to be cleaned."""
    out = []
    for rec in sorted(REGISTRY.glob("*.json")) if REGISTRY.is_dir() else []:
        try:
            nodes = Nodes(**json.loads(rec.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if nodes.owner and not alive(nodes.owner):
            out.append(nodes)
    return out
