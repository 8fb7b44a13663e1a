"""Who runs where, and which rank stopped answering: the message a lost peer ends a rank with.

A multi-node run fails in three ways that look alike from the inside: a node dies (its ranks' connections close
within a second), the network between nodes is cut, or a rank stalls (a hung GPU, a stopped process: its sockets
stay open, nothing crashes). The last two surface only as a collective timing out after
``parallel.timeout_minutes``, and gloo's or NCCL's message names neither the rank nor the host. So:

- :func:`record_peers` (collective, once after set-up) gathers every rank's host name and address, and starts a
  *pulse*: a daemon thread writing ``STEP TIME`` under ``lev/alive/RANK`` every :data:`PULSE_S` seconds (a sixth
  of ``parallel.timeout_minutes`` when that is shorter) into the job's c10d store (``MASTER_ADDR:MASTER_PORT``:
  torchrun's agent store, or rank 0's with ``srun``), through a client of its own. A stopped process, a dead node
  or a rank cut off from the store stops pulsing; a rank busy in a long collective does not.
- when a collective fails, :meth:`Peers.diagnose` names the ranks behind it: the address in the error (a closed
  connection names its peer) mapped to its ranks and host, and the ranks whose pulse is older than :data:`STALE`
  intervals. Reading the store happens in a thread given :data:`READ_S` seconds (a TCP connection into a cut
  network blocks regardless of the store's timeout); a store that does not answer (it lived on the lost node, or
  this rank is the one cut off) is said as such, and one whose address refuses the connection (the process that
  hosted it is gone: rank 0 under ``launchers/local.py`` or ``srun``) as gone, without c10d's retries.

Nothing here waits on the training path: the main thread never touches the store, so no rank waits longer than
the collectives' own timeouts. This is a diagnosis, not a watchdog (nothing is killed here): the bound is
``parallel.timeout_minutes``; nvidia-resiliency-ext's ``ft_launcher`` is the watchdog that restarts a hung rank
sooner (docs/launchers.md, "Failures at scale").
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

ALIVE = "lev/alive/"
ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")
PULSE_S = 5.0  # seconds between a rank's pulses (at most; a sixth of parallel.timeout_minutes when that is shorter)
STALE = 3  # a pulse older than this many intervals: the rank is not answering
READ_S = 5.0  # the diagnosis waits this long for the store
PROBE_S = 0.2  # a connection to the store that stays silent this long: its process lives
SHOWN = 8  # ranks named in a message at most
CURRENT: "Peers | None" = None  # this process's table, for the fault handler (set by record_peers)


def _address(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def _store_client(timeout_s: float):
    """A client of the job's c10d store of its own (None without MASTER_ADDR/MASTER_PORT: one plain process)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class StoreGone(RuntimeError):
    """Nothing listens at the job's store's address: the process (or node) that hosted it is gone."""


