"""benchmarks/wan_pool.py's pool on network namespaces: the machines of the multi-host test
(tests/integration/netpool.py), with a user-space delay line between the volunteers and the
relay.

    .venv/bin/python benchmarks/wan_netns.py line --host H --route PORT=HOST:PORT ... [--delay MS]
    .venv/bin/python benchmarks/wan_netns.py serve --port PORT
    .venv/bin/python benchmarks/wan_netns.py rtt HOST PORT ITERS WARMUP
    .venv/bin/python benchmarks/wan_netns.py stream HOST PORT NBYTES

(wan_pool.py runs these on the machines; a person has no reason to.)

The machines (``TOPOLOGY``, namespaces vpwan<pid>-<machine> on the bridge 10.213.77.0/24): the
coordinator (10.213.77.2), relay-0 (.3), the volunteers agent-0 and agent-1 (.11, .12; one slot
each) and the user (.20), behind the multi-host test's firewalls (the volunteers and the user
drop every new inbound connection; the servers let in their port only), set up with the
operator's commands (``vpool-coordinator init --public-url``, ``relay add relay-0 --address
10.213.77.3:7000`` and its bundle, join tokens, ``vsdk login``) by ``netpool.setup_pool``.

The delay line (``line``, benchmarks/delayline.py's ``DelayLine``) is a process on relay-0's
machine. It listens on 10.213.77.3:7000, the address relay-0's bundle advertises and its
certificate names, and forwards each connection to the relay, which listens on 127.0.0.1:7000 of
the same machine (the bundle's settings, but ``VPOOL_RELAY_HOST=127.0.0.1`` in its environment
instead of 0.0.0.0: only the line reaches it), ``delay`` later each way. So every agent <->
relay connection crosses the line, TLS from end to end through it; what goes to the coordinator
(the agents' and the relay's HTTPS) does not. A message between ranks on the two agents goes
rank -> agent-0 -> wire -> line -> relay -> line -> wire -> agent-1 -> rank.

Plain TCP goes through the same line process: its second route, 10.213.77.3:7100 ->
127.0.0.1:7100 (relay-0's firewall lets 7100 in too), leads to ``serve`` on relay-0's machine (an
8 B echo, and a sink that answers one byte once it has a stream's bytes), and the client
(``rtt``, ``stream``) runs on agent-0's machine: the same line, between the same machines as the
pool's messages. A plain round trip crosses the line twice, a plain stream once.

``line_pool`` makes the machines, starts the line and ``serve`` (unless there is no line: the
"direct" row, where the relay listens on 0.0.0.0:7000 as its bundle says), measures plain TCP
through the line before the pool starts (``plain``), sets the pool up and yields a ``vsdk`` run
on the user's machine. Whatever happens, every process it started is stopped by its pid and every
namespace removed (``netpool.namespaces``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

THIS = Path(__file__).resolve()
HERE = THIS.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import delayline  # noqa: E402

from tests.integration import netpool  # noqa: E402
from vpool.readyfile import write_ready_file  # noqa: E402

RELAY = "relay-0"
TOPOLOGY = netpool.Topology(
    relays=(RELAY,), agents=("agent-0", "agent-1"), slots=1, pool_name="wan"
)
TAG = "vpwan"
LINE_HOST = netpool.ADDRESS[RELAY]
RELAY_PORT = netpool.RELAY_PORT  # where the line listens (advertised), and the relay behind it
PLAIN_PORT = 7100  # the line's route to the plain TCP endpoints
CLIENT = "agent-0"  # where plain TCP's client runs
TIMEOUT = 900
MiB = 1024 * 1024
RTT_SIZE = 8

Vsdk = Callable[..., str]


class Plain:
    """Plain TCP from agent-0's machine through the line to ``serve`` on relay-0's."""

    def __init__(self, pool: netpool.Pool) -> None:
        self.pool = pool

    def _client(self, *args: object) -> dict[str, object]:
        argv = self.pool.net.on(CLIENT, sys.executable, THIS, *args)
        res = netpool.run(argv, timeout=TIMEOUT)
        out: dict[str, object] = json.loads(res.stdout.splitlines()[-1])
        return out

    def rtt(self, iters: int, warmup: int) -> list[float]:
        """Seconds of each of ``iters`` 8 B round trips, after ``warmup``."""
        out = self._client("rtt", LINE_HOST, PLAIN_PORT, iters, warmup)
        times = out["rtt"]
        assert isinstance(times, list)
        return [float(t) for t in times]

    def stream(self, nbytes: int) -> float:
        """MiB/s of one stream of ``nbytes``, from its first byte to the sink's answer."""
        out = self._client("stream", LINE_HOST, PLAIN_PORT, nbytes)
        return float(str(out["bytes"])) / float(str(out["seconds"])) / MiB


