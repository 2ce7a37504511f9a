"""Same-host links: the Unix socket a relay also listens on, for clients on its machine.

A relay listening on TCP port P also listens on the abstract Unix socket
``local_socket_name(P)`` (Linux; ``local_socket`` setting). An agent whose relay address is a
loopback address (so the relay runs in the agent's network namespace, on its machine) connects
there instead, and speaks exactly what it would have spoken over TCP (preamble, TLS, frames).
Abstract socket names are scoped by network namespace, as loopback addresses are: the name
of port P reaches the relay that 127.0.0.1:P reaches, never one on another machine.

What it saves: loopback TCP runs the whole TCP receive path, in the sender's system call, for
every segment. A 265 MB image in 1 MiB sends cost 0.056-0.100 s of CPU to send and 0.046-0.125
s to receive over loopback TCP, 0.027-0.049 and 0.027-0.040 s over a Unix socket with a 4 MiB
send buffer (``LOCAL_SNDBUF``; 2-core test machine, throwaway microbenchmark). And nothing can
change bytes on their way through a Unix socket (no path, only the kernel), so a checkpoint
put over one needs no transport MAC (``protocol.ckptdigest``), which costs both ends 0.035 s
per 200 MB.
"""

from __future__ import annotations

import ipaddress

LOCAL_SNDBUF = 4 << 20  # a checkpoint upload's send buffer on a same-host link


def local_socket_name(port: int) -> str:
    """The abstract Unix socket name of the relay listening on TCP ``port`` on this host."""
    return f"\0vpool-relay/{port}"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
