"""The agent's side of checkpoints that needs neither CRIU nor a relay: settings, the ranks'
environment, output offsets, the control connection and the store client (a checkpoint that
fails at the dump: ``test_checkpoint_failures``)."""

from __future__ import annotations

import functools
import os
import signal
import ssl
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, cast

import pytest
import trio
from cryptography.hazmat.primitives.poly1305 import Poly1305

from vpool.protocol import api
from vpool.protocol.ckptdigest import image_digest
from vpool.protocol.framing import (
    PREFIX_SIZE,
    FrameDecoder,
    encode_frame,
    parse_prefix,
    raw_frame_parts,
)
from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    CheckpointRequest,
    CkptChunk,
    CkptEnd,
    CkptForked,
    CkptGet,
    CkptInfo,
    CkptPut,
    CkptStored,
    Error,
    Hello,
    Message,
    RankHello,
    RankWelcome,
    Welcome,
    decode,
    encode,
)
from vpool.tls import client_context, server_context
from vpool.worker_agent.agent import drop_scratch
from vpool.worker_agent.checkpoints import (
    Capability,
    Checkpointer,
    checkpoint_signal,
    checkpoints_enabled,
    next_periodic,
)
from vpool.worker_agent.local_ranks import LocalRank, LocalRanks
from vpool.worker_agent.output import OutputPump
from vpool.worker_agent.ranks import rank_env
from vpool.worker_agent.settings import AgentSettings, load_agent_settings
from vpool.worker_agent.store_client import (
    STORE_PREAMBLE,
    Aborter,
    StoreConnection,
    StoreError,
    open_store,
    run_in_thread,
)

from .conftest import Pki

LEASE = api.Lease(
    job=3,
    rank=1,
    incarnation=2,
    size=2,
    token="rank-token",
    bundle="",
    entry="app.py",
    args=[],
    stdin=None,
    relays=[],
    homes=[],
    job_uid="uid42",
    ckpt_key="A" * 43,
)


# -- settings and environment -----------------------------------------------------------------


def test_checkpoint_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VPOOL_AGENT_FINGERPRINT_SALT", "agent-b")
    monkeypatch.setenv("VPOOL_AGENT_CHECKPOINT_ZSTD_LEVEL", "3")
    s = load_agent_settings(overrides={"work_dir": str(tmp_path)})
    assert s.fingerprint_salt == "agent-b"
    assert s.checkpoint_zstd_level == 3
    # No fixed paths shared by every agent of the machine: the agent's own, or named after it.
    assert (s.criu, s.rank_root_path) == ("criu", tmp_path / "ranks")
    assert s.checkpoint_clone_timeout == 600.0
    if Path("/dev/shm").is_dir():
        assert s.scratch_path.parent == Path("/dev/shm")
        assert s.scratch_path.name.startswith(f"vpool-ckpt-{os.getuid()}-")
        other = load_agent_settings(overrides={"work_dir": str(tmp_path / "other")})
        assert other.scratch_path != s.scratch_path
    else:
        assert s.scratch_path == tmp_path / "ckpt"
    assert AgentSettings(checkpoint_scratch=str(tmp_path / "x")).scratch_path == tmp_path / "x"


def test_an_agent_leaves_no_empty_scratch_directory(tmp_path: Path) -> None:
    """Its own scratch directory goes when the agent ends, if empty (checkpoints being taken
    keep it); one the volunteer named stays."""
    s = load_agent_settings(overrides={"work_dir": str(tmp_path)})
    s.scratch_path.mkdir(mode=0o700)
    (s.scratch_path / "7-0-1-abc").mkdir()
    drop_scratch(s)
    assert s.scratch_path.is_dir()
    (s.scratch_path / "7-0-1-abc").rmdir()
    drop_scratch(s)
    assert not s.scratch_path.exists()
    drop_scratch(s)  # gone already: nothing to do
    named = AgentSettings(work_dir=str(tmp_path), checkpoint_scratch=str(tmp_path / "x"))
    named.scratch_path.mkdir()
    drop_scratch(named)
    assert named.scratch_path.is_dir()


def test_periodic_checkpoints_keep_their_period() -> None:
    # A 7 s checkpoint started at 30: the next is due at 60, not 30 s after it ended (67).
    assert next_periodic(30.0, 30.0, 30.0, 37.0) == 60.0
    # An ordered one (at 41-48) leaves the schedule alone...
    assert next_periodic(30.0, 60.0, None, 48.0) == 63.0  # ...but half a period of rest
    assert next_periodic(30.0, 90.0, None, 48.0) == 90.0
    # Slower than the period: half a period after its end, not at once.
    assert next_periodic(10.0, 10.0, 10.0, 32.0) == 37.0


