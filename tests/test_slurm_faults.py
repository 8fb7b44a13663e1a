"""Faults on the real two-node SLURM cluster: a lost node, a cut network (mid-step and during a checkpoint
save) and a stalled rank, each hitting a ``launchers.slurm submit --nodes 2 --launch torchrun`` job (tiny-cpu LEV,
DP 2: one rank on each node) mid-training.

For each fault, what must hold (docs/launchers.md, "Failures at scale"): the rank that survives names the lost
one (rank and host) within the bound its timeout sets and exits 76; the job does not outlive the fault by more
than SLURM's node timeout (``SlurmdTimeout`` 30 s in the test cluster); ``latest`` never names a checkpoint
begun after the fault; once the node is back, the job (requeued by SLURM or by its own script) resumes from the
latest complete checkpoint, losing at most ``checkpoint.save_interval`` steps, and the steps it trains again give
the very losses they gave before the fault; no process of the job is left on either node.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests import netns_nodes
from tests import slurm_cluster as cluster
from tests.test_slurm import TERMINAL, job_info, log_text, slurm, submitted, wait_jobs

pytestmark = pytest.mark.multiproc
STEPS, SAVE, FAULT_AT = 20, 5, 12
TIMEOUT_S = 15  # parallel.timeout_minutes = 0.25: every training collective, the stop vote included
INIT_TIMEOUT_S = 30  # parallel.init_timeout_minutes = 0.5: start-up and checkpoint saves
SLURMD_TIMEOUT_S = 30  # tests/slurm_cluster.py: SLURM declares a silent node DOWN after this
SLACK_S = 20  # a loaded 2-core machine


@pytest.fixture(scope="module")
def nodes(slurm_cluster) -> netns_nodes.Nodes:
    found = cluster.nodes_of(Path(slurm_cluster["SLURM_CONF"]).parent)
    assert found is not None and len(found.names) == 2
    return found


@pytest.fixture(scope="module")
def overrides(minipile_shards, tokenizer_model) -> list[str]:
    return [
        f"data.prefixes=[{minipile_shards['train']}]",
        f"data.tokenizer={tokenizer_model}",
        "train.micro_batch_size=2",  # DP 2 x 2 = the global batch of 4
        "train.global_batch_size=4",
        f"train.steps={STEPS}",
        "train.eval_interval=0",
        f"checkpoint.save_interval={SAVE}",
        "logging.log_interval=1",
        f"parallel.timeout_minutes={TIMEOUT_S / 60}",
        f"parallel.init_timeout_minutes={INIT_TIMEOUT_S / 60}",
    ]


def logged(run: Path) -> dict[int, float]:
    path = run / "train_log.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def latest(run: Path) -> int | None:
    f = run / "checkpoints" / "latest"
    return int(f.read_text().strip().removeprefix("global_step")) if f.exists() else None


def job_processes(run: Path) -> list[str]:
    """Processes (any namespace: this machine's /proc sees every node's) whose command line names the run."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(run) in cmd:
                out.append(f"{d.name}: {cmd[:160]}")
    return out


