"""Fakes for the agent's tests: a coordinator (an httpx transport), a TLS relay, rank programs.

The fake coordinator is a small in-process implementation of the agent API of
``protocol/api.py``; the agent reaches it through ``httpx.MockTransport`` so every request still
goes through the agent's real client code. The fake relay is a real trio TLS server speaking the
frames of ``protocol/framing.py`` with certificates from ``protocol/pki.py``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import hashlib
import io
import json
import os
import socket
import textwrap
import time
import zipfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from vpool.protocol import api, pki, tokens
from vpool.protocol.framing import FrameDecoder, encode_frame, raw_frame_parts
from vpool.protocol.messages import Message
from vpool.tls import server_context
from vpool.worker_agent import sandboxed
from vpool.worker_agent.agent import AgentStarted, run_agent
from vpool.worker_agent.local_ranks import LocalRanks
from vpool.worker_agent.proxy import RankProxy
from vpool.worker_agent.settings import AgentSettings

AGENT_TOKEN = "agent-token-1"


# -- the fake coordinator ----------------------------------------------------------------------


@dataclass
class FakeCoordinator:
    """Records what the agent posts; hands out queued leases and stop orders."""

    heartbeat_interval: float = 0.05
    blobs: dict[str, bytes] = field(default_factory=dict)
    enrolls: list[api.EnrollRequest] = field(default_factory=list)
    outputs: list[api.OutputChunk] = field(default_factory=list)
    exits: list[api.RankExit] = field(default_factory=list)
    problems: list[api.RankProblem] = field(default_factory=list)
    results: dict[tuple[int, int, int], bytes] = field(default_factory=dict)
    heartbeats: list[api.AgentHeartbeat] = field(default_factory=list)
    lease_requests: list[api.LeaseRequest] = field(default_factory=list)
    revoked: set[str] = field(default_factory=set)  # tokens answered with 401
    auth: list[tuple[str, str]] = field(default_factory=list)  # (path, bearer token)
    pending_leases: list[api.Lease] = field(default_factory=list)
    pending_stops: list[api.StopOrder] = field(default_factory=list)
    token_to_hand_out: str = ""
    fail_next: int = 0  # that many requests fail as if the coordinator were down
    down: bool = False  # every request fails as if the coordinator were down (restarting)
    refused_while_down: list[str] = field(default_factory=list)  # paths tried meanwhile
    corrupt_blobs: bool = False
    refuse_output: bool = False  # answer output posts with 409, as for a job that is over
    # With a key, tokens are really signed (for tests against the real relay).
    signing_key: Ed25519PrivateKey | None = None

    @property
    def agent_token(self) -> str:
        if self.signing_key is None:
            return f"agent-token-{len(self.enrolls)}"
        claims = tokens.AgentClaims(agent="agent-1", expires=time.time() + 3600)
        return tokens.sign_token(claims, self.signing_key)

    def rank_token(self, job: int, rank: int, size: int, incarnation: int = 1) -> str:
        if self.signing_key is None:
            return f"rank-token-{job}-{rank}"
        claims = tokens.RankClaims(
            job=job,
            rank=rank,
            incarnation=incarnation,
            size=size,
            agent="agent-1",
            expires=time.time() + 3600,
        )
        return tokens.sign_token(claims, self.signing_key)

    def __post_init__(self) -> None:
        self.changed = trio.Event()

    def _touch(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, predicate: Callable[[], Any], seconds: float = 20.0) -> Any:
        """Wait until ``predicate()`` is truthy (re-checked whenever the agent calls in)."""
        with trio.fail_after(seconds):
            while not (result := predicate()):
                await self.changed.wait()
        return result

    def add_blob(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        self.blobs[sha] = data
        return sha

    def add_lease(self, lease: api.Lease) -> None:
        self.pending_leases.append(lease)
        self._touch()

    def stop(self, job: int, rank: int, incarnation: int = 1, reason: str = "cancelled") -> None:
        self.pending_stops.append(api.StopOrder(job, rank, incarnation, reason))
        self._touch()

    def output_of(
        self, job: int, rank: int, stream: str = "stdout", incarnation: int | None = None
    ) -> bytes:
        chunks = sorted(
            (
                c
                for c in self.outputs
                if (c.job, c.rank, c.stream) == (job, rank, stream)
                and incarnation in (None, c.incarnation)
            ),
            key=lambda c: c.offset,
        )
        out = bytearray()
        for c in chunks:
            assert c.offset <= len(out), "a gap in the output offsets"
            out[c.offset : c.offset + len(c.data)] = c.data
        return bytes(out)

    def exit_of(self, job: int, rank: int) -> api.RankExit | None:
        return next((e for e in self.exits if (e.job, e.rank) == (job, rank)), None)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self._handle(request)
        finally:
            self._touch()

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            self.refused_while_down.append(request.url.path)
            raise httpx.ConnectError("fake coordinator is restarting", request=request)
        if self.fail_next > 0:
            self.fail_next -= 1
            raise httpx.ConnectError("fake coordinator is down", request=request)
        path = request.url.path
        token = request.headers.get("authorization", "").removeprefix("Bearer ")
        self.auth.append((path, token))
        if path == "/api/v1/agents/enroll":
            req = msgspec.json.decode(request.content, type=api.EnrollRequest)
            tokens.verify_possession(
                req.public_key, req.timestamp, req.signature, now=req.timestamp
            )
            self.enrolls.append(req)
            return _json(
                api.EnrollResponse(
                    agent_id="agent-1",
                    agent_token=self.agent_token,
                    signing_key="",
                    heartbeat_interval=self.heartbeat_interval,
                )
            )
        if token == "" or token in self.revoked:
            return _error(401, "bad_token", "unknown or revoked token")
        if path == "/api/v1/agents/lease":
            req_l = msgspec.json.decode(request.content, type=api.LeaseRequest)
            self.lease_requests.append(req_l)
            with trio.move_on_after(min(req_l.wait, 0.5)):
                while not self.pending_leases:
                    await self.changed.wait()
            leases, self.pending_leases = self.pending_leases, []
            return _json(api.LeaseResponse(leases=leases))
        if path == "/api/v1/agents/heartbeat":
            self.heartbeats.append(msgspec.json.decode(request.content, type=api.AgentHeartbeat))
            stops, self.pending_stops = self.pending_stops, []
            new_token, self.token_to_hand_out = self.token_to_hand_out, ""
            return _json(api.AgentHeartbeatResponse(stop=stops, agent_token=new_token))
        if path.startswith("/api/v1/agents/blobs/"):
            sha = path.rsplit("/", 1)[1]
            if sha not in self.blobs:
                return _error(404, "not_found", f"no blob {sha}")
            data = self.blobs[sha]
            return httpx.Response(200, content=data + b"!" if self.corrupt_blobs else data)
        if path == "/api/v1/agents/output" and self.refuse_output:
            return _error(409, "job_over", "the job is no longer running")
        if path == "/api/v1/agents/output":
            self.outputs += msgspec.json.decode(request.content, type=api.OutputBatch).chunks
            return _json({})
        if path == "/api/v1/agents/exit":
            self.exits.append(msgspec.json.decode(request.content, type=api.RankExit))
            return _json({})
        if path == "/api/v1/agents/problem":
            self.problems.append(msgspec.json.decode(request.content, type=api.RankProblem))
            return _json({})
        if path.startswith("/api/v1/agents/results/"):
            job, rank, inc = (int(x) for x in path.split("/")[-3:])
            self.results[(job, rank, inc)] = request.content
            return _json({})
        return _error(404, "not_found", path)


def _json(obj: Any) -> httpx.Response:
    return httpx.Response(
        200, content=msgspec.json.encode(obj), headers={"content-type": "application/json"}
    )


def _error(status: int, code: str, message: str) -> httpx.Response:
    body = api.ErrorBody(error=api.ErrorDetail(code=code, message=message))
    return httpx.Response(status, content=msgspec.json.encode(body))


@pytest.fixture
def coordinator() -> FakeCoordinator:
    return FakeCoordinator()


# -- TLS material ------------------------------------------------------------------------------


@dataclass
class Pki:
    ca: Path
    cert: Path
    key: Path


@pytest.fixture(scope="session")
def pool_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    now = dt.datetime.now(dt.UTC)
    ca_cert, ca_key = pki.make_ca("test", now=now)
    cert, key = pki.issue_server_cert(
        ca_cert,
        ca_key,
        common_name="relay",
        dns_names=["localhost"],
        ip_addresses=["127.0.0.1"],
        now=now,
    )
    (d / "ca.pem").write_bytes(ca_cert)
    (d / "relay.pem").write_bytes(cert)
    (d / "relay.key").write_bytes(key)
    return Pki(d / "ca.pem", d / "relay.pem", d / "relay.key")


# -- the fake relay ----------------------------------------------------------------------------


class RelayConn:
    """The relay's end of one agent connection, driven by the test."""

    def __init__(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        self.stream = stream
        self.decoder = FrameDecoder()
        self.closed = trio.Event()

    async def receive(self, seconds: float = 20.0) -> tuple[Message, bytes, bytes]:
        """Next frame: (message, payload, the frame's exact bytes)."""
        with trio.fail_after(seconds):
            while (frame := self.decoder.next_frame()) is None:
                data = await self.stream.receive_some(65536)
                assert data, "the agent closed the relay connection"
                self.decoder.receive_data(data)
        raw = b"".join(raw_frame_parts(frame.raw_header, frame.payload))
        return frame.message, frame.payload, raw

    async def send(self, msg: Message, payload: bytes = b"") -> bytes:
        frame = encode_frame(msg, payload)
        await self.stream.send_all(frame)
        return frame

    async def close(self) -> None:
        await trio.aclose_forcefully(self.stream)
        self.closed.set()


@dataclass
class FakeRelay:
    host: str
    port: int
    connections: trio.MemoryReceiveChannel[RelayConn]

    @property
    def info(self) -> api.RelayInfo:
        return api.RelayInfo(name="relay-0", host=self.host, port=self.port)

    async def accept(self, seconds: float = 20.0) -> RelayConn:
        with trio.fail_after(seconds):
            return await self.connections.receive()


@pytest.fixture
async def relay(nursery: trio.Nursery, pool_pki: Pki) -> AsyncIterator[FakeRelay]:
    send, recv = trio.open_memory_channel[RelayConn](16)

    async def handler(stream: trio.SSLStream[trio.SocketStream]) -> None:
        conn = RelayConn(stream)
        await send.send(conn)
        await conn.closed.wait()

    ctx = server_context(pool_pki.cert, pool_pki.key)
    listeners = await nursery.start(
        functools.partial(trio.serve_ssl_over_tcp, handler, 0, ctx, host="127.0.0.1")
    )
    port = listeners[0].transport_listener.socket.getsockname()[1]
    yield FakeRelay("127.0.0.1", port, recv)


# -- bundles and rank programs -----------------------------------------------------------------

# A rank that speaks the frame protocol itself, so these tests do not depend on vpool.mpi.
RANK_PROGRAM = textwrap.dedent(
    """
    import json, os, socket, sys, time
    from vpool.protocol import framing, messages as m

    sock = socket.socket(socket.AF_UNIX)
    sock.connect(os.environ["VPOOL_AGENT_SOCKET"])
    dec = framing.FrameDecoder()

    def recv():
        while (f := dec.next_frame()) is None:
            data = sock.recv(1 << 20)
            if not data:
                sys.exit("agent closed the socket")
            dec.receive_data(data)
        return f

    def send(msg, payload=b""):
        sock.sendall(framing.encode_frame(msg, payload))

    def say(**kw):
        print(json.dumps(kw), flush=True)

    secret = sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "secret" else None
    with open(os.environ["VPOOL_RANK_SECRET_FILE"]) as _f:  # the agent writes it
        SECRET = _f.read()
    send(m.RankHello(version=m.PROTOCOL_VERSION, secret=secret or SECRET))
    w = recv().message
    if isinstance(w, m.Error):
        say(error=w.code)
        sys.exit(9)
    say(welcome=[w.job, w.rank, w.size, w.incarnation, w.processor])
    mode = sys.argv[1]
    if mode == "proxy":
        n = int(sys.argv[2])
        send(m.Data(job=w.job, src=w.rank, dst=1, seq=1, ctx=0, tag=5), bytes(range(256)) * n)
        for _ in range(2):
            f = recv()
            raw = b"".join(framing.raw_frame_parts(f.raw_header, f.payload))
            if isinstance(f.message, m.Data):
                say(data=len(f.payload), sha=__import__("hashlib").sha256(raw).hexdigest())
            else:
                fields = [getattr(f.message, k) for k in f.message.__struct_fields__]
                say(other=type(f.message).__name__, fields=fields)
        send(m.Finalize())
    elif mode == "pingpong":
        # rank 0 sends ping to 1, 1 answers pong; each waits for its deposit's Ack.
        n = int(sys.argv[2])
        if w.rank == 0:
            send(m.Data(job=w.job, src=0, dst=1, seq=1, ctx=0, tag=1), b"ping" * n)
        got_data = got_ack = False
        while not (got_data and got_ack):
            f = recv()
            if isinstance(f.message, m.Data):
                got_data = True
                say(data=f.payload[:4].decode(), n=len(f.payload), src=f.message.src)
                if w.rank == 1:
                    send(m.Data(job=w.job, src=1, dst=0, seq=1, ctx=0, tag=1), b"pong" * n)
            elif isinstance(f.message, m.Ack):
                got_ack = True
                say(ack=[f.message.src, f.message.dst, f.message.seq])
        send(m.Finalize())
    elif mode == "stream":
        # rank 0 sends N messages of S bytes to rank 1, which answers once it has them all.
        n, size = int(sys.argv[2]), int(sys.argv[3])
        start = time.perf_counter()
        if w.rank == 0:
            payload = b"z" * size
            for seq in range(1, n + 1):
                send(m.Data(job=w.job, src=0, dst=1, seq=seq, ctx=0, tag=0), payload)
            while not isinstance(recv().message, m.Data):
                pass
            elapsed = time.perf_counter() - start
            say(elapsed=elapsed, msgs_per_s=n / elapsed, mb_per_s=n * size / elapsed / 1e6)
        else:
            got = 0
            while got < n:
                got += isinstance(recv().message, m.Data)
            send(m.Data(job=w.job, src=1, dst=0, seq=1, ctx=0, tag=0), b"done")
            while not isinstance(recv().message, m.Ack):
                pass
        send(m.Finalize())
    elif mode == "deposit":
        # N messages of S bytes to rank 1, as fast as the agent takes them; then the Ack of
        # the last one (the relay's log holds them all).
        n, size = int(sys.argv[2]), int(sys.argv[3])
        payload = bytes(size)
        for seq in range(1, n + 1):
            send(m.Data(job=w.job, src=w.rank, dst=1, seq=seq, ctx=0, tag=0), payload)
        while not (isinstance(f := recv().message, m.Ack) and f.seq == n):
            pass
        say(acked=n)
        send(m.Finalize())
    elif mode in ("seqgap", "detgap"):
        # A first message in order, then a gap: the agent refuses the gap itself.
        send(m.Data(job=w.job, src=w.rank, dst=1, seq=1, ctx=0, tag=0), b"in order")
        send(m.Det(job=w.job, rank=w.rank, index=0, data=b"d0"))
        if mode == "seqgap":
            send(m.Data(job=w.job, src=w.rank, dst=1, seq=1000, ctx=0, tag=0), b"gap")
        else:
            send(m.Det(job=w.job, rank=w.rank, index=57, data=b"gap"))
        f = recv()
        while not isinstance(f.message, m.Error):
            f = recv()
        say(refused=f.message.code)
    elif mode == "flood":
        # Idle connections to the agent's socket, more than it would keep: it closes all but
        # a few at once.
        import select, socket as socketlib
        n = int(sys.argv[2])
        conns = []
        for _ in range(n):
            c = socketlib.socket(socketlib.AF_UNIX)
            c.connect(os.environ["VPOOL_AGENT_SOCKET"])
            conns.append(c)
        poller = select.poll()
        for c in conns:
            poller.register(c, select.POLLIN)
        # Well within the agent's hello timeout (10 s), after which it closes any anyway.
        closed, deadline = set(), time.monotonic() + 5
        while len(closed) < n - 8 and time.monotonic() < deadline:
            closed.update(fd for fd, _ in poller.poll(100))
        say(flooded=n, closed=len(closed))
        f = recv()
        say(got=type(f.message).__name__)
    elif mode == "fuzz":
        # Seeded random traffic, well-formed (in-order and repeated messages and determinants,
        # spawn requests, side connections), with one hostile frame at a random point, of the
        # kind the seed picks; then on until the agent closes the connection, or N frames.
        import random, socket as socketlib
        seed, n = int(sys.argv[2]), int(sys.argv[3])
        rng = random.Random(seed)
        kinds = ["seqgap", "detgap", "forged", "stranger", "baddst", "garbage", "ckpt", "zero"]
        hostile, hostile_at = kinds[seed % len(kinds)], rng.randint(5, 60)
        side, seqs, dets, sent = [], {}, 0, 0
        def step(i):
            global dets
            dst = rng.randint(0, w.size - 1)
            last = seqs.get(dst, 0)
            if i == hostile_at:
                data = dict(job=w.job, src=w.rank, dst=dst, seq=last + 1, ctx=0, tag=i)
                if hostile == "seqgap":
                    send(m.Data(**{**data, "seq": last + rng.randint(2, 10**6)}), b"gap")
                elif hostile == "detgap":
                    send(m.Det(job=w.job, rank=w.rank, index=dets + rng.randint(1, 99), data=b""))
                elif hostile == "forged":
                    send(m.Data(**{**data, "src": (w.rank + 1) % w.size}), b"forged")
                elif hostile == "stranger":
                    send(m.Data(**{**data, "job": w.job + 1}), b"stranger")
                elif hostile == "baddst":
                    send(m.Data(**{**data, "dst": rng.choice([-1, w.size, 10**9])}), b"dst")
                elif hostile == "garbage":
                    sock.sendall(rng.randbytes(rng.randint(1, 64)))
                elif hostile == "ckpt":
                    send(m.CkptForked(ckpt=i, pid=rng.randint(-1, 40)))
                else:
                    send(m.Data(**{**data, "seq": 0}), b"zero")
            else:
                pick = rng.random()
                if pick < 0.6:
                    seq = last + 1 if rng.random() < 0.9 or not last else last
                    body = rng.randbytes(rng.choice([0, 10, 1000, 70000]))
                    send(m.Data(job=w.job, src=w.rank, dst=dst, seq=seq, ctx=0, tag=i), body)
                    seqs[dst] = max(last, seq)
                elif pick < 0.85:
                    send(m.Det(job=w.job, rank=w.rank, index=dets, data=b"d"))
                    dets += 1
                elif pick < 0.95:
                    c = socketlib.socket(socketlib.AF_UNIX)
                    try:
                        c.connect(os.environ["VPOOL_AGENT_SOCKET"])
                        side.append(c)
                    except OSError:
                        pass
                else:
                    send(m.SpawnRequest(
                        seq=i, command=["x"], maxprocs=rng.randint(-1, 5), least=0, parent=[],
                        ctx=0,
                    ))
        for i in range(n):
            try:
                step(i)
            except OSError:
                break  # the agent closed the connection under the write
            sent = i + 1
            try:
                sock.setblocking(False)
                if sock.recv(1 << 16, socketlib.MSG_PEEK) == b"":
                    break  # the agent is done with this rank
            except BlockingIOError:
                pass
            except OSError:
                break
            finally:
                sock.setblocking(True)
        say(fuzzed=sent, hostile=hostile, at=hostile_at)
    elif mode == "bigframe":
        # One message announced larger than the rank's memory limit (its bytes never made):
        # the prefix, the header and a first MiB of payload; then what the agent answers.
        size = int(sys.argv[2])
        header = framing.encode_frame(
            m.Data(job=w.job, src=w.rank, dst=1, seq=1, ctx=0, tag=0)
        )[framing.PREFIX_SIZE:]
        try:
            sock.sendall(framing.frame_prefix(len(header), size) + header + bytes(1 << 20))
        except OSError:
            pass
        f = recv()
        say(refused=f.message.code)
    elif mode == "deeptree":
        # 1,100 nested directories and 3,000 empty files in its directory, then a clean exit.
        fd = os.open(".", os.O_RDONLY)
        for _ in range(1100):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(fd)
        os.mkdir("many")
        for i in range(3000):
            open(f"many/{i}", "w").close()
        say(made="deep")
    elif mode == "forged":
        send(m.Data(job=w.job, src=w.rank + 1, dst=0, seq=1, ctx=0, tag=0), b"x")
        f = recv()
        say(refused=f.message.code)
    elif mode == "abort":
        send(m.Abort(code=7, message="giving up"))
        sys.exit(7)
    elif mode == "wait":
        f = recv()
        say(got=type(f.message).__name__)
        time.sleep(60)
    elif mode == "hang":
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        say(pid=os.getpid())
        time.sleep(120)
    sys.exit(0)
    """
)

ENV_PROGRAM = textwrap.dedent(
    """
    import json, os, sys
    info = {k: v for k, v in os.environ.items() if k.startswith(("VPOOL_", "PYTHON", "HOME"))}
    info["path0"] = sys.path[0:3]
    info["cwd"] = os.getcwd()
    info["fresh"] = not os.path.exists("result.txt")  # a new directory per incarnation
    with open(os.environ["VPOOL_RANK_SECRET_FILE"]) as f:
        info["secret"] = f.read()
    info["stdin"] = sys.stdin.read()
    try:
        import mpi4py
        info["mpi4py"] = mpi4py.__file__
    except Exception as exc:
        info["mpi4py"] = repr(exc)
    print(json.dumps(info))
    with open("result.txt", "w") as f:
        f.write("made by the rank")
    with open("data/input.txt", "a") as f:
        f.write(" and changed")
    sys.stdout.write("x" * 200000)
    sys.stderr.write("to stderr\\n")
    """
)


def host_pid(ns_pid: int, job: int, rank: int) -> int:
    """The pid, as this test sees it, of the rank process of ``job``/``rank`` that has pid
    ``ns_pid`` in its own PID namespace (its sandbox's; the same pid unsandboxed)."""
    want = {b"VPOOL_JOB=" + str(job).encode(), b"VPOOL_RANK=" + str(rank).encode()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                nspid = next(line.split()[1:] for line in f if line.startswith("NSpid:"))
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, StopIteration):
            continue
        # The program itself (``python ENTRY``), not its sandbox's bwrap or init, and one this
        # test started (another pytest worker may run a rank of the same job and rank number).
        if (
            nspid[-1] == str(ns_pid)
            and want <= env
            and len(argv) > 1
            and argv[1].endswith(b".py")
            and _descends_from_this_process(int(entry))
        ):
            return int(entry)
    raise AssertionError(f"no process of rank {rank} of job {job} has pid {ns_pid} inside")


def _descends_from_this_process(pid: int) -> bool:
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        try:
            with open(f"/proc/{pid}/status") as f:
                pid = next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
        except (OSError, StopIteration, ValueError):
            return False
    return False


def make_bundle(files: dict[str, str | bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, content in files.items():
            zf.writestr(name, content)
    return buf.getvalue()


def lease_for(
    coordinator: FakeCoordinator,
    relay: FakeRelay | None,
    *,
    program: str = RANK_PROGRAM,
    args: list[str] | None = None,
    job: int = 7,
    rank: int = 0,
    size: int = 2,
    stdin: bytes | None = None,
    extra: dict[str, str | bytes] | None = None,
) -> api.Lease:
    bundle = coordinator.add_blob(make_bundle({"app.py": program, **(extra or {})}))
    relays = [relay.info] if relay is not None else []
    return api.Lease(
        job=job,
        rank=rank,
        incarnation=1,
        size=size,
        token=coordinator.rank_token(job, rank, size),
        bundle=bundle,
        entry="app.py",
        args=args or [],
        stdin=coordinator.add_blob(stdin) if stdin is not None else None,
        relays=relays,
        homes=[0] * size if relays else [],
    )


@pytest.fixture(scope="session")
def selftest_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test agents' shared ``selftest_cache``: the first agent of the session with given
    settings probes its sandbox, the others reuse what it found (the agent checks that nothing
    it depends on changed). tests/worker_agent/test_selftest.py probes every time."""
    return tmp_path_factory.getbasetemp() / "agent-selftest.json"


@pytest.fixture
def settings(
    request: pytest.FixtureRequest, tmp_path: Path, pool_pki: Pki, selftest_cache: Path
) -> AgentSettings:
    """The test agent's settings; ``parametrize("settings", [{...}], indirect=True)`` changes
    some."""
    base = AgentSettings(
        selftest_cache=str(selftest_cache),
        name="test-agent",
        coordinator_url="https://coordinator.invalid",
        coordinator_ca=str(pool_pki.ca),
        identity_dir=str(tmp_path / "id"),
        work_dir=str(tmp_path / "w"),
        slots=4,
        stop_grace=0.5,
        retry_max_delay=0.2,
        relay_reconnect=1.0,  # tests of reconnection set their own
    )
    return dataclasses.replace(base, **getattr(request, "param", {}))


@dataclass
class RunningAgent:
    started: AgentStarted
    cancel_scope: trio.CancelScope
    finished: trio.Event


@pytest.fixture
async def agent(
    nursery: trio.Nursery, settings: AgentSettings, coordinator: FakeCoordinator
) -> RunningAgent:
    scope = trio.CancelScope()
    finished = trio.Event()

    async def run(task_status: trio.TaskStatus[AgentStarted]) -> None:
        try:
            with scope:
                await run_agent(
                    settings,
                    transport=httpx.MockTransport(coordinator.handle),
                    task_status=task_status,
                )
        finally:
            finished.set()

    # Started once its sandbox and checkpoint probes are done: seconds, or tens of them on a
    # machine whose cores are busy with other tests' processes.
    with trio.fail_after(60):
        started = await nursery.start(run)
    return RunningAgent(started, scope, finished)


def lines(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.decode().splitlines() if line.startswith("{")]


# -- the fake coordinator over real HTTPS ------------------------------------------------------


def asgi_app(fake: FakeCoordinator) -> Callable[..., Any]:
    """The fake coordinator as an ASGI app, for tests that need a real HTTPS server."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                event = await receive()
                kind = event["type"].rsplit(".", 1)[1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        body = b""
        while True:
            event = await receive()
            body += event.get("body", b"")
            if not event.get("more_body"):
                break
        request = httpx.Request(
            scope["method"],
            "https://coordinator" + scope["path"],
            headers=[(k.decode(), v.decode()) for k, v in scope["headers"]],
            content=body,
        )
        try:
            resp = await fake.handle(request)
        except httpx.ConnectError:
            resp = httpx.Response(503, json={"error": {"code": "down", "message": "down"}})
        headers = [(b"content-type", resp.headers.get("content-type", "application/json").encode())]
        await send({"type": "http.response.start", "status": resp.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": resp.content})

    return app


@pytest.fixture
async def https_coordinator(
    nursery: trio.Nursery, coordinator: FakeCoordinator, pool_pki: Pki
) -> str:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.certfile = str(pool_pki.cert)
    config.keyfile = str(pool_pki.key)
    config.accesslog = None
    config.errorlog = None
    [url] = await nursery.start(
        functools.partial(serve, asgi_app(coordinator), config, mode="asgi")  # type: ignore[arg-type]
    )
    return str(url)


@pytest.fixture
async def proxy(nursery: trio.Nursery, tmp_path: Path) -> tuple[LocalRanks, Path]:
    """A rank proxy serving ``tmp_path/a.sock`` for the ranks added to its LocalRanks."""
    ranks = LocalRanks()
    path = await nursery.start(
        RankProxy(ranks, processor="host", max_payload=1 << 20).serve, tmp_path / "a.sock"
    )
    return ranks, path


# -- a real sandbox (bwrap) -------------------------------------------------------------


@pytest.fixture(scope="module")
def iso(tmp_path_factory: pytest.TempPathFactory) -> sandboxed.Isolation:
    work = tmp_path_factory.mktemp("agent")
    found = sandboxed.find_isolation(AgentSettings(work_dir=str(work)))
    if not found.on:
        pytest.skip(f"no sandbox here: {found.reason}")
    return found


@pytest.fixture
def rank_dir(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    d = tmp_path / "rank"
    (d / "work").mkdir(parents=True)
    (d / "home").mkdir()
    sock_path = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"vpool-t-{os.getpid()}.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    server.listen()
    try:
        yield d, sock_path
    finally:
        server.close()
        sock_path.unlink(missing_ok=True)
