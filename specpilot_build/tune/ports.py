"""Free ports for a tune's servers: a trial launched on another machine (or beside other trials) has no fixed PORT,
so each server asks the OS for a free port and is served there; a port taken between the asking and the serving
(another process got it first) is given up for a fresh one."""

from __future__ import annotations

import socket

from specpilot_build.errors import SpecPilotError

HOST = "127.0.0.1"
TRIES = 5


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def serve_free(engine_id: str) -> tuple[int, int]:
    """Serve `engine_id` on a free port; returns (port, pid)."""
    from specpilot_build.serve.process import serve

    for attempt in range(TRIES):
        port = free_port()
        try:
            return port, int(serve(engine_id, port, quiet=True)["pid"])
        except SpecPilotError as exc:
            if "in use" not in str(exc) or attempt == TRIES - 1:
                raise
    raise AssertionError("unreachable")
