"""``protocol.rank_link``: what an agent keeps for its ranks towards the relays."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vpool.protocol.rank_link import Delivery, Held, RankLink, is_current, replaces, restarted


def test_acks_release_frames_and_resend_takes_every_unacked_message() -> None:
    link = RankLink(home=True)
    frames = {(dst, seq): [b"d%d-%d" % (dst, seq)] for dst in (1, 2) for seq in (1, 2, 3)}
    for (dst, seq), parts in frames.items():
        link.deposited(dst, seq, parts)
    for index in range(3):
        link.det_sent(index, [b"det%d" % index])
    assert len(link) == 9
    link.acked(1, 2)  # cumulative
    link.dets_acked(1)
    assert len(link) == 6
    link.acked(1, 1)  # an older ack changes nothing
    assert len(link) == 6
    assert not link.holds_data(1, 3) and link.holds_data(1, 2) and link.holds_data(3, 9)
    assert link.holds_dets(1) and not link.holds_dets(2)

    # The relay came back with two determinants: every unacked message goes again (the relay
    # digest-checks what it holds), determinants only from the third.
    resend = link.resend(dets_logged=2)
    assert resend == [[b"det2"], frames[(1, 3)], frames[(2, 1)], frames[(2, 2)], frames[(2, 3)]]
    assert len(link) == 5
    link.dets_acked(3)
    link.acked(1, 3)
    link.acked(2, 3)
    assert len(link) == 0


def test_a_link_that_is_not_home_keeps_its_determinants_on_resend() -> None:
    link = RankLink(home=False)
    link.det_sent(0, [b"det0"])
    assert link.resend(dets_logged=5) == [[b"det0"]]


def test_buffers_are_kept_not_copied() -> None:
    link = RankLink(home=False)
    payload = bytearray(b"x" * 1000)
    parts = [b"head", payload]
    link.deposited(1, 1, parts)
    [again] = link.resend(dets_logged=0)
    assert again is parts and again[1] is payload


def test_delivery_resumes_after_what_the_rank_has() -> None:
    d = Delivery({0: 3, 1: 0}, dets=2)
    assert d.resume(home=True) == ({0: 3}, 2) and d.resume(home=False) == ({}, 0)
    d.data(1, 1)
    assert d.det_in(1) is False  # the rank has it
    assert d.det_in(2) is True and d.dets == 3
    d.det_out(3)  # the rank made determinant 3
    assert d.det_in(3) is False and d.resume(home=True) == ({0: 3, 1: 1}, 4)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 20)), max_size=60))
def test_determinants_reach_the_rank_once_each_in_order(events: list[tuple[bool, int]]) -> None:
    # However pushes (replays after reconnections) and the rank's own determinants mix, the
    # rank is given a determinant only if it has none with that index yet, and the count
    # only grows.
    d = Delivery()
    has: set[int] = set()
    last = 0
    for pushed, index in events:
        if pushed:
            given_now = d.det_in(index)
            assert given_now == (index >= last)
            if given_now:
                has.update(range(last, index + 1))
        else:
            d.det_out(index)
            has.update(range(last, index + 1))
        assert d.dets >= last
        last = d.dets
    assert all(i in has for i in range(d.dets))


def test_incarnation_rules_of_the_agent() -> None:
    assert is_current(2, 2) and not is_current(2, 1) and not is_current(1, 2)
    assert replaces(3, 2) and not replaces(2, 2) and not replaces(1, 2)
    assert not restarted(1) and restarted(2)


def test_local_delivery_takes_only_the_next_message_of_a_channel() -> None:
    d = Delivery({0: 2})
    assert d.local(0, 4) is False  # 3 is still to come from the relay
    assert d.data(0, 3) is True and d.local(0, 4) is True
    assert d.data(0, 4) is False  # the relay's push of it, too late: dropped
    assert d.local(1, 1) is True and d.local(1, 1) is False
    assert d.resume(home=True) == ({0: 4, 1: 1}, 0)


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12)), max_size=60))
def test_a_channel_reaches_the_rank_once_each_in_order(events: list[tuple[bool, int]]) -> None:
    """Whatever mix of relay pushes (in order, maybe repeated after a reconnection) and local
    offers, the rank gets each seq of a channel once, in order, with no gap."""
    d = Delivery()
    got: list[int] = []
    relay = 0
    for local, seq in events:
        if local:
            if d.local(0, seq):
                got.append(seq)
        else:
            relay = min(relay + 1, seq)  # the relay pushes in order, from where it is
            if d.data(0, relay):
                got.append(relay)
    assert got == list(range(1, len(got) + 1))


def test_receivers_of_unlogged_local_messages_are_known_until_acked() -> None:
    link = RankLink(home=False)
    link.deposited(1, 1, [b"a"], local=True)
    link.deposited(1, 2, [b"b"])  # went the relay's way
    link.deposited(2, 1, [b"c"], local=True)
    assert sorted(link.unlogged_local()) == [1, 2]
    link.acked(1, 1)
    assert link.unlogged_local() == [2]
    link.acked(2, 1)
    assert link.unlogged_local() == []


def test_every_delivery_pair_is_a_rule() -> None:
    from vpool.protocol.rank_link import DELIVERY_RULES, Place, Take, Via

    assert set(DELIVERY_RULES) == {(v, p) for v in Via for p in Place}
    # Each rule through ``take``: the rank has 2 of channel (0, me).
    place_seq = {Place.HAD: 2, Place.NEXT: 3, Place.AHEAD: 5}
    for (via, place), rule in DELIVERY_RULES.items():
        d = Delivery({0: 2})
        assert d.take(via, 0, place_seq[place]) is rule
        assert d.received[0] == (place_seq[place] if rule is Take.GIVE else 2)


def test_held_counts_the_bytes_kept_over_every_link_of_a_rank() -> None:
    """What the agent holds of a rank's frames until logged (its budget, issue 35): added as
    frames are kept, released as acks come and when a link lets go of everything."""
    released: list[int] = []
    held = Held(lambda: released.append(held.bytes))
    home, other = RankLink(home=True, held=held), RankLink(home=False, held=held)
    home.deposited(1, 1, [b"a" * 10, b"b" * 5])
    home.deposited(1, 2, [b"c" * 20])
    home.det_sent(0, [b"d" * 3])
    other.deposited(2, 1, [b"e" * 100])
    assert held.bytes == 138 and (home.nbytes, other.nbytes) == (38, 100)
    home.acked(1, 1)
    assert held.bytes == 123 and released == [123]
    home.acked(1, 1)  # again: nothing to release, nobody woken
    assert released == [123]
    assert home.resend(dets_logged=1) == [[b"c" * 20]]  # the logged determinant goes
    assert held.bytes == 120
    other.clear()
    assert held.bytes == 20 and len(other) == 0
    home.acked(1, 2)
    assert held.bytes == 0 and home.nbytes == 0 and released[-1] == 0
