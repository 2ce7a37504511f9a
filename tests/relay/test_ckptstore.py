"""The relay's checkpoint store over real TLS with real tokens: puts and gets, refusals,
retention, reports to the coordinator and what their answers do."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
from relay_fakes import FakeAgent, FakeCoordinator, Pool, start_relay
from store_fakes import MAC_KEY, MiB, ckpt_files, get, image, put, store_conn, until

from vpool.protocol import api
from vpool.protocol.ckptdigest import image_digest
from vpool.protocol.messages import (
    CkptChunk,
    CkptGet,
    CkptPut,
    CkptStored,
    Error,
)
from vpool.relay.ckptstore import Image, trim_target


@pytest.mark.large
async def test_put_get_round_trip(pool: Pool, relay: Any, tmp_path: Path, agents: object) -> None:
    conn = await store_conn(pool, relay.addr)
    assert conn.welcome is not None and conn.welcome.max_payload >= MiB
    data = image(1, 5 * MiB + 12345)
    stored = await put(conn, pool, 3, 1, 1, data, received={0: 7}, dets=4)
    assert stored == CkptStored(ckpt=1, retained=[1])
    # Several puts on one connection, one after the other.
    data2 = image(2, 3 * MiB)
    assert await put(conn, pool, 3, 1, 2, data2, received={0: 9}, dets=5) == CkptStored(
        ckpt=2, retained=[2, 1]
    )
    assert ckpt_files(tmp_path / "relay", 3, 1) == ["1.img", "1.json", "2.img", "2.json"]
    got = await get(conn, pool, 3, 1, 1)
    assert not isinstance(got, Error)
    info, back = got
    assert back == data
    assert (info.ckpt, info.received, info.dets, info.fingerprint, info.meta) == (
        1,
        {0: 7},
        4,
        "fp-1",
        b"manifest",
    )
    # Another agent (the restoring one) fetches over its own connection.
    other = await store_conn(pool, relay.addr, "agent-2")
    got = await get(other, pool, 3, 1, 2)
    assert not isinstance(got, Error) and got[1] == data2
    assert relay.hub.load_report().bytes_stored >= len(data) + len(data2)


@pytest.mark.large
async def test_refusals(pool: Pool, relay: Any, tmp_path: Path, agents: object) -> None:
    conn = await store_conn(pool, relay.addr)
    data = image(5, 2 * MiB + 3)
    # Bytes that do not match CkptEnd: nothing is committed, the connection goes on.
    err = await put(conn, pool, 4, 0, 5, data, digest=b"\0" * 32)
    assert isinstance(err, Error) and (err.code, err.job, err.rank) == ("corrupt", 4, 0)
    # Nor does the bytes' SHA-256 (the digest images had before BLAKE3).
    err = await put(conn, pool, 4, 0, 5, data, digest=hashlib.sha256(data).digest())
    assert isinstance(err, Error) and (err.code, err.job, err.rank) == ("corrupt", 4, 0)
    assert ckpt_files(tmp_path / "relay", 4, 0) == []
    assert await put(conn, pool, 4, 0, 5, data, incarnation=2) == CkptStored(ckpt=5, retained=[5])
    # Not newer than the newest image.
    err = await put(conn, pool, 4, 0, 5, data, incarnation=2)
    assert isinstance(err, Error) and err.code == "stale_ckpt"
    # An incarnation older than the newest known (here: the image's) is fenced, and so is one
    # older than an attachment's.
    err = await put(conn, pool, 4, 0, 6, data, incarnation=1)
    assert isinstance(err, Error) and err.code == "fenced"
    agent = await FakeAgent.connect(pool, relay.addr)
    await agent.attach(pool, 4, 0, size=2, home=True, incarnation=3)
    err = await put(conn, pool, 4, 0, 6, data, incarnation=2)
    assert isinstance(err, Error) and err.code == "fenced"
    assert await put(conn, pool, 4, 0, 6, data, incarnation=3) == CkptStored(
        ckpt=6, retained=[6, 5]
    )
    # Gets: an unknown image, an incarnation older than the image's.
    err = await get(conn, pool, 4, 0, 99, incarnation=3)
    assert isinstance(err, Error) and err.code == "not_found"
    err = await get(conn, pool, 4, 0, 6, incarnation=2)
    assert isinstance(err, Error) and err.code == "fenced"
    got = await get(conn, pool, 4, 0, 6, incarnation=3)
    assert not isinstance(got, Error) and got[1] == data
    # A rank token of another agent closes the connection.
    token = pool.rank_token(4, 0, agent="someone-else", size=2, incarnation=3)
    await conn.send(CkptGet(token=token, ckpt=6))
    err = await conn.expect_error("wrong_token")
    assert err.rank == -1


@pytest.mark.large
async def test_too_large_and_truncated(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    settings = pool.settings(tmp_path / "relay", checkpoint_max_bytes=3 * MiB)
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    conn = await store_conn(pool, relay.addr)
    await conn.send(
        CkptPut(
            token=pool.rank_token(1, 0, agent="agent-1", size=2),
            ckpt=1,
            received={},
            dets=0,
            fingerprint="fp",
            mac_key=MAC_KEY,
        )
    )
    for _ in range(4):
        await conn.send(CkptChunk(ckpt=1), b"x" * MiB)
    await conn.expect_error("too_large")
    # An upload cut off in the middle: no image, no part file, and the rank may upload again.
    conn = await store_conn(pool, relay.addr)
    await conn.send(
        CkptPut(
            token=pool.rank_token(1, 0, agent="agent-1", size=2),
            ckpt=2,
            received={},
            dets=0,
            fingerprint="fp",
            mac_key=MAC_KEY,
        )
    )
    await conn.send(CkptChunk(ckpt=2), b"y" * MiB)
    await conn.aclose()
    await until(lambda: not (relay.hub.store.uploading or ckpt_files(tmp_path / "relay", 1, 0)))
    conn = await store_conn(pool, relay.addr)
    assert await put(conn, pool, 1, 0, 2, b"z" * 1000) == CkptStored(ckpt=2, retained=[2])


@pytest.mark.large
async def test_keep_n_and_restart_sweeps(
    pool: Pool,
    nursery: trio.Nursery,
    tmp_path: Path,
    agents: object,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = pool.settings(tmp_path / "relay", checkpoint_keep=2)
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    conn = await store_conn(pool, relay.addr)
    for ckpt in (1, 2, 3):
        stored = await put(conn, pool, 2, 1, ckpt, image(ckpt, MiB + ckpt))
        assert stored == CkptStored(ckpt=ckpt, retained=[ckpt, ckpt - 1][: min(ckpt, 2)])
    d = tmp_path / "relay" / "jobs" / "2" / "1" / "ckpt"
    assert ckpt_files(tmp_path / "relay", 2, 1) == ["2.img", "2.json", "3.img", "3.json"]
    err = await get(conn, pool, 2, 1, 1)
    assert isinstance(err, Error) and err.code == "not_found"
    await conn.aclose()
    await relay.stop()
    # What a kill leaves behind: a part file, an image without its manifest.
    (d / "4.abcd.part").write_bytes(b"half")
    (d / "5.img").write_bytes(b"uncommitted")
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    assert ckpt_files(tmp_path / "relay", 2, 1) == ["2.img", "2.json", "3.img", "3.json"]
    conn = await store_conn(pool, relay.addr)
    got = await get(conn, pool, 2, 1, 3)
    assert not isinstance(got, Error) and got[1][:MiB] == image(3, MiB + 3)[:MiB]
    assert relay.hub.store.nbytes == 2 * MiB + 5
    await conn.aclose()
    await relay.stop()
    # A record from before BLAKE3 (key ``sha256``): its image is dropped, with a log line.
    record = json.loads((d / "2.json").read_bytes())
    record["sha256"] = hashlib.sha256((d / "2.img").read_bytes()).hexdigest()
    del record["digest"]
    (d / "2.json").write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING, logger="vpool.relay.ckptstore"):
        relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    assert ckpt_files(tmp_path / "relay", 2, 1) == ["3.img", "3.json"]
    assert relay.hub.store.retained((2, 1)) == [3] and relay.hub.store.nbytes == MiB + 3
    assert any("2.json" in r.getMessage() and "SHA-256" in r.getMessage() for r in caplog.records)
    conn = await store_conn(pool, relay.addr)
    err = await get(conn, pool, 2, 1, 2)
    assert isinstance(err, Error) and err.code == "not_found"


class CkptCoordinator(FakeCoordinator):
    """The fake coordinator plus ``/relays/checkpoint``: answers ``status`` (503 = down), with
    ``answer`` when it is 200 (``{}``, as a coordinator from before ``CheckpointAccepted``)."""

    def __init__(self, pool: Pool) -> None:
        super().__init__(pool)
        self.checkpoints: list[api.RelayCheckpoint] = []
        self.status = 503
        self.answer: object = {}
        self.seen = 0  # reports received, answered or not
        self.gate: trio.Event | None = None  # when set up, answers wait for it
        self.transport = httpx.MockTransport(self.handle_ckpt)

    async def handle_ckpt(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/api/v1/relays/checkpoint":
            return await self.handle(request)
        try:
            report = msgspec.json.decode(request.content, type=api.RelayCheckpoint)
            self.seen += 1
            self.changed.set()
            self.changed = trio.Event()
            if self.gate is not None:
                await self.gate.wait()
            if self.status != 200:
                return self._json(api.ErrorBody(api.ErrorDetail("no", "not now")), self.status)
            self.checkpoints.append(report)
            return self._json(self.answer)
        finally:
            self.changed.set()
            self.changed = trio.Event()


@pytest.mark.large
async def test_ckpt_stored_comes_once_the_coordinator_has_the_image(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    # The agent of a rank that just died reports the loss right after CkptStored: the
    # coordinator must know the image by then, or the replacement starts from an older one.
    coord = CkptCoordinator(pool)
    coord.status = 200
    coord.gate = trio.Event()
    settings = pool.settings(tmp_path / "relay", coordinator_url="http://coord", relay_key="s3cret")
    relay = await start_relay(nursery, settings, coordinator_transport=coord.transport)
    conn = await store_conn(pool, relay.addr)
    answers: list[object] = []
    done = trio.Event()

    async def upload() -> None:
        answers.append(await put(conn, pool, 6, 1, 1, b"img-1"))
        done.set()

    nursery.start_soon(upload)
    await coord.wait_for(lambda: coord.seen == 1)
    with trio.move_on_after(0.3):  # the coordinator has not answered: no CkptStored yet
        await done.wait()
    assert not answers, answers
    coord.gate.set()
    with trio.fail_after(10):
        await done.wait()
    assert answers == [CkptStored(1, [1])]
    assert [r.ckpt for r in coord.checkpoints] == [1]


@pytest.mark.large
async def test_reports_trim_only_once_accepted_and_409_deletes(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    coord = CkptCoordinator(pool)
    settings = pool.settings(
        tmp_path / "relay",
        coordinator_url="http://coord",
        relay_key="s3cret",
        store_report_wait=0.5,
    )
    relay = await start_relay(nursery, settings, coordinator_transport=coord.transport)
    a = await FakeAgent.connect(pool, relay.addr, "agent-1")
    await a.attach(pool, 6, 0, size=2)
    for seq in range(1, 11):
        await a.deposit(6, 0, 1, seq, b"m%d" % seq)
    await a.acks_until(6, 0, 1, 10)
    box = relay.hub.boxes[(6, 1)]
    conn = await store_conn(pool, relay.addr)
    # The coordinator is down: CkptStored after store_report_wait all the same (the image is
    # durable), the report is retried, the log stays whole.
    assert await put(conn, pool, 6, 1, 1, b"img-1", received={0: 6}) == CkptStored(1, [1])
    await coord.wait_for(lambda: len(coord.heartbeats) >= 3)
    assert len(box.mailbox) == 10 and not box.trim
    coord.status = 200
    await coord.wait_for(lambda: len(coord.checkpoints) == 1)
    rep = coord.checkpoints[0]
    assert (rep.name, rep.job, rep.rank, rep.incarnation, rep.ckpt, rep.size) == (
        "relay-t",
        6,
        1,
        1,
        1,
        5,
    )
    assert (rep.digest, rep.received, rep.retained, rep.trimmed) == (
        image_digest(b"img-1").hex(),
        {0: 6},
        [1],
        False,
    )
    await until(lambda: len(box.mailbox) == 4)
    assert box.trim.received == {0: 6}
    # A 409: the image is deleted, the agent told, the log not trimmed further.
    coord.status = 409
    refused = await put(conn, pool, 6, 1, 2, b"img-2", received={0: 9})
    assert isinstance(refused, Error) and refused.code == "refused", refused
    await until(lambda: ckpt_files(tmp_path / "relay", 6, 1) == ["1.img", "1.json"])
    assert ckpt_files(tmp_path / "relay", 6, 1) == ["1.img", "1.json"]
    assert box.trim.received == {0: 6}
    # The job ends: its images go with its logs.
    coord.finished_jobs.append(6)
    await until(lambda: not (tmp_path / "relay" / "jobs" / "6").exists())
    assert relay.hub.store.nbytes == 0 and not relay.hub.store.images


@pytest.mark.large
async def test_an_image_accepted_without_trim_leaves_the_log_whole(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    """A job validated by replay: its ranks are re-executed from the beginning, so the
    coordinator accepts images with ``trim=False`` and the log stays whole, across a restart
    too (the manifest says so)."""
    coord = CkptCoordinator(pool)
    coord.status = 200
    coord.answer = api.CheckpointAccepted(trim=False)
    settings = pool.settings(tmp_path / "relay", coordinator_url="http://coord", relay_key="s3cret")
    relay = await start_relay(nursery, settings, coordinator_transport=coord.transport)
    a = await FakeAgent.connect(pool, relay.addr, "agent-1")
    await a.attach(pool, 6, 0, size=2)
    for seq in range(1, 11):
        await a.deposit(6, 0, 1, seq, b"m%d" % seq)
    await a.acks_until(6, 0, 1, 10)
    conn = await store_conn(pool, relay.addr)
    assert await put(conn, pool, 6, 1, 1, b"img-1", received={0: 6}) == CkptStored(1, [1])
    manifest = tmp_path / "relay" / "jobs" / "6" / "1" / "ckpt" / "1.json"
    await until(lambda: json.loads(manifest.read_bytes())["accepted"])
    assert json.loads(manifest.read_bytes())["trim"] is False
    box = relay.hub.boxes[(6, 1)]
    assert len(box.mailbox) == 10 and not box.trim
    await conn.aclose()
    await a.aclose()
    await relay.stop()
    relay = await start_relay(nursery, settings, coordinator_transport=coord.transport)
    box = relay.hub.boxes[(6, 1)]
    assert len(box.mailbox) == 10 and not box.trim
    assert [r.ckpt for r in coord.checkpoints] == [1]  # accepted: not reported again


def test_an_image_accepted_without_trim_holds_the_trim_back() -> None:
    def img(ckpt: int, received: int, *, accepted: bool = True, trim: bool = True) -> Image:
        return Image(
            job=1,
            rank=0,
            ckpt=ckpt,
            incarnation=1,
            size=1,
            digest=b"",
            received={1: received},
            dets=ckpt,
            fingerprint="",
            meta=b"",
            accepted=accepted,
            trim=trim,
        )

    assert trim_target([img(1, 4), img(2, 9)]) == ({1: 4}, 1)
    assert trim_target([img(1, 4, accepted=False), img(2, 9)]) == ({1: 9}, 2)
    assert trim_target([img(1, 4, trim=False), img(2, 9)]) is None
    assert trim_target([img(1, 4), img(2, 9, accepted=False, trim=False)]) == ({1: 4}, 1)
    # Manifests written before the flag: trimmed as before.
    old = json.loads(img(3, 5).to_json())
    del old["trim"]
    assert Image.from_json(json.dumps(old).encode(), Path(".")).trim is True
