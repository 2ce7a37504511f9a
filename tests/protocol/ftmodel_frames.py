"""The frames of the fault-tolerance model and the links they travel on, between a simulated
rank's agent (``ftmodel_rank``) and a simulated relay (``ftmodel_relay``)."""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .ftmodel_rank import SimRank
    from .ftmodel_relay import SimRelay


def digest(src: int, dst: int, seq: int, payload: Any) -> bytes:
    return hashlib.blake2b(repr((src, dst, seq, payload)).encode(), digest_size=16).digest()


# -- frames and links ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Data:
    src: int
    inc: int
    dst: int
    seq: int
    payload: Any


@dataclass(frozen=True)
class Det:
    rank: int
    inc: int
    index: int
    record: tuple[int, str, Any]  # (clock, kind, value); kind: "any" | "poll" | "fail"


@dataclass(frozen=True)
class Delivered:
    """The receiver's agent gave ``rank`` (incarnation ``inc``) message ``seq`` of ``src``
    itself (agent-local delivery): its home relay need not push it."""

    rank: int
    inc: int
    src: int
    seq: int


@dataclass(frozen=True)
class Credit:
    rank: int
    inc: int


@dataclass(frozen=True)
class Push:
    src: int
    seq: int
    payload: Any


@dataclass(frozen=True)
class Ack:
    dst: int
    seq: int


@dataclass(frozen=True)
class DetAck:
    count: int


@dataclass(eq=False)
class Link:
    """One direction of one connection between a rank's agent and a relay: frames in flight, in
    order. ``relay`` is the relay at one end; ``to_rank`` tells the direction."""

    name: str
    relay: SimRelay
    rank: SimRank
    to_rank: bool
    frames: deque[Any] = field(default_factory=deque)
    alive: bool = True
