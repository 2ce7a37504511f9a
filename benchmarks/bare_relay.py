"""The baseline: a bare trio store-and-forward relay over TCP + TLS 1.3, and its two clients.

The relay reads whole length-prefixed frames from one client and writes them to the other; the
clients do exactly what benchmarks/programs/pingpong.py does, with blocking TLS sockets. This is
the floor vpool's data path (rank -> agent -> relay -> agent -> rank, with logging) is held to.

    python benchmarks/bare_relay.py            # prints the same JSON as the MPI program
    python benchmarks/bare_relay.py --sweep [--quick]   # what programs/mpi_bench.py prints

``measure`` gives pingpong.py's three figures; ``measure_sweep`` the round trip per message size
and the streaming bandwidth per size, with the same iteration counts as programs/mpi_bench.py.
"""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing as mp
import socket
import ssl
import struct
import sys
import tempfile
import time
from pathlib import Path

import trio

from vpool.protocol.pki import issue_server_cert, make_ca
from vpool.tls import client_context, server_context

PREFIX = struct.Struct("!I")


async def _read_exact(stream: trio.abc.ReceiveStream, buf: bytearray, n: int) -> bool:
    while len(buf) < n:
        chunk = await stream.receive_some(max(65536, n - len(buf)))
        if not chunk:
            return False
        buf += chunk
    return True


