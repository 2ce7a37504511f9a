"""protocol.window: the push window that grows with the link's bandwidth-delay product, driven
by synthetic clocks (a discrete-event link model; no network, no processes)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vpool.protocol.mailbox import Mailbox, Offer
from vpool.protocol.window import PushWindow

MiB = 1024 * 1024


# -- a relay pushing over a link to an agent that credits ------------------------------------


@dataclass
class Link:
    """One receiving rank's path: the relay's mailbox pushes frames onto a link of
    ``bandwidth`` bytes/s and ``delay`` s each way; the agent hands each frame to the rank,
    which takes ``consumer`` bytes/s (None: at once), and sends Credit once it has ``batch``
    bytes to credit (as worker_agent.local_ranks does), which arrives ``delay`` later."""

    window: int
    window_max: int | None
    delay: float
    bandwidth: float
    frame: int
    consumer: float | None = None
    batch: int = 0
    first: int = 0  # size of a small frame ahead of the stream (a ping), 0: none
    credited: list[tuple[float, int]] = field(default_factory=list)  # (time, bytes)
    windows: list[tuple[float, int]] = field(default_factory=list)  # (time, window)

    def run(self, until: float) -> Mailbox[int]:
        box: Mailbox[int] = Mailbox(window=self.window, window_max=self.window_max)
        # More frames than the link could carry by ``until``: the relay never runs dry.
        for seq in range(1, int(self.bandwidth * until / self.frame) + 100):
            assert box.offer(0, seq) is Offer.NEW
            size = self.first if seq == 1 and self.first else self.frame
            box.written(box.append(0, seq, size, seq))
        box.advance()
        box.attach({})
        events: list[tuple[float, int, str, int]] = []
        order = 0
        link_free = rank_free = 0.0
        held = 0

        def later(t: float, kind: str, n: int) -> None:
            nonlocal order
            order += 1
            heapq.heappush(events, (t, order, kind, n))

        def push(now: float) -> None:
            nonlocal link_free
            while (e := box.next_push(now)) is not None:
                link_free = max(link_free, now) + e.size / self.bandwidth
                later(link_free + self.delay, "arrive", e.size)

        push(0.0)
        while events:
            now, _, kind, n = heapq.heappop(events)
            if now > until:
                break
            if kind == "arrive":
                if self.consumer is None:
                    done = now
                else:
                    done = max(rank_free, now) + n / self.consumer
                    rank_free = done
                later(done, "written", n)
            elif kind == "written":
                held += n
                if held >= self.batch:
                    later(now + self.delay, "credit", held)
                    held = 0
            else:
                box.credit(n, now)
                self.credited.append((now, n))
                self.windows.append((now, box.window))
                push(now)
        return box

    def rate(self, start: float, end: float) -> float:
        """Bytes/s credited between ``start`` and ``end``."""
        return sum(n for t, n in self.credited if start <= t < end) / (end - start)


def test_a_fixed_window_caps_a_long_link_at_window_per_round_trip() -> None:
    link = Link(4 * MiB, None, delay=0.020, bandwidth=1000 * MiB, frame=MiB)
    box = link.run(until=2.0)
    assert box.window == 4 * MiB
    rate = link.rate(1.0, 2.0)
    assert 0.8 * 4 * MiB / 0.040 < rate < 1.2 * 4 * MiB / 0.040  # ~100 MiB/s of 1000


@pytest.mark.parametrize("frame", [64 * 1024, MiB, 16 * MiB])
def test_the_window_grows_until_the_link_sets_the_pace(frame: int) -> None:
    bandwidth = 1000 * MiB
    link = Link(4 * MiB, 64 * MiB, delay=0.020, bandwidth=bandwidth, frame=frame, batch=MiB)
    box = link.run(until=2.0)
    assert link.rate(1.0, 2.0) > 0.9 * bandwidth
    # Twice the bandwidth-delay product (40 MiB) or the cap; never past the cap.
    assert 40 * MiB <= box.window <= 64 * MiB
    assert box.push_window.min_rtt is not None and box.push_window.min_rtt >= 0.040


@pytest.mark.parametrize("bandwidth", [100 * MiB, 200 * MiB, 400 * MiB])
def test_frames_larger_than_the_bandwidth_delay_product_still_overlap(bandwidth: float) -> None:
    # A ping measured the bare round trip (40 ms); 16 MiB frames take longer than that to
    # cross, and credit comes only once a whole frame is through. A window of twice the
    # bandwidth-delay product (8-32 MiB) would keep one frame in flight at a time, idling the
    # link while each frame's credit travels back: the window also holds one such frame.
    link = Link(4 * MiB, 64 * MiB, delay=0.020, bandwidth=bandwidth, frame=16 * MiB, first=100)
    box = link.run(until=4.0)
    assert box.push_window.min_rtt == pytest.approx(0.040, abs=0.001)
    assert link.rate(2.0, 4.0) > 0.9 * bandwidth
    assert box.window <= 64 * MiB


def test_it_grows_in_a_few_round_trips() -> None:
    link = Link(4 * MiB, 64 * MiB, delay=0.020, bandwidth=1000 * MiB, frame=MiB)
    link.run(until=1.0)
    first_full = next(t for t, w in link.windows if w >= 40 * MiB)
    assert first_full < 12 * 0.040  # doubling per round trip: 4 -> 64 MiB in ~4-5 of them


def test_the_window_stops_at_twice_the_bandwidth_delay_product() -> None:
    # A slow link (100 MiB/s, 20 ms each way): BDP 4 MiB; the window settles near 2 x BDP,
    # well below the cap, and the link is full.
    bandwidth = 100 * MiB
    link = Link(MiB, 256 * MiB, delay=0.020, bandwidth=bandwidth, frame=256 * 1024)
    box = link.run(until=3.0)
    assert link.rate(2.0, 3.0) > 0.95 * bandwidth
    bdp = bandwidth * 0.040
    assert 1.5 * bdp <= box.window <= 4 * bdp


def test_a_slow_rank_does_not_grow_the_window_much() -> None:
    # The rank reads 20 MiB/s: frames queue in its agent and round trips get long (seconds),
    # but min_rtt stays one frame's trip (40 ms of link, 50 ms for the rank to read 1 MiB) and
    # the rate is the rank's: 2 x 20 MiB/s x 91 ms + 1 MiB = 4.6 MiB, far from the cap.
    link = Link(4 * MiB, 64 * MiB, delay=0.020, bandwidth=1000 * MiB, frame=MiB, consumer=20 * MiB)
    box = link.run(until=3.0)
    window = box.push_window
    assert window.max_rate == pytest.approx(20 * MiB, rel=0.05)
    assert window.min_rtt == pytest.approx(0.091, abs=0.002)
    assert box.window < 5 * MiB
    assert link.rate(1.0, 3.0) == pytest.approx(20 * MiB, rel=0.1)


def test_no_growth_without_a_stream_held_back() -> None:
    # One small frame at a time, each credited before the next: never window-limited.
    w = PushWindow(4 * MiB, 64 * MiB)
    t = 0.0
    for _ in range(100):
        w.pushed(1000, t)
        t += 0.040
        w.credited(1000, t)
        t += 0.001
    assert w.size == 4 * MiB
    assert w.min_rtt == pytest.approx(0.040)


def test_reset_returns_to_the_initial_window() -> None:
    link = Link(4 * MiB, 64 * MiB, delay=0.020, bandwidth=1000 * MiB, frame=MiB)
    box = link.run(until=1.0)
    assert box.window > 4 * MiB
    box.attach({})
    assert box.window == 4 * MiB and box.in_flight == 0
    assert box.push_window.min_rtt is None and box.push_window.in_flight == 0
    box.detach()
    assert box.window == 4 * MiB


def test_a_fixed_window_records_nothing() -> None:
    w = PushWindow(100)
    assert not w.growing
    w.pushed(50, 0.0)
    w.limited()
    w.credited(50, 1.0)
    assert w.size == 100 and w.in_flight == 0 and w.min_rtt is None
    assert PushWindow(100, 10).maximum == 100  # a maximum below the initial window: fixed
    with pytest.raises(ValueError):
        PushWindow(0, 10)


def test_credit_beyond_what_was_pushed_and_pushes_without_a_time() -> None:
    w = PushWindow(100, 1000)
    w.pushed(60, None)
    w.credited(1000, 1.0)  # late credit of an earlier attachment: only 60 count
    assert w.in_flight == 0 and w.min_rtt is None
    w.pushed(60, 2.0)
    w.credited(60, None)
    assert w.in_flight == 0 and w.min_rtt is None
    w.pushed(60, 3.0)
    w.credited(30, 3.5)  # half a frame: no sample yet
    assert w.min_rtt is None
    w.credited(30, 4.0)
    assert w.min_rtt == pytest.approx(1.0)


def test_a_burst_of_credit_is_not_a_fast_link() -> None:
    # Ten frames sent over 1 s and credited all at once: the send interval bounds the rate.
    w = PushWindow(10, 10**9)
    for i in range(10):
        w.pushed(100, i * 0.1)
    w.limited()
    w.credited(1000, 1.0)
    assert w.max_rate <= 1000 / 0.9 + 1e-9
    assert w.size <= 2 * w.max_rate * w.min_rtt + w.max_frame + 1  # type: ignore[operator]


# -- properties ------------------------------------------------------------------------------

events = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(1, 5000), st.floats(0, 0.1)),
        st.tuples(st.just("credit"), st.integers(0, 8000), st.floats(0, 0.1)),
        st.tuples(st.just("limited"), st.just(0), st.just(0.0)),
        st.tuples(st.just("untimed_push"), st.integers(1, 5000), st.just(0.0)),
        st.tuples(st.just("untimed_credit"), st.integers(0, 8000), st.just(0.0)),
        st.tuples(st.just("reset"), st.just(0), st.just(0.0)),
    ),
    max_size=200,
)


@given(events, st.integers(1, 10_000), st.integers(0, 200_000))
@settings(max_examples=300)
def test_window_stays_within_bounds_and_never_shrinks_while_attached(
    schedule: list[tuple[str, int, float]], initial: int, extra: int
) -> None:
    w = PushWindow(initial, initial + extra)
    now = 0.0
    sent = delivered = 0
    last = w.size
    for op, n, dt in schedule:
        now += dt
        if op == "push":
            w.pushed(n, now)
            sent += n
        elif op == "untimed_push":
            w.pushed(n, None)
            sent += n
        elif op in ("credit", "untimed_credit"):
            w.credited(n, now if op == "credit" else None)
            delivered = min(sent, delivered + n)
        elif op == "limited":
            w.limited()
        else:
            w.reset()
            sent = delivered = 0
            last = initial
        assert initial <= w.size <= initial + extra
        assert w.size >= last, "the window never shrinks while the receiver stays attached"
        last = w.size
        if w.growing:
            assert w.in_flight == sent - delivered >= 0
        if w.min_rtt is not None:
            assert w.min_rtt >= 0
        assert w.max_rate >= 0


mailbox_ops = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.integers(1, 3000)),
        st.tuples(st.just("push"), st.integers(1, 5)),
        st.tuples(st.just("credit"), st.integers(0, 6000)),
        st.tuples(st.just("tick"), st.integers(0, 50)),
        st.tuples(st.just("reattach"), st.just(0)),
    ),
    max_size=150,
)


@given(mailbox_ops, st.integers(1, 4000), st.integers(0, 50_000))
@settings(max_examples=300)
def test_mailbox_pushes_only_within_the_window_in_force(
    schedule: list[tuple[str, int]], window: int, extra: int
) -> None:
    box: Mailbox[int] = Mailbox(window=window, window_max=window + extra)
    box.attach({})
    seq = 0
    received = 0
    now = 0.0
    for op, n in schedule:
        if op == "send":
            seq += 1
            box.written(box.append(0, seq, n, seq))
            box.advance()
        elif op == "push":
            for _ in range(n):
                before, size = box.in_flight, box.window
                e = box.next_push(now)
                if e is None:
                    assert before >= size or received == seq
                    break
                assert before < size, "pushed only while less than the window is in flight"
                assert e.seq == received + 1
                received = e.seq
        elif op == "credit":
            box.credit(n, now)
        elif op == "tick":
            now += n / 1000
        else:
            box.attach({0: received})
            assert box.window == window and box.in_flight == 0
        assert window <= box.window <= window + extra
    # Liveness: crediting everything delivers everything.
    while (e := box.next_push(now)) is not None or box.in_flight:
        if e is not None:
            assert e.seq == received + 1
            received = e.seq
        box.credit(box.in_flight, now)
        now += 0.001
    assert received == seq
