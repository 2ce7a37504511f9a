"""The relay's push window over a real connection: it grows when a receiver's credit comes back
a round trip late and frames wait, within push_window .. push_window_max; a fixed window stays;
a re-attach starts again from push_window. The link is emulated by the fake agent, which
credits each pushed frame a fixed delay after it read it (a delay line for Credit)."""

from __future__ import annotations

import collections

import trio
from relay_fakes import FakeAgent, Pool, RunningRelay, start_relay

from vpool.protocol.framing import encode_frame
from vpool.protocol.messages import Credit

KiB = 1024
DELAY = 0.02  # s between reading a frame and its Credit reaching the relay
FRAMES = 200
PAYLOAD = b"w" * (16 * KiB)


async def stream_with_late_credit(pool: Pool, relay: RunningRelay) -> list[int]:
    """Deposit FRAMES frames from rank 0 to rank 1 and receive them, crediting each DELAY
    after it arrived; the seqs received, in order."""
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    r = await FakeAgent.connect(pool, relay.addr, "agent-r")
    assert r.welcome is not None and r.welcome.push_window == relay.settings.push_window
    await a.attach(pool, 1, 0, size=2)
    await r.attach(pool, 1, 1, size=2, home=True)
    for seq in range(1, FRAMES + 1):
        await a.deposit(1, 0, 1, seq, PAYLOAD)
    got: list[int] = []
    due: collections.deque[tuple[float, int]] = collections.deque()
    wake = trio.Event()

    async def credit_later() -> None:
        nonlocal wake
        sent = 0
        while sent < FRAMES:
            while not due:
                await wake.wait()
                wake = trio.Event()
            at, nbytes = due.popleft()
            await trio.sleep_until(at)
            await r.send(Credit(job=1, rank=1, nbytes=nbytes))
            sent += 1

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(credit_later)
            for _ in range(FRAMES):
                msg, payload = await r.next_data(credit=False)
                got.append(msg.seq)
                due.append((trio.current_time() + DELAY, len(encode_frame(msg, payload))))
                wake.set()
    return got


async def test_the_window_grows_with_late_credit(
    pool: Pool, nursery: trio.Nursery, tmp_path: object, agents: object
) -> None:
    settings = pool.settings(  # type: ignore[operator]
        tmp_path / "relay",  # type: ignore[operator]
        push_window=64 * KiB,
        push_window_max=1024 * KiB,
    )
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    assert await stream_with_late_credit(pool, relay) == list(range(1, FRAMES + 1))
    box = relay.hub.boxes[(1, 1)]
    window = box.mailbox.push_window
    # 3.2 MiB credited a round trip late: the window doubled several times, within the cap.
    assert 4 * 64 * KiB <= window.size <= 1024 * KiB
    assert window.min_rtt is not None and window.min_rtt >= DELAY
    # A new attachment starts from push_window again.
    r2 = await FakeAgent.connect(pool, relay.addr, "agent-r")
    await r2.attach(pool, 1, 1, size=2, home=True, received={0: FRAMES})
    assert box.mailbox.window == 64 * KiB


async def test_a_fixed_window_stays(
    pool: Pool, nursery: trio.Nursery, tmp_path: object, agents: object
) -> None:
    settings = pool.settings(  # type: ignore[operator]
        tmp_path / "relay",  # type: ignore[operator]
        push_window=64 * KiB,
        push_window_max=64 * KiB,
    )
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    assert await stream_with_late_credit(pool, relay) == list(range(1, FRAMES + 1))
    box = relay.hub.boxes[(1, 1)]
    assert box.mailbox.window == 64 * KiB
    assert box.mailbox.push_window.min_rtt is None  # a fixed window measures nothing