async def serve(ctx: ssl.SSLContext, task_status=trio.TASK_STATUS_IGNORED) -> None:
    peers: dict[int, trio.SSLStream] = {}
    both = trio.Event()

    async def handle(raw: trio.SocketStream) -> None:
        stream = trio.SSLStream(raw, ctx, server_side=True)
        buf = bytearray()
        if not await _read_exact(stream, buf, 1):
            return
        me = buf[0]
        del buf[:1]
        peers[me] = stream
        if len(peers) == 2:
            both.set()
        await both.wait()
        other = peers[1 - me]
        try:
            while True:  # store and forward: a whole frame in, then the whole frame out
                if not await _read_exact(stream, buf, 4):
                    return
                (n,) = PREFIX.unpack_from(buf)
                if not await _read_exact(stream, buf, 4 + n):
                    return
                frame = bytes(buf[: 4 + n])
                del buf[: 4 + n]
                await other.send_all(frame)
        except trio.BrokenResourceError:
            return  # a client went away: the run is over

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from a blocking socket (the benchmark clients' one reader)."""
    view = bytearray(n)
    got = 0
    while got < n:
        k = sock.recv_into(memoryview(view)[got:])
        if not k:
            raise ConnectionError("relay closed")
        got += k
    return bytes(view)


class _Client:
    def __init__(self, port: int, ca: Path, me: int) -> None:
        raw = socket.create_connection(("127.0.0.1", port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = client_context(ca).wrap_socket(raw, server_hostname="127.0.0.1")
        self.sock.sendall(bytes([me]))

    def send(self, payload: bytes) -> None:
        if len(payload) > 65536:
            self.sock.sendall(PREFIX.pack(len(payload)))
            self.sock.sendall(payload)
        else:
            self.sock.sendall(PREFIX.pack(len(payload)) + payload)

    def recv(self) -> bytes:
        head = self._exact(4)
        return self._exact(PREFIX.unpack(head)[0])

    def _exact(self, n: int) -> bytes:
        return recv_exact(self.sock, n)


def pair_figures(c, me: int, plan: dict[str, list[tuple[int, int]]]) -> dict[str, dict[str, float]]:  # type: ignore[no-untyped-def]
    """Round trips and streaming between two peers ``me`` = 0 and 1, each with a client ``c``
    that has ``send(bytes)`` and ``recv()``; ``plan`` as ``sweep_plan`` returns it. Shared by
    every two-client benchmark so they measure exactly the same thing."""

    def sync() -> None:  # a round trip of 1 byte, the barrier of this two-client world
        if me == 0:
            c.send(b"s")
            c.recv()
        else:
            c.recv()
            c.send(b"s")

    def rtt(size: int, iters: int) -> float:
        msg = bytes(size)
        for n in (max(1, iters // 10), iters):  # warm-up, then measured
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                if me == 0:
                    c.send(msg)
                    c.recv()
                else:
                    c.recv()
                    c.send(msg)
            elapsed = time.perf_counter() - t0
        return elapsed / iters

    def bandwidth(size: int, count: int) -> float:
        msg = bytes(size)
        sync()
        t0 = time.perf_counter()
        if me == 0:
            for _ in range(count):
                c.send(msg)
            c.recv()
        else:
            for _ in range(count):
                c.recv()
            c.send(b"k")
        return count * size / (time.perf_counter() - t0) / 2**20

    return {
        "rtt": {str(s): rtt(s, n) for s, n in plan["rtt"]},
        "bw": {str(s): bandwidth(s, n) for s, n in plan["bw"]},
    }


def pingpong_plan(iters: tuple[int, int, int]) -> dict[str, list[tuple[int, int]]]:
    return {"rtt": [(64, iters[0]), (2**20, iters[1])], "bw": [(2**20, iters[2])]}


def pingpong_result(fig: dict[str, dict[str, float]]) -> dict[str, float]:
    """The figures of benchmarks/programs/pingpong.py out of ``pair_figures``."""
    return {
        "rtt_64": fig["rtt"]["64"],
        "rtt_1m": fig["rtt"][str(2**20)],
        "bw_mib": fig["bw"][str(2**20)],
    }


def _client(me: int, port: int, ca: str, iters: tuple[int, int, int], out: mp.Queue) -> None:
    fig = pair_figures(_Client(port, Path(ca), me), me, pingpong_plan(iters))
    if me == 0:
        out.put(pingpong_result(fig))


def _sweep_client(me: int, port: int, ca: str, quick: bool, out: mp.Queue) -> None:
    result = pair_figures(_Client(port, Path(ca), me), me, sweep_plan(quick))
    if me == 0:
        out.put(result)


KiB, MiB = 1024, 1024 * 1024


def sweep_plan(quick: bool) -> dict[str, list[tuple[int, int]]]:
    """(size, iterations) of each round trip and streaming measurement, as in mpi_bench.py."""
    if quick:
        rtt_sizes = [8, 512, 32 * KiB, 2 * MiB, 16 * MiB]
        bw_sizes = [1 * MiB, 16 * MiB]
        rtt_bytes, bw_bytes, cap = 24 * MiB, 96 * MiB, 300
    else:
        rtt_sizes = [8, 32, 128, 512, 2 * KiB, 8 * KiB, 32 * KiB, 128 * KiB, 512 * KiB, 2 * MiB]
        rtt_sizes += [8 * MiB, 16 * MiB]
        bw_sizes = [64 * KiB, 1 * MiB, 16 * MiB]
        rtt_bytes, bw_bytes, cap = 128 * MiB, 512 * MiB, 1000
    return {
        "rtt": [(s, max(3, min(cap, rtt_bytes // (2 * s)))) for s in rtt_sizes],
        "bw": [(s, max(4, bw_bytes // s)) for s in bw_sizes],
    }


def _relay_process(cert: str, key: str, port_q: mp.Queue) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve, server_context(Path(cert), Path(key)))
            port_q.put(port)

    trio.run(main)


def measure(iters: tuple[int, int, int] = (2000, 50, 200)) -> dict[str, float]:
    """Start the bare relay and two client processes; return their figures."""
    return _run(_client, (iters,))


def measure_sweep(quick: bool = False) -> dict[str, dict[str, float]]:
    """Round trip per size and streaming bandwidth per size (``sweep_plan``)."""
    return _run(_sweep_client, (quick,))


def _run(target, extra: tuple):  # type: ignore[no-untyped-def]
    now = dt.datetime.now(dt.UTC)
    with tempfile.TemporaryDirectory() as tmp:
        ca_cert, ca_key = make_ca("bench", now=now)
        cert, key = issue_server_cert(
            ca_cert, ca_key, common_name="bare", dns_names=[], ip_addresses=["127.0.0.1"], now=now
        )
        paths = {name: Path(tmp, name) for name in ("ca.pem", "relay.pem", "relay.key")}
        for name, data in zip(paths, (ca_cert, cert, key), strict=True):
            paths[name].write_bytes(data)
        ctx = mp.get_context("spawn")
        port_q: mp.Queue = ctx.Queue()
        out: mp.Queue = ctx.Queue()
        relay = ctx.Process(
            target=_relay_process, args=(str(paths["relay.pem"]), str(paths["relay.key"]), port_q)
        )
        relay.start()
        try:
            port = port_q.get(timeout=30)
            clients = [
                ctx.Process(target=target, args=(me, port, str(paths["ca.pem"]), *extra, out))
                for me in (0, 1)
            ]
            for c in clients:
                c.start()
            result = out.get(timeout=300)
            for c in clients:
                c.join(timeout=30)
            return result
        finally:
            relay.kill()
            relay.join()


if __name__ == "__main__":
    if "--sweep" in sys.argv:
        json.dump(measure_sweep("--quick" in sys.argv), sys.stdout)
    else:
        json.dump(measure(), sys.stdout)
    print()