@contextlib.contextmanager
def line_pool(
    delay: float | None,
    work: Path,
    *,
    rate: float | None = None,
    plain: Callable[[Plain], None] | None = None,
    relay_env: dict[str, str] | None = None,
) -> Iterator[Vsdk]:
    """The pool on the namespaces, its relay behind a line of ``delay`` s each way and ``rate``
    bytes/s (no line if ``delay`` is None); ``plain`` is called with the line up, before the
    pool starts; ``relay_env`` is given to the relay over its bundle's settings. Yields
    ``vsdk`` on the user's machine: it returns what the command printed, and raises
    RuntimeError if it failed."""
    tmp = Path(tempfile.mkdtemp(prefix="netns-", dir=work))
    with netpool.namespaces(TOPOLOGY, TAG, tmp) as pool:
        pool.relay_env = dict(relay_env or {})
        if delay is not None:
            pool.net.nft(RELAY, "add", "rule", "inet", "filter", "input",
                         "tcp", "dport", str(PLAIN_PORT), "accept")  # fmt: skip
            pool.start("plain", RELAY, sys.executable, THIS, "serve", "--port", PLAIN_PORT)
            pool.ready("plain")
            routes = [f"{port}=127.0.0.1:{port}" for port in (RELAY_PORT, PLAIN_PORT)]
            pool.start("line", RELAY, sys.executable, THIS, "line", "--host", LINE_HOST,
                       "--delay", delay * 1000, "--rate", (rate or 0) / MiB,
                       *(a for r in routes for a in ("--route", r)))  # fmt: skip
            pool.ready("line")
            if plain is not None:
                plain(Plain(pool))
            pool.relay_env["VPOOL_RELAY_HOST"] = "127.0.0.1"
        netpool.setup_pool(pool)

        def vsdk(*args: object) -> str:
            res = pool.vsdk(*args, timeout=TIMEOUT)
            if res.returncode != 0:
                raise RuntimeError(
                    f"vsdk {' '.join(map(str, args))} failed ({res.returncode}):\n"
                    f"{res.stderr.decode(errors='replace')[-3000:]}\n{pool.logs()}"
                )
            return res.stdout.decode()

        yield vsdk


# -- the processes on the machines ----------------------------------------------------------------


def _line(opts: argparse.Namespace) -> None:
    rate = opts.rate * MiB if opts.rate > 0 else None
    lines = []
    for route in opts.route:
        listen, _, target = route.partition("=")
        host, _, port = target.rpartition(":")
        lines.append(
            delayline.DelayLine(
                (host, int(port)), opts.delay / 1000, host=opts.host, port=int(listen), rate=rate
            )
        )
    write_ready_file(Path(opts.ready_file), {"pid": os.getpid(), "routes": opts.route})
    threading.Event().wait()  # until SIGTERM


def _serve(opts: argparse.Namespace) -> None:
    """On 127.0.0.1:PORT, each connection's first byte says what it is: b"e" an echo, b"s" and
    8 bytes of length a stream to sink, answered with b"k" once all of it came."""
    server = socket.create_server(("127.0.0.1", opts.port))

    def handle(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            kind = conn.recv(1)
            if kind == b"e":
                while data := conn.recv(65536):
                    conn.sendall(data)
            elif kind == b"s":
                (left,) = struct.unpack("!Q", _exact(conn, 8))
                buf = bytearray(4 * MiB)
                while left > 0:
                    n = conn.recv_into(buf, min(left, len(buf)))
                    if n == 0:
                        return
                    left -= n
                conn.sendall(b"k")

    write_ready_file(Path(opts.ready_file), {"pid": os.getpid(), "port": opts.port})
    while True:
        conn, _ = server.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def _exact(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            raise SystemExit("the connection ended early")
        got += chunk
    return got


def _rtt(opts: argparse.Namespace) -> None:
    msg = b"\x5a" * RTT_SIZE
    times = []
    with socket.create_connection((opts.host, opts.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(b"e")
        for _ in range(opts.warmup + opts.iters):
            t0 = time.perf_counter()
            sock.sendall(msg)
            _exact(sock, len(msg))
            times.append(time.perf_counter() - t0)
    print(json.dumps({"rtt": times[opts.warmup :]}), flush=True)


def _stream(opts: argparse.Namespace) -> None:
    block = b"\x5a" * MiB
    with socket.create_connection((opts.host, opts.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        sock.sendall(b"s" + struct.pack("!Q", opts.nbytes))
        left = opts.nbytes
        while left > 0:
            n = min(left, len(block))
            sock.sendall(block if n == len(block) else block[:n])
            left -= n
        if _exact(sock, 1) != b"k":
            raise SystemExit("no answer from the sink")
        seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "bytes": opts.nbytes}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    line = sub.add_parser("line", help="the delay line, until SIGTERM")
    line.add_argument("--host", required=True, help="address to listen on")
    line.add_argument("--route", action="append", required=True, help="PORT=HOST:PORT")
    line.add_argument("--delay", type=float, default=0.0, help="ms each way")
    line.add_argument("--rate", type=float, default=0.0, help="MiB/s (0: no bottleneck)")
    line.add_argument("--ready-file", required=True)
    serve = sub.add_parser("serve", help="the plain TCP echo and sink, until SIGTERM")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--ready-file", required=True)
    rtt = sub.add_parser("rtt", help="8 B round trips through the echo; prints JSON")
    stream = sub.add_parser("stream", help="one stream to the sink; prints JSON")
    for p in (rtt, stream):
        p.add_argument("host")
        p.add_argument("port", type=int)
    rtt.add_argument("iters", type=int)
    rtt.add_argument("warmup", type=int)
    stream.add_argument("nbytes", type=int)
    opts = ap.parse_args()
    {"line": _line, "serve": _serve, "rtt": _rtt, "stream": _stream}[opts.command](opts)


if __name__ == "__main__":
    main()
