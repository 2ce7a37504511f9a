"""Connection session state machines, as one transition table of data (like h11's ``_state``).

Two kinds of connection, each seen from either end:

- ``"relay"``: agent (client) <-> relay (server), opened by ``Hello``/``Welcome``;
- ``"rank"``: rank (client) <-> agent (server), opened by ``RankHello``/``RankWelcome``.

``Session.send(msg)`` checks a message we are about to send (``LocalProtocolError`` if illegal);
``Session.receive(msg)`` checks one that arrived (``RemoteProtocolError`` if illegal). An
``Error`` from either side, or ``close()``, ends the session, except an open session's ``Error``
about one rank (``rank`` >= 0), after which the connection may go on.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from vpool.protocol.errors import LocalProtocolError, RemoteProtocolError, ends_connection
from vpool.protocol.messages import (
    Abort,
    Ack,
    Attach,
    Attached,
    CheckpointRequest,
    Credit,
    Data,
    Delivered,
    Det,
    Detach,
    DetAck,
    Error,
    Failed,
    Finalize,
    Hello,
    Message,
    Ping,
    Pong,
    RankHello,
    RankWelcome,
    Spawned,
    SpawnRequest,
    Stop,
    Welcome,
)

Kind = Literal["relay", "rank"]
Side = Literal["client", "server"]


class State(Enum):
    OPENING = "opening"  # client: hello not yet sent; server: hello not yet received
    HELLO_SENT = "hello_sent"  # client only: waiting for the welcome
    OPEN = "open"
    CLOSED = "closed"


# (kind, who sends, state of the session, message type) -> next state.
# "client"/"server" name the sender of the message.
_S, _O = State.OPENING, State.OPEN
TRANSITIONS: dict[tuple[Kind, Side, State, type], State] = {
    ("relay", "client", _S, Hello): State.HELLO_SENT,
    ("relay", "server", State.HELLO_SENT, Welcome): _O,
    **{("relay", "client", _O, t): _O for t in (Attach, Data, Det, Credit, Delivered, Detach)},
    **{("relay", "server", _O, t): _O for t in (Attached, Data, Det, Ack, DetAck, Stop)},
    # Liveness (``protocol.liveness``): either side may ping once the session is open.
    **{("relay", "client", _O, t): _O for t in (Ping, Pong)},
    **{("relay", "server", _O, t): _O for t in (Ping, Pong)},
    ("rank", "client", _S, RankHello): State.HELLO_SENT,
    ("rank", "server", State.HELLO_SENT, RankWelcome): _O,
    **{("rank", "client", _O, t): _O for t in (Data, Det, Abort, Finalize, SpawnRequest)},
    **{
        ("rank", "server", _O, t): _O
        for t in (Data, Det, Ack, DetAck, Stop, CheckpointRequest, Failed, Spawned)
    },
}


class Session:
    """Tracks one connection's phase from one end, checking every message against the table."""

    def __init__(self, kind: Kind, side: Side) -> None:
        self.kind: Kind = kind
        self.side: Side = side
        # The server never sees its own HELLO_SENT: it moves OPENING -> HELLO_SENT on receipt.
        self.state = State.OPENING

    def _step(self, sender: Side, msg: Message, exc: type[Exception]) -> None:
        if self.state is State.CLOSED:
            raise exc(f"{type(msg).__name__} on a closed {self.kind} session")
        if isinstance(msg, Error):
            # An error about one rank of a multiplexed connection whose code ends only that
            # rank's attachment leaves the session open (``errors.ends_connection``).
            if not (self.state is State.OPEN and not ends_connection(msg.code, msg.rank)):
                self.state = State.CLOSED
            return
        nxt = TRANSITIONS.get((self.kind, sender, self.state, type(msg)))
        if nxt is None:
            raise exc(
                f"{type(msg).__name__} from the {sender} is not allowed in state "
                f"{self.state.value} of a {self.kind} session"
            )
        self.state = nxt

    def send(self, msg: Message) -> None:
        self._step(self.side, msg, LocalProtocolError)

    def receive(self, msg: Message) -> None:
        peer: Side = "server" if self.side == "client" else "client"
        self._step(peer, msg, RemoteProtocolError)

    def close(self) -> None:
        self.state = State.CLOSED

    @property
    def is_open(self) -> bool:
        return self.state is State.OPEN
