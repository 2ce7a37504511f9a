"""Determinants: logging every outcome the runtime decides by timing, and obeying them on replay.

A restarted rank re-executes its program from the start (docs/internals.md, "Fault tolerance").
Its messages come again from the relays in the same per-channel order, so everything that
depends only on program order and per-channel FIFO comes out the same. What depends on *when*
messages arrived is logged here while running live, as ``Det(job, rank, index, data)`` frames to
the agent (and its home relay), and obeyed on replay.

Events. Decision points are numbered 0, 1, 2, ... in program order (the "event number"); each
of these calls takes one number whenever it is made:

- posting a receive from ``ANY_SOURCE`` (outcome: the world rank it matched, logged when it
  matches, which may be later, in the background). A receive naming its source is
  deterministic even with ``ANY_TAG``: the messages of one channel arrive in send order and
  MPI's matching takes, per source, the earliest matching message for the earliest posted
  matching receive, so which message each receive gets does not depend on when it arrived;
- ``Iprobe``/``Improbe`` (any source; outcome: the source found) and blocking
  ``Probe``/``Mprobe`` from ``ANY_SOURCE`` (outcome: the source);
- ``Test``/``test``, ``Testall``, ``Get_status``, ``Get_status_all`` on requests that are not
  trivially complete (outcome: success), ``Testany``, ``Waitany``, ``Get_status_any`` (the
  index), ``Testsome``, ``Waitsome``, ``Get_status_some`` (the indices);
- ``Wtime`` and ``Get_processor_name`` (the value read);
- an observation of the rank's own state that another thread changes (``vpool.mpi.observe``:
  the ``mpi4py.futures`` manager thread looking at its task queue and its clock; outcome: the
  small value seen, none when there was nothing to see, a failed test).

Asynchronous sends are the sends the runtime makes during progress, not as the program-ordered
effect of the current call: rounds of non-blocking collectives (every step of a schedule after
the one made by the call that started it), ``Ssend`` match notices and the forwarding of a
revocation (ULFM's ``Comm.Revoke``). They are positioned by
the count of ``Data`` frames this rank had written when they were made ("position"), which
fixes their place in each channel's seq order.

Det data: a msgpack array (``msgspec``) of records, written in order (records are batched: one
``Det`` carries every record made since the last one was written, up to ``BATCH``); a record is
one of::

    [0, event, kind, value]   the outcome of decision event ``event``; ``kind``: K_MATCH,
                              K_PROBE, K_TEST, K_ANY, K_SOME, K_WTIME, K_NAME, K_VALUE;
                              ``value``: a world rank, true, an index, a list of indices, a
                              float, a string or an observed value (msgpack-able)
    [1, event]                lazy record: every event <= ``event`` without an outcome record
                              was a failed test (a run of failed tests is one record, written
                              only before the next ``Data`` deposit)
    [2, position, sched]      one step of the ``sched``-th non-blocking collective schedule
                              (numbered in start order) was made at ``position``
    [3, position, src, seq]   the match notice for message ``seq`` of rank ``src`` was sent at
                              ``position``; ``src`` -1: the revocation notices forwarding the
                              revocation of context ``seq`` to its members were sent there
                              (``vpool.mpi.runtime``, revocation)

Det indexes count ``Det`` frames (0, 1, ... per rank, across incarnations); event numbers restart
at 0 with every incarnation started from the beginning, since the program does. A process restored
from a checkpoint (``vpool.mpi.checkpoint``) is the image's process: its event numbers,
frame counts and Det index continue from the image, and so did those of the incarnation that made
the image after it (the same process), so its later records fit the restored process as they are.

Replay (``RankWelcome.replay_dets = N``): the N records are loaded inside ``MPI.Init`` (a restored
process: the records from the image's Det index D to N-1, in ``resume``). The
"horizon" is the highest event number they mention. An event with an outcome record reproduces
it (blocking until it can: the messages come again); an event up to the horizon without one is a
failed test; an event past the horizon is decided live and logged with index N, N+1, ....
Asynchronous sends are performed exactly as recorded, in record order, each once the frame count
reaches its position; live ones are held back until the rank has re-sent every frame the relays
already hold (``RankWelcome.replay_sent``) and the recorded ones are all done. A record that does
not fit the event ends the rank: "program is not deterministic: ...".

Pessimistic rule: no ``Data`` leaves before every record made so far is acknowledged
(``DetAck``); ``Transport.send_data`` checks ``det_need != det_acked`` (one integer comparison)
and only then calls ``before_data``.

Fault tolerance off (``attach(logging=False)``: ``VPOOL_FT=0``, read by the runtime inside
``MPI.Init``, set by the coordinator in the leases of a job submitted with
``--no-fault-tolerance``): no record is made,
so no ``Det`` is written and no deposit waits for a ``DetAck``. Events are still numbered and
asynchronous sends still made at once; a replay handed to such a rank is still obeyed.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn

import msgspec

from vpool.protocol.errors import LocalProtocolError

R_OUTCOME, R_FAILED, R_STEP, R_NOTICE = range(4)
K_MATCH, K_PROBE, K_TEST, K_ANY, K_SOME, K_WTIME, K_NAME, K_VALUE = range(8)
KIND_NAMES = (
    "ANY_SOURCE match",
    "probe",
    "test",
    "any",
    "some",
    "Wtime",
    "processor name",
    "observed value",
)

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode

BATCH = 512  # records per Det at most (a Det is header only: at most 64 KiB)
MAX_DATA = 48 * 1024


# -- the rule of a decision event, as data ----------------------------------------------------


class Event(enum.Enum):
    TEST = "test"  # a test, probe or read (``decide``): no outcome recorded = a failed test
    ANY_RECV = "any_recv"  # a receive from ANY_SOURCE being posted (``any_post``)


class Phase(enum.Enum):
    LIVE = "live"  # past the horizon of the loaded records
    REPLAY = "replay"  # within it


class Record(enum.Enum):
    NONE = "none"  # no record of this event
    SAME = "same"  # a record of this event's kind
    OTHER = "other"  # a record of another kind


class Rule(enum.Enum):
    DECIDE = "decide"  # decided now and logged (a failed test lazily)
    REPRODUCE = "reproduce"  # the recorded outcome, waiting until it can be had
    FAILED = "failed"  # a failed test, not logged again
    DIVERGED = "diverged"  # the program is not deterministic: the rank ends


# (event, phase, record) -> rule. Past the horizon there are no records (the horizon is the
# highest event they mention), so the LIVE rows with one cannot happen. A receive from
# ANY_SOURCE without a record inside the horizon did not match in the logged run before it
# ended: deciding it live is safe, since every message it could take was left untaken by every
# logged decision.
EVENT_RULES: dict[tuple[Event, Phase, Record], Rule] = {
    (Event.TEST, Phase.LIVE, Record.NONE): Rule.DECIDE,
    (Event.TEST, Phase.REPLAY, Record.NONE): Rule.FAILED,
    (Event.TEST, Phase.REPLAY, Record.SAME): Rule.REPRODUCE,
    (Event.TEST, Phase.REPLAY, Record.OTHER): Rule.DIVERGED,
    (Event.ANY_RECV, Phase.LIVE, Record.NONE): Rule.DECIDE,
    (Event.ANY_RECV, Phase.REPLAY, Record.NONE): Rule.DECIDE,
    (Event.ANY_RECV, Phase.REPLAY, Record.SAME): Rule.REPRODUCE,
    (Event.ANY_RECV, Phase.REPLAY, Record.OTHER): Rule.DIVERGED,
}


def event_rule(event: Event, phase: Phase, rec: tuple[int, Any] | None, kind: int) -> Rule:
    """The rule for one decision event of ``kind`` (``K_*``) given its record, if any."""
    record = Record.NONE if rec is None else Record.SAME if rec[0] == kind else Record.OTHER
    rule = EVENT_RULES.get((event, phase, record))
    if rule is None:
        raise LocalProtocolError(f"{event.value} event in {phase.value} with {record.value}")
    return rule


class FT:
    """The determinant layer of one rank (``Engine.ft``). Without a transport (a singleton run)
    nothing is logged and nothing replayed."""

    __slots__ = (
        "_fail",
        "any_ops",
        "async_live",
        "asyncs",
        "eng",
        "ev",
        "horizon",
        "index",
        "lazy_ev",
        "loaded",
        "logged_ev",
        "logging",
        "outcomes",
        "pending",
        "replay_sent",
        "replaying",
        "scheds",
        "transport",
    )

    def __init__(self, eng: Any, *, fail: Callable[[str], NoReturn]) -> None:
        self.eng = eng
        # How the rank ends when the log and the program disagree (the runtime exits).
        self._fail = fail
        self.transport: Any = None
        self.logging = False  # records are made (a transport, fault tolerance on)
        self.ev = 0  # the next event's number
        self.index = 0  # the next record's Det index
        self.pending: list[list[Any]] = []  # records made, not yet written
        self.logged_ev = -1  # highest event number a written record covers
        self.lazy_ev = -1  # highest failed-test event, logged only once a record covers it
        self.any_ops: dict[Any, int] = {}  # live ANY_SOURCE receives not matched yet -> event
        self.scheds = 0  # schedules started so far (their numbers)
        # Replay.
        self.loaded = 0
        self.outcomes: dict[int, tuple[int, Any]] = {}
        self.horizon = -1
        self.asyncs: deque[list[Any]] = deque()
        self.replay_sent: dict[int, int] = {}
        self.async_live = True
        self.replaying = False  # recorded asynchronous sends are still to be made

    # ---- wiring ----------------------------------------------------------------------------

    def attach(
        self,
        transport: Any,
        replay_dets: int,
        replay_sent: dict[int, int],
        *,
        logging: bool = True,
    ) -> None:
        """Start over ``transport``; ``logging``: make records (fault tolerance on)."""
        self.transport = transport
        transport.ft = self
        self.logging = logging
        self.index = transport.det_sent = transport.det_acked = replay_dets
        self.replay_sent = dict(replay_sent)
        if replay_dets:
            transport.wait_dets(replay_dets)
            self.logged_ev = self.horizon
            self.async_live = False
            self.replaying = True
            self._check_live()
        self._gate()

    def resume(self, transport: Any, total_dets: int, replay_sent: dict[int, int]) -> None:
        """Continue a process restored from a checkpoint image over ``transport`` (reopened):
        its Det frames ``self.index .. total_dets-1`` (written by the incarnation that made
        the image, after it) are read and obeyed as a replay from the start obeys all of them;
        ``replay_sent`` holds back live asynchronous sends as in ``attach``."""
        start = self.index
        if total_dets < start:
            self._fail(
                f"the agent holds {total_dets} determinants, the checkpoint image wrote {start}"
            )
        self.loaded = start
        self.replay_sent = dict(replay_sent)
        self.pending.clear()  # written before the image was taken: nothing is pending
        transport.det_sent = transport.det_acked = start
        if total_dets > start:
            transport.wait_dets(total_dets)
            self.logged_ev = max(self.logged_ev, self.horizon)
            self.async_live = False
            self.replaying = True
        self.index = transport.det_sent = transport.det_acked = total_dets
        if not self.async_live:
            self._check_live()
        self._gate()

    def _resume_any_ops(self) -> None:
        """ANY_SOURCE receives posted before the image and matched only after it: their
        records are among the loaded ones; they take the recorded source (they are already
        posted, so ``any_post`` cannot do it)."""
        for op, ev in list(self.any_ops.items()):
            rec = self.outcomes.pop(ev, None)
            rule = event_rule(Event.ANY_RECV, Phase.REPLAY, rec, K_MATCH)
            if rule is Rule.DECIDE:
                continue  # no match was logged: decided live, as in ``any_post``
            if rule is Rule.DIVERGED:
                self._mismatch(ev, rec, "a receive from ANY_SOURCE")
            assert rec is not None
            del self.any_ops[op]
            op.src = rec[1]

    def busy(self) -> bool:
        """Replaying: determinants still to obey or recorded sends still to make (no
        checkpoint now)."""
        return self.replaying or self.ev <= self.horizon

    def load(self, index: int, data: bytes) -> None:
        """A determinant of an earlier incarnation (in index order, before any new one)."""
        if index != self.loaded:
            self._fail(f"determinant {index} from the agent, expected {self.loaded}")
        self.loaded += 1
        try:
            for rec in _decode(data):
                kind = rec[0]
                if kind == R_OUTCOME:
                    self.outcomes[rec[1]] = (rec[2], rec[3])
                    self.horizon = max(self.horizon, rec[1])
                elif kind == R_FAILED:
                    self.horizon = max(self.horizon, rec[1])
                elif kind in (R_STEP, R_NOTICE):
                    self.asyncs.append(rec)
                else:
                    raise ValueError(f"record kind {kind}")
        except (msgspec.DecodeError, ValueError, IndexError, TypeError) as exc:
            self._diverged(f"determinant {index} is malformed ({exc})")
        if self.any_ops:
            # A restored process: before any Data that follows the Dets can match them.
            self._resume_any_ops()

    def _mismatch(self, ev: int, rec: tuple[int, Any] | None, now: str) -> NoReturn:
        assert rec is not None
        self._diverged(f"event {ev} was a {KIND_NAMES[rec[0]]} when logged, {now} now")

    def _diverged(self, text: str) -> NoReturn:
        self._fail(f"program is not deterministic: {text}")

    # ---- writing records ---------------------------------------------------------------------

    def _gate(self) -> None:
        """Set the transport's fast-path test: ``det_need == det_acked`` only when a Data frame
        may go out at once (no record unwritten or unacknowledged, nothing to replay first)."""
        t = self.transport
        if t is None:
            return
        if self.pending or self.lazy_ev > self.logged_ev or not self.async_live:
            t.det_need = -1
        else:
            t.det_need = t.det_sent

    def _record(self, rec: list[Any]) -> None:
        if not self.logging:
            return
        self.pending.append(rec)
        self.transport.det_need = -1

    def flush(self) -> None:
        """Write the records made so far (never from inside a transport callback)."""
        t = self.transport
        pending = self.pending
        while pending:
            n = min(len(pending), BATCH)
            data = _encode(pending[:n])
            while len(data) > MAX_DATA and n > 1:
                n //= 2
                data = _encode(pending[:n])
            del pending[:n]
            t.send_det(self.index, data)
            self.index += 1
        self._gate()

    def before_data(self) -> None:
        """The slow path of a deposit: recorded asynchronous sends due at this position first,
        then every record written (the lazy one too) and acknowledged."""
        if not self.async_live:
            self._drain()
        if self.lazy_ev > self.logged_ev:
            self.pending.append([R_FAILED, self.lazy_ev])
            self.logged_ev = self.lazy_ev
        self.flush()
        t = self.transport
        t.wait_det_acks()
        if getattr(t, "ckpt_request", None) is not None:
            # A rank that sends after every receive reads mostly here: a safe point too (no
            # frame half written, no decision in flight).
            self.eng.checkpoint()

    # ---- decision events ---------------------------------------------------------------------

    def decide(
        self,
        kind: int,
        live: Callable[[], Any],
        ready: Callable[[Any], bool] | None = None,
    ) -> Any:
        """One decision event: the recorded outcome on replay (once ``ready(outcome)``), else
        ``live()``, logged unless None (a failed test, logged lazily)."""
        ev = self.ev
        self.ev = ev + 1
        if ev > self.horizon:
            value = live()
            if ev > self.horizon:
                if self.logging:
                    if value is None:
                        self.lazy_ev = ev
                        self.transport.det_need = -1
                    else:
                        self.logged_ev = ev
                        self._record([R_OUTCOME, ev, kind, value])
                        if len(self.pending) >= BATCH:
                            self.flush()
                return value
            # A checkpoint was taken inside ``live()`` and this is the restored process: the
            # image's maker decided this event after the fork; its outcome is in the log.
        rec = self.outcomes.pop(ev, None)
        rule = event_rule(Event.TEST, Phase.REPLAY, rec, kind)
        if rule is Rule.FAILED:
            return None
        if rule is Rule.DIVERGED:
            self._mismatch(ev, rec, f"a {KIND_NAMES[kind]}")
        assert rec is not None
        value = rec[1]
        if ready is not None:
            self.until(lambda: ready(value))
        return value

    def missing(self, what: str) -> None:
        self._diverged(f"event {self.ev - 1} ({what}) has no logged value")

    def until(self, cond: Callable[[], bool]) -> None:
        """Make progress until ``cond()`` (a recorded outcome can be reproduced)."""
        eng = self.eng
        while not cond():
            eng.advance_schedules()
            if eng.notices:
                eng._flush_notices()
            if self.replaying and self.pump():
                continue
            if cond():
                break
            if self.transport is None:
                self._diverged("a logged outcome cannot be reproduced without peers")
            self.transport.progress(True)
            if self.pending:
                self.flush()

    def any_post(self, op: Any) -> None:
        """A receive from ANY_SOURCE is being posted: force the recorded source, or log it."""
        ev = self.ev
        self.ev = ev + 1
        if ev <= self.horizon:
            rec = self.outcomes.pop(ev, None)
            rule = event_rule(Event.ANY_RECV, Phase.REPLAY, rec, K_MATCH)
            if rule is Rule.DIVERGED:
                self._mismatch(ev, rec, "a receive from ANY_SOURCE")
            if rule is Rule.REPRODUCE:
                assert rec is not None
                op.src = rec[1]
                return
        if self.logging:
            self.any_ops[op] = ev

    def matched(self, op: Any, src: int) -> None:
        """A live ANY_SOURCE receive matched a message of ``src`` (maybe in a transport
        callback: the record is only queued)."""
        ev = self.any_ops.pop(op, None)
        if ev is not None:
            self.logged_ev = max(self.logged_ev, ev)
            self._record([R_OUTCOME, ev, K_MATCH, src])

    # ---- asynchronous sends ------------------------------------------------------------------

    def new_schedule(self) -> int:
        n = self.scheds
        self.scheds = n + 1
        return n

    def _position(self) -> int:
        return sum(self.transport.sent)

    def may_step(self, sched: Any) -> bool:
        """May the schedule take its next step (its receives are complete) now?"""
        if self.transport is None:
            return True
        if self.async_live:
            if self.logging:
                self._record([R_STEP, self._position(), sched._sid])
            return True
        head = self._head()
        if head is None or head[0] != R_STEP or head[2] != sched._sid:
            return False
        if head[1] != self._position():
            return False
        self.asyncs.popleft()
        self._check_live()
        return True

    def send_notices(self) -> None:
        """Send the match notices of synchronous messages matched so far, as allowed."""
        eng = self.eng
        t = self.transport
        notices = eng.notices
        if t is None:
            notices.clear()
            return
        if self.async_live:
            while notices:
                src, seq = notices.pop(0)
                if self.logging:
                    self._record([R_NOTICE, self._position(), src, seq])
                eng._send_notice(src, seq)
            return
        while notices:
            head = self._head()
            if head is None or head[0] != R_NOTICE or head[1] != self._position():
                return
            key = (head[2], head[3])
            if key not in notices:
                return
            notices.remove(key)
            self.asyncs.popleft()
            self._check_live()
            eng._send_notice(*key)
            if self.async_live:
                self.send_notices()
                return

    def _head(self) -> list[Any] | None:
        if self.asyncs:
            head = self.asyncs[0]
            if head[1] < self._position():
                what = "a collective round" if head[0] == R_STEP else "a match notice"
                self._diverged(
                    f"{what} logged after {head[1]} messages was not due after {head[1]}"
                )
            return head
        self._check_live()
        return None

    def _check_live(self) -> None:
        """Asynchronous sends go live once the recorded ones are done and every frame the
        relays hold has been re-sent (before, one would take a seq of a logged message)."""
        if self.async_live or self.asyncs:
            return
        sent = self.transport.sent
        for dst, seq in self.replay_sent.items():
            if 0 <= dst < len(sent) and sent[dst] < seq:
                return
        self.async_live = True
        self.replaying = False
        self._gate()
        eng = self.eng
        if eng.notices:
            self.send_notices()

    def pump(self) -> bool:
        """Make the recorded asynchronous sends that are due and possible; True if any was."""
        before = len(self.asyncs)
        eng = self.eng
        while self.asyncs:
            n = len(self.asyncs)
            eng.advance_schedules()
            if eng.notices:
                self.send_notices()
            if len(self.asyncs) == n:
                break
        self._check_live()
        return len(self.asyncs) != before

    def _drain(self) -> None:
        """Before a deposit on replay: every recorded asynchronous send due at this position
        goes first, waiting until it can (its messages come again)."""
        if self.eng.advancing:
            return  # a recorded step is sending: it was atomic when logged
        while True:
            head = self._head()
            if head is None or head[1] != self._position():
                return
            if not self.pump():
                self.transport.progress(True)
