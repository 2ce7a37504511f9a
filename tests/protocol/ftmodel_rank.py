"""A simulated rank of the fault-tolerance model: the program's runtime and its agent.

See ``ftmodel`` ("A rank") for what it does: numbering, determinants, the pessimistic rule,
lazy failed polls, resends, replay of a restarted incarnation, and agent-local delivery. What its
agent keeps is the product's: ``protocol.rank_link.Delivery`` (per source, the highest seq given
to the rank, by the relay or locally) and one ``protocol.rank_link.RankLink`` per relay (the
frames not acknowledged yet, resent after a relay restart).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from vpool.protocol.rank_ft import K_MATCH, K_PROBE, Event, Phase, Rule, event_rule
from vpool.protocol.rank_link import Delivery, RankLink

from .ftmodel_config import Divergence, ModelError
from .ftmodel_frames import Ack, Credit, Data, Delivered, Det, DetAck, Link, Push
from .ftmodel_mpi import ANY, Env, Op, Poll, Recv, RecvAny, Send

if TYPE_CHECKING:
    from .ftmodel import World


class UnorderedDelivery(Delivery):
    """``Delivery`` with one rule taken out, for the test that shows the model notices: a
    message goes to a rank of the same agent at once even when earlier ones of its channel
    are still to come from the relay."""

    def local(self, src: int, seq: int) -> bool:
        if seq <= self.received.get(src, 0):
            return False
        self.received[src] = seq
        return True


# The model's record kinds as the runtime's (a failed poll is a record of a probe's kind).
_KINDS = {"any": K_MATCH, "poll": K_PROBE, "fail": K_PROBE}


class SimRank:
    def __init__(self, world: World, rank: int, inc: int, replay: list[tuple[int, str, Any]]):
        self.world, self.rank, self.inc = world, rank, inc
        self.home = world.home(rank)
        self.state = "running"  # running -> finalizing -> exited; or down (crashed)
        self.seq_out: dict[int, int] = {}
        self.arrived: dict[int, deque[tuple[int, Any]]] = {s: deque() for s in world.ranks}
        # Per source, the highest seq given to us (pushed by the home relay, or delivered by
        # the agent itself): ``Attach.received`` of a re-attachment.
        self.delivery = Delivery() if world.config.local_in_order else UnorderedDelivery()
        self.consumed: list[tuple[int, int, Any]] = []  # (src, seq, payload), in program order
        self.decisions: list[tuple[str, Any]] = []  # every non-deterministic outcome
        self.clock = 0
        self.records = {rec[0]: rec for rec in replay}
        self.horizon = max(self.records, default=-1)
        self.dets = len(replay)  # index of the next determinant
        self.det_acked = len(replay)
        self.lazy: int | None = None  # clock of the last failed poll not logged yet
        # relay -> what the agent keeps unacknowledged there (frames as one-part lists)
        self.links = {x: RankLink(home=x == self.home) for x in range(world.config.relays)}
        self.up: dict[int, Link] = {}  # relay -> our link to it
        self.output: Any = None
        self.gen = world.programs[rank](rank, world.size)
        self.op: Op | None = None
        self._advance(None)

    def __repr__(self) -> str:
        return f"rank {self.rank}.{self.inc}"

    # Which ways the current operation can complete now, as choices for the scheduler.
    def options(self) -> list[Any]:
        op = self.op
        if self.state != "running":
            return []
        if isinstance(op, Send):
            if self.lazy is not None and self.world.config.flush_lazy:
                return ["flush"]
            if self.world.config.pessimistic and self.det_acked < self.dets:
                return []  # the pessimistic rule: wait for DetAck
            return ["deposit"]
        if isinstance(op, Recv):
            return ["recv"] if self.arrived[op.src] else []
        if isinstance(op, Env):
            return ["env"]
        # A decision event: the runtime's rule (``rank_ft.EVENT_RULES``) says what it does.
        rule = self._rule()
        record = self.records.get(self.clock)
        if rule is Rule.DIVERGED:
            raise Divergence(
                f"program is not deterministic: {self} event {self.clock} is {op}, "
                f"the log says {record}"
            )
        if rule is Rule.REPRODUCE:
            assert record is not None
            src = record[2]
            return [record[1]] if src is None or self.arrived[src] else []
        if rule is Rule.FAILED:
            return ["fail"]
        waiting = [s for s, q in self.arrived.items() if q]
        if isinstance(op, Poll) and op.src != ANY:
            waiting = [s for s in waiting if s == op.src]
        if isinstance(op, RecvAny):
            return [("any", s) for s in waiting]
        return [("poll", s) for s in waiting] or ["fail"]

    def take(self, choice: Any) -> str:
        op = self.op
        if choice == "flush":
            clock, self.lazy = self.lazy, None
            self._log_det("fail", None, clock=clock)
            return f"{self}: logs its lazy record: polls failed up to event {clock}"
        if choice == "deposit":
            assert isinstance(op, Send)
            seq = self.seq_out[op.dst] = self.seq_out.get(op.dst, 0) + 1
            frame = Data(self.rank, self.inc, op.dst, seq, op.payload)
            to = self.world.local_receiver(self, op.dst, seq)
            if to is not None:  # agent-local delivery
                to.arrived[self.rank].append((seq, op.payload))
            if to is None or self.world.config.deposit_local:
                relay = self.world.home(op.dst)
                self.links[relay].deposited(op.dst, seq, [frame], local=to is not None)
                self.world.send(self.up[relay], frame)
            if to is not None:  # right behind the Data (here: on the receiver's connection)
                notice = Delivered(to.rank, to.inc, self.rank, seq)
                self.world.send(to.up[to.home], notice)
            self._advance(None)
            how = f", delivered locally to {to}" if to is not None else ""
            return f"{self}: deposits {op.dst}#{seq}={op.payload!r}{how}"
        if choice == "recv":
            assert isinstance(op, Recv)
            return self._consume(op.src, live=None)
        if choice == "env":
            self.decisions.append(("env", self.inc))
            self._advance(self.inc)
            return f"{self}: reads the environment (unlogged): {self.inc}"
        # A non-deterministic event: decided live (``Rule.DECIDE``), else replayed.
        live = self._rule() is Rule.DECIDE
        if isinstance(op, RecvAny):
            return self._consume(choice[1] if live else self.records[self.clock][2], live=live)
        if choice == "fail":
            src = None
            if live:
                self.lazy = self.clock  # logged only if a deposit follows
        else:
            src = choice[1] if live else self.records[self.clock][2]
            if live:
                self._log_det("poll", src)
        self.decisions.append(("poll", src))
        self.clock += 1
        self._advance(src)
        return f"{self}: {op} -> {src} ({'live' if live else 'replay'})"

    def _rule(self) -> Rule:
        """The runtime's rule for the current decision event (a poll is a test-like event,
        its records "poll" and "fail" of one kind; a ``RecvAny`` an ANY_SOURCE receive)."""
        op = self.op
        event = Event.ANY_RECV if isinstance(op, RecvAny) else Event.TEST
        phase = Phase.REPLAY if self.clock <= self.horizon else Phase.LIVE
        record = self.records.get(self.clock)
        rec = None if record is None else (_KINDS[record[1]], record[2])
        return event_rule(event, phase, rec, K_MATCH if event is Event.ANY_RECV else K_PROBE)

    def _consume(self, src: int, live: bool | None) -> str:
        seq, payload = self.arrived[src].popleft()
        self.consumed.append((src, seq, payload))
        how = ""
        if live is not None:
            if live:
                self._log_det("any", src)
            self.decisions.append(("any", src))
            self.clock += 1
            how = " (live)" if live else " (replay)"
        self._advance(payload if live is None else (src, payload))
        return f"{self}: consumes {src}#{seq}={payload!r}{how}"

    def _log_det(self, kind: str, value: Any, clock: int | None = None) -> None:
        if kind != "fail":
            self.lazy = None  # a later record covers the failed polls before it
        det = Det(
            self.rank, self.inc, self.dets, (self.clock if clock is None else clock, kind, value)
        )
        self.dets += 1
        self.links[self.home].det_sent(det.index, [det])
        self.world.send(self.up[self.home], det)

    def _advance(self, value: Any) -> None:
        try:
            self.op = self.gen.send(value)
        except StopIteration as stop:
            self.op, self.output, self.state = None, stop.value, "finalizing"
            self._maybe_exit()

    def _maybe_exit(self) -> None:
        # Finalize waits until every deposit is acknowledged, so no message dies with the process.
        if self.state == "finalizing" and not any(
            queue for link in self.links.values() for queue in link.data.values()
        ):
            self.state = "exited"

    # Frames from the relays.
    def receive(self, relay: int, frame: Any) -> None:
        if self.state == "exited":
            return
        if isinstance(frame, Push):
            had = dict(self.delivery.received)
            if self.delivery.data(frame.src, frame.seq):
                if frame.seq != had.get(frame.src, 0) + 1:
                    raise ModelError(f"{self} got {frame.src}#{frame.seq} after {had}")
                self.arrived[frame.src].append((frame.seq, frame.payload))
            else:  # delivered locally already: our Delivered came too late to stop it
                self.world.late_notices += 1
                if not self.world.config.credit_dropped:
                    return  # dropped (and, here, not credited)
            self.world.send(self.up[relay], Credit(self.rank, self.inc))
        elif isinstance(frame, Ack):
            self.links[relay].acked(frame.dst, frame.seq)
            self._maybe_exit()
        elif isinstance(frame, DetAck):
            self.det_acked = max(self.det_acked, frame.count)
            self.links[relay].dets_acked(frame.count)
