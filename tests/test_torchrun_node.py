"""``launchers.torchrun_node`` (the per-node command of a ``--launch torchrun`` SLURM job) keeps its workers' exit
code whatever SIGTERMs reach it: ``srun --kill-on-bad-exit=1`` ends every task of the step (one SIGTERM to each
process) as soon as one node's task exits 75, at any moment of the others' lives, their interpreter's exit
included. A task that died of that SIGTERM made srun report 143 and the job was not requeued (seen in CI: the
preempted two-node job of test_slurm.py, "srun: Force Terminated", "training exited with code 143").

The agent runs on this machine (``--standalone``, one worker); the worker stands for the trainer: it counts the
SIGTERMs it gets, then ignores them and exits 75, like a trainer that checkpointed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multiproc import REPO, base_env

pytestmark = pytest.mark.multiproc

WORKER = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
open(sys.argv[1], "w").close()  # started
time.sleep(float(sys.argv[2]))
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1], "w") as f:
    f.write(str(len(got)))
sys.exit(75)
"""


def start_agent(tmp_path: Path, worker_seconds: float) -> tuple[subprocess.Popen, Path]:
    script, marker = tmp_path / "worker.py", tmp_path / "worker.state"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "launchers.torchrun_node", "--standalone", "--nproc-per-node=1",
           "--monitor-interval=0.05", str(script), str(marker), str(worker_seconds)]  # fmt: skip
    agent = subprocess.Popen(cmd, cwd=REPO, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 90
    while not marker.exists():
        assert agent.poll() is None and time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.02)
    return agent, marker


def finish(agent: subprocess.Popen) -> str:
    try:
        return agent.communicate(timeout=60)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_a_sigterm_to_the_agent_reaches_the_worker_and_the_workers_code_stands(tmp_path):
    """A SIGTERM to the agent alone (torchrun's own handling raised in the agent: exit 1, the worker's 75 lost)."""
    agent, marker = start_agent(tmp_path, worker_seconds=2)
    agent.send_signal(signal.SIGTERM)
    out = finish(agent)
    assert agent.returncode == 75, out[-3000:]
    assert marker.read_text() == "1", "the worker did not get the agent's SIGTERM"
    assert "worker 0 exited with code 75" in out


def test_sigterms_all_the_way_to_the_agents_exit_never_change_its_code(tmp_path):
    """SIGTERM every few ms from the worker's start to the agent's exit: every moment of the agent's life is hit,
    its interpreter's shutdown included (where Python puts back the default action of a signal it handled)."""
    agent, marker = start_agent(tmp_path, worker_seconds=1)
    sent = 0
    while agent.poll() is None:
        try:
            os.kill(agent.pid, signal.SIGTERM)
            sent += 1
        except ProcessLookupError:
            break
        time.sleep(0.005)
    out = finish(agent)
    assert agent.returncode == 75, (agent.returncode, sent, out[-3000:])
    assert sent > 50  # the storm lasted the worker's second, the agent's exit included