def test_rank_env_has_checkpoint_variables_only_when_enabled(tmp_path: Path) -> None:
    cap = Capability(criu="4.1.1", fingerprint="f")
    kw = {
        "secret_file": "/vpool/rank/.vpool-secret",
        "socket_path": tmp_path / "a.sock",
        "shim": tmp_path,
        "home": tmp_path,
    }
    assert checkpoints_enabled(cap, LEASE) == ""
    env = rank_env(
        LEASE, **kw, rank_dir=tmp_path / "r", checkpoints=True, clone_timeout=42, orphan_wait=7
    )
    assert env["VPOOL_RANK_DIR"] == str(tmp_path / "r")
    assert env["VPOOL_CKPT_SIGNAL"] == str(int(signal.SIGRTMIN) + 4) == str(checkpoint_signal())
    assert env["VPOOL_CKPT_CLONE_TIMEOUT"] == "42"
    assert env["VPOOL_CKPT_ORPHAN_WAIT"] == "7"
    env = rank_env(LEASE, **kw, rank_dir=tmp_path / "r", checkpoints=False)
    assert "VPOOL_RANK_DIR" not in env and "VPOOL_CKPT_SIGNAL" not in env
    assert env["VPOOL_RANK_SECRET_FILE"] == "/vpool/rank/.vpool-secret"
    assert not any(
        "SECRET=" in f"{k}={v}" and k != "VPOOL_RANK_SECRET_FILE" for k, v in env.items()
    )
    # Each missing condition turns checkpoints off, with the reason.
    assert "CRIU" in checkpoints_enabled(Capability(), LEASE)
    no_ft = api.Lease(**{**_fields(LEASE), "env": {"VPOOL_FT": "0"}})
    assert "fault tolerance" in checkpoints_enabled(cap, no_ft)
    no_key = api.Lease(**{**_fields(LEASE), "ckpt_key": ""})
    assert "key" in checkpoints_enabled(cap, no_key)


def _fields(lease: api.Lease) -> dict[str, object]:
    return {f: getattr(lease, f) for f in lease.__struct_fields__}


# -- output offsets ---------------------------------------------------------------------------


async def test_stream_offsets_count_what_is_still_in_the_pipe() -> None:
    """Offsets = start + bytes the pump read + FIONREAD of the pipe, with the pump stalled
    (its posts block, its buffer is full) so that part of the output stays in the pipe."""
    release = trio.Event()

    async def post(batch: api.OutputBatch) -> None:
        await release.wait()

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pump = OutputPump(
        LEASE, post, max_buffered=100, batch_bytes=50, start={"stdout": 1000, "stderr": 7}
    )
    stdout, stderr = trio.lowlevel.FdStream(out_r), trio.lowlevel.FdStream(err_r)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump.run, stdout, stderr)
        os.write(out_w, b"a" * 300)
        os.write(err_w, b"e" * 5)
        with trio.fail_after(5):
            while pump.read["stdout"] < 1300 or pump.read["stderr"] < 12:  # noqa: ASYNC110
                await trio.sleep(0.001)
        await trio.testing.wait_all_tasks_blocked()
        # The buffer is full: the pump reads no more, what follows stays in the pipe.
        os.write(out_w, b"b" * 500)
        await trio.testing.wait_all_tasks_blocked()
        assert pump.read["stdout"] == 1300
        assert pump.stream_offsets() == {"stdout": 1800, "stderr": 12}
        os.close(out_w)
        os.close(err_w)
        release.set()
    assert pump.offsets == {"stdout": 1800, "stderr": 12}


