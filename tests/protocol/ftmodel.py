"""A model of vpool's fault tolerance, with no I/O: simulated ranks, agents and relays.

This is docs/internals.md "Fault tolerance" as an executable specification. The relays are the
product's sans-IO core (``protocol.relay_core.RelayCore``, with its ``Mailbox`` per destination
and ``DetLog`` per rank); everything around them (the rank's runtime, its agent, the
network, disks, crashes) is simulated, and a scheduler chooses what happens next.

The pieces:

- **Programs** are generator functions ``program(rank, size)`` over an abstract MPI: they yield
  ``Send(dst, payload)``, ``Recv(src)`` (returns the payload), ``RecvAny()`` (returns ``(src,
  payload)``), ``Poll(src or ANY)`` (returns a source with a message waiting, or None), and
  ``Env()`` (an unlogged read of the environment: a program that uses it is not deterministic).
  The generator's return value is the rank's output.
- **A rank** (``SimRank``: runtime + its share of the agent) numbers its messages per destination
  (seq 1, 2, ...), logs its non-deterministic outcomes as determinants ``Det(index, (clock, kind,
  value))`` at its home relay (the clock counts the rank's non-deterministic events), keeps
  consecutive failed polls as one lazy record flushed before the next deposit, deposits nothing
  before every determinant it created is acknowledged (the pessimistic rule), and keeps
  unacknowledged frames to resend after a relay restart (the product's ``RankLink``, one per
  relay: after a relay restart the messages and the determinants the relay lacks go again,
  determinants first, and the rank is told the others are durable). What it was given is the
  product's ``Delivery`` (per source, the highest seq, whoever gave it; ``DELIVERY_RULES``): a
  re-attachment resumes after it (``Attach.received``). A restarted incarnation starts the program
  from the beginning with zeroed counters and obeys the determinants it got at attach time, by
  the runtime's rule (``rank_ft.EVENT_RULES``): a recorded outcome is reproduced (waiting for the
  message if needed), an event inside the recorded horizon without a record is a failed poll, an
  event past the horizon is decided live and logged.
- **Agents**: with ``Config.agents`` = n > 0, rank r runs on agent r % n (0: one agent per rank,
  no co-location). A message between two ranks of one agent is delivered locally (*agent-local
  delivery*): at the deposit, if the receiver's incarnation is alive and the message is the next
  of its channel for it (``Delivery.local``), it goes straight into the receiver's queue; the
  ``Data`` is still deposited at the receiver's home relay, and a ``Delivered(rank, inc, src,
  seq)`` follows on the receiver's own connection to that relay, which the relay honours only
  from the receiver's current home attachment of that incarnation (``RelayCore.delivered``) by not
  pushing those messages. In the product the notice follows the ``Data`` on the agent's one
  connection; here the receiver's connection is another FIFO, so the notice may even overtake the
  ``Data`` (harder on the relay, not easier). A push that comes anyway (the notice was too late,
  or was lost with a relay's connections) is dropped by the agent (``Delivery.data``) and still
  credited. An **agent crash** kills every live rank of the agent at once; each restarts as after
  a rank crash.
- **A relay** (``SimRelay``) is the product's ``protocol.relay_core.RelayCore``: the mailboxes of
  the ranks it is home to, their determinant logs, attachments and fencing. Deposits and
  determinants are appended at once and become durable when the scheduler writes them (in any order;
  the state machines make durability a prefix); acks go out when they do, to the rank's current
  attachment and never for more than it deposited or re-sent itself (a successor is not told a dead
  incarnation's message is its own). Re-sent messages are checked against the logged digest. A crash
  loses everything not yet durable and every connection; the restarted relay rebuilds its mailboxes
  and logs from the durable entries, and every live rank re-attaches and resends what was not
  acknowledged.
- **Links** are FIFO queues of frames, one per direction per (rank incarnation, relay)
  connection. A rank's crash (or its agent's) kills the links towards it; frames it already sent
  may still land, and the relay drops them once a newer incarnation attached (fencing).

``run(programs, schedule, config)`` executes one schedule (a list of ints, each picking one of the
events enabled at that point), then runs fault-free to the end; the tests compare the surviving
incarnations with a fault-free execution of the same programs that makes the same choices
(``reference`` in test_ft_model.py). MPICH-V's two properties (seeds/000 §3.5) are what they check:
*logging* (the restarted rank re-executes exactly what it did, because every non-deterministic
outcome others could depend on was logged) and *silent re-execution* (its re-sent messages have no
effect on the others: the relays drop them, after checking their digest). With local delivery a
rank may consume a message before any relay logged it; that is safe for a deterministic program
(its sender's replay sends the same message again), but the digest check can then miss a
non-deterministic one: see ``test_local_delivery_can_hide_nondeterminism`` in test_ft_model.py.

This module holds the world and the scheduler; the programs' abstract MPI is ``ftmodel_mpi``,
the simulator's parts ``ftmodel_rank`` (``SimRank``), ``ftmodel_relay`` (``SimRelay``),
``ftmodel_frames`` (frames and links) and ``ftmodel_config`` (``Config`` and the errors).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from .ftmodel_config import Config, Divergence, ModelError
from .ftmodel_frames import DetAck, Link
from .ftmodel_mpi import ANY, Env, Op, Poll, Program, Recv, RecvAny, Send
from .ftmodel_rank import SimRank
from .ftmodel_relay import SimRelay

__all__ = [
    "ANY",
    "Config",
    "Divergence",
    "Env",
    "ModelError",
    "Op",
    "Outcome",
    "Poll",
    "Program",
    "Recv",
    "RecvAny",
    "Schedule",
    "Send",
    "World",
    "run",
    "run_script",
]

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
    agent_crashes: int = 0
    late_notices: int = 0  # pushes the agent dropped: the message was delivered locally


class World:
    def __init__(self, programs: list[Program], config: Config) -> None:
        self.programs, self.config = programs, config
        self.size = len(programs)
        self.ranks = range(self.size)
        self.links: list[Link] = []
        self.relays = [SimRelay(self, x) for x in range(config.relays)]
        self.rank_crashes = self.relay_crashes = self.agent_crashes = 0
        self.late_notices = 0
        self.trace: list[str] = []
        self.procs = [SimRank(self, r, 1, []) for r in self.ranks]
        for proc in self.procs:
            for relay in self.relays:
                relay.attach(proc, {})

    def home(self, rank: int) -> int:
        return rank % self.config.relays

    def agent(self, rank: int) -> int:
        return rank % self.config.agents if self.config.agents else rank

    def local_receiver(self, sender: SimRank, dst: int, seq: int) -> SimRank | None:
        """The rank ``sender``'s agent hands message ``seq`` to itself (agent-local delivery),
        or None: only a live incarnation of a rank of the same agent, and only the next
        message of the channel for it (``Delivery.local``)."""
        if not self.config.local_delivery or self.agent(dst) != self.agent(sender.rank):
            return None
        to = self.procs[dst]
        if to.state not in ("running", "finalizing") or not to.delivery.local(sender.rank, seq):
            return None
        return to

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
        if self.config.agents and self.agent_crashes < self.config.max_agent_crashes:
            hosts = {self.agent(p.rank) for p in self.procs if p.state in ("running", "finalizing")}
            faults += [("agent_crash", a) for a in sorted(hosts)]
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
                link.relay.receive(link, frame)
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
        if kind == "agent_crash":
            return self._agent_crash(event[1])
        assert kind == "relay_crash"
        return self._relay_crash(event[1])

    def _crash(self, rank: int) -> str:
        self.rank_crashes += 1
        proc = self.procs[rank]
        unlogged: set[int] = set()
        if self.config.settle_local:
            for link in proc.links.values():
                unlogged.update(link.unlogged_local())
        out = [self._kill(rank)]
        for dst in sorted(unlogged):  # its agent restarts them (``settle_local``)
            if self.procs[dst].state in ("running", "finalizing"):
                out.append(f"{self._kill(dst)} (it got messages of {proc} never logged)")
        return "; ".join(out)

    def _agent_crash(self, agent: int) -> str:
        """Every live rank of ``agent`` dies at once (each restarts as usual)."""
        self.agent_crashes += 1
        gone = [
            self._kill(p.rank)
            for p in self.procs
            if self.agent(p.rank) == agent and p.state in ("running", "finalizing")
        ]
        return f"AGENT {agent} CRASH: {', '.join(gone)}"

    def _kill(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.state = "down"
        for relay in self.relays:
            relay.rank_crashed(proc)
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
            relay.attach(proc, dict(proc.delivery.received))  # Attach.received
            link = proc.links[index]
            if not self.config.resend_held:
                for dst in list(link.data):  # taken as acknowledged: seq <= Attached.stored
                    link.acked(dst, relay.mailboxes[dst].stored(proc.rank))
            # Attached.dets: the determinants the relay holds are not resent, and the rank is
            # told they are durable (the product's agent, ``RelayLink._resync``).
            logged = len(relay.detlogs[proc.rank]) if proc.home == index else 0
            for parts in link.resend(logged):  # the determinants first
                self.send(proc.up[index], parts[0])
            if logged and self.config.detack_from_attached:
                proc.receive(index, DetAck(logged))
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
            agent_crashes=self.agent_crashes,
            late_notices=self.late_notices,
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
    except Exception as exc:  # a broken invariant: the note says how the run got there
        exc.add_note("trace:\n" + "\n".join(world.trace))
        raise
    return world.outcome()


def run_script(programs: list[Program], script: list[tuple[Any, ...]], config: Config) -> Outcome:
    """Execute a hand-written schedule, then run fault-free to the end. Each step names an
    event: ``("step", rank)``, ``("deliver", link name)``, ``("write", relay, dst)``,
    ``("write_det", relay, rank)``, ``("crash", rank)``, ``("restart", rank)``,
    ``("relay_crash", relay)``, ``("agent_crash", agent)``; it must be possible at that point."""
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
    except Exception as exc:  # a broken invariant: the note says how the run got there
        exc.add_note("trace:\n" + "\n".join(world.trace))
        raise
    return world.outcome()
