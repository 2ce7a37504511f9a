"""``vpool.protocol.rank_ft`` alone: what a live run logs, and how a replay obeys it."""

from __future__ import annotations

from typing import Any, NoReturn

import msgspec
import pytest

from vpool.mpi import transport as transport_mod
from vpool.mpi.constants import ANY_SOURCE
from vpool.protocol import rank_ft as ftmod
from vpool.protocol.rank_ft import FT, K_MATCH, K_TEST, K_WTIME, R_FAILED, R_OUTCOME


def _fail(text: str) -> NoReturn:
    """As the runtime's ``die``, which ends the process: here, the test."""
    raise SystemExit(text)


class FakeTransport:
    """Acks every determinant at once; any wait for input is a test failure."""

    def __init__(self, size: int = 3, dets: list[bytes] | None = None) -> None:
        self.sent = [0] * size
        self.det_sent = self.det_acked = self.det_need = 0
        self.ft: Any = None
        self.written: list[tuple[int, bytes]] = []
        self.incoming = list(dets or [])

    def send_det(self, index: int, data: bytes) -> None:
        self.written.append((index, data))
        self.det_sent += 1
        self.det_acked = self.det_sent

    def wait_det_acks(self) -> None:
        assert self.det_acked == self.det_sent

    def wait_dets(self, n: int) -> None:
        for i, data in enumerate(self.incoming[:n]):
            self.ft.load(i, data)

    def progress(self, block: bool) -> None:
        raise AssertionError("the replay waited for a message that cannot come")


class FakeEngine:
    def __init__(self) -> None:
        self.notices: list[tuple[int, int]] = []
        self.schedules: list[Any] = []
        self.advancing = False
        self.ft = FT(self, fail=_fail)

    def advance_schedules(self) -> None:
        pass

    def _flush_notices(self) -> None:
        self.ft.send_notices()


class Op:
    def __init__(self, src: int = ANY_SOURCE) -> None:
        self.src = src


def live_ft(size: int = 3) -> tuple[FT, FakeTransport]:
    eng = FakeEngine()
    t = FakeTransport(size)
    eng.ft.attach(t, 0, {})
    return eng.ft, t


def replay_ft(written: list[tuple[int, bytes]]) -> tuple[FT, FakeTransport]:
    eng = FakeEngine()
    t = FakeTransport(dets=[d for _, d in written])
    eng.ft.attach(t, len(written), {})
    return eng.ft, t


def records(t: FakeTransport) -> list[Any]:
    return [rec for _, data in t.written for rec in msgspec.msgpack.decode(data)]


def test_live_logging_batches_and_lazy_failures() -> None:
    ft, t = live_ft()
    assert ft.decide(K_TEST, lambda: None) is None  # event 0: failed test, not logged yet
    assert ft.decide(K_TEST, lambda: None) is None  # event 1
    assert t.det_need != t.det_acked  # a deposit now must log the failures first
    assert ft.decide(K_WTIME, lambda: 1.5) == 1.5  # event 2: logged (covers 0 and 1)
    assert ft.decide(K_TEST, lambda: None) is None  # event 3: failed, lazy
    ft.before_data()  # what the transport does before a deposit
    assert records(t) == [[R_OUTCOME, 2, K_WTIME, 1.5], [R_FAILED, 3]]
    assert [i for i, _ in t.written] == [0]  # one Det for the batch
    assert t.det_need == t.det_acked  # the fast path is open again
    ft.before_data()
    assert len(t.written) == 1  # nothing new to log


def test_any_source_match_logged_when_it_happens() -> None:
    ft, t = live_ft()
    op = Op()
    ft.any_post(op)  # event 0
    assert ft.decide(K_TEST, lambda: True) is True  # event 1
    ft.matched(op, 2)  # in the background, later
    ft.flush()
    assert records(t) == [[R_OUTCOME, 1, K_TEST, True], [R_OUTCOME, 0, K_MATCH, 2]]


def test_replay_obeys_then_goes_live() -> None:
    ft, t = live_ft()
    op = Op()
    ft.any_post(op)
    ft.matched(op, 1)
    assert ft.decide(K_TEST, lambda: None) is None
    assert ft.decide(K_WTIME, lambda: 7.25) == 7.25
    assert ft.decide(K_TEST, lambda: True) is True
    assert ft.decide(K_TEST, lambda: None) is None
    ft.before_data()

    ft2, t2 = replay_ft(t.written)
    op2 = Op()
    ft2.any_post(op2)
    assert op2.src == 1  # forced to the logged source
    # A test that failed when logged fails again, even if the outcome is there now.
    assert ft2.decide(K_TEST, lambda: True) is None
    assert ft2.decide(K_WTIME, lambda: 99.0) == 7.25
    assert ft2.decide(K_TEST, lambda: None, lambda _: True) is True
    assert ft2.decide(K_TEST, lambda: True) is None  # inside the horizon, no record: failed
    # Past the horizon: live, logged with the next Det index.
    assert ft2.decide(K_WTIME, lambda: 3.0) == 3.0
    ft2.flush()
    assert t2.written[0][0] == len(t.written)
    assert records(t2) == [[R_OUTCOME, 5, K_WTIME, 3.0]]


