"""The lost-peer diagnosis (leviathan_pretrain/trainer/peers.py) and the exit codes a communication failure gets
(trainer/faults.py), in one process: a real c10d TCPStore stands for the job's store, the pulses are written into it
as the ranks' pulse threads write them. The real faults across two nodes: tests/test_slurm_faults.py."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from leviathan_pretrain.trainer import peers
from leviathan_pretrain.trainer.faults import lost_peer

GLOO_TIMEOUT = "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 15000ms for recv"
GLOO_CLOSED = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.9.8.2]:41234. This is typically..."


@pytest.fixture(autouse=True)
def _no_thread_outlives_a_test():
    """The diagnosis reads and the pulse run in daemon threads; one still inside a c10d call when the interpreter
    exits aborts it ("terminate called without an active exception"; the trainer leaves by ``os._exit``): join them."""
    yield
    for t in threading.enumerate():
        if t.name.startswith("lev-peers-"):
            t.join(30)
            assert not t.is_alive(), t.name


@pytest.fixture
def store(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    return master


def table(rank: int = 0) -> peers.Peers:
    return peers.Peers(rank, ["node1", "node2", "node2"], ["10.9.8.1", "10.9.8.2", "10.9.8.2"], pulse_s=1.0)


def pulse(store, rank: int, step: int, age_s: float) -> None:
    store.set(f"{peers.ALIVE}{rank}", f"{step} {time.time() - age_s:.3f}")


def test_a_stale_pulse_names_the_rank_and_host(store):
    pulse(store, 1, 7, age_s=0.5)
    pulse(store, 2, 5, age_s=40)  # stopped 40 s ago, in step 5
    said = table().diagnose(GLOO_TIMEOUT)
    assert said.startswith("not answering: rank 2 on node2 (rank 2 last seen in step 5, 40 s ago)"), said
    assert "rank 1" not in said


def test_a_rank_that_never_pulsed_is_named(store):
    pulse(store, 1, 7, age_s=0.2)
    assert "not answering: rank 2 on node2 (rank 2 never seen)" in table().diagnose(GLOO_TIMEOUT)


def test_fresh_pulses_name_nobody(store):
    pulse(store, 1, 7, age_s=0.1)
    pulse(store, 2, 7, age_s=0.1)
    assert table().diagnose(GLOO_TIMEOUT) == "every rank pulsed within the last 3 s (a slow rank, not a stalled one?)"


def test_a_closed_connection_names_the_ranks_at_its_address(store):
    pulse(store, 1, 7, age_s=0.1)
    pulse(store, 2, 7, age_s=0.1)
    said = table().diagnose(GLOO_CLOSED)
    assert said == "the connection to 10.9.8.2 (ranks 1, 2 on node2) closed", said
    loop = peers.Peers(0, ["a", "a", "b"], ["10.0.0.1", "10.0.0.1", "10.0.0.2"], pulse_s=1.0)
    said = loop.diagnose("Connection closed by peer [127.0.0.1]:5000")  # ranks on one host talk over loopback
    assert said.startswith("the connection to 127.0.0.1 (rank 1 on a) closed"), said


def test_a_store_that_does_not_answer_is_said_and_never_waited_on(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)  # the connection is taken (by the kernel), nothing ever answers on it: a store cut off
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
        monkeypatch.setattr(peers, "READ_S", 1.0)
        t0 = time.monotonic()
        said = table().diagnose(GLOO_TIMEOUT)
        assert "the job's store did not answer" in said and "this rank may be the one cut off" in said, said
        assert time.monotonic() - t0 < 3


def test_a_store_whose_host_process_is_gone_is_said_so_at_once(monkeypatch, capfd):
    """Refused (nothing listens: the process that hosted the store died with the peer, as rank 0 under
    launchers/local.py): said as gone, not as this rank being cut off, without c10d's retries (a C++ stack each)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    t0 = time.monotonic()
    said = table().diagnose(GLOO_CLOSED)
    assert said == (
        f"the connection to 10.9.8.2 (ranks 1, 2 on node2) closed; the job's store is gone too (nothing listens at "
        f"127.0.0.1:{port}: it went with the process that hosted it)"
    ), said
    assert time.monotonic() - t0 < 1
    assert "frame #" not in capfd.readouterr().err


def test_the_pulse_thread_writes_this_ranks_step(store):
    me = table(rank=1)
    me.beat(12)
    me.start_pulse(timeout_s=10)
    try:
        deadline = time.monotonic() + 10
        while not store.check([f"{peers.ALIVE}1"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        step, at = store.get(f"{peers.ALIVE}1").decode().split()
        assert step == "12" and abs(time.time() - float(at)) < 5
    finally:
        me.stop()


@pytest.mark.parametrize(
    "error, kind",
    [
        (RuntimeError(GLOO_TIMEOUT), "timeout"),
        (RuntimeError(GLOO_CLOSED), "closed"),
        (RuntimeError("[c10d] Connection reset by peer"), "closed"),
        (dist.DistBackendError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)"), "timeout"),
        (RuntimeError("DataLoader worker timed out"), None),  # a timeout, but not the communication's
        (ValueError("Timed out waiting for gloo"), None),
        (RuntimeError("CUDA out of memory"), None),
    ],
)
def test_which_errors_are_a_lost_peer(error, kind):
    assert lost_peer(error) == kind
