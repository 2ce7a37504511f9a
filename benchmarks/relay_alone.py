"""The relay alone on the message path, next to benchmarks/bare_relay.py measured in the same run.

A real ``vpool-relay`` process (TLS, log on disk) and two client processes that act as agents
with blocking TLS sockets: rank 0 and rank 1 of one job, both homed at the relay, each pushed
frame credited back. Same figures as the bare relay: 64 B and 1 MiB round trips, 1 MiB streaming.

    .venv/bin/python benchmarks/relay_alone.py [--quick] [--fsync]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from vpool.protocol.framing import PREFIX, PREFIX_SIZE, encode_frame
from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    Attach,
    Attached,
    Credit,
    Data,
    Hello,
    Welcome,
    decode,
)
from vpool.protocol.pki import issue_server_cert, make_ca
from vpool.protocol.tokens import (
    AgentClaims,
    RankClaims,
    private_key_bytes,
    private_key_from_bytes,
    public_key_text,
    sign_token,
)
from vpool.tls import client_context

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bare_relay

BIN = Path(sys.executable).parent


class Agent:
    def __init__(self, port: int, ca: Path, key: Ed25519PrivateKey, rank: int) -> None:
        raw = socket.create_connection(("127.0.0.1", port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = client_context(ca).wrap_socket(raw, server_hostname="127.0.0.1")
        self.buf = bytearray()
        self.rank = rank
        self.seq = 0
        exp = time.time() + 3600
        name = f"bench-{rank}"
        self.sock.sendall(
            encode_frame(
                Hello(
                    version=PROTOCOL_VERSION,
                    role="agent",
                    token=sign_token(AgentClaims(agent=name, expires=exp), key),
                )
            )
        )
        assert isinstance(self.recv()[0], Welcome)
        claims = RankClaims(job=1, rank=rank, incarnation=1, size=2, agent=name, expires=exp)
        self.sock.sendall(encode_frame(Attach(token=sign_token(claims, key), home=True)))
        assert isinstance(self.recv()[0], Attached)

    def send(self, payload: bytes) -> None:
        self.seq += 1
        msg = Data(job=1, src=self.rank, dst=1 - self.rank, seq=self.seq, ctx=0, tag=0)
        self.sock.sendall(encode_frame(msg, payload))

    def recv(self) -> tuple[object, memoryview]:
        head = self._exact(PREFIX_SIZE)
        hl, pl = PREFIX.unpack(head)
        body = self._exact(hl + pl)
        return decode(body[:hl]), memoryview(body)[hl:]

    def recv_data(self) -> memoryview:
        while True:
            msg, payload = self.recv()
            if isinstance(msg, Data):
                size = len(encode_frame(msg)) + len(payload)
                self.sock.sendall(encode_frame(Credit(job=1, rank=self.rank, nbytes=size)))
                return payload

    def _exact(self, n: int) -> bytes:
        return bare_relay.recv_exact(self.sock, n)


class _DataOnly:
    """The relay's pushes without acks: what pair_figures needs."""

    def __init__(self, agent: Agent) -> None:
        self.send = agent.send
        self.recv = agent.recv_data


def _client(
    rank: int, port: int, ca: str, key_pem: bytes, iters: tuple[int, int, int], out: mp.Queue
) -> None:
    c = Agent(port, Path(ca), private_key_from_bytes(key_pem), rank)
    result = bare_relay.pingpong_result(
        bare_relay.pair_figures(_DataOnly(c), rank, bare_relay.pingpong_plan(iters))
    )
    # Small messages streamed: the relay's per-message cost.
    small = bytes(64)
    n = iters[0] * 20
    t0 = time.perf_counter()
    if rank == 0:
        for _ in range(n):
            c.send(small)
        c.recv_data()
    else:
        for _ in range(n):
            c.recv_data()
        c.send(b"k")
    if rank == 0:
        out.put({**result, "msgs_per_s_64": n / (time.perf_counter() - t0)})


@contextlib.contextmanager
def running_relay(
    key: Ed25519PrivateKey, *, fsync: bool = False, profile: str = ""
) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """A real ``vpool-relay`` process on 127.0.0.1 (TLS with a fresh CA, tokens signed by
    ``key``, its log in a temporary directory): the process, its port and the CA file. Ended
    when the block ends."""
    now = dt.datetime.now(dt.UTC)
    with tempfile.TemporaryDirectory() as tmp:
        ca_cert, ca_key = make_ca("bench", now=now)
        cert, cert_key = issue_server_cert(
            ca_cert, ca_key, common_name="r", dns_names=[], ip_addresses=["127.0.0.1"], now=now
        )
        for name, data in (("ca.pem", ca_cert), ("relay.pem", cert), ("relay.key", cert_key)):
            Path(tmp, name).write_bytes(data)
        ready = Path(tmp, "ready.json")
        env = {
            **os.environ,
            "VPOOL_RELAY_TLS_CERT": str(Path(tmp, "relay.pem")),
            "VPOOL_RELAY_TLS_KEY": str(Path(tmp, "relay.key")),
            "VPOOL_RELAY_SIGNING_KEY": public_key_text(key.public_key()),
            "VPOOL_RELAY_FSYNC": "true" if fsync else "false",
        }
        cmd = [str(BIN / "vpool-relay")]
        if profile:
            cmd = [sys.executable, "-m", "cProfile", "-o", profile, "-m", "vpool.relay.cli"]
        relay = subprocess.Popen(
            [
                *cmd,
                "--port",
                "0",
                "--data-dir",
                str(Path(tmp, "data")),
                "--ready-file",
                str(ready),
                "--log-level",
                "WARNING",
            ],
            env=env,
        )
        try:
            deadline = time.monotonic() + 30
            while not ready.exists():
                if time.monotonic() > deadline or relay.poll() is not None:
                    raise RuntimeError("the relay did not start")
                time.sleep(0.02)
            yield relay, json.loads(ready.read_text())["port"], Path(tmp, "ca.pem")
        finally:
            relay.terminate()
            relay.wait(timeout=30)


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    """User + system CPU seconds so far of process ``pid`` and of its live descendants (the
    relay's store process does a checkpoint's work on the relay's side)."""
    total = process_cpu(pid)
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                total += tree_cpu(int(child))
            except FileNotFoundError:
                pass  # it ended meanwhile
    return total


def measure(
    iters: tuple[int, int, int], *, fsync: bool = False, profile: str = ""
) -> dict[str, float]:
    key = Ed25519PrivateKey.generate()
    with running_relay(key, fsync=fsync, profile=profile) as (relay, port, ca):
        ctx = mp.get_context("spawn")
        out: mp.Queue = ctx.Queue()
        clients = [
            ctx.Process(target=_client, args=(r, port, str(ca), private_key_bytes(key), iters, out))
            for r in (0, 1)
        ]
        for c in clients:
            c.start()
        result = out.get(timeout=600)
        for c in clients:
            c.join(timeout=30)
        result["relay_cpu_s"] = process_cpu(relay.pid)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fsync", action="store_true")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--profile", default="", help="cProfile the relay into this file")
    args = parser.parse_args()
    iters = (500, 20, 100) if args.quick else (2000, 50, 300)
    result: dict[str, object] = {"relay": measure(iters, fsync=args.fsync, profile=args.profile)}
    if not args.no_baseline:
        base = bare_relay.measure(iters)
        result["bare"] = base
        mine = result["relay"]
        assert isinstance(mine, dict)
        result["ratio"] = {k: mine[k] / base[k] for k in base}
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
