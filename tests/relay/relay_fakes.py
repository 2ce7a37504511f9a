"""Fakes for the relay tests: a pool's keys and certificates, a fake agent speaking the frames
over TLS, a relay running in the test's nursery and a fake coordinator (an httpx transport)."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from vpool import tls
from vpool.protocol import api, pki
from vpool.protocol.framing import FrameDecoder, encode_frame
from vpool.protocol.local import local_socket_name
from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Attach,
    Attached,
    Credit,
    Data,
    Det,
    DetAck,
    Error,
    Hello,
    Message,
    Stop,
    Welcome,
)
from vpool.protocol.tokens import AgentClaims, RankClaims, public_key_text, sign_token
from vpool.relay import log as logfiles
from vpool.relay.hub import Hub
from vpool.relay.server import serve_relay
from vpool.relay.settings import RelaySettings

DEADLINE = 10.0


@dataclass
class Pool:
    """A pool's CA, relay certificate and coordinator signing key."""

    dir: Path
    key: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate)

    def __post_init__(self) -> None:
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
        self.ca = self.dir / "ca.pem"
        self.cert = self.dir / "relay.pem"
        self.cert_key = self.dir / "relay.key"
        self.ca.write_bytes(ca_cert)
        self.cert.write_bytes(cert)
        self.cert_key.write_bytes(key)
        self.client_ssl = tls.client_context(self.ca)

    @property
    def public_key_text(self) -> str:
        return public_key_text(self.key.public_key())

    def agent_token(
        self, agent: str, *, expires: float | None = None, key: Ed25519PrivateKey | None = None
    ) -> str:
        exp = time.time() + 3600 if expires is None else expires
        return sign_token(AgentClaims(agent=agent, expires=exp), key or self.key)

    def rank_token(
        self,
        job: int,
        rank: int,
        *,
        agent: str,
        size: int,
        incarnation: int = 1,
        expires: float | None = None,
        key: Ed25519PrivateKey | None = None,
        validating: bool = False,
    ) -> str:
        exp = time.time() + 3600 if expires is None else expires
        claims = RankClaims(
            job=job,
            rank=rank,
            incarnation=incarnation,
            size=size,
            agent=agent,
            expires=exp,
            validating=validating,
        )
        return sign_token(claims, key or self.key)

    def settings(self, data_dir: Path, **kw: Any) -> RelaySettings:
        base = RelaySettings(
            name="relay-t",
            host="127.0.0.1",
            port=0,
            data_dir=str(data_dir),
            tls_cert=str(self.cert),
            tls_key=str(self.cert_key),
            lost_grace=0.5,
            handshake_timeout=5.0,
        )
        return replace(base, **kw)


