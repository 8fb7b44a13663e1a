"""The test cluster itself (tests/slurm_cluster.py, tests/netns_nodes.py): its nodes are separate machines to the
network, and a cluster whose session was killed is found and removed whole at the next start."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests import netns_nodes
from tests import slurm_cluster as cluster
from tests.multiproc import REPO, base_env

pytestmark = pytest.mark.multiproc


def _leftovers(nodes: netns_nodes.Nodes) -> list[str]:
    out = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30).stdout
    out += [f"namespace {n}" for n in nodes.names if n in netns]
    out += [f"link {x}" for x in (nodes.bridge, *map(nodes.veth, range(nodes.count))) if f" {x}" in links]
    out += [f"/etc/hosts: {line}" for line in Path("/etc/hosts").read_text().splitlines() if nodes.tag in line]
    out += [f"record {p}" for p in netns_nodes.REGISTRY.glob(f"{nodes.tag}.json")]
    return out


def _sleeps(node: str) -> list[int]:
    def cmd(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    return [pid for pid in netns_nodes.pids(node) if cmd(pid).split(b"\0")[0].endswith(b"/sleep")]


def test_a_killed_sessions_cluster_is_removed_at_the_next_start(slurm_cluster):
    """A process starts a two-node cluster, runs a job across it, and dies without stopping anything (SIGKILL of
    a test session). Its daemons, job, namespaces, veths, bridge and /etc/hosts lines outlive it; the next start
    (here clean_stale, which start runs first) removes exactly those, and leaves this session's cluster alone."""
    state = Path(tempfile.mkdtemp(prefix="lev-slurm-orphan-"))  # not under tmp_path: munged cannot reach into 0700
    code = (
        "import os, subprocess, sys; sys.path.insert(0, sys.argv[2]); from tests import slurm_cluster as c; "
        "env = c.start(sys.argv[1], nodes=2); "
        "subprocess.run(['sbatch', '-N', '2', '-o', sys.argv[1] + '/job-%j.out', '--wrap', 'srun sleep 300'], "
        "env={**os.environ, **env}, check=True); "
        "print(env['LEV_TEST_NODES'], flush=True); os._exit(0)"
    )
    try:
        _orphan_then_clean(code, state, slurm_cluster)
    finally:
        cluster.stop(state)  # whatever the assertions left (nothing, when they pass)
        shutil.rmtree(state, ignore_errors=True)


def _orphan_then_clean(code: str, state: Path, slurm_cluster: dict) -> None:
    p = subprocess.run(
        [sys.executable, "-c", code, str(state), str(REPO)], env=base_env(), capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    orphan = cluster.nodes_of(state)
    assert orphan is not None and orphan.names == p.stdout.split()[-1].split(","), p.stdout
    deadline = time.monotonic() + 60  # the job's srun task (sleep) runs in the second node's namespace too
    while time.monotonic() < deadline and not _sleeps(orphan.names[1]):
        time.sleep(0.5)
    assert _sleeps(orphan.names[1]), "the job's task did not start on the second node"
    in_nodes = [pid for name in orphan.names for pid in netns_nodes.pids(name)]
    hosts_before = Path("/etc/hosts").read_text().splitlines()
    others = [p for p in netns_nodes.REGISTRY.iterdir() if p.name != f"{orphan.tag}.json"]  # this session's record
    assert _leftovers(orphan) and orphan in netns_nodes.stale()

    assert orphan.tag in cluster.clean_stale()
    assert _leftovers(orphan) == []
    # only what the orphan's record names went: every other /etc/hosts line (this session's nodes, localhost)
    # and every other file in the registry folder stay, byte for byte
    assert Path("/etc/hosts").read_text().splitlines() == [x for x in hosts_before if not x.endswith(orphan.hosts_mark)]
    assert others and all(p.exists() for p in others)
    assert not [pid for pid in in_nodes if netns_nodes.alive(pid)]
    assert not cluster._processes_of(state / "slurm.conf")  # no daemon of it (munged included) either
    # this session's cluster was not stale, and still runs jobs on both nodes
    names = slurm_cluster["LEV_TEST_NODES"].split(",")
    out = subprocess.run(["srun", "-N", "2", "hostname"], capture_output=True, text=True, timeout=120)
    assert sorted(out.stdout.split()) == sorted(names), out.stderr