async def test_held_pump_reads_nothing_until_released() -> None:
    """A checkpoint holds the pump: ``read`` stays put while the rank writes on, so the image's
    offsets are ``read`` at the hold plus what the rank finds in its pipes when it forks."""
    posted: list[api.OutputBatch] = []

    async def post(batch: api.OutputBatch) -> None:
        posted.append(batch)

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pump = OutputPump(LEASE, post, interval=0.01)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump.run, trio.lowlevel.FdStream(out_r), trio.lowlevel.FdStream(err_r))
        os.write(out_w, b"a" * 100)
        with trio.fail_after(5):
            while pump.read["stdout"] < 100:  # noqa: ASYNC110
                await trio.sleep(0.001)
        with trio.fail_after(5):
            await pump.hold()
        held = dict(pump.read)
        os.write(out_w, b"b" * 70)  # the rank writes on (after its fork, say)
        os.write(err_w, b"e" * 3)
        await trio.testing.wait_all_tasks_blocked()
        assert pump.read == held == {"stdout": 100, "stderr": 0}
        assert pump.stream_offsets() == {"stdout": 170, "stderr": 3}  # read + in the pipes
        pump.release()
        with trio.fail_after(5):
            while pump.read != {"stdout": 170, "stderr": 3}:  # noqa: ASYNC110
                await trio.sleep(0.001)
        os.close(out_w)
        os.close(err_w)
    data = b"".join(c.data for b in posted for c in b.chunks if c.stream == "stdout")
    assert data == b"a" * 100 + b"b" * 70


# -- the control connection -------------------------------------------------------------------


class FakeRankConn:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = FrameDecoder()

    async def send(self, msg: Message) -> None:
        await self.stream.send_all(encode_frame(msg))

    async def receive(self) -> Message:
        with trio.fail_after(10):
            while (frame := self.decoder.next_frame()) is None:
                data = await self.stream.receive_some(65536)
                assert data, "the agent closed the connection"
                self.decoder.receive_data(data)
        return frame.message


async def _connect(path: Path, hello: RankHello) -> tuple[FakeRankConn, Message]:
    conn = FakeRankConn(await trio.open_unix_socket(str(path)))
    await conn.send(hello)
    return conn, await conn.receive()


async def test_control_connection_handshake(proxy: tuple[LocalRanks, Path]) -> None:
    ranks, path = proxy
    rank = LocalRank(LEASE)
    ranks.add(rank)
    data, welcome = await _connect(path, RankHello(PROTOCOL_VERSION, rank.secret))
    control, welcome2 = await _connect(path, RankHello(PROTOCOL_VERSION, rank.secret, control=True))
    assert isinstance(welcome, RankWelcome) and welcome == welcome2
    assert (welcome.job, welcome.rank, welcome.incarnation) == (3, 1, 2)
    assert rank.control is not None
    # A second control connection is refused.
    other, refused = await _connect(path, RankHello(PROTOCOL_VERSION, rank.secret, control=True))
    await other.stream.aclose()
    assert isinstance(refused, Error) and refused.code == "already_connected"
    # rank -> agent: handed to the checkpoint task
    forked = CkptForked(ckpt=9, pid=123, received=[0, 4], sent=[2, 0], dets=3, pending=[5, 0])
    await control.send(forked)
    with trio.fail_after(5):
        assert await rank.control_recv.receive() == forked
    # Anything else on it is a protocol error; the control connection ends, the data one not.
    await control.send(CheckpointRequest(request=1))
    err = await control.receive()
    assert isinstance(err, Error)
    with trio.fail_after(5):
        while rank.control is not None:  # noqa: ASYNC110
            await trio.sleep(0.01)
    await data.stream.aclose()
    await control.stream.aclose()


async def test_restored_process_must_name_the_image(proxy: tuple[LocalRanks, Path]) -> None:
    ranks, path = proxy
    rank = LocalRank(LEASE)
    rank.restored_from = 77
    ranks.add(rank)
    for checkpoint in (76, -1):
        conn, refused = await _connect(
            path, RankHello(PROTOCOL_VERSION, rank.secret, checkpoint=checkpoint)
        )
        await conn.stream.aclose()
        assert isinstance(refused, Error) and refused.code == "wrong_checkpoint"
    conn, welcome = await _connect(path, RankHello(PROTOCOL_VERSION, rank.secret, checkpoint=77))
    assert isinstance(welcome, RankWelcome)
    await conn.stream.aclose()


