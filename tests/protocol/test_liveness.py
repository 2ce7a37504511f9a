"""Ping and Pong in the session table, and the liveness core's timing rules, with no clock."""

from __future__ import annotations

import itertools
import math

import pytest

from vpool.protocol import messages as m
from vpool.protocol.errors import LocalProtocolError, RemoteProtocolError
from vpool.protocol.liveness import Liveness, Silent
from vpool.protocol.session import TRANSITIONS, Session, State

# -- the session table ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,side,state,msg,direction",
    list(
        itertools.product(
            ["relay", "rank"],
            ["client", "server"],
            list(State),
            [m.Ping(nonce=1), m.Pong(nonce=1)],
            ["send", "receive"],
        )
    ),
)
def test_ping_and_pong_only_on_an_open_relay_session(kind, side, state, msg, direction) -> None:  # type: ignore[no-untyped-def]
    session = Session(kind, side)
    session.state = state
    legal = kind == "relay" and state is State.OPEN
    sender = side if direction == "send" else ("server" if side == "client" else "client")
    assert (TRANSITIONS.get((kind, sender, state, type(msg))) is not None) == legal
    if legal:
        getattr(session, direction)(msg)
        assert session.state is State.OPEN
    else:
        exc = LocalProtocolError if direction == "send" else RemoteProtocolError
        with pytest.raises(exc):
            getattr(session, direction)(msg)


def test_either_side_pings_between_other_traffic() -> None:
    agent, relay = Session("relay", "client"), Session("relay", "server")
    for msg, sender, receiver in [
        (m.Hello(version=m.PROTOCOL_VERSION, role="agent", pings=True), agent, relay),
        (m.Welcome(version=m.PROTOCOL_VERSION, pings=True), relay, agent),
        (m.Ping(nonce=1), agent, relay),
        (m.Attach(token="t", home=True), agent, relay),
        (m.Pong(nonce=1), relay, agent),
        (m.Ping(nonce=7), relay, agent),
        (m.Attached(job=1, rank=0, incarnation=1), relay, agent),
        (m.Pong(nonce=7), agent, relay),
    ]:
        sender.send(msg)
        receiver.receive(msg)
    assert agent.is_open and relay.is_open


def test_a_ping_before_the_welcome_is_refused() -> None:
    agent = Session("relay", "client")
    agent.send(m.Hello(version=m.PROTOCOL_VERSION, role="agent"))
    with pytest.raises(LocalProtocolError):
        agent.send(m.Ping(nonce=1))
    relay = Session("relay", "server")
    with pytest.raises(RemoteProtocolError, match="Ping from the client is not allowed"):
        relay.receive(m.Ping(nonce=1))


def test_ping_pong_and_the_flags_round_trip() -> None:
    for msg in (
        m.Ping(nonce=2**40),
        m.Pong(nonce=0),
        m.Hello(version=2, role="agent", token="t", pings=True),
        m.Welcome(version=2, relay="r", pings=True),
    ):
        assert m.decode(m.encode(msg)) == msg


def test_a_peer_without_the_flags_reads_as_not_pinging() -> None:
    # What an older agent or relay sends: the arrays end before ``pings``.
    assert m.decode(m.encode(m.Hello(version=2, role="agent", token="t", software="x"))).pings is (
        False
    )
    old_welcome = m.encode(m.Welcome(version=2, relay="r", max_payload=1, push_window=2))
    assert m.decode(old_welcome).pings is False  # type: ignore[union-attr]


# -- the liveness core ---------------------------------------------------------------------


def test_pings_a_quiet_peer_then_gives_it_up() -> None:
    live = Liveness(ping_interval=5, dead_after=12, now=100.0)
    assert live.next_timer() == 105.0
    assert live.handle_timer(104.9) is None
    assert live.handle_timer(105.0) == m.Ping(nonce=1)
    # Still silent: another ping an interval after the last one, then the end at 12 s.
    assert live.next_timer() == 110.0
    assert live.handle_timer(109.0) is None
    assert live.handle_timer(110.0) == m.Ping(nonce=2)
    assert live.next_timer() == 112.0
    assert live.handle_timer(112.0) == Silent(12.0)


def test_anything_heard_puts_both_off() -> None:
    live = Liveness(ping_interval=5, dead_after=12, now=0.0)
    assert live.handle_timer(5.0) == m.Ping(nonce=1)
    live.heard(5.25)  # the Pong, or any other frame
    assert live.next_timer() == 10.25
    assert live.handle_timer(10.0) is None
    live.heard(3.0)  # an older time changes nothing
    assert live.heard_at == 5.25
    assert live.handle_timer(10.25) == m.Ping(nonce=2)
    assert live.handle_timer(15.25) == m.Ping(nonce=3)
    assert live.next_timer() == 17.25
    assert live.handle_timer(17.25) == Silent(12.0)


def test_a_busy_connection_is_never_pinged() -> None:
    live = Liveness(ping_interval=5, dead_after=12, now=0.0)
    for t in range(1, 100):
        live.heard(float(t))
        assert live.handle_timer(t + 0.5) is None
    assert live.next_timer() == 104.0


def test_a_listener_that_never_pings() -> None:
    live = Liveness(ping_interval=0, dead_after=30, now=0.0)
    assert live.next_timer() == 30.0
    assert live.handle_timer(29.9) is None
    live.heard(20.0)
    assert live.next_timer() == 50.0
    assert live.handle_timer(50.0) == Silent(30.0)


def test_both_off_never_wakes() -> None:
    live = Liveness(ping_interval=0, dead_after=0, now=0.0)
    assert live.next_timer() == math.inf
    assert live.handle_timer(1e9) is None


def test_giving_up_before_the_first_ping_is_refused() -> None:
    with pytest.raises(ValueError, match="pinged sooner"):
        Liveness(ping_interval=5, dead_after=5, now=0.0)
