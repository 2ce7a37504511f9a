"""The owner comes back, the machine goes to sleep (issue 22): real logind D-Bus messages, a
real pool, real CRIU.

logind itself is faked (tests/worker_agent/fake_logind.py) on a real ``dbus-daemon``: one agent
is pointed at that bus (``logind_bus``, ``run_when = "idle"``) and takes its delay inhibitor lock.
The idle hint going false freezes its ranks and true thaws them. PrepareForSleep(true)
then makes it checkpoint every rank it runs and hand them back; the test checks that each image
is committed at the relay before the agent releases its lock (what lets the machine sleep), that
the ranks are restored from those images on the other agent, and that the output is identical.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

from tests.integration.conftest import start_pool
from tests.integration.test_checkpoints import (
    ckpt_id,
    detail,
    ended,
    events,
    images,
    output,
    reference,
    submit,
    wait_agents,
    wait_until,
)
from tests.integration.test_suspend import (
    agent_status,
    freezer_state,
    reconfigure,
    running_on,
    wait_for,
)

# ruff: noqa: F811
from tests.worker_agent.fake_logind import (  # noqa: F401 (pytest fixtures)
    FakeLogind,
    dbus_daemon,
    fake_logind,
)

if TYPE_CHECKING:
    from conftest import Pool

pytestmark = pytest.mark.slow


async def test_prepare_for_sleep_commits_every_image_before_the_lock_is_released(
    fake_logind: FakeLogind, tmp_path: Path
) -> None:
    pool: Pool = await trio.to_thread.run_sync(
        lambda: start_pool(tmp_path / "home", agents=2, relays=1)
    )
    try:
        await _sleep_and_wake(pool, fake_logind)
    finally:
        await trio.to_thread.run_sync(lambda: pool.vsdk("local", "down", timeout=60))


async def _sleep_and_wake(pool: Pool, logind: FakeLogind) -> None:
    def blocking(f, *args):  # type: ignore[no-untyped-def]
        return trio.to_thread.run_sync(lambda: f(*args))

    logind.set_idle(True, since=3600)
    # A machine configured as packaging/README.md advises (the agent lets go of its lock at
    # logind's limit; 5 s by default, tight for a loaded test machine).
    logind.inhibit_delay_max_usec = 120_000_000
    ref = reference(4, "300")  # made in a thread meanwhile
    await blocking(
        lambda: reconfigure(
            pool, "agent-0", logind_bus=logind.address, run_when="idle", idle_after=1.0
        )
    )
    await blocking(wait_agents, pool, 2)
    (lock,) = await logind.wait_for(lambda: logind.held("delay", "sleep"), seconds=60)
    assert lock.who == "vpool agent" and "checkpoints" in lock.why, lock
    st = await blocking(agent_status, pool, "agent-0")
    assert st["sleep_lock"] and st["idle_source"] == "logind", st
    assert st["sleep_delay_max"] == 120.0, st

    job = await blocking(submit, pool, 4, "300")
    await blocking(
        wait_until,
        pool,
        job,
        lambda d: ended(d) or b"step 20:" in output(pool, job),
        "progress",
    )
    mine = await blocking(running_on, pool, job, "agent-0")
    assert mine, "agent-0 runs none of the ranks"

    # The owner comes back (logind's idle hint goes false): frozen within a look or two; away
    # again for idle_after: thawed.
    pids = [pool.rank_pid(rank, job, "agent-0") for rank in mine]
    logind.set_idle(False)
    await blocking(
        wait_for, "frozen", lambda: all(freezer_state(p) == "FROZEN" for p in pids), pool
    )
    st = await blocking(agent_status, pool, "agent-0")
    assert st["reason"] == "the owner is using the machine (it runs after 1 s idle)", st
    logind.set_idle(True, since=5)
    await blocking(
        wait_for, "thawed", lambda: all(freezer_state(p) == "THAWED" for p in pids), pool
    )

    going = time.time()
    await logind.prepare_for_sleep(True)
    await logind.wait_released(lock, seconds=120)
    released = time.time()
    # Every image is on the relay's disk (committed) when the lock goes.
    committed = {rank: images(pool, job, rank) for rank in mine}
    assert all(committed.values()), committed
    # And the coordinator knows they left: they restart elsewhere while this machine sleeps.
    d = await blocking(detail, pool, job)
    assert all([e for e in events(d, "rank_lost", r) if e["time"] >= going] for r in mine), d[
        "events"
    ]
    st = await blocking(agent_status, pool, "agent-0")
    assert st["activity"] == "leaving" and not st["sleep_lock"], st
    print(f"\nPrepareForSleep to lock released with {len(mine)} rank(s): {released - going:.2f} s")

    await logind.prepare_for_sleep(False)  # woke up: the agent takes a lock again
    await logind.wait_for(lambda: logind.held("delay", "sleep"), seconds=30)
    d = await blocking(wait_until, pool, job, ended, "job end", 180)
    assert d["job"]["state"] == "succeeded", (d, pool.logs())
    assert output(pool, job) == await blocking(ref.result)
    for rank in mine:
        (made,) = [e for e in events(d, "checkpoint", rank) if e["time"] >= going]
        restored = events(d, "rank_restored", rank)
        assert restored and ckpt_id(restored[-1]["message"]) == ckpt_id(made["message"]), d
        lost = events(d, "rank_lost", rank)
        assert lost and "going to sleep" in lost[-1]["message"], d["events"]
    st = await blocking(agent_status, pool, "agent-0")
    assert st["activity"] == "available", st
