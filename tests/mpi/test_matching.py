"""Matching rules of the runtime, without processes: the queues of ``vpool.mpi.matching``."""

from __future__ import annotations

from dataclasses import dataclass

from vpool.mpi.constants import ANY_SOURCE, ANY_TAG
from vpool.mpi.matching import Matcher
from vpool.mpi.topology import compute_dims
from vpool.protocol.messages import Data


@dataclass(eq=False)
class Recv:
    ctx: int
    src: int
    tag: int


def data(src: int, seq: int, tag: int = 0, ctx: int = 0) -> Data:
    return Data(job=1, src=src, dst=9, seq=seq, ctx=ctx, tag=tag)


def arrive(m: Matcher, msg: Data) -> Recv | None:
    op = m.arrive(msg)
    if op is None:
        m.stash(msg, b"")
    return op  # type: ignore[no-any-return]


def test_earliest_posted_receive_wins() -> None:
    m = Matcher()
    first, second = Recv(0, ANY_SOURCE, ANY_TAG), Recv(0, 3, 5)
    assert m.post(first) is None and m.post(second) is None
    assert arrive(m, data(3, 1, tag=5)) is first
    assert arrive(m, data(3, 2, tag=5)) is second
    assert arrive(m, data(3, 3, tag=5)) is None


def test_receives_take_the_earliest_matching_message() -> None:
    m = Matcher()
    for seq, (src, tag) in enumerate([(1, 7), (2, 8), (1, 8), (2, 7)], start=1):
        arrive(m, data(src, seq, tag=tag))
    entry = m.post(Recv(0, ANY_SOURCE, 8))
    assert entry is not None and (entry[0].src, entry[0].tag) == (2, 8)
    entry = m.post(Recv(0, 1, ANY_TAG))
    assert entry is not None and entry[0].seq == 1
    entry = m.post(Recv(0, 1, ANY_TAG))
    assert entry is not None and entry[0].seq == 3
    entry = m.probe(0, ANY_SOURCE, ANY_TAG)
    assert entry is not None and entry[0].seq == 4
    assert m.post(Recv(0, 1, ANY_TAG)) is None  # nothing left from 1: posted instead


def test_contexts_never_match_each_other() -> None:
    m = Matcher()
    arrive(m, data(1, 1, ctx=1))
    assert m.post(Recv(0, 1, ANY_TAG)) is None
    assert m.probe(1, 1, ANY_TAG) is not None
    op = Recv(1, 1, ANY_TAG)
    assert m.post(op) is not None
    assert arrive(m, data(1, 2, ctx=0)) is not None


def test_cancel_withdraws_only_unmatched_receives() -> None:
    m = Matcher()
    op = Recv(0, 1, 0)
    m.post(op)
    assert m.cancel(op)
    assert not m.cancel(op)
    assert arrive(m, data(1, 1)) is None


def test_compute_dims_like_mpich() -> None:
    assert compute_dims(12, [0, 0]) == [4, 3]
    assert compute_dims(16, 3) == [4, 2, 2]
    assert compute_dims(7, 2) == [7, 1]
    assert compute_dims(24, [0, 2, 0]) == [4, 2, 3]
    assert compute_dims(1, 3) == [1, 1, 1]
