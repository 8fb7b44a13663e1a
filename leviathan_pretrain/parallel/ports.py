"""A free local TCP port (for the rendezvous of a local multi-process run). Imports nothing heavy: the
launcher (launchers/local.py) uses it before any rank exists, and rank discovery (parallel/groups.py) after."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
