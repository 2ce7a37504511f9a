"""Every (state, message) pair either follows the transition table or raises (h2 style)."""

from __future__ import annotations

import itertools

import pytest

from vpool.protocol import messages as m
from vpool.protocol.errors import LocalProtocolError, RemoteProtocolError
from vpool.protocol.session import TRANSITIONS, Session, State

SAMPLES: list[m.Message] = [
    m.Hello(version=1, role="agent"),
    m.Welcome(version=1),
    m.Attach(token="t"),
    m.Attached(job=1, rank=0, incarnation=1),
    m.Detach(job=1, rank=0),
    m.Data(job=1, src=0, dst=1, seq=1, ctx=0, tag=0),
    m.Ack(job=1, src=0, dst=1, seq=1),
    m.Credit(job=1, rank=0, nbytes=10),
    m.Stop(job=1, rank=0, incarnation=1, reason="x"),
    m.RankHello(version=1, secret="s"),
    m.RankWelcome(job=1, rank=0, size=2, incarnation=1),
    m.Abort(code=3),
    m.Finalize(),
]


@pytest.mark.parametrize(
    "kind,side,state,msg,direction",
    [
        (k, s, st, msg, d)
        for k, s, st, msg, d in itertools.product(
            ["relay", "rank"], ["client", "server"], list(State), SAMPLES, ["send", "receive"]
        )
    ],
)
def test_every_pair_transitions_or_raises(kind, side, state, msg, direction) -> None:  # type: ignore[no-untyped-def]
    session = Session(kind, side)
    session.state = state
    sender = side if direction == "send" else ("server" if side == "client" else "client")
    expected = TRANSITIONS.get((kind, sender, state, type(msg)))
    if state is State.CLOSED:
        expected = None
    if expected is None:
        exc = LocalProtocolError if direction == "send" else RemoteProtocolError
        with pytest.raises(exc):
            getattr(session, direction)(msg)
    else:
        getattr(session, direction)(msg)
        assert session.state is expected


def test_relay_handshake_then_traffic() -> None:
    client, server = Session("relay", "client"), Session("relay", "server")
    for msg, sender, receiver in [
        (m.Hello(version=1, role="agent"), client, server),
        (m.Welcome(version=1), server, client),
        (m.Attach(token="t", home=True), client, server),
        (m.Attached(job=1, rank=0, incarnation=1), server, client),
        (m.Data(job=1, src=0, dst=1, seq=1, ctx=0, tag=0), client, server),
        (m.Ack(job=1, src=0, dst=1, seq=1), server, client),
    ]:
        sender.send(msg)
        receiver.receive(msg)
    assert client.is_open and server.is_open


def test_data_before_hello_is_a_remote_error() -> None:
    server = Session("relay", "server")
    with pytest.raises(RemoteProtocolError, match="not allowed"):
        server.receive(m.Data(job=1, src=0, dst=1, seq=1, ctx=0, tag=0))


def test_error_closes() -> None:
    s = Session("rank", "client")
    s.receive(m.Error(code="x", message="y"))
    assert s.state is State.CLOSED
    with pytest.raises(LocalProtocolError):
        s.send(m.RankHello(version=1, secret="s"))