def revive(nodes: netns_nodes.Nodes, name: str, stale: set[int] = frozenset(), timeout: float = 90) -> list[str]:
    """Node ``name`` back in service, clean, as after the reboot a cluster's health check gives a node it declared
    DOWN: the processes of the faulted attempt (``stale``, slurmd aside) killed, its link up, its slurmd running,
    SLURM told to resume it if it is DOWN."""
    killed = []
    for p in stale & set(_pids(name)):
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            if os.path.basename(argv[0]) != b"slurmd":
                os.kill(p, signal.SIGKILL)
                killed.append(b" ".join(argv).decode(errors="replace")[:120])
        except (OSError, ProcessLookupError):  # gone meanwhile
            pass
    netns_nodes.set_link(nodes, name, up=True)
    conf = os.environ["SLURM_CONF"]
    if not any("slurmd" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace") for p in _pids(name)):
        subprocess.run(netns_nodes.enter(nodes, name, ["slurmd", "-f", conf, "-N", name]), check=True, timeout=30)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = subprocess.run(["sinfo", "-h", "-n", name, "-o", "%T"], capture_output=True, text=True).stdout.strip()
        if state and "down" not in state and "*" not in state and "drain" not in state:
            return killed
        if "down" in state or "drain" in state:
            subprocess.run(["scontrol", "update", f"nodename={name}", "state=resume"], capture_output=True, timeout=30)
        time.sleep(1)
    raise AssertionError(f"node {name} did not come back within {timeout} s (sinfo: {state})")


def _pids(name: str) -> list[int]:
    return [p for p in netns_nodes.pids(name) if Path(f"/proc/{p}").exists()]


def trainer_pid(name: str) -> int:
    for p in _pids(name):
        cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        if "-m leviathan_pretrain.train" in cmd and "torchrun_node" not in cmd:
            return p
    raise AssertionError(f"no training process in node {name}")


def wait_for(what: str, cond, timeout: float, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"{what}: not within {timeout} s")


def saving_marker(run: Path) -> Path | None:
    for m in (run / "checkpoints").glob("global_step*/leviathan.saving"):
        if int(m.parent.name.removeprefix("global_step")) > SAVE:  # not the first save: a checkpoint exists
            return m
    return None


def submit(run: Path, overrides: list[str], nodes: int) -> str:
    """``submit --launch torchrun`` of the test's run, DP 2: one rank on each of two nodes, or both on one node."""
    geometry = ["--nodes", str(nodes), "--gpus-per-node", "0", "--tasks-per-node", str(2 // nodes)]
    return submitted(
        slurm("submit", "--config", "configs/tiny-cpu-lev.yaml", *geometry, "--launch", "torchrun", "--run-dir", run,
              *overrides)
    )  # fmt: skip


def run_fault(kind: str, nodes, overrides: list[str], tmp_path) -> dict:
    """Submit, inject ``kind`` on node 2, measure, then let the run finish: a stalled rank's job requeues itself
    (exit 76) and resumes on the same nodes; a lost or cut-off node's job is requeued by SLURM, which this test sees
    and then cancels, resubmitting the same command on the node left (DP 2 on one node: the same arithmetic; a job
    requeued under its old id onto a node that comes back can be hit by SLURM's late clean-up of the old attempt)."""
    run = tmp_path / kind
    job = submit(run, overrides, nodes=2)
    victim = nodes.names[1]
    out = {"run": run, "job": job}
    try:
        if kind == "save":  # the link goes down while a checkpoint is being written (its marker exists)
            marker = wait_for("a checkpoint save", lambda: saving_marker(run), 600, poll=0.002)
            netns_nodes.set_link(nodes, victim, up=False)
            out["during_save"] = marker.exists()
        else:
            wait_for(f"step {FAULT_AT}", lambda: max(logged(run), default=0) >= FAULT_AT, 600)
            if kind == "node":
                for p in _pids(victim):  # every process of the node, its slurmd included
                    os.kill(p, signal.SIGKILL)
            elif kind == "link":
                netns_nodes.set_link(nodes, victim, up=False)
            elif kind == "stall":
                os.kill(trainer_pid(victim), signal.SIGSTOP)
        t_fault = time.monotonic()
        out["stale"] = set(_pids(victim))  # the faulted attempt's processes on node 2
        out["before"] = logged(run)
        out["fault_step"] = max(out["before"], default=0)
        out["latest_at_fault"] = latest(run)
        line = re.compile(r"\[rank (\d+) on (\S+)\] lost a peer.*")
        found = wait_for("a rank's 'lost a peer' line", lambda: line.search(log_text(run)), 300, poll=0.1)
        out["detect_s"] = time.monotonic() - t_fault
        out["line"] = found.group(0)
        wait_for("the job to leave RUNNING", lambda: job_info(job).get("JobState") != "RUNNING", 300, poll=0.2)
        out["end_s"] = time.monotonic() - t_fault
        out["latest_after"] = latest(run)
        if kind != "stall":
            info = wait_for("SLURM's requeue", lambda: (i := job_info(job))["Restarts"] == "1" and i, 120)
            out["requeued_by_slurm"] = info["JobState"] in ("PENDING", "REQUEUED", "COMPLETING")
            subprocess.run(["scancel", job], check=True, timeout=30)
            wait_for("the cancel", lambda: job_info(job).get("JobState") in TERMINAL, 120)
            job = out["job"] = submit(run, overrides, nodes=1)
        else:  # the stalled node is up: clean it for the job's own requeue
            out["lingering"] = revive(nodes, victim, out["stale"])
        out["info"] = wait_jobs([job], timeout=600)[job]
    finally:
        if "lingering" not in out:  # after the resumed job (or a failure): node 2 back for the next test
            out["lingering"] = revive(nodes, victim, out.get("stale", set()))
    out["after"] = logged(run)
    out["log"] = log_text(run)
    out["left"] = job_processes(run)
    return out


@pytest.mark.parametrize("kind", ["node", "link", "stall", "save"])
def test_fault_ends_names_and_resumes(kind, nodes, overrides, tmp_path):
    if kind == "save":  # the save's barriers wait init_timeout_minutes: below SLURM's node timeout here
        overrides = [o for o in overrides if "init_timeout" not in o] + [
            f"parallel.init_timeout_minutes={TIMEOUT_S / 60}"
        ]
    r = run_fault(kind, nodes, overrides, tmp_path)
    log, info = r["log"], r["info"]
    victim = nodes.names[1]
    print(
        f"[fault {kind}] at step {r['fault_step']} (latest {r['latest_at_fault']}): detected {r['detect_s']:.1f} s, "
        f"job ended {r['end_s']:.1f} s after the fault, resumed from {r['latest_after']}; left on node 2 when it came "
        f"back: {r['lingering']}; {r['line'][:300]}"
    )
    # the survivor (rank 0 on node 1) names rank 1 on node 2, or a rank cut off says so; exit 76 reaches the launcher
    assert f"on {victim}" in r["line"] and "rank 1" in r["line"], r["line"]
    code = 1 if kind == "node" else 76  # a closed connection: 1 (the peer's own code says why); a timeout: 76
    assert f"worker 0 exited with code {code}" in log, log[-4000:]
    bound = {"node": 5, "link": TIMEOUT_S, "stall": TIMEOUT_S, "save": TIMEOUT_S}[kind]
    assert r["detect_s"] <= bound + SLACK_S, (r["detect_s"], log[-3000:])
    assert r["end_s"] <= max(bound, SLURMD_TIMEOUT_S) + 2 * SLACK_S, (r["end_s"], log[-3000:])
    if kind == "save":
        assert r["during_save"], "the link went down after the save had finished"
    # no checkpoint begun after the fault became latest; the job resumed from the latest complete one and finished
    assert r["latest_after"] == r["latest_at_fault"] or r["latest_after"] <= r["fault_step"], r
    assert info["JobState"] == "COMPLETED", info
    if kind == "stall":
        assert info["Restarts"] == "1", info  # requeued by its own script (exit 76)
    else:
        assert r["requeued_by_slurm"] and info["NumNodes"] == "1", info  # then resubmitted on the node left
    resumed = [json.loads(x) for x in (r["run"] / "train_log.jsonl").read_text().splitlines()]
    resumed = [x for x in resumed if x.get("event") == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] == r["latest_after"], resumed
    assert r["fault_step"] - resumed[0]["step"] <= SAVE, (r["fault_step"], resumed)
    # the steps trained again give the losses they gave before the fault; the run reaches its last step
    again = [s for s in r["before"] if s > resumed[0]["step"]]
    assert again and all(r["after"][s] == r["before"][s] for s in again), (again, r["before"], r["after"])
    assert max(r["after"]) == STEPS
    assert r["left"] == [], r["left"]
    for name in nodes.names:  # only slurmd is left in each node
        for p in _pids(name):
            argv0 = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0]
            assert os.path.basename(argv0) == b"slurmd", (name, p, argv0)
