"""A model of vpool's fault tolerance, with no I/O: simulated ranks, agents and relays.

This is docs/internals.md "Fault tolerance (issue 4)" as an executable specification. The relays
use the real sans-IO state machines (``protocol.mailbox.Mailbox`` per destination,
``protocol.detlog.DetLog`` per rank); everything around them (the rank's runtime, its agent, the
network, disks, crashes) is simulated, and a scheduler chooses what happens next.

The pieces:

- **Programs** are generator functions ``program(rank, size)`` over an abstract MPI: they yield
  ``Send(dst, payload)``, ``Recv(src)`` (returns the payload), ``RecvAny()`` (returns ``(src,
  payload)``), ``Poll(src or ANY)`` (returns a source with a message waiting, or None), and
  ``Env()`` (an unlogged read of the environment: a program that uses it is not deterministic).
  The generator's return value is the rank's output.
- **A rank** (``SimRank``: runtime + agent) numbers its messages per destination (seq 1, 2, ...),
  logs its non-deterministic outcomes as determinants ``Det(index, (clock, kind, value))`` at its
  home relay (the clock counts the rank's non-deterministic events), keeps consecutive failed polls
  as one lazy record flushed before the next deposit, deposits nothing before every determinant it
  created is acknowledged (the pessimistic rule), and keeps unacknowledged frames to resend after
  a relay restart. A restarted incarnation starts the program from the beginning with zeroed
  counters and obeys the determinants it got at attach time: a recorded outcome is reproduced
  (waiting for the message if needed), an event inside the recorded horizon without a record is a
  failed poll, an event past the horizon is decided live and logged.
- **A relay** (``SimRelay``) holds the mailboxes of the ranks it is home to and their determinant
  logs. Deposits and determinants are appended at once and become durable when the scheduler
  writes them (in any order; the state machines make durability a prefix); acks go out when they
  do. Re-sent messages are checked against the logged digest. A crash loses everything not yet
  durable and every connection; the restarted relay rebuilds its mailboxes and logs from the
  durable entries, and every live rank re-attaches and resends what was not acknowledged.
- **Links** are FIFO queues of frames, one per direction per (rank incarnation, relay)
  connection. A rank's crash kills the links towards it; frames it already sent may still land,
  and the relay drops them once a newer incarnation attached (fencing).

``run(programs, schedule, config)`` executes one schedule (a list of ints, each picking one of the
events enabled at that point), then runs fault-free to the end; the tests compare the surviving
incarnations with a fault-free execution of the same programs that makes the same choices
(``reference`` in test_ft_model.py). MPICH-V's two properties (seeds/000 §3.5) are what they check:
*logging* (the restarted rank re-executes exactly what it did, because every non-deterministic
outcome others could depend on was logged) and *silent re-execution* (its re-sent messages have no
effect on the others: the relays drop them, after checking their digest).
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from vpool.protocol.detlog import DetLog, DetOffer
from vpool.protocol.mailbox import Mailbox, Offer

ANY = -1


# -- the abstract MPI the programs are written against ------------------------------------------


@dataclass(frozen=True)
class Send:
    dst: int
    payload: Any


@dataclass(frozen=True)
class Recv:
    src: int


@dataclass(frozen=True)
class RecvAny:
    pass


@dataclass(frozen=True)
class Poll:
    src: int  # a rank or ANY


@dataclass(frozen=True)
class Env:
    """Read something from the environment that is not logged (here: the incarnation)."""


Op = Send | Recv | RecvAny | Poll | Env
Program = Callable[[int, int], Generator[Op, Any, Any]]


@dataclass(frozen=True)
class Config:
    relays: int = 2  # home of rank r: relay r % relays
    window: int = 2  # push window, in frames (every frame has size 1)
    max_rank_crashes: int = 3
    max_relay_crashes: int = 2
    # The protocol's rules, each of which a test turns off to show the model notices.
    pessimistic: bool = True  # deposit only once every earlier determinant is acknowledged
    flush_lazy: bool = True  # the lazy failed-poll record is logged before the next deposit
    # A new incarnation attaches to its home relay only once every logged determinant is durable
    # (else it could obey a determinant that a relay crash then loses).
    attach_after_durable: bool = True
    # After a relay restart the agent resends every unacknowledged message, also those the
    # relay says it holds (seq <= Attached.stored): the logged copy may come from an older
    # incarnation, and the relay's digest check is the only place a different one shows.
    resend_held: bool = True


class Divergence(Exception):
    """The protocol detected a non-deterministic program (what the job fails with)."""


class ModelError(AssertionError):
    """The protocol broke one of its own invariants (a bug, never a program's fault)."""


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


# -- ranks: runtime + agent --------------------------------------------------------------------


class SimRank:
    def __init__(self, world: World, rank: int, inc: int, replay: list[tuple[int, str, Any]]):
        self.world, self.rank, self.inc = world, rank, inc
        self.home = world.home(rank)
        self.state = "running"  # running -> finalizing -> exited; or down (crashed)
        self.seq_out: dict[int, int] = {}
        self.arrived: dict[int, deque[tuple[int, Any]]] = {s: deque() for s in world.ranks}
        self.received: dict[int, int] = {}  # per source, the highest seq pushed to us
        self.consumed: list[tuple[int, int, Any]] = []  # (src, seq, payload), in program order
        self.decisions: list[tuple[str, Any]] = []  # every non-deterministic outcome
        self.clock = 0
        self.records = {rec[0]: rec for rec in replay}
        self.horizon = max(self.records, default=-1)
        self.dets = len(replay)  # index of the next determinant
        self.det_acked = len(replay)
        self.lazy: int | None = None  # clock of the last failed poll not logged yet
        self.unacked: dict[int, dict[int, Data]] = {}  # dst -> seq -> frame
        self.unacked_dets: dict[int, Det] = {}
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
        record = self.records.get(self.clock)
        if record is not None:  # replaying: reproduce the recorded outcome
            want = "any" if isinstance(op, RecvAny) else ("poll", "fail")
            if record[1] not in want:
                raise Divergence(
                    f"program is not deterministic: {self} event {self.clock} is {op}, "
                    f"the log says {record}"
                )
            src = record[2]
            return [record[1]] if src is None or self.arrived[src] else []
        if self.clock <= self.horizon:  # inside the horizon, no record: a failed poll
            if isinstance(op, RecvAny):
                raise Divergence(f"program is not deterministic: {self} {op} not in the log")
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
            self.unacked.setdefault(op.dst, {})[seq] = frame
            self.world.send(self.up[self.world.home(op.dst)], frame)
            self._advance(None)
            return f"{self}: deposits {op.dst}#{seq}={op.payload!r}"
        if choice == "recv":
            assert isinstance(op, Recv)
            return self._consume(op.src, live=None)
        if choice == "env":
            self.decisions.append(("env", self.inc))
            self._advance(self.inc)
            return f"{self}: reads the environment (unlogged): {self.inc}"
        # A non-deterministic event: decided live past the horizon, else replayed.
        live = self.clock > self.horizon
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
        self.unacked_dets[det.index] = det
        self.world.send(self.up[self.home], det)

    def _advance(self, value: Any) -> None:
        try:
            self.op = self.gen.send(value)
        except StopIteration as stop:
            self.op, self.output, self.state = None, stop.value, "finalizing"
            self._maybe_exit()

    def _maybe_exit(self) -> None:
        # Finalize waits until every deposit is acknowledged, so no message dies with the process.
        if self.state == "finalizing" and not any(self.unacked.values()):
            self.state = "exited"

    # Frames from the relays.
    def receive(self, relay: int, frame: Any) -> None:
        if self.state == "exited":
            return
        if isinstance(frame, Push):
            if frame.seq != self.received.get(frame.src, 0) + 1:
                raise ModelError(f"{self} got {frame.src}#{frame.seq} after {self.received}")
            self.received[frame.src] = frame.seq
            self.arrived[frame.src].append((frame.seq, frame.payload))
            self.world.send(self.up[relay], Credit(self.rank, self.inc))
        elif isinstance(frame, Ack):
            pending = self.unacked.get(frame.dst, {})
            for seq in [s for s in pending if s <= frame.seq]:
                del pending[seq]
            self._maybe_exit()
        elif isinstance(frame, DetAck):
            self.det_acked = max(self.det_acked, frame.count)
            for index in [i for i in self.unacked_dets if i < frame.count]:
                del self.unacked_dets[index]


# -- relays ------------------------------------------------------------------------------------


class SimRelay:
    def __init__(self, world: World, index: int) -> None:
        self.world, self.index = world, index
        self.homed = [r for r in world.ranks if world.home(r) == index]
        self.mailboxes: dict[int, Mailbox[Any]] = {
            r: Mailbox(window=world.config.window) for r in self.homed
        }
        self.detlogs: dict[int, DetLog[Any]] = {r: DetLog() for r in self.homed}
        self.unwritten: dict[int, set[int]] = {r: set() for r in self.homed}  # dets being written
        self.fence: dict[int, int] = {}  # rank -> newest incarnation attached
        self.down: dict[int, Link] = {}  # rank -> link to its current incarnation

    def attach(self, rank: SimRank, received: dict[int, int]) -> None:
        """``Attach`` from ``rank``'s agent (fresh incarnation or re-attach after our restart)."""
        self.fence[rank.rank] = rank.inc
        rank.up[self.index] = self.world.link(
            Link(f"{rank}->relay {self.index}", self, rank, False)
        )
        self.down[rank.rank] = self.world.link(
            Link(f"relay {self.index}->{rank}", self, rank, True)
        )
        if rank.rank in self.mailboxes:
            self.mailboxes[rank.rank].attach(received)
            self.pump()

    def pending_writes(self) -> list[tuple[Any, ...]]:
        events: list[tuple[Any, ...]] = []
        for dst, box in self.mailboxes.items():
            events += [("write", self.index, dst, e) for e in box.entries() if not e.written]
        for rank, indexes in self.unwritten.items():
            events += [("write_det", self.index, rank, i) for i in sorted(indexes)]
        return events

    def written(self, dst: int, entry: Any) -> str:
        box = self.mailboxes[dst]
        box.written(entry)
        for e in box.advance():  # acked in log order, cumulative per channel
            self._to(e.src, Ack(dst, e.seq))
        self.pump()
        return f"relay {self.index}: {entry.src}->{dst}#{entry.seq} written"

    def det_written(self, rank: int, index: int) -> str:
        log = self.detlogs[rank]
        log.written(index)
        self.unwritten[rank].discard(index)
        before = log.durable
        if log.advance() > before:
            self._to(rank, DetAck(log.durable))
        return f"relay {self.index}: det {index} of rank {rank} written"

    def receive(self, frame: Any) -> None:
        sender = frame.src if isinstance(frame, Data) else frame.rank
        if self.fence.get(sender) != frame.inc:
            return  # a stale incarnation's frame, still on the wire: fenced
        if isinstance(frame, Credit):
            self.mailboxes[frame.rank].credit(1)
        elif isinstance(frame, Det):
            self._det(frame)
        else:
            self._deposit(frame)
        self.pump()

    def _deposit(self, frame: Data) -> None:
        box = self.mailboxes[frame.dst]
        mark = digest(frame.src, frame.dst, frame.seq, frame.payload)
        offer = box.offer(frame.src, frame.seq)
        if offer is Offer.NEW:
            box.append(frame.src, frame.seq, 1, frame.payload, mark)
            return
        logged = box.entry(frame.src, frame.seq)
        assert logged is not None
        if logged.digest != mark:
            raise Divergence(
                f"program is not deterministic: rank {frame.src} re-sent message {frame.seq} to "
                f"rank {frame.dst} (channel {frame.src}->{frame.dst}) with different content "
                f"({frame.payload!r}, logged {logged.ref!r})"
            )
        if offer is Offer.DUPLICATE:
            self._to(frame.src, Ack(frame.dst, box.acked(frame.src)))

    def _det(self, frame: Det) -> None:
        log = self.detlogs[frame.rank]
        if log.offer(frame.index) is DetOffer.NEW:
            log.append(frame.index, frame.record)
            self.unwritten[frame.rank].add(frame.index)
            return
        logged = log.replay(frame.index)[0]
        if logged != frame.record:
            raise ModelError(f"relay {self.index}: det {frame.index} {frame.record} != {logged}")
        self._to(frame.rank, DetAck(log.durable))

    def _to(self, rank: int, frame: Any) -> None:
        link = self.down.get(rank)
        if link is not None and link.alive:
            self.world.send(link, frame)

    def pump(self) -> None:
        """Push every durable message the window allows (the relay pushes eagerly)."""
        for dst, box in self.mailboxes.items():
            while (entry := box.next_push()) is not None:
                self._to(dst, Push(entry.src, entry.seq, entry.ref))

    def crash(self) -> None:
        """Lose what is not durable and every connection; rebuild from the durable state."""
        for dst, box in self.mailboxes.items():
            fresh: Mailbox[Any] = Mailbox(window=self.world.config.window)
            for e in list(box.entries())[: box.durable_count]:
                fresh.written(fresh.append(e.src, e.seq, e.size, e.ref, e.digest))
            fresh.advance()
            self.mailboxes[dst] = fresh
        for rank, log in self.detlogs.items():
            rebuilt: DetLog[Any] = DetLog()
            for i, ref in enumerate(log.replay(0)[: log.durable]):
                rebuilt.append(i, ref)
                rebuilt.written(i)
            rebuilt.advance()
            self.detlogs[rank] = rebuilt
            self.unwritten[rank].clear()
        self.fence.clear()
        self.down.clear()
        self.world.cut(self)


# -- the world and the scheduler ------------------------------------------------------------------


@dataclass
class Outcome:
    consumed: dict[int, list[tuple[int, int, Any]]]
    outputs: dict[int, Any]
    decisions: dict[int, list[tuple[str, Any]]]
    incarnations: dict[int, int]
    relay_crashes: int
    trace: list[str]
    divergence: str | None = None


class World:
    def __init__(self, programs: list[Program], config: Config) -> None:
        self.programs, self.config = programs, config
        self.size = len(programs)
        self.ranks = range(self.size)
        self.links: list[Link] = []
        self.relays = [SimRelay(self, x) for x in range(config.relays)]
        self.rank_crashes = self.relay_crashes = 0
        self.trace: list[str] = []
        self.procs = [SimRank(self, r, 1, []) for r in self.ranks]
        for proc in self.procs:
            for relay in self.relays:
                relay.attach(proc, {})

    def home(self, rank: int) -> int:
        return rank % self.config.relays

    def link(self, link: Link) -> Link:
        self.links.append(link)
        return link

    def send(self, link: Link, frame: Any) -> None:
        if link.alive:
            link.frames.append(frame)

    def cut(self, relay: SimRelay) -> None:
        """Every connection of ``relay`` breaks: the frames on them are lost."""
        for link in self.links:
            if link.relay is relay:
                link.alive = False
        self.links = [link for link in self.links if link.alive]

    def events(self) -> list[tuple[Any, ...]]:
        """What can happen next, faults aside: deliveries, writes, rank steps, restarts."""
        events: list[tuple[Any, ...]] = [
            ("restart", p.rank) for p in self.procs if p.state == "down" and self._can_restart(p)
        ]
        events += [("deliver", link) for link in self.links if link.frames]
        for relay in self.relays:
            events += relay.pending_writes()
        for proc in self.procs:
            events += [("step", proc.rank, choice) for choice in proc.options()]
        return events

    def faults(self) -> list[tuple[Any, ...]]:
        """The crashes still in the budget."""
        faults: list[tuple[Any, ...]] = []
        if self.rank_crashes < self.config.max_rank_crashes:
            live = [p.rank for p in self.procs if p.state in ("running", "finalizing")]
            faults += [("crash", r) for r in live]
        if self.relay_crashes < self.config.max_relay_crashes:
            faults += [("relay_crash", x) for x in range(len(self.relays))]
        return faults

    def _can_restart(self, proc: SimRank) -> bool:
        log = self.relays[proc.home].detlogs[proc.rank]
        return not self.config.attach_after_durable or log.durable == len(log)

    def apply(self, event: tuple[Any, ...]) -> str:
        kind = event[0]
        if kind == "deliver":
            link = event[1]
            frame = link.frames.popleft()
            if link.to_rank:
                link.rank.receive(link.relay.index, frame)
            else:
                link.relay.receive(frame)
            return f"{link.name}: {frame}"
        if kind == "write":
            return self.relays[event[1]].written(event[2], event[3])
        if kind == "write_det":
            return self.relays[event[1]].det_written(event[2], event[3])
        if kind == "step":
            return self.procs[event[1]].take(event[2])
        if kind == "crash":
            return self._crash(event[1])
        if kind == "restart":
            return self._restart(event[1])
        assert kind == "relay_crash"
        return self._relay_crash(event[1])

    def _crash(self, rank: int) -> str:
        self.rank_crashes += 1
        proc = self.procs[rank]
        proc.state = "down"
        for relay in self.relays:
            link = relay.down.pop(rank, None)
            if link is not None:
                link.alive = False
            if rank in relay.mailboxes:
                relay.mailboxes[rank].detach()
        return f"CRASH {proc}"

    def _restart(self, rank: int) -> str:
        # The home relay answers Attached(dets=len(log)) and sends the Dets; the agent attaches
        # to every relay (fencing the old incarnation) before the process starts.
        replay = self.relays[self.home(rank)].detlogs[rank].replay(0)
        proc = self.procs[rank] = SimRank(self, rank, self.procs[rank].inc + 1, list(replay))
        for relay in self.relays:
            relay.attach(proc, {})
        return f"RESTART {proc}, replaying {len(replay)} determinants {list(replay)}"

    def _relay_crash(self, index: int) -> str:
        self.relay_crashes += 1
        relay = self.relays[index]
        relay.crash()
        for proc in self.procs:
            if proc.state not in ("running", "finalizing"):
                continue
            relay.attach(proc, dict(proc.received))
            for dst, pending in proc.unacked.items():
                if self.home(dst) != index:
                    continue
                held = relay.mailboxes[dst].stored(proc.rank)  # Attached.stored[dst]
                for seq in sorted(pending):
                    if seq <= held and not self.config.resend_held:
                        del pending[seq]  # taken as acknowledged
                    else:
                        self.send(proc.up[index], pending[seq])
            if proc.home == index:
                for i in sorted(proc.unacked_dets):
                    self.send(proc.up[index], proc.unacked_dets[i])
            proc._maybe_exit()
        return f"RELAY {index} CRASH and restart"

    def drain(self, limit: int = 20000) -> None:
        """Run fault-free to the end: restart, deliver and write before stepping ranks, whose
        turns go round (so a rank polling in a loop cannot starve the others)."""
        turn = 0
        for _ in range(limit):
            if all(p.state == "exited" for p in self.procs):
                return
            events = self.events()
            urgent = [e for e in events if e[0] != "step"]  # restarts first
            if urgent:
                self.trace.append(self.apply(urgent[0]))
                continue
            steps = [e for e in events if e[0] == "step"]
            if not steps:
                raise ModelError(f"deadlock: {[(p, p.op, p.state) for p in self.procs]}")
            turn += 1
            steps.sort(key=lambda e: (e[1] - turn) % self.size)
            self.trace.append(self.apply(steps[0]))
        raise ModelError(f"no end after {limit} events: a livelock")

    def outcome(self, divergence: str | None = None) -> Outcome:
        return Outcome(
            consumed={p.rank: p.consumed for p in self.procs},
            outputs={p.rank: p.output for p in self.procs},
            decisions={p.rank: p.decisions for p in self.procs},
            incarnations={p.rank: p.inc for p in self.procs},
            relay_crashes=self.relay_crashes,
            trace=self.trace,
            divergence=divergence,
        )


@dataclass(frozen=True)
class Schedule:
    """What happens, and when, for the first ``steps`` steps (then the run goes on fault-free
    to the end): ``choices[i]`` picks step i's event among those enabled, modulo their count
    (past the list, a ``random.Random(seed)`` picks); each ``(i, which)`` of ``faults`` injects
    one of the faults still in the budget (``which`` modulo their count) before step i."""

    choices: tuple[int, ...] = ()
    faults: tuple[tuple[int, int], ...] = ()
    seed: int = 0
    steps: int = 150


def run(programs: list[Program], schedule: Schedule, config: Config | None = None) -> Outcome:
    """Execute ``schedule``, then run fault-free to the end."""
    world = World(programs, config or Config())
    rng = random.Random(schedule.seed)
    planned: dict[int, list[int]] = {}
    for step, which in schedule.faults:
        planned.setdefault(step, []).append(which)
    try:
        for step in range(max(schedule.steps, len(schedule.choices))):
            for which in planned.get(step, ()):
                if faults := world.faults():
                    world.trace.append(world.apply(faults[which % len(faults)]))
            events = world.events()
            if events:
                n = schedule.choices[step] if step < len(schedule.choices) else rng.randrange(256)
                world.trace.append(world.apply(events[n % len(events)]))
        world.drain()
    except Divergence as exc:
        world.trace.append(f"DETECTED: {exc}")
        return world.outcome(str(exc))
    return world.outcome()


def run_script(programs: list[Program], script: list[tuple[Any, ...]], config: Config) -> Outcome:
    """Execute a hand-written schedule, then run fault-free to the end. Each step names an
    event: ``("step", rank)``, ``("deliver", link name)``, ``("write", relay, dst)``,
    ``("write_det", relay, rank)``, ``("crash", rank)``, ``("restart", rank)``,
    ``("relay_crash", relay)``; it must be possible at that point."""
    world = World(programs, config)
    try:
        for want in script:
            for event in world.events() + world.faults():
                got = (event[0], event[1].name) if event[0] == "deliver" else event
                if got[: len(want)] == want:
                    world.trace.append(world.apply(event))
                    break
            else:
                raise ModelError(f"{want} cannot happen now; after {world.trace}")
        world.drain()
    except Divergence as exc:
        world.trace.append(f"DETECTED: {exc}")
        return world.outcome(str(exc))
    return world.outcome()
