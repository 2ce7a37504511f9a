"""protocol.mailbox: the receiver's log at its home relay, driven without any I/O."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vpool.protocol.errors import LocalProtocolError, RemoteProtocolError
from vpool.protocol.mailbox import Mailbox, Offer


def deposit(box: Mailbox[str], src: int, seq: int, size: int = 10) -> None:
    assert box.offer(src, seq) is Offer.NEW
    box.written(box.append(src, seq, size, f"{src}:{seq}"))


def test_offer_new_duplicate_pending_gap() -> None:
    box: Mailbox[str] = Mailbox(window=100)
    assert box.offer(0, 1) is Offer.NEW
    e1 = box.append(0, 1, 10, "a")
    e2 = box.append(0, 2, 10, "b")
    assert box.offer(0, 1) is Offer.PENDING
    box.written(e1)
    assert [e.seq for e in box.advance()] == [1]
    assert box.offer(0, 1) is Offer.DUPLICATE
    assert box.offer(0, 2) is Offer.PENDING
    assert box.offer(0, 3) is Offer.NEW
    with pytest.raises(RemoteProtocolError) as info:
        box.offer(0, 4)
    assert info.value.code == "seq_gap"
    with pytest.raises(RemoteProtocolError):
        box.offer(1, 0)
    box.written(e2)
    assert box.advance() == [e2]
    assert (box.stored(0), box.acked(0), box.acked(1)) == (2, 2, 0)


def test_append_out_of_order_is_our_bug() -> None:
    box: Mailbox[str] = Mailbox(window=100)
    box.append(0, 1, 1, "a")
    with pytest.raises(LocalProtocolError):
        box.append(0, 3, 1, "c")


def test_durable_is_a_prefix_even_when_writes_finish_out_of_order() -> None:
    box: Mailbox[str] = Mailbox(window=100)
    a = box.append(0, 1, 10, "a")
    b = box.append(1, 1, 10, "b")
    box.written(b)
    assert box.advance() == []
    assert box.acked(1) == 0  # b is written, but behind a hole
    box.written(a)
    assert box.advance() == [a, b]
    assert box.acked_counters() == {0: 1, 1: 1}


def test_push_window_and_credit() -> None:
    box: Mailbox[str] = Mailbox(window=25)
    for seq in range(1, 6):
        deposit(box, 0, seq)
    box.advance()
    assert box.next_push() is None  # nobody attached
    box.attach({})
    pushed = []
    while (e := box.next_push()) is not None:
        pushed.append(e.seq)
    assert pushed == [1, 2, 3]  # 0, 10, 20 < 25 outstanding
    box.credit(10)
    assert box.next_push().seq == 4  # type: ignore[union-attr]
    assert box.next_push() is None
    box.credit(1000)  # never below zero
    assert box.in_flight == 0
    with pytest.raises(RemoteProtocolError):
        box.credit(-1)


def test_a_frame_bigger_than_the_window_still_goes() -> None:
    box: Mailbox[str] = Mailbox(window=5)
    deposit(box, 0, 1, size=50)
    deposit(box, 0, 2, size=50)
    box.advance()
    box.attach({})
    assert box.next_push().seq == 1  # type: ignore[union-attr]
    assert box.next_push() is None
    box.credit(50)
    assert box.next_push().seq == 2  # type: ignore[union-attr]


def test_resume_skips_what_was_received() -> None:
    box: Mailbox[str] = Mailbox(window=10**6)
    for seq in range(1, 4):
        deposit(box, 0, seq)
        deposit(box, 1, seq)
    box.advance()
    box.attach({0: 2, 1: 3, 7: 9})
    assert [(e.src, e.seq) for e in iter(box.next_push, None)] == [(0, 3)]
    box.attach({})
    assert len(list(iter(box.next_push, None))) == 6
    box.detach()
    assert box.next_push() is None


def test_entries_not_durable_are_not_pushed() -> None:
    box: Mailbox[str] = Mailbox(window=10**6)
    box.attach({})
    e = box.append(0, 1, 10, "a")
    assert box.next_push() is None
    box.written(e)
    box.advance()
    assert box.next_push() is e


# -- a whole schedule against a model -----------------------------------------------------

SOURCES = 3
Op = tuple[str, int, int]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.integers(0, SOURCES - 1), st.integers(1, 40)),
        st.tuples(st.just("resend"), st.integers(0, SOURCES - 1), st.integers(1, 5)),
        st.tuples(st.just("write"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("push"), st.integers(1, 5), st.just(0)),
        st.tuples(st.just("credit"), st.integers(0, 100), st.just(0)),
        st.tuples(st.just("reattach"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("detach"), st.just(0), st.just(0)),
    ),
    max_size=120,
)


@given(ops, st.integers(1, 60))
def test_schedule_keeps_fifo_window_and_durability(schedule: list[Op], window: int) -> None:
    box: Mailbox[tuple[int, int]] = Mailbox(window=window)
    sent = [0] * SOURCES  # highest seq each source deposited
    unwritten: list = []
    received = [0] * SOURCES  # what the receiving rank has, per source
    attached = False
    for op, a, b in schedule:
        if op == "send":
            seq = sent[a] + 1
            assert box.offer(a, seq) is Offer.NEW
            unwritten.append(box.append(a, seq, b, (a, seq)))
            sent[a] = seq
        elif op == "resend" and sent[a]:
            seq = max(1, sent[a] - b)
            offer = box.offer(a, seq)
            assert offer is (Offer.DUPLICATE if seq <= box.acked(a) else Offer.PENDING)
        elif op == "write" and unwritten:
            box.written(unwritten.pop(a % len(unwritten)))
            before = box.acked_counters()
            fresh = box.advance()
            for e in fresh:
                assert e.written and e.seq > before.get(e.src, 0)
        elif op == "push" and attached:
            for _ in range(a):
                outstanding = box.in_flight
                e = box.next_push()
                if e is None:
                    break
                assert outstanding < window
                assert e.written and e.seq <= box.acked(e.src)
                assert e.seq == received[e.src] + 1, "FIFO per channel, no gap, no repeat"
                received[e.src] = e.seq
        elif op == "credit" and attached:
            box.credit(a)
        elif op == "reattach":
            # The receiving rank may have lost the tail of what it got (restart from a
            # checkpoint): it announces its counters and the relay resumes after them.
            received = [max(0, r - a) for r in received]
            box.attach(dict(enumerate(received)))
            attached = True
        elif op == "detach":
            box.detach()
            attached = False
    # Liveness: once everything is written and the receiver credits all, it gets everything.
    for e in unwritten:
        box.written(e)
    box.advance()
    assert box.acked_counters() == {s: n for s, n in enumerate(sent) if n}
    box.attach(dict(enumerate(received)))
    while (e := box.next_push()) is not None:
        assert e.seq == received[e.src] + 1
        received[e.src] = e.seq
        box.credit(e.size)
    assert received == sent
