"""The engine's failure handling in process (``vpool.mpi.runtime``, ULFM): no rank process, a
fake transport that records what would be sent, frames handed in as the transport would."""

from __future__ import annotations

from array import array
from typing import Any

import pytest

from vpool.mpi import errors
from vpool.mpi.constants import ANY_SOURCE, ANY_TAG, UNDEFINED
from vpool.mpi.request import RecvOp
from vpool.mpi.runtime import CTX_REVOKE, Engine
from vpool.protocol.messages import KIND_BUFFER, Data

SIZE = 4
ME = 0
W2C = list(range(SIZE))  # COMM_WORLD's world -> comm map


class FakeTransport:
    """Records every Data written; nothing is ever waited for."""

    def __init__(self) -> None:
        self.sent = [0] * SIZE
        self.acked = [0] * SIZE
        self.det_sent = self.det_acked = self.det_need = 0
        self.ft: Any = None
        self.ckpt_request = None
        self.frames: list[tuple[int, int, int, bytes]] = []

    def send_data(
        self, dst: int, ctx: int, tag: int, kind: int, parts: list[int], bufs: list[Any], n: int
    ) -> None:
        self.sent[dst] += 1
        self.frames.append((dst, ctx, tag, b"".join(bytes(b) for b in bufs)))

    def progress(self, block: bool) -> None:
        if block:
            raise AssertionError("the engine blocked")


def engine(eager: bool = True) -> tuple[Engine, FakeTransport]:
    eng = Engine(1, ME, SIZE)
    t = FakeTransport()
    eng.transport = t  # type: ignore[assignment]
    eng.ft.attach(t, 0, {}, logging=False)
    eng.eager = eager
    return eng, t


def arrive(eng: Engine, src: int, ctx: int, tag: int, payload: bytes = b"x", seq: int = 1) -> None:
    eng.on_small(Data(1, src, ME, seq, ctx, tag, KIND_BUFFER, []), memoryview(payload))


def pill(eng: Engine, src: int, ctx: int, group: tuple[int, ...] = tuple(range(SIZE))) -> None:
    payload = array("i", group).tobytes()
    eng.on_small(Data(1, src, ME, 9, CTX_REVOKE, ctx, KIND_BUFFER, []), memoryview(payload))


def recv(eng: Engine, src: int, ctx: int = 0, tag: int = ANY_TAG, w2c: Any = W2C) -> RecvOp:
    op = RecvOp(ctx, src, tag, None, w2c)
    eng.post(op)
    return op


def error_of(call: Any, *args: Any, **kw: Any) -> int:
    with pytest.raises(errors.MPIException) as info:
        call(*args, **kw)
    return info.value.error_code


def test_error_classes_are_mpichs() -> None:
    assert (errors.ERR_PROC_FAILED, errors.ERR_PROC_FAILED_PENDING, errors.ERR_REVOKED) == (
        101,
        102,
        103,
    )
    assert errors.error_string(errors.ERR_REVOKED) == "Communication object revoked"
    assert errors.add_error_class() > errors.ERR_REVOKED


def test_a_receive_from_a_failed_rank_fails_and_its_late_messages_are_dropped() -> None:
    eng, _ = engine()
    arrive(eng, 2, 0, 5, b"early")  # before the notice: still received
    waiting = recv(eng, 2, tag=6)
    other = recv(eng, 1, tag=6)
    eng.on_failed([2])
    assert (waiting.done, waiting.error) == (True, errors.ERR_PROC_FAILED)
    assert not other.done  # from a live rank, p2p: untouched
    early = recv(eng, 2, tag=5)
    assert (early.done, early.error, early.payload) == (True, errors.SUCCESS, b"early")
    arrive(eng, 2, 0, 6, b"late", seq=2)  # after the notice: dropped
    later = recv(eng, 2, tag=6)
    assert (later.done, later.error) == (True, errors.ERR_PROC_FAILED)
    assert eng.failed == [2]
    eng.on_failed([2, 3])  # cumulative: only 3 is new
    assert eng.failed == [2, 3]


def test_sends_to_a_failed_rank_fail() -> None:
    eng, t = engine()
    op = eng.ssend(3, 0, 1, KIND_BUFFER, [], [b"s"], 1)
    eng.on_failed([3])
    assert t.acked[3] == t.sent[3] == 1  # finalizing does not wait for the dead to ack
    assert (op.done, op.error) == (True, errors.ERR_PROC_FAILED)
    with pytest.raises(errors.MPIException):
        op.finish(None)
    assert error_of(eng.send, 3, 0, 1, KIND_BUFFER, [], [b"x"], 1) == errors.ERR_PROC_FAILED
    eng.send(1, 0, 1, KIND_BUFFER, [], [b"x"], 1)
    assert t.frames[-1][0] == 1


