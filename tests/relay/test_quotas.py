"""What a job may store at a relay (``relay.quotas``): a job past ``job_log_quota`` is refused
for good, told once and reported once, while the relay serves every other job; a disk down to
``disk_reserve`` refuses deposits without the relay exiting; heartbeats name the jobs the
relay holds files of, and those the coordinator says are over are deleted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
import trio.lowlevel
from relay_fakes import DEADLINE, FakeAgent, FakeCoordinator, Pool, start_relay

from vpool.protocol.messages import Ack, Data, Stop
from vpool.protocol.relay_core import Refused
from vpool.relay.ckptstore import Image


async def _relay(pool: Pool, nursery: trio.Nursery, tmp_path: Path, **kw: Any) -> tuple[Any, Any]:
    coord = FakeCoordinator(pool)
    settings = pool.settings(
        tmp_path / "relay", coordinator_url="http://coord", relay_key="s3cret", **kw
    )
    relay = await start_relay(nursery, settings, coordinator_transport=coord.transport)
    await coord.wait_for(lambda: bool(coord.registered))
    return relay, coord


async def _no_ack_for(agent: FakeAgent, job: int, seconds: float = 0.3) -> None:
    """Nothing of ``job`` is acknowledged within ``seconds`` (what a refusal means)."""
    with trio.move_on_after(seconds):
        while True:
            msg, _ = await agent.recv()
            assert not (isinstance(msg, Ack) and msg.job == job), msg


async def test_a_job_past_its_quota_fails_alone(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    relay, coord = await _relay(pool, nursery, tmp_path, job_log_quota=64 * 1024)
    flood = await FakeAgent.connect(pool, relay.addr, "agent-a")
    calm = await FakeAgent.connect(pool, relay.addr, "agent-b")
    await flood.attach(pool, 1, 0, size=2)
    await calm.attach(pool, 2, 0, size=2)
    await calm.attach(pool, 2, 1, size=2, home=True)
    chunk = b"x" * 16 * 1024
    for seq in range(1, 4):  # 48 KiB: within the quota
        await flood.deposit(1, 0, 1, seq, chunk)
    await flood.acks_until(1, 0, 1, 3)
    await flood.deposit(1, 0, 1, 4, chunk)  # past 64 KiB with the frames' headers
    err = await flood.expect_rank_error("quota_exceeded")
    assert (err.job, err.rank) == (1, 0) and "job_log_quota (64 KiB)" in err.message
    await flood.deposit(1, 0, 1, 5, chunk)  # refused for good, silently now
    await _no_ack_for(flood, 1)
    await coord.wait_for(lambda: bool(coord.refused))
    [report] = coord.refused
    assert (report.job, report.code) == (1, "quota_exceeded") and report.message == err.message

    # The other job, within its quota, does not notice: deposits are logged and pushed.
    for seq in range(1, 6):
        await calm.deposit(2, 0, 1, seq, b"y" * 1024)
    pushed, acked = [], 0
    with trio.fail_after(DEADLINE):
        while len(pushed) < 5 or acked < 5:
            msg, _ = await calm.recv()
            if isinstance(msg, Data):
                pushed.append(msg.seq)
            elif isinstance(msg, Ack):
                acked = max(acked, msg.seq)
    assert pushed == [1, 2, 3, 4, 5]

    # The coordinator ends job 1: its logs go, and the quota's count with them.
    job_dir = relay.settings.data_path(relay.hub.name) / "jobs" / "1"
    assert job_dir.exists()
    coord.finished_jobs = [1]
    with trio.fail_after(DEADLINE):
        while job_dir.exists():
            await coord.wait_for(lambda: True)
            await trio.lowlevel.checkpoint()
    assert 1 not in relay.hub.quotas.job_bytes and 1 not in relay.hub.quotas.refused
    assert len(coord.refused) == 1  # reported once


async def test_a_full_disk_refuses_deposits_and_the_relay_goes_on(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    relay, coord = await _relay(pool, nursery, tmp_path, disk_reserve=1 << 62)
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await a.attach(pool, 3, 0, size=2)
    await a.deposit(3, 0, 1, 1, b"hello")
    err = await a.expect_rank_error("disk_full")
    assert "disk is full" in err.message and "disk_reserve" in err.message
    await coord.wait_for(lambda: bool(coord.refused))
    assert coord.refused[0].code == "disk_full"
    # Still serving: a new connection is welcomed, its rank attached.
    b = await FakeAgent.connect(pool, relay.addr, "agent-b")
    await b.attach(pool, 4, 0, size=1)
    assert not relay.done.is_set()


async def test_heartbeats_name_the_jobs_held_and_the_over_ones_are_deleted(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    relay, coord = await _relay(pool, nursery, tmp_path)
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    for job in (5, 6):
        await a.attach(pool, job, 0, size=2)
        await a.deposit(job, 0, 1, 1, b"kept")
        await a.acks_until(job, 0, 1, 1)
    await coord.wait_for(lambda: bool(coord.heartbeats) and coord.heartbeats[-1].jobs == [5, 6])
    coord.finished_jobs = [5]  # e.g. a job that never ran here, or ended long ago
    await coord.wait_for(lambda: coord.heartbeats[-1].jobs == [6])
    data = relay.settings.data_path(relay.hub.name) / "jobs"
    assert not (data / "5").exists() and (data / "6").exists()
    assert await a.expect(Stop) == Stop(job=5, rank=0, incarnation=1, reason="job finished")
    await a.send(Data(job=6, src=0, dst=1, seq=2, ctx=0, tag=0), b"still served")
    await a.acks_until(6, 0, 1, 2)


def _image(job: int, ckpt: int, size: int, directory: Path) -> Image:
    return Image(
        job=job, rank=0, ckpt=ckpt, incarnation=1, size=size, digest=b"d" * 32, received={},
        dets=0, fingerprint="", meta=b"", directory=directory,
    )  # fmt: skip


async def test_checkpoint_images_count_in_the_job_quota(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    settings = pool.settings(tmp_path / "relay", job_log_quota=64 * 1024, checkpoint_keep=2)
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    store = relay.hub.store
    where = tmp_path / "images"
    where.mkdir()
    assert await store.commit_put(_image(9, 1, 40 * 1024, where)) == [1]
    # A second image is kept beside the first (checkpoint_keep = 2): 80 KiB, past the quota.
    refused = await store.commit_put(_image(9, 2, 40 * 1024, where))
    assert isinstance(refused, Refused) and refused.code == "quota_exceeded"
    assert "logs and checkpoint images there would hold 80 KiB" in refused.message
    assert store.retained((9, 0)) == [1] and store.job_nbytes[9] == 40 * 1024
    again = store.begin_put((9, 0), 1, 3)  # refused for good
    assert isinstance(again, Refused) and again.code == "quota_exceeded"
    # Logs count the images too: 40 KiB of images and 24 KiB of messages pass 64 KiB.
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await a.attach(pool, 10, 0, size=2)
    assert await store.commit_put(_image(10, 1, 40 * 1024, where)) == [1]
    await a.deposit(10, 0, 1, 1, b"z" * 24 * 1024)
    err = await a.expect_rank_error("quota_exceeded")
    assert err.job == 10 and "would hold 64.0" in err.message


async def test_an_image_that_replaces_the_older_one_takes_no_more_room(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    settings = pool.settings(tmp_path / "relay", job_log_quota=64 * 1024, checkpoint_keep=1)
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    where = tmp_path / "images"
    where.mkdir()
    for ckpt in (1, 2, 3):
        assert await relay.hub.store.commit_put(_image(9, ckpt, 40 * 1024, where)) == [ckpt]
    assert relay.hub.store.job_nbytes[9] == 40 * 1024 and not relay.hub.quotas.refused