def _probe(timeout_s: float) -> None:
    """A plain TCP connection to the job's store first: :class:`StoreGone` when it is refused or reset within
    :data:`PROBE_S` (the process hosting it is exiting: its listening socket may outlive the peer's connection by
    a moment), ``OSError`` when it fails otherwise (a timeout: a cut network). c10d's own client would retry until
    its timeout and print a C++ stack trace per try; its server takes a silent connection, closed, silently."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return
    gone = StoreGone(f"nothing listens at {host}:{port}")
    try:
        conn = socket.create_connection((host, int(port)), timeout=timeout_s)
    except ConnectionRefusedError:
        raise gone from None
    with conn:
        conn.settimeout(PROBE_S)
        try:
            said = conn.recv(1)
        except TimeoutError:  # silence: a live store waits for its client's request
            return
        except ConnectionResetError:
            raise gone from None
    if said == b"":
        raise gone


def _bounded(fn, seconds: float):
    """``(result, None)`` or ``(None, why)``: ``fn()`` in a daemon thread given ``seconds``."""
    box: list = [None, "no answer within %g s" % seconds]

    def run():
        try:
            box[:] = [fn(), None]
        except Exception as e:  # noqa: BLE001 - a diagnosis never raises
            box[:] = [None, str(e).strip().splitlines()[0][:100] if str(e).strip() else type(e).__name__]

    t = threading.Thread(target=run, name="lev-peers-read", daemon=True)
    t.start()
    t.join(seconds)
    return tuple(box)


@dataclass
class Peers:
    rank: int
    hosts: list[str]  # by rank
    addresses: list[str | None]  # by rank
    last_step: int = 0
    pulse_s: float = PULSE_S
    _by_address: dict = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _pulse: threading.Thread | None = None

    def __post_init__(self):
        for r, a in enumerate(self.addresses):
            if a:
                self._by_address.setdefault(a, []).append(r)

    @property
    def host(self) -> str:
        return self.hosts[self.rank]

    def beat(self, step: int) -> None:
        """This rank begins ``step`` (the pulse carries it; no I/O here)."""
        self.last_step = step

    def start_pulse(self, timeout_s: float) -> None:
        def pulse():
            try:
                store = _store_client(timeout_s)
                while store is not None and not self._stop.is_set():
                    store.set(f"{ALIVE}{self.rank}", f"{self.last_step} {time.time():.3f}")
                    self._stop.wait(self.pulse_s)
            except Exception:  # noqa: BLE001 - the store is gone (end of the job, a lost node): stop pulsing
                return

        self._pulse = threading.Thread(target=pulse, name="lev-peers-pulse", daemon=True)
        self._pulse.start()

    def stop(self) -> None:
        """End the pulse and wait for it (bounded): a daemon thread still inside a c10d call when the interpreter
        exits aborts the process ("terminate called without an active exception", exit 134)."""
        self._stop.set()
        if self._pulse is not None:
            self._pulse.join(READ_S)

    def name(self, ranks: list[int]) -> str:
        by_host: dict[str, list[int]] = {}
        for r in ranks:
            by_host.setdefault(self.hosts[r], []).append(r)
        parts = [
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs[:SHOWN]))}{', ...' if len(rs) > SHOWN else ''}"
            f" on {h}"
            for h, rs in by_host.items()
        ]
        return "; ".join(parts[:SHOWN]) + ("; ..." if len(parts) > SHOWN else "")

    def pulses(self) -> dict[int, tuple[int, float]]:
        """Every other rank's last pulse ``{rank: (step, unix time)}`` (a rank that never pulsed is absent)."""
        _probe(READ_S)
        store = _store_client(READ_S)
        if store is None:
            raise RuntimeError("no MASTER_ADDR/MASTER_PORT: no job store")
        out = {}
        for r in range(len(self.hosts)):
            key = f"{ALIVE}{r}"
            if r != self.rank and store.check([key]):
                step, at = store.get(key).decode().split()
                out[r] = (int(step), float(at))
        return out

    def silent(self) -> tuple[list[int], str]:
        """``(ranks, detail)``: the ranks whose pulse is older than :data:`STALE` intervals (or missing)."""
        beats, why = _bounded(self.pulses, READ_S)
        if beats is None and why.startswith("nothing listens"):  # refused: the store's host answered, so not cut off
            return [], f"the job's store is gone too ({why}: it went with the process that hosted it)"
        if beats is None:
            return [], f"the job's store did not answer ({why}): this rank may be the one cut off"
        now = time.time()
        quiet = [
            r
            for r in range(len(self.hosts))
            if r != self.rank and now - beats.get(r, (0, 0.0))[1] > STALE * self.pulse_s
        ]
        detail = ", ".join(
            f"rank {r} "
            + (f"last seen in step {beats[r][0]}, {now - beats[r][1]:.0f} s ago" if r in beats else "never seen")
            for r in quiet[:SHOWN]
        )
        return quiet, detail

    def diagnose(self, error: str) -> str:
        """One sentence naming the ranks and hosts behind a failed collective."""
        out = []
        m = ADDRESS.search(error)
        if m:
            ip = m.group(1)
            local = ip.startswith("127.") or ip == "::1"  # ranks on this host talk over loopback
            ranks = [r for r, h in enumerate(self.hosts) if h == self.host and r != self.rank] if local else []
            ranks = ranks or self._by_address.get(ip, [])
            out.append(f"the connection to {ip} ({self.name(ranks) if ranks else 'not a rank of this job'}) closed")
        quiet, detail = self.silent()
        if quiet:
            out.append(f"not answering: {self.name(quiet)} ({detail})")
        elif detail:
            out.append(detail)
        elif not m:
            out.append(
                f"every rank pulsed within the last {STALE * self.pulse_s:g} s (a slow rank, not a stalled one?)"
            )
        return "; ".join(out)


def record_peers(timeout_minutes: float) -> Peers:
    """Collective: every rank's host and address; starts this rank's pulse (see the module docstring)."""
    global CURRENT
    if CURRENT is not None:
        CURRENT.stop()
    host = socket.gethostname()
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, (host, _address(host)))
    peers = Peers(dist.get_rank(), [h for h, _ in table], [a for _, a in table])
    peers.pulse_s = min(PULSE_S, 60 * timeout_minutes / 6)  # a rank stalled for one timeout is stale by then
    if dist.get_world_size() > 1:
        peers.start_pulse(60 * timeout_minutes)
    CURRENT = peers
    return peers