def test_a_collective_with_a_failed_member_fails_where_it_waits() -> None:
    eng, _ = engine()
    in_world = recv(eng, 1, ctx=1, tag=3)  # a collective's receive from a live member
    sub = [UNDEFINED] * SIZE
    sub[0], sub[1] = 0, 1
    in_sub = recv(eng, 1, ctx=5, tag=3, w2c=sub)  # a communicator without the failed rank
    eng.on_failed([2])
    assert (in_world.done, in_world.error) == (True, errors.ERR_PROC_FAILED)
    assert not in_sub.done
    again = recv(eng, 1, ctx=1, tag=4)
    assert again.error == errors.ERR_PROC_FAILED


def test_any_source_stays_pending_until_the_failure_is_acknowledged() -> None:
    eng, _ = engine()
    eng.on_failed([3])
    op = recv(eng, ANY_SOURCE, tag=7)
    assert error_of(eng.wait, op, request=True) == errors.ERR_PROC_FAILED_PENDING
    assert op in eng.matcher.posted and not op.done  # the request stays pending
    eng.acked[0] = {3}
    arrive(eng, 1, 0, 7, b"after")
    eng.wait(op, request=True)
    assert (op.error, op.payload) == (errors.SUCCESS, b"after")
    # A blocking receive cannot stay pending: ERR_PROC_FAILED, and it is withdrawn.
    eng.on_failed([3, 2])
    blocking = recv(eng, ANY_SOURCE, tag=8)
    assert error_of(eng.wait, blocking) == errors.ERR_PROC_FAILED
    assert blocking not in eng.matcher.posted


def test_a_probe_for_a_failed_rank_raises() -> None:
    eng, _ = engine()
    eng.on_failed([2])
    assert error_of(eng.matcher.probe, 0, 2, ANY_TAG) == errors.ERR_PROC_FAILED
    assert eng.matcher.probe(0, 1, ANY_TAG) is None  # a live rank: nothing yet, no error


def test_revocation_in_a_reporting_mode_acts_at_once_and_is_forwarded() -> None:
    eng, t = engine(eager=True)
    p2p = recv(eng, 1, ctx=4, tag=1)
    coll = recv(eng, 2, ctx=5, tag=1)
    elsewhere = recv(eng, 1, ctx=6, tag=1)
    pill(eng, 3, 4)
    assert (p2p.error, coll.error) == (errors.ERR_REVOKED, errors.ERR_REVOKED)
    assert not elsewhere.done
    assert recv(eng, 1, ctx=4).error == errors.ERR_REVOKED
    assert error_of(eng.send, 1, 4, 0, KIND_BUFFER, [], [], 0) == errors.ERR_REVOKED
    # Forwarded once, to every member but this rank, at the next flush (not from a callback).
    assert not t.frames
    eng._flush_notices()
    assert sorted((f[0], f[1], f[2]) for f in t.frames) == [
        (1, CTX_REVOKE, 4),
        (2, CTX_REVOKE, 4),
        (3, CTX_REVOKE, 4),
    ]
    pill(eng, 2, 4)
    eng._flush_notices()
    assert len(t.frames) == 3


def test_a_revocation_notice_counts_even_after_its_senders_death() -> None:
    eng, _ = engine(eager=True)
    eng.on_failed([3])
    pill(eng, 3, 6)  # it revoked, then died; the news of its death came first
    assert 6 in eng.revoked


def test_revocation_in_transparent_mode_ends_only_the_senders_channel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vpool.mpi import environment

    eng, t = engine(eager=False)
    monkeypatch.setattr(environment, "_engine", eng)
    arrive(eng, 3, 4, 1, b"before")
    from_3 = recv(eng, 3, ctx=4, tag=2)
    from_1 = recv(eng, 1, ctx=4, tag=2)
    anyone = recv(eng, ANY_SOURCE, ctx=4, tag=2)
    pill(eng, 3, 4)
    assert from_3.error == errors.ERR_REVOKED and anyone.error == errors.ERR_REVOKED
    assert not from_1.done  # rank 1's own notice ends that one
    assert 4 not in eng.revoked  # not observed by the program yet
    earlier = recv(eng, 3, ctx=4, tag=1)  # sent before the notice: still received
    assert (earlier.error, earlier.payload) == (errors.SUCCESS, b"before")
    assert recv(eng, 3, ctx=4, tag=1).error == errors.ERR_REVOKED  # sticky
    assert recv(eng, 3, ctx=5, tag=9).error == errors.ERR_REVOKED  # collectives' context too
    pill(eng, 1, 4)
    assert from_1.error == errors.ERR_REVOKED
    assert error_of(from_1.finish, None) == errors.ERR_REVOKED
    # The program observed it: from now on the context is revoked here.
    assert 4 in eng.revoked
    eng._flush_notices()
    assert {f[0] for f in t.frames if f[1] == CTX_REVOKE} == {1, 2, 3}
