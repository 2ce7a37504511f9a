"""TCP keepalive for long-lived connections: the kernel's second line behind the application's
pings (``protocol.liveness``).

With these options a peer that vanished is noticed by the kernel even when the application
reads nothing: an idle connection is probed after ``KEEPIDLE`` s, every ``KEEPINTVL`` s, and
given up after ``KEEPCNT`` unanswered probes (25 s); data sent and not acknowledged for
``USER_TIMEOUT_MS`` ends it too (15 s; Linux only), so a write into a black hole fails instead of
waiting on a full send buffer. Both ends of an agent <-> relay connection set them, and the
agent's HTTP connections to the coordinator (``socket_options``).
"""

from __future__ import annotations

import socket

import trio

KEEPIDLE = 10
KEEPINTVL = 5
KEEPCNT = 3
USER_TIMEOUT_MS = 15_000


def keepalive_options() -> list[tuple[int, int, int]]:
    """The options as ``(level, option, value)``, those this platform has."""
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (
        ("TCP_KEEPIDLE", KEEPIDLE),
        ("TCP_KEEPINTVL", KEEPINTVL),
        ("TCP_KEEPCNT", KEEPCNT),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            opts.append((socket.IPPROTO_TCP, option, value))
    return opts


def set_keepalive(sock: trio.socket.SocketType) -> None:
    """Set ``keepalive_options`` on a TCP socket (a socket of another family is left alone)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    for level, option, value in keepalive_options():
        try:
            sock.setsockopt(level, option, value)
        except OSError:
            pass  # a kernel without this option: the others still apply
