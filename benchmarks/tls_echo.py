"""CPU cost of one TLS hop in trio: ``trio.SSLStream`` next to a raw non-blocking ``ssl`` socket.

    .venv/bin/python benchmarks/tls_echo.py [--messages N]

A blocking client sends N small messages (16 B) one at a time through a TLS echo server on
127.0.0.1 and reads each back. The server runs under trio, once with trio's ``SSLStream`` (what
the relay and agents use) and once with an ``ssl.SSLSocket`` in non-blocking mode driven by
``trio.lowlevel.wait_readable``. Printed: round trip per message and the server's CPU time per
message (user + system, so the loopback TCP work is in it), and the raw/trio ratios.

This is the floor of one hop on the message path: each message of a vpool job crosses an agent,
a relay and an agent, each at least one such hop (see the issue-3 note on allreduce latency).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import socket
import ssl
import sys
import tempfile
import time
from pathlib import Path

import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

MESSAGE = b"x" * 16


def make_cert(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


class RawStream:
    """Just enough of a trio stream over a non-blocking ``ssl.SSLSocket``: a read or write that
    can proceed does so without a trip through the scheduler."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.sock = sock

    async def send_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view) :]
            except ssl.SSLWantWriteError:
                await trio.lowlevel.wait_writable(self.sock)
            except ssl.SSLWantReadError:
                await trio.lowlevel.wait_readable(self.sock)

    async def receive_some(self, n: int = 65536) -> bytes:
        while True:
            try:
                return self.sock.recv(n)
            except ssl.SSLWantReadError:
                await trio.lowlevel.wait_readable(self.sock)
            except ssl.SSLWantWriteError:
                await trio.lowlevel.wait_writable(self.sock)
            except (ssl.SSLEOFError, ConnectionResetError):
                return b""


async def serve(listener: socket.socket, ctx: ssl.SSLContext, mode: str) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stream: trio.SSLStream[trio.SocketStream] | RawStream
    if mode == "trio":
        stream = trio.SSLStream(
            trio.SocketStream(trio.socket.from_stdlib_socket(conn)), ctx, server_side=True
        )
        await stream.do_handshake()
    else:
        raw = ctx.wrap_socket(conn, server_side=True)  # blocking handshake, then non-blocking
        raw.setblocking(False)
        stream = RawStream(raw)
    while True:
        try:
            data = await stream.receive_some(65536)
        except trio.BrokenResourceError:
            return
        if not data:
            return
        await stream.send_all(data)


def client(port: int, cafile: Path, n: int, out: int) -> None:
    ctx = ssl.create_default_context(cafile=str(cafile))
    with ctx.wrap_socket(
        socket.create_connection(("127.0.0.1", port)), server_hostname="localhost"
    ) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n // 10):  # warm-up
            s.sendall(MESSAGE)
            s.recv(100)
        t0 = time.perf_counter()
        for _ in range(n):
            s.sendall(MESSAGE)
            s.recv(100)
        os.write(out, f"{(time.perf_counter() - t0) / n}\n".encode())


def measure(mode: str, n: int, cert: Path, key: Path) -> tuple[float, float]:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            client(listener.getsockname()[1], cert, n, write_end)
        finally:
            os._exit(0)
    os.close(write_end)
    t0 = os.times()
    trio.run(serve, listener, ctx, mode)
    t1 = os.times()
    os.waitpid(pid, 0)
    rtt = float(os.read(read_end, 100).decode())
    os.close(read_end)
    listener.close()
    cpu = (t1.user - t0.user) + (t1.system - t0.system)
    return rtt, cpu / (n + n // 10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20000)
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = make_cert(Path(tmp))
        res = {mode: measure(mode, opts.messages, cert, key) for mode in ("trio", "raw")}
    print(f"{'server':>8} {'round trip':>12} {'server CPU/msg':>16}")
    for mode, (rtt, cpu) in res.items():
        print(f"{mode:>8} {rtt * 1e6:10.1f} us {cpu * 1e6:13.1f} us")
    (rtt_t, cpu_t), (rtt_r, cpu_r) = res["trio"], res["raw"]
    print(f"raw/trio: round trip {rtt_r / rtt_t:.2f}x, server CPU {cpu_r / cpu_t:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