class FakeAgent:
    """One agent connection, driven step by step by a test. Every connection lands in
    ``opened`` (the ``agents`` fixture closes them)."""

    opened: list[FakeAgent] = []

    def __init__(self, stream: trio.abc.Stream, agent: str) -> None:
        self.stream = stream
        self.agent = agent
        self.decoder = FrameDecoder(max_payload=2**31)
        self.welcome: Welcome | None = None

    @classmethod
    async def connect(
        cls,
        pool: Pool,
        addr: tuple[str, int],
        agent: str = "agent-1",
        *,
        hello: bool = True,
        token: str | None = None,
        local: bool = False,
    ) -> FakeAgent:
        stream: trio.abc.Stream
        if local:  # the relay's same-host socket (``protocol.local``), TLS inside as on TCP
            unix = await trio.open_unix_socket(local_socket_name(addr[1]))
            stream = trio.SSLStream(unix, pool.client_ssl, server_hostname=addr[0])
        else:
            stream = await trio.open_ssl_over_tcp_stream(
                addr[0], addr[1], ssl_context=pool.client_ssl
            )
        self = cls(stream, agent)
        cls.opened.append(self)
        if hello:
            tok = pool.agent_token(agent) if token is None else token
            await self.send(Hello(version=PROTOCOL_VERSION, role="agent", token=tok))
            self.welcome = await self.expect(Welcome)
        return self

    async def send(self, msg: Message, payload: bytes = b"") -> None:
        await self.stream.send_all(encode_frame(msg, payload))

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def recv(self) -> tuple[Message, bytes]:
        """The next frame; EOFError when the relay closed the connection."""
        with trio.fail_after(DEADLINE):
            while True:
                frame = self.decoder.next_frame()
                if frame is not None:
                    return frame.message, frame.payload
                try:
                    data = await self.stream.receive_some(1 << 20)
                except trio.BrokenResourceError as exc:
                    raise EOFError("connection broken") from exc
                if not data:
                    raise EOFError("connection closed")
                self.decoder.receive_data(data)

    async def expect(self, kind: type[Any]) -> Any:
        msg, _ = await self.recv()
        assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r}"
        return msg

    async def expect_error(self, code: str) -> Error:
        """Skip acks and pushes up to an Error with ``code``, then see the connection close."""
        while True:
            msg, _ = await self.recv()
            if isinstance(msg, Error):
                break
            assert isinstance(msg, Ack | Data | DetAck), msg
        err = msg
        assert err.code == code, err
        with trio.fail_after(DEADLINE):
            try:
                while True:
                    await self.recv()
            except EOFError:
                pass
        return err

    async def expect_rank_error(self, code: str) -> Error:
        """Skip acks, pushes and stops up to an Error with ``code`` about one rank; the
        connection stays up."""
        while True:
            msg, _ = await self.recv()
            if isinstance(msg, Error):
                assert msg.code == code, msg
                assert msg.rank >= 0, msg
                return msg
            assert isinstance(msg, Ack | Data | DetAck | Stop), msg

    async def attach(
        self,
        pool: Pool,
        job: int,
        rank: int,
        *,
        size: int,
        home: bool = False,
        received: dict[int, int] | None = None,
        incarnation: int = 1,
        dets_from: int = 0,
        validating: bool = False,
    ) -> Attached:
        token = pool.rank_token(
            job, rank, agent=self.agent, size=size, incarnation=incarnation, validating=validating
        )
        await self.send(
            Attach(token=token, home=home, received=received or {}, dets_from=dets_from)
        )
        return await self.expect(Attached)

    async def attach_home(
        self, pool: Pool, job: int, rank: int, *, size: int, **kw: Any
    ) -> tuple[Attached, list[Det]]:
        """A home attachment and the determinants replayed right after ``Attached``."""
        att = await self.attach(pool, job, rank, size=size, home=True, **kw)
        dets_from = kw.get("dets_from", 0)
        dets = [await self.expect(Det) for _ in range(max(0, att.dets - dets_from))]
        return att, dets

    async def det(self, job: int, rank: int, index: int, data: bytes) -> None:
        await self.send(Det(job=job, rank=rank, index=index, data=data))

    async def det_ack(self) -> DetAck:
        """The next DetAck (skipping acks)."""
        while True:
            msg, _ = await self.recv()
            if isinstance(msg, DetAck):
                return msg
            assert isinstance(msg, Ack), msg

    async def deposit(
        self, job: int, src: int, dst: int, seq: int, payload: bytes, tag: int = 0
    ) -> None:
        await self.send(Data(job=job, src=src, dst=dst, seq=seq, ctx=0, tag=tag), payload)

    async def next_data(self, *, credit: bool = True) -> tuple[Data, bytes]:
        """The next pushed Data frame (skipping acks), credited back as the agent would."""
        while True:
            msg, payload = await self.recv()
            if isinstance(msg, Data):
                if credit:
                    nbytes = len(encode_frame(msg, payload))
                    await self.send(Credit(job=msg.job, rank=msg.dst, nbytes=nbytes))
                return msg, payload
            assert isinstance(msg, Ack), msg

    async def next_ack(self) -> Ack:
        return await self.expect(Ack)

    async def acks_until(self, job: int, src: int, dst: int, seq: int) -> None:
        while True:
            ack = await self.next_ack()
            if (ack.job, ack.src, ack.dst) == (job, src, dst) and ack.seq >= seq:
                return

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


@dataclass
class RunningRelay:
    addr: tuple[str, int]
    scope: trio.CancelScope
    settings: RelaySettings
    hub: Hub
    done: trio.Event

    async def stop(self) -> None:
        self.scope.cancel()
        with trio.fail_after(DEADLINE):
            await self.done.wait()


