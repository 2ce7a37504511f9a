"""Helpers of the coordinator tests: an in-process pool driven through httpx, a fake clock."""

from __future__ import annotations

import hashlib
import io
import time
import zipfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from vpool.coordinator import keys
from vpool.coordinator.app import create_app
from vpool.coordinator.service import Coordinator
from vpool.coordinator.settings import CoordinatorSettings
from vpool.protocol import api
from vpool.protocol.tokens import sign_possession

T = TypeVar("T")
RELAY_NAMES = [f"relay-{i}" for i in range(10)]  # each has a key in every test pool


def relay_key(name: str = "relay-0") -> str:
    return f"vpr_key-of-{name}-for-tests"


def relay_headers(name: str = "relay-0") -> dict[str, str]:
    return {"Authorization": f"Bearer {relay_key(name)}"}


HELLO = b"from mpi4py import MPI\nprint('hello from', MPI.COMM_WORLD.Get_rank())\n"
# What the fake agents' heartbeats say of their isolation unless a test says otherwise: a
# sandbox with no memory limit per rank, so that every job may be placed there.
SANDBOX = api.IsolationReport(level="sandbox", checkpoints=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_zip(files: dict[str, bytes]) -> bytes:
    """The same files make the same bytes (so the same blob), whenever they are zipped: a
    member's time is fixed, not the current second."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), data)
    return buf.getvalue()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode(response: httpx.Response, type_: type[T]) -> T:
    assert response.status_code < 300, (response.status_code, response.text)
    return msgspec.json.decode(response.content, type=type_)


@dataclass
class Agent:
    id: str
    token: str
    key: Ed25519PrivateKey
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Pool:
    client: httpx.AsyncClient
    core: Coordinator
    clock: FakeClock
    users: dict[str, str] = field(default_factory=dict)

    def add_user(self, name: str, role: api.Role = "user") -> dict[str, str]:
        token, token_hash = keys.new_api_token()
        self.core.store.add_user(name, token_hash, self.clock(), role=role)
        self.users[name] = token
        return {"Authorization": f"Bearer {token}"}

    def user(self, name: str = "alice") -> dict[str, str]:
        if name not in self.users:
            return self.add_user(name)
        return {"Authorization": f"Bearer {self.users[name]}"}

    async def post(self, url: str, body: Any, headers: dict[str, str]) -> httpx.Response:
        return await self.client.post(url, content=msgspec.json.encode(body), headers=headers)

    async def upload(self, data: bytes, user: str = "alice") -> str:
        digest = sha(data)
        r = await self.client.put(f"/api/v1/blobs/{digest}", content=data, headers=self.user(user))
        assert decode(r, api.BlobInfo).size == len(data)
        return digest

    async def submit(
        self,
        ranks: int,
        *,
        user: str = "alice",
        program: bytes = HELLO,
        stdin: bytes | None = None,
        args: list[str] | None = None,
        memory: int = 0,
        unsandboxed: bool = False,
        validate: bool = False,
        checkpoint_every: float = 0.0,
        on_failure: api.FailureMode = "transparent",
        universe: int = 0,
        module: str = "",
    ) -> api.JobInfo:
        bundle = await self.upload(make_zip({"app.py": program, "input.txt": b"42\n"}), user)
        stdin_sha = await self.upload(stdin, user) if stdin is not None else None
        sub = api.JobSubmit(
            ranks=ranks,
            bundle=bundle,
            entry="app.py",
            args=args or [],
            stdin=stdin_sha,
            name=f"job-of-{user}",
            memory=memory,
            unsandboxed=unsandboxed,
            validate=validate,
            checkpoint_every=checkpoint_every,
            on_failure=on_failure,
            universe=universe,
            module=module,
        )
        r = await self.post("/api/v1/jobs", sub, self.user(user))
        assert r.status_code == 201, r.text
        return decode(r, api.JobInfo)

    async def running_job(self, ranks: int) -> tuple[api.JobInfo, Agent, list[api.Lease]]:
        """A job of ``ranks`` ranks running on one agent of as many slots, behind a relay: the
        job, the agent and its leases."""
        await self.register_relay()
        job = await self.submit(ranks)
        agent = await self.enroll(slots=ranks)
        leases = await self.lease(agent)
        await self.heartbeat(agent, leases)
        return job, agent, leases

    async def job(self, job_id: int, user: str = "alice") -> api.JobDetail:
        r = await self.client.get(f"/api/v1/jobs/{job_id}", headers=self.user(user))
        return decode(r, api.JobDetail)

    async def enroll(
        self,
        name: str = "agent-1",
        slots: int = 2,
        isolation: api.IsolationReport | None = SANDBOX,
        join_token: str = "",
    ) -> Agent:
        key = Ed25519PrivateKey.generate()
        return await self.enroll_key(key, name, slots, isolation, join_token)

    async def enroll_key(
        self,
        key: Ed25519PrivateKey,
        name: str,
        slots: int,
        isolation: api.IsolationReport | None = SANDBOX,
        join_token: str = "",
    ) -> Agent:
        """Enroll, then (unless ``isolation`` is None) send a first heartbeat with the
        isolation report, as real agents do before they ask for leases."""
        resp = decode(await self.enroll_request(key, name, slots, join_token), api.EnrollResponse)
        agent = Agent(
            resp.agent_id, resp.agent_token, key, {"Authorization": f"Bearer {resp.agent_token}"}
        )
        if isolation is not None:
            await self.heartbeat(agent, [], free=slots, isolation=isolation)
        return agent

    async def enroll_request(
        self, key: Ed25519PrivateKey, name: str = "agent-1", slots: int = 2, join_token: str = ""
    ) -> httpx.Response:
        ts = self.clock()
        pub, sig = sign_possession(key, ts)
        req = api.EnrollRequest(
            public_key=pub,
            timestamp=ts,
            signature=sig,
            name=name,
            slots=slots,
            join_token=join_token,
        )
        return await self.post("/api/v1/agents/enroll", req, {})

    async def lease(self, agent: Agent, free: int = 8, wait: float = 0.0) -> list[api.Lease]:
        r = await self.post(
            "/api/v1/agents/lease", api.LeaseRequest(free_slots=free, wait=wait), agent.headers
        )
        return decode(r, api.LeaseResponse).leases

    async def heartbeat(
        self,
        agent: Agent,
        ranks: list[api.Lease],
        free: int = 8,
        state: str = "running",
        isolation: api.IsolationReport | None = SANDBOX,
    ) -> api.AgentHeartbeatResponse:
        hb = api.AgentHeartbeat(
            ranks=[
                api.RankState(job=x.job, rank=x.rank, incarnation=x.incarnation, state=state)
                for x in ranks
            ],
            free_slots=free,
            isolation=isolation,
        )
        return decode(
            await self.post("/api/v1/agents/heartbeat", hb, agent.headers),
            api.AgentHeartbeatResponse,
        )

    async def exit(
        self, agent: Agent, lease: api.Lease, code: int = 0, aborted: bool = False
    ) -> httpx.Response:
        ex = api.RankExit(
            job=lease.job,
            rank=lease.rank,
            incarnation=lease.incarnation,
            code=code,
            aborted=aborted,
        )
        return await self.post("/api/v1/agents/exit", ex, agent.headers)

    async def output(
        self, agent: Agent, lease: api.Lease, stream: str, offset: int, data: bytes
    ) -> httpx.Response:
        chunk = api.OutputChunk(
            job=lease.job,
            rank=lease.rank,
            incarnation=lease.incarnation,
            stream=stream,
            offset=offset,
            data=data,
        )  # type: ignore[arg-type]
        return await self.post(
            "/api/v1/agents/output", api.OutputBatch(chunks=[chunk]), agent.headers
        )

    async def register_relay(self, name: str = "relay-0", port: int = 7000) -> None:
        r = await self.post(
            "/api/v1/relays/register",
            api.RelayRegister(name=name, host="127.0.0.1", port=port),
            relay_headers(name),
        )
        decode(r, api.RelayRegistered)

    async def relay_heartbeat(
        self, name: str = "relay-0", fenced: list[api.RankFence] | None = None
    ) -> api.RelayHeartbeatResponse:
        r = await self.post(
            "/api/v1/relays/heartbeat",
            api.RelayHeartbeat(name=name, load=api.RelayLoad(), fenced=fenced or []),
            relay_headers(name),
        )
        return decode(r, api.RelayHeartbeatResponse)


def test_settings(tmp_path: Path, **overrides: Any) -> CoordinatorSettings:
    values: dict[str, Any] = {
        "state_dir": str(tmp_path / "state"),
        # Most tests enroll agents of their own; tests of join tokens close it.
        "open_enrollment": True,
        "insecure_http": True,
        "heartbeat_interval": 1.0,
        "agent_timeout": 10.0,
        "relay_timeout": 10.0,
        "max_blob_bytes": 1 << 20,
        "max_ranks": 16,
        # Jobs spawn nothing unless a test says so (their leases' size is then their ranks).
        "spawn_default": 0,
        "pool_name": "test-pool",
        "max_request_bytes": 256 << 10,
    }
    values.update(overrides)
    return CoordinatorSettings(**values)


test_settings.__test__ = False  # type: ignore[attr-defined]


def new_core(tmp_path: Path, clock: FakeClock, **overrides: Any) -> Coordinator:
    """A coordinator on ``tmp_path`` (``test_settings`` plus ``overrides``) that knows the key
    of every relay in ``RELAY_NAMES``."""
    core = Coordinator(test_settings(tmp_path, **overrides), clock=clock)
    for name in RELAY_NAMES:
        core.store.add_relay_key(name, keys.hash_token(relay_key(name)), clock(), replace=True)
    return core


@asynccontextmanager
async def open_pool(
    tmp_path: Path, clock: FakeClock | None = None, **overrides: Any
) -> AsyncIterator[Pool]:
    """A coordinator on ``tmp_path`` (``test_settings`` plus ``overrides``) behind an
    in-process HTTP client, closed at the end."""
    clock = clock or FakeClock()
    core = new_core(tmp_path, clock, **overrides)
    app = create_app(core.settings, coordinator=core)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as c:
            yield Pool(c, core, clock)
    finally:
        core.close()