@pytest.mark.large
async def test_a_pid_the_rank_names_is_killed_only_when_it_is_the_ranks_own(
    nursery: trio.Nursery,
) -> None:
    """A ``CkptForked`` for a checkpoint nobody waits for makes the agent kill the clone it
    names: only a descendant of the rank's own, never a process a hostile rank points at."""
    program = (
        "import os, sys, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n    time.sleep(60)\n    os._exit(0)\n"
        "print(pid, flush=True)\ntime.sleep(60)\n"
    )
    rank_proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", program], stdout=subprocess.PIPE
    )
    victim = await trio.lowlevel.open_process([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert rank_proc.stdout is not None
        clone = int((await rank_proc.stdout.receive_some(100)).split()[0])
        rank = LocalRank(LEASE)
        rank.pid = rank_proc.pid
        checkpointer = Checkpointer(cast(Any, None), rank, cast(Any, None), cast(Any, None))
        nursery.start_soon(checkpointer._control_reader)
        clone_fd = os.pidfd_open(clone)
        try:
            for pid in (victim.pid, os.getpid(), 1, clone):
                await rank.control_send.send(CkptForked(ckpt=5, pid=pid))
            # The clone, which is the rank's, dies; then nothing else did.
            with trio.fail_after(10):
                await trio.lowlevel.wait_readable(clone_fd)
        finally:
            os.close(clone_fd)
        assert victim.poll() is None and rank_proc.poll() is None
    finally:
        for proc in (rank_proc, victim):
            proc.kill()
            await proc.wait()


# -- the store client -------------------------------------------------------------------------


class FakeStore:
    """A tiny TLS checkpoint store: keeps images in memory, speaks the preamble and frames."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.ctx = ctx
        self.images: dict[int, tuple[CkptPut, bytes]] = {}
        self.hellos: list[Hello] = []
        self.preambles: list[bytes] = []

    async def handle(self, tcp: trio.SocketStream) -> None:
        preamble = b""
        with trio.fail_after(10):
            while len(preamble) < len(STORE_PREAMBLE):
                more = await tcp.receive_some(len(STORE_PREAMBLE) - len(preamble))
                if not more:
                    return
                preamble += more
        self.preambles.append(preamble)
        stream = trio.SSLStream(tcp, self.ctx, server_side=True)
        buf = bytearray()

        async def frame() -> tuple[Message, bytes]:
            """The next frame; ``CkptChunk`` may carry a payload (FrameDecoder refuses it)."""
            with trio.fail_after(10):
                while True:
                    if len(buf) >= PREFIX_SIZE:
                        head, size = parse_prefix(buf[:PREFIX_SIZE])
                        end = PREFIX_SIZE + head + size
                        if len(buf) >= end:
                            msg = decode(bytes(buf[PREFIX_SIZE : PREFIX_SIZE + head]))
                            payload = bytes(buf[PREFIX_SIZE + head : end])
                            del buf[:end]
                            return msg, payload
                    data = await stream.receive_some(1 << 20)
                    if not data:
                        raise trio.EndOfChannel
                    buf.extend(data)

        async def send(msg: Message, payload: bytes = b"") -> None:
            await stream.send_all(b"".join(raw_frame_parts(encode(msg), payload)))

        hello, _ = await frame()
        assert isinstance(hello, Hello)
        self.hellos.append(hello)
        await send(Welcome(version=PROTOCOL_VERSION, relay="r"))
        try:
            while True:
                msg, _ = await frame()
                if isinstance(msg, CkptPut):
                    body = bytearray()
                    while True:
                        more, chunk = await frame()
                        if isinstance(more, CkptChunk):
                            body += chunk
                            continue
                        assert isinstance(more, CkptEnd) and more.size == len(body)
                        assert more.digest == image_digest(body)
                        # The agent MACs every byte under the put's one-time key.
                        Poly1305.verify_tag(msg.mac_key, bytes(body), more.mac)
                        break
                    self.images[msg.ckpt] = (msg, bytes(body))
                    await send(CkptStored(msg.ckpt, [msg.ckpt]))
                elif isinstance(msg, CkptGet):
                    if msg.ckpt not in self.images:
                        await send(Error("not_found", "no such image"))
                        return
                    put, body = self.images[msg.ckpt]
                    digest = image_digest(body)
                    await send(
                        CkptInfo(
                            msg.ckpt,
                            len(body),
                            digest,
                            put.received,
                            put.dets,
                            put.fingerprint,
                            put.meta,
                        )
                    )
                    for i in range(0, len(body), 1000):
                        await send(CkptChunk(msg.ckpt), body[i : i + 1000])
                    await send(CkptEnd(msg.ckpt, len(body), digest))
        except (trio.EndOfChannel, trio.BrokenResourceError):
            pass  # the agent closed the connection (it sends no TLS goodbye)


@pytest.fixture
async def store(nursery: trio.Nursery, pool_pki: Pki) -> tuple[FakeStore, api.RelayInfo]:
    fake = FakeStore(server_context(pool_pki.cert, pool_pki.key))
    listeners = await nursery.start(
        functools.partial(trio.serve_tcp, fake.handle, 0, host="127.0.0.1")
    )
    port = listeners[0].socket.getsockname()[1]
    return fake, api.RelayInfo(name="r", host="127.0.0.1", port=port)


async def test_store_client_put_and_get(
    store: tuple[FakeStore, api.RelayInfo], pool_pki: Pki
) -> None:
    fake, info = store
    ctx = client_context(pool_pki.ca)
    body = os.urandom(5000)

    def connect() -> StoreConnection:
        return open_store(info, ssl_context=ctx, token="agent", max_payload=1 << 20)

    def put(_: Aborter) -> CkptStored:
        with connect() as c:
            c.put_begin(CkptPut("rank-token", 5, {0: 3}, 2, "fp", b"meta"))
            for i in range(0, len(body), 1500):
                c.put_chunk(5, body[i : i + 1500])
            return c.put_end(5, len(body), image_digest(body))

    assert await run_in_thread(put) == CkptStored(5, [5])
    assert fake.preambles == [STORE_PREAMBLE]
    assert fake.hellos[0].role == "store" and fake.hellos[0].token == "agent"
    assert fake.images[5][1] == body

    def get(_: Aborter) -> tuple[CkptInfo, bytes]:
        with connect() as c:
            got_info, chunks = c.get("rank-token", 5)
            return got_info, b"".join(chunks)

    got_info, got = await run_in_thread(get)
    assert got == body
    assert (got_info.received, got_info.dets, got_info.meta) == ({0: 3}, 2, b"meta")

    def missing(_: Aborter) -> None:
        with connect() as c:
            c.get("rank-token", 6)

    with pytest.raises(StoreError) as refused:
        await run_in_thread(missing)
    assert refused.value.code == "not_found"


async def test_niced_upload_reaches_the_loop_by_its_token(
    store: tuple[FakeStore, api.RelayInfo], pool_pki: Pki
) -> None:
    """The agent uploads at ``checkpoint_nice``: the work runs in a thread of its own that
    much nicer, and calls into trio (the wait for the relays' acks) with the loop's token."""
    fake, info = store
    ctx = client_context(pool_pki.ca)
    body = os.urandom(3000)
    token = trio.lowlevel.current_trio_token()
    seen: list[int] = []

    async def in_loop() -> int:
        await trio.lowlevel.checkpoint()
        return threading.get_native_id()

    def put(aborter: Aborter) -> tuple[int, CkptStored]:
        tid = threading.get_native_id()
        seen.append(os.getpriority(os.PRIO_PROCESS, tid))
        with open_store(
            info, ssl_context=ctx, token="agent", max_payload=1 << 20, aborter=aborter
        ) as c:
            c.put_begin(CkptPut("rank-token", 3, {}, 0, "fp", b""))
            c.put_chunk(3, body)
            loop_tid = trio.from_thread.run(in_loop, trio_token=token)
            return loop_tid, c.put_end(3, len(body), image_digest(body))

    loop_tid, stored = await run_in_thread(put, nice=9)
    assert stored == CkptStored(3, [3])
    assert loop_tid == threading.get_native_id()
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen == [min(mine + 9, 19)]
    assert fake.images[3][1] == body


@pytest.mark.parametrize("nice", [0, 9])
async def test_cancelled_upload_ends_its_thread_at_once(
    store: tuple[FakeStore, api.RelayInfo], pool_pki: Pki, nice: int
) -> None:
    """A store that never answers CkptEnd: cancelling the caller shuts the connection down,
    and the worker thread (blocked in recv, its timeout 60 s) ends with it."""
    _, info = store
    ctx = client_context(pool_pki.ca)
    started = trio.Event()
    ended: list[BaseException] = []
    token = trio.lowlevel.current_trio_token()

    def hang(aborter: Aborter) -> None:
        with open_store(
            info, ssl_context=ctx, token="agent", max_payload=1 << 20, aborter=aborter
        ) as c:
            c.put_begin(CkptPut("rank-token", 9, {}, 0, "fp", b""))
            trio.from_thread.run_sync(started.set, trio_token=token)
            try:
                c.receive()  # the fake store sends nothing until CkptEnd
            except BaseException as exc:
                ended.append(exc)
                raise

    with trio.move_on_after(30) as deadline:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(run_in_thread, hang, nice=nice))
            await started.wait()
            nursery.cancel_scope.cancel()
    assert not deadline.cancelled_caught
    assert len(ended) == 1 and isinstance(ended[0], StoreError)