async def start_relay(nursery: trio.Nursery, settings: RelaySettings, **kw: Any) -> RunningRelay:
    scope = trio.CancelScope()
    done = trio.Event()
    send, recv = trio.open_memory_channel[Hub](1)

    async def run(task_status: trio.TaskStatus[tuple[str, int]]) -> None:
        try:
            with scope:
                await serve_relay(settings, hub_ready=send, task_status=task_status, **kw)
        finally:
            done.set()

    with trio.fail_after(DEADLINE):
        addr = await nursery.start(run)
    return RunningRelay(addr, scope, settings, recv.receive_nowait(), done)


Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


class FakeCoordinator:
    """The relay endpoints of the coordinator API, recording what relays post."""

    def __init__(
        self, pool: Pool, *, heartbeat_interval: float = 0.05, register_failures: int = 0
    ) -> None:
        self.pool = pool
        self.heartbeat_interval = heartbeat_interval
        self.register_failures = register_failures
        self.registered: list[api.RelayRegister] = []
        self.heartbeats: list[api.RelayHeartbeat] = []
        self.lost: list[api.RankLost] = []
        self.diverged: list[api.RelayDiverged] = []
        self.validated: list[api.RelayValidated] = []
        # What /relays/validated answers; ``validated_seen`` counts the posts, answered or not.
        self.validated_status = 200
        self.validated_seen = 0
        self.refused: list[api.RelayRefused] = []
        self.finished_jobs: list[int] = []
        self.changed = trio.Event()
        self.transport = httpx.MockTransport(self.handle)

    def _json(self, body: object, status: int = 200) -> httpx.Response:
        return httpx.Response(
            status, content=msgspec.json.encode(body), headers={"content-type": "application/json"}
        )

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer s3cret":
            return self._json(api.ErrorBody(api.ErrorDetail("unauthorized", "bad secret")), 401)
        path = request.url.path
        try:
            if path == "/api/v1/relays/register":
                if self.register_failures > 0:
                    self.register_failures -= 1
                    return self._json(api.ErrorBody(api.ErrorDetail("down", "starting")), 503)
                self.registered.append(msgspec.json.decode(request.content, type=api.RelayRegister))
                return self._json(
                    api.RelayRegistered(
                        signing_key=self.pool.public_key_text,
                        heartbeat_interval=self.heartbeat_interval,
                    )
                )
            if path == "/api/v1/relays/heartbeat":
                self.heartbeats.append(
                    msgspec.json.decode(request.content, type=api.RelayHeartbeat)
                )
                return self._json(api.RelayHeartbeatResponse(finished_jobs=self.finished_jobs))
            if path == "/api/v1/relays/diverged":
                self.diverged.append(msgspec.json.decode(request.content, type=api.RelayDiverged))
                return self._json({})
            if path == "/api/v1/relays/validated":
                report = msgspec.json.decode(request.content, type=api.RelayValidated)
                self.validated_seen += 1
                if self.validated_status != 200:
                    detail = api.ErrorDetail("not_found", f"no job {report.job}")
                    return self._json(api.ErrorBody(detail), self.validated_status)
                self.validated.append(report)
                return self._json({})
            if path == "/api/v1/relays/refused":
                self.refused.append(msgspec.json.decode(request.content, type=api.RelayRefused))
                return self._json({})
            if path == "/api/v1/relays/lost":
                self.lost.extend(msgspec.json.decode(request.content, type=api.RelayLost).lost)
                return self._json({})
            return self._json(api.ErrorBody(api.ErrorDetail("not_found", path)), 404)
        finally:
            self.changed.set()
            self.changed = trio.Event()

    async def wait_for(self, check: Callable[[], bool]) -> None:
        with trio.fail_after(DEADLINE):
            while not check():
                await self.changed.wait()


__all__ = ["DEADLINE", "FakeAgent", "FakeCoordinator", "Pool", "RunningRelay", "start_relay"]


def hold_log_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the relay's log writes wait (at most DEADLINE) until the returned event is set.
    They run in a worker thread only on a relay with ``fsync=True``: start it so."""
    release = threading.Event()
    real_write = logfiles.write_runs

    def slow_write(runs: list[logfiles.Run], *, fsync: bool) -> None:
        release.wait(DEADLINE)
        real_write(runs, fsync=fsync)

    monkeypatch.setattr(logfiles, "write_runs", slow_write)
    return release