def test_replay_of_a_different_kind_is_not_deterministic(monkeypatch: Any) -> None:
    ft, t = live_ft()
    ft.decide(K_WTIME, lambda: 1.0)
    ft.flush()
    ft2, _ = replay_ft(t.written)

    def die(text: str, code: int = 1) -> None:
        raise SystemExit(text)

    monkeypatch.setattr(transport_mod, "die", die)
    with pytest.raises(SystemExit, match="program is not deterministic: event 0 was a Wtime"):
        ft2.decide(K_TEST, lambda: True)


def test_async_sends_wait_for_their_position(monkeypatch: Any) -> None:
    ft, t = live_ft()

    class Sched:
        _sid = 0

    t.sent[1] = 2
    assert ft.may_step(Sched())  # logged at position 2
    ft.flush()
    ft2, t2 = replay_ft(t.written)
    assert ft2.replaying and not ft2.async_live
    assert t2.det_need != t2.det_acked  # deposits check the queue first
    assert not ft2.may_step(Sched())  # position 0: too early
    t2.sent[1] = 2
    assert ft2.may_step(Sched())
    assert ft2.async_live and not ft2.replaying
    assert t2.det_need == t2.det_acked


def test_async_sends_held_until_logged_frames_are_resent() -> None:
    eng = FakeEngine()
    t = FakeTransport()
    eng.ft.attach(t, 0, {})
    eng.ft.async_live = False  # as after a replay whose relays hold 3 frames to rank 2
    eng.ft.replaying = True
    eng.ft.replay_sent = {2: 3}
    eng.notices.append((2, 5))
    sent: list[tuple[int, int]] = []
    eng._send_notice = lambda src, seq: sent.append((src, seq))  # type: ignore[attr-defined]
    eng.ft.send_notices()
    assert sent == []  # would take seq 1 of channel ->2, logged as something else
    t.sent[2] = 3
    eng.ft.pump()
    assert sent == [(2, 5)]


def test_malformed_determinant_ends_the_rank(monkeypatch: Any) -> None:
    def die(text: str, code: int = 1) -> None:
        raise SystemExit(text)

    monkeypatch.setattr(transport_mod, "die", die)
    with pytest.raises(SystemExit, match="determinant 0 is malformed"):
        replay_ft([(0, b"\xc1")])
    assert ftmod.KIND_NAMES[K_MATCH] == "ANY_SOURCE match"


# -- the decision rule, as a table: every (event, phase, record) -------------------------------

Event, Phase, Record, Rule = ftmod.Event, ftmod.Phase, ftmod.Record, ftmod.Rule
IMPOSSIBLE = {(e, Phase.LIVE, r) for e in Event for r in (Record.SAME, Record.OTHER)}


def test_every_triple_is_a_rule_or_impossible() -> None:
    every = {(e, p, r) for e in Event for p in Phase for r in Record}
    assert set(ftmod.EVENT_RULES) == every - IMPOSSIBLE
    for event, phase, record in IMPOSSIBLE:
        rec = (K_MATCH + 1, None) if record is Record.OTHER else (K_MATCH, 1)
        with pytest.raises(ftmod.LocalProtocolError):
            ftmod.event_rule(event, phase, rec, K_MATCH)


def _logged(*steps: str) -> list[tuple[int, bytes]]:
    """A live run's determinants: "wtime" (a logged read), "any" (an ANY_SOURCE receive
    matching rank 1), "fail" (a failed test)."""
    ft, t = live_ft()
    for step in steps:
        if step == "wtime":
            ft.decide(K_WTIME, lambda: 1.0)
        elif step == "any":
            op = Op()
            ft.any_post(op)
            ft.matched(op, 1)
        else:
            ft.decide(K_TEST, lambda: None)
    ft.before_data()
    ft.flush()
    return t.written


@pytest.mark.parametrize("key", sorted(ftmod.EVENT_RULES, key=str))
def test_each_rule(key: tuple[Any, Any, Any], monkeypatch: Any) -> None:
    """Each row of the table, through the public API of ``FT``."""
    event, phase, record = key
    rule = ftmod.EVENT_RULES[key]

    def die(text: str, code: int = 1) -> None:
        raise SystemExit(text)

    monkeypatch.setattr(transport_mod, "die", die)
    # Event 0 is the one under test. Its record: an ANY_SOURCE match ("any"), a Wtime read
    # ("wtime", the kind the test-like event below asks for), or none (a failed test, inside
    # the horizon because event 1 is logged).
    first = {
        Record.NONE: "fail",
        Record.SAME: "any" if event is Event.ANY_RECV else "wtime",
        Record.OTHER: "wtime" if event is Event.ANY_RECV else "any",
    }[record]
    ft, _ = replay_ft(_logged(first, "wtime")) if phase is Phase.REPLAY else live_ft()
    kind = K_WTIME  # what a test-like event asks here
    if rule is Rule.DIVERGED:
        with pytest.raises(SystemExit, match="not deterministic: event 0 was a"):
            ft.any_post(Op()) if event is Event.ANY_RECV else ft.decide(kind, lambda: 2.0)
        return
    if event is Event.ANY_RECV:
        op = Op()
        ft.any_post(op)
        if rule is Rule.REPRODUCE:
            assert op.src == 1 and op not in ft.any_ops
        else:  # decided live: logged when it matches
            assert rule is Rule.DECIDE and op.src == ANY_SOURCE and op in ft.any_ops
        return
    got = ft.decide(kind, lambda: 2.0)
    expected = {Rule.DECIDE: 2.0, Rule.REPRODUCE: 1.0, Rule.FAILED: None}[rule]
    assert got == expected
