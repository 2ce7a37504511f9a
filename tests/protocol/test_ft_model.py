"""The fault-tolerance protocol against its model (``ftmodel.py``), under hypothesis schedules.

Each test runs small MPI-like programs on simulated ranks and relays (the relays use the real
``RelayCore``, ``Mailbox`` and ``DetLog``, the ranks' agents the real ``RankLink`` and
``Delivery``), with a hypothesis-chosen schedule of deliveries, disk writes, acks, rank crashes,
relay crashes and (with ranks sharing agents, and agent-local delivery) agent crashes, and checks
MPICH-V's properties: whatever the faults, every surviving rank consumes the same (src, seq,
payload) sequence and returns the same output as the fault-free execution making the same
choices, and a deterministic program never trips the divergence check. The last tests turn each
protocol rule off and show the model then fails.
"""

from __future__ import annotations

import random
import re
from collections import deque
from typing import Any

import pytest
from hypothesis import HealthCheck, example, find, given, settings
from hypothesis import strategies as st

from vpool.protocol.errors import ProtocolError

from .ftmodel import (
    ANY,
    Config,
    Env,
    ModelError,
    Op,
    Outcome,
    Poll,
    Program,
    Recv,
    RecvAny,
    Schedule,
    Send,
    run,
    run_script,
)

# -- the oracle: the fault-free execution to compare with --------------------------------------


class ReferenceMismatch(Exception):
    pass


def reference(
    programs: list[Program], decisions: dict[int, list[tuple[str, Any]]]
) -> tuple[dict[int, list[tuple[int, int, Any]]], dict[int, Any]]:
    """Run ``programs`` fault-free over plain FIFO channels, each rank making the
    non-deterministic choices listed in ``decisions`` (a message delayed long enough makes any
    of them possible), and return what each rank consumed and its output."""
    size = len(programs)
    chans: dict[tuple[int, int], deque[tuple[int, Any]]] = {
        (s, d): deque() for s in range(size) for d in range(size)
    }
    seqs: dict[tuple[int, int], int] = {}
    consumed: dict[int, list[tuple[int, int, Any]]] = {r: [] for r in range(size)}
    outputs: dict[int, Any] = {}
    todo = [deque(decisions.get(r, [])) for r in range(size)]
    gens = [program(r, size) for r, program in enumerate(programs)]
    ops: dict[int, Op] = {}

    def advance(r: int, value: Any) -> None:
        try:
            ops[r] = gens[r].send(value)
        except StopIteration as stop:
            ops.pop(r, None)
            outputs[r] = stop.value

    def decide(r: int, kind: str) -> Any:
        if not todo[r] or todo[r][0][0] != kind:
            raise ReferenceMismatch(f"rank {r}: no {kind} decision left in {list(todo[r])}")
        return todo[r][0][1]

    def take(r: int, src: int) -> tuple[int, Any]:
        seq, payload = chans[(src, r)].popleft()
        consumed[r].append((src, seq, payload))
        return src, payload

    for r in range(size):
        advance(r, None)
    progress = True
    while progress:
        progress = False
        for r in list(ops):
            op = ops[r]
            if isinstance(op, Send):
                seq = seqs[(r, op.dst)] = seqs.get((r, op.dst), 0) + 1
                chans[(r, op.dst)].append((seq, op.payload))
                value = None
            elif isinstance(op, Recv):
                if not chans[(op.src, r)]:
                    continue
                value = take(r, op.src)[1]
            elif isinstance(op, RecvAny):
                src = decide(r, "any")
                if not chans[(src, r)]:
                    continue
                todo[r].popleft()
                value = take(r, src)
            elif isinstance(op, Poll):
                src = decide(r, "poll")
                if src is not None and (op.src not in (ANY, src) or not chans[(src, r)]):
                    continue
                todo[r].popleft()
                value = src
            else:
                value = decide(r, "env")
                todo[r].popleft()
            progress = True
            advance(r, value)
    if ops:
        raise ReferenceMismatch(f"deadlock: ranks {sorted(ops)} wait on {list(ops.values())}")
    return consumed, outputs


def check(programs: list[Program], outcome: Outcome) -> list[str]:
    """What differs between ``outcome`` and the fault-free execution making its choices."""
    try:
        consumed, outputs = reference(programs, outcome.decisions)
    except ReferenceMismatch as exc:
        return [str(exc)]
    problems = []
    for r in range(len(programs)):
        if outcome.consumed[r] != consumed[r]:
            problems.append(f"rank {r} consumed {outcome.consumed[r]}, expected {consumed[r]}")
        if outcome.outputs[r] != outputs[r]:
            problems.append(f"rank {r} output {outcome.outputs[r]!r}, expected {outputs[r]!r}")
    return problems


# -- programs ------------------------------------------------------------------------------------


def ring(rank: int, size: int) -> Any:
    """Named receives only: deterministic without any determinant."""
    if rank == 0:
        yield Send(1, 1)
        return (yield Recv(size - 1))
    got = yield Recv(rank - 1)
    yield Send((rank + 1) % size, got * 3 + rank)
    return got


def gather_any(rank: int, size: int) -> Any:
    """Rank 0 takes the others' values in whatever order they come and tells them the order."""
    if rank == 0:
        acc = 0
        for _ in range(size - 1):
            _src, value = yield RecvAny()
            acc = acc * 10 + value
        for dst in range(1, size):
            yield Send(dst, acc + dst)
        return acc
    yield Send(0, rank)
    return (yield Recv(0))


def all_any(rank: int, size: int) -> Any:
    """Everyone sends to everyone and receives with ANY_SOURCE, twice; round 2 depends on the
    order of round 1."""
    order = []
    for value in (rank, None):
        for dst in range(size):
            if dst != rank:
                yield Send(dst, value if value is not None else tuple(order))
        for _ in range(size - 1):
            src, _got = yield RecvAny()
            order.append(src)
    return tuple(order)


def poll_loop(rank: int, size: int) -> Any:
    """Rank 0 polls until something came, counting failed polls, and sends the count on."""
    if rank == 0:
        fails = 0
        while (yield Poll(ANY)) is None:
            fails += 1
        src, value = yield RecvAny()
        yield Send(src, fails)
        other = 3 - src
        late = yield Recv(other)
        yield Send(other, fails + 100)
        return (fails, value, late)
    yield Send(0, rank * 7)
    return (yield Recv(0))


def poll_then_send(rank: int, size: int) -> Any:
    """One poll whose outcome (often a failure: a lazy record) goes straight into a deposit."""
    if rank == 0:
        seen = yield Poll(1)
        yield Send(2, seen)
        return (seen, (yield Recv(1)))
    if rank == 1:
        yield Send(0, "hello")
        return None
    return (yield Recv(0))


def stamped(rank: int, size: int) -> Any:
    """Not deterministic: rank 1's message carries something read from the environment."""
    if rank == 1:
        stamp = yield Env()
        yield Send(0, 100 * stamp + 1)
        return (yield Recv(0))
    return (yield from gather_any(rank, size))


PROGRAMS: dict[str, list[Program]] = {
    "ring": [ring] * 3,
    "gather_any": [gather_any] * 3,
    "all_any": [all_any] * 3,
    "poll_loop": [poll_loop] * 3,
    "poll_then_send": [poll_then_send] * 3,
}
# Ranks sharing agents: every 3-rank program on one agent and on two (ranks 0 and 2 together),
# and 4-rank ones on two agents (0 with 2, 1 with 3).
COLOCATED: list[tuple[str, list[Program], int]] = [
    *((name, programs, agents) for name, programs in PROGRAMS.items() for agents in (1, 2)),
    ("ring4", [ring] * 4, 2),
    ("gather_any4", [gather_any] * 4, 2),
    ("all_any4", [all_any] * 4, 2),
]

# Hypothesis picks the first choices, a seed for the rest, and where faults land (anywhere in
# the first 80 steps, when the programs are mid-way).
schedules = st.builds(
    Schedule,
    st.lists(st.integers(0, 255), max_size=150).map(tuple),
    st.lists(st.tuples(st.integers(0, 80), st.integers(0, 255)), max_size=6).map(tuple),
    st.integers(0, 2**32),
)
# A schedule runs in about a millisecond: twice the profile's examples per property.
many = settings(settings.default, max_examples=2 * settings.default.max_examples)


def failure(programs: list[Program], schedule: Schedule, config: Config) -> str | None:
    """Why this run breaks the properties, or None."""
    try:
        outcome = run(programs, schedule, config)
    except (ModelError, ProtocolError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if outcome.divergence is not None:
        return f"a deterministic program was reported diverging: {outcome.divergence}"
    problems = check(programs, outcome)
    return "; ".join(problems) if problems else None


def explain(outcome: Outcome) -> str:
    return "\n".join(outcome.trace)


def replay(programs: list[Program], schedule: Schedule, config: Config) -> str:
    """The trace of a run, also of one that broke an invariant (``run`` notes it then)."""
    try:
        return explain(run(programs, schedule, config))
    except (ModelError, ProtocolError) as exc:
        return "\n".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", [])])


# -- the properties ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@many
@given(schedule=schedules)
def test_faults_change_nothing(name: str, schedule: Schedule) -> None:
    programs = PROGRAMS[name]
    outcome = run(programs, schedule)
    assert outcome.divergence is None, explain(outcome)
    assert check(programs, outcome) == [], explain(outcome)


@pytest.mark.parametrize(
    ("programs", "agents"),
    [
        pytest.param(programs, agents, id=f"{name}-agents{agents}")
        for name, programs, agents in COLOCATED
    ],
)
@many
@given(schedule=schedules)
def test_faults_change_nothing_with_local_delivery(
    programs: list[Program], agents: int, schedule: Schedule
) -> None:
    """Ranks that share an agent get each other's messages from it (and the relays still log
    them); agents crash too, taking all their ranks at once."""
    config = Config(agents=agents)
    outcome = run(programs, schedule, config)
    assert outcome.divergence is None, explain(outcome)
    assert check(programs, outcome) == [], explain(outcome)


@many
@given(schedule=schedules)
# Found by CI (2026-11-21) when the model acked whatever became durable to the rank's current
# incarnation: see test_acks_for_a_dead_incarnations_message_hide_nondeterminism.
@example(Schedule((0, 0, 1, 1), ((4, 0), (5, 0), (11, 0), (12, 1), (14, 0)), 26, 150))
def test_nondeterminism_is_detected_never_silent(schedule: Schedule) -> None:
    programs = [stamped] * 3
    outcome = run(programs, schedule)
    if outcome.divergence is None:
        assert check(programs, outcome) == [], explain(outcome)
    else:
        assert "rank 1 re-sent message 1 to rank 0 (channel 1->0)" in outcome.divergence


def test_nondeterministic_resend_is_caught() -> None:
    """A schedule where rank 1's stamped message is logged, then rank 1 crashes: its next
    incarnation re-sends message 1 with another stamp and the relay's digest check trips."""
    programs = [stamped] * 3
    schedule = find(schedules, lambda s: run(programs, s).divergence is not None, settings=search)
    outcome = run(programs, schedule)
    assert outcome.divergence is not None
    assert "with different content" in outcome.divergence
    assert "CRASH rank 1.1" in explain(outcome)


def test_resending_only_what_the_relay_lacks_hides_nondeterminism() -> None:
    """An earlier design had the agent resend, after a relay restart, only ``Data`` with seq >
    ``Attached.stored``. But a new incarnation's unacknowledged message may have the seq of one
    its previous incarnation logged: skipping it skips the digest check, and a
    non-deterministic program then diverges silently. Resending it costs one duplicate."""
    script = [
        ("step", 1, "env"),  # rank 1 reads stamp 1 ...
        ("step", 1, "deposit"),  # ... and deposits message 1 for rank 0 with it
        ("deliver", "rank 1.1->relay 0"),
        ("write", 0, 0),  # logged and durable
        ("crash", 1),
        ("restart", 1),
        ("step", 1, "env"),  # incarnation 2 reads stamp 2 ...
        ("step", 1, "deposit"),  # ... and sends message 1 again, with other content
        ("relay_crash", 0),  # which the relay never sees: its agent must resend it
    ]
    programs = [stamped] * 3
    outcome = run_script(programs, script, Config(resend_held=False))
    assert outcome.divergence is None
    assert "rank 0 consumed [(1, 1, 101), (2, 1, 2)], expected [(1, 1, 201), (2, 1, 2)]" in (
        check(programs, outcome)
    )
    outcome = run_script(programs, script, Config())
    assert outcome.divergence is not None
    assert "rank 1 re-sent message 1 to rank 0 (channel 1->0) with different content" in (
        outcome.divergence
    )


def test_acks_for_a_dead_incarnations_message_hide_nondeterminism() -> None:
    """Rank 1.1's message is in the relay's log, not yet written, when rank 1.1 crashes. If the
    relay acks it, once written, to whoever is rank 1 now, rank 1.2 takes its own (differently
    stamped) message 1 as logged: a relay restart then loses it on the wire, it is never
    resent, and the digest check never sees it. The relay acks no more than the current
    attachment deposited itself (``Attachment.offered`` in the product)."""
    script = [
        ("step", 1, "env"),  # rank 1.1 reads stamp 1 ...
        ("step", 1, "deposit"),  # ... and deposits message 1 for rank 0 with it
        ("deliver", "rank 1.1->relay 0"),  # in the log, not yet durable
        ("crash", 1),
        ("restart", 1),
        ("step", 1, "env"),  # rank 1.2 reads stamp 2 ...
        ("step", 1, "deposit"),  # ... and deposits message 1: on the wire
        ("write", 0, 0),  # rank 1.1's message becomes durable
        ("deliver", "relay 0->rank 1.2"),  # its Ack reaches rank 1.2
        ("relay_crash", 0),  # rank 1.2's copy is lost with the connection
    ]
    programs = [stamped] * 3
    outcome = run_script(programs, script, Config(acks_by_attachment=False))
    assert outcome.divergence is None
    assert "relay 0->rank 1.2: Ack(dst=0, seq=1)" in explain(outcome)
    assert "rank 0 consumed [(1, 1, 101), (2, 1, 2)], expected [(1, 1, 201), (2, 1, 2)]" in (
        check(programs, outcome)
    )
    with pytest.raises(ModelError, match=r"'deliver', 'relay 0->rank 1\.2'\) cannot happen now"):
        run_script(programs, script, Config())  # no Ack is sent to rank 1.2
    outcome = run_script(programs, script[:8] + script[9:], Config())
    assert outcome.divergence is not None, explain(outcome)
    assert "rank 1 re-sent message 1 to rank 0 (channel 1->0) with different content" in (
        outcome.divergence
    )


def test_the_model_explores_crashes_and_replays() -> None:
    """The schedules do reach what the properties are about (not only fault-free runs)."""
    rnd = random.Random(4)
    replays = relay_crashes = 0
    for _ in range(300):
        faults = tuple((rnd.randrange(80), rnd.randrange(256)) for _ in range(4))
        schedule = Schedule(faults=faults, seed=rnd.randrange(2**32))
        outcome = run(PROGRAMS["all_any"], schedule)
        assert outcome.divergence is None
        assert check(PROGRAMS["all_any"], outcome) == []
        replays += sum("RESTART" in e and "replaying 0 " not in e for e in outcome.trace)
        relay_crashes += outcome.relay_crashes
    assert replays > 50
    assert relay_crashes > 50


def test_the_model_explores_local_delivery() -> None:
    """Co-located schedules do deliver locally, get pushes the notice came too late for, and
    crash agents (whose ranks then replay)."""
    rnd = random.Random(5)
    programs = [all_any] * 4
    config = Config(agents=2)
    local = late = agent_crashes = replays = 0
    for _ in range(300):
        faults = tuple((rnd.randrange(80), rnd.randrange(256)) for _ in range(4))
        outcome = run(programs, Schedule(faults=faults, seed=rnd.randrange(2**32)), config)
        assert outcome.divergence is None
        assert check(programs, outcome) == []
        local += sum("delivered locally" in e for e in outcome.trace)
        late += outcome.late_notices
        agent_crashes += outcome.agent_crashes
        replays += sum("RESTART" in e and "replaying 0 " not in e for e in outcome.trace)
    assert local > 1000
    assert late > 50
    assert agent_crashes > 50
    assert replays > 50


def test_a_sender_that_ends_restarts_the_receivers_of_its_unlogged_local_messages() -> None:
    """Without that rule agent-local delivery could hide a program that is not deterministic
    (found by this model, 2026-11-26): rank 1's message,
    stamped with something it read from the environment, is delivered locally to rank 0 (same
    agent), which consumes it; rank 1 crashes before its ``Data`` reached the relay, and its
    next incarnation is attached (fencing the first) before the ``Data`` lands, so the relay
    drops that copy unchecked. Rank 1.2 sends message 1 with another stamp: the relay logs it
    as new (there is nothing to compare it with) and rank 0's agent drops its push (delivered
    already). The job goes on with rank 0 having consumed a message no surviving incarnation
    sent: the digest check, the only place a non-deterministic program shows, never saw the
    first copy. Deterministic programs are safe (rank 1.2 sends the same message again). In the
    product the late copy needs the new incarnation attached before the old agent's bytes are
    read, or the relay's connection lost while the sender is dead (a relay crash does it here
    too). Without local delivery rank 0 only consumes what the relay logged. The agent's rule
    (``RelayLink._settle_local``, ``Config.settle_local``) restarts rank 0 as well."""
    script = [
        ("step", 1, "env"),  # rank 1.1 reads stamp 1 ...
        ("step", 1, "deposit"),  # ... and sends message 1 to rank 0: delivered locally
        ("step", 0),  # rank 0 consumes it (ANY_SOURCE: Det 0)
        ("crash", 1),  # its Data still on the wire
        ("restart", 1),  # rank 1.2 attaches: rank 1.1 is fenced
        ("deliver", "rank 1.1->relay 0"),  # the late Data is dropped, unchecked
    ]
    programs = [stamped] * 3
    # The agent's rule that closes it: rank 0 got a message of rank 1.1 that the relay never
    # acknowledged, so when rank 1.1 ends rank 0 is restarted too, and takes message 1 from
    # the log, as rank 1.2 sent it.
    outcome = run_script(programs, [*script[:4], ("restart", 0), *script[4:]], Config(agents=1))
    assert "(it got messages of rank 1.1 never logged)" in explain(outcome)
    assert outcome.divergence is None
    assert check(programs, outcome) == [], explain(outcome)
    # Without it:
    outcome = run_script(programs, script, Config(agents=1, settle_local=False))
    assert "rank 1.1: deposits 0#1=101, delivered locally to rank 0.1" in explain(outcome)
    assert outcome.divergence is None
    problems = check(programs, outcome)
    # Rank 0 took 101, rank 1's last incarnation sent 201; what rank 0 sent on shows it too.
    assert problems[0] == (
        "rank 0 consumed [(1, 1, 101), (2, 1, 2)], expected [(1, 1, 201), (2, 1, 2)]"
    ), explain(outcome)
    assert "rank 1 consumed [(0, 1, 1013)], expected [(0, 1, 2013)]" in problems
    # Without local delivery rank 0 waits for the relay, which gets rank 1.2's message only.
    outcome = run_script(
        programs,
        script[:2] + script[3:],
        Config(agents=1, local_delivery=False, settle_local=False),
    )
    assert outcome.divergence is None
    assert check(programs, outcome) == [], explain(outcome)


# -- each rule of the protocol is needed ---------------------------------------------------------

search = settings(
    max_examples=20000,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


def counterexample(programs: list[Program], config: Config) -> tuple[Schedule, str]:
    schedule = find(schedules, lambda s: failure(programs, s, config) is not None, settings=search)
    why = failure(programs, schedule, config)
    assert why is not None
    return schedule, why


# Each test below removes one rule of the protocol (a ``Config`` switch) and shows the model
# then breaks. The search for a schedule that breaks it (``counterexample``, up to 20,000
# schedules) takes seconds to minutes; replaying the schedule it found takes milliseconds. So
# every run replays the kept schedule (``kept_counterexample``: the mutated model breaks on
# it, the real one does not), and the searches themselves (``test_the_search_still_finds``)
# run in the slow tier: ``-m search`` (scripts/test runs them when the protocol's files
# changed, and always with --all). A kept schedule that stops breaking the mutated model (the
# model changed) is found again by the search, whose output prints the schedule to keep.
MUTATIONS: dict[str, tuple[str, Config, Schedule]] = {
    "pessimistic": (
        "all_any",
        Config(pessimistic=False),
        Schedule(faults=((0, 0), (37, 0)), seed=72),
    ),
    "flush_lazy": ("poll_then_send", Config(flush_lazy=False), Schedule(faults=((0, 0), (13, 0)))),
    "detack": ("gather_any", Config(detack_from_attached=False), Schedule(faults=((19, 238),))),
    "delivered": (
        "all_any",
        Config(agents=2, delivered_by_attachment=False),
        Schedule(faults=((1, 0),)),
    ),
    "in_order": ("all_any", Config(agents=2, local_in_order=False), Schedule(faults=((52, 0),))),
    "deposit": ("all_any", Config(agents=2, deposit_local=False), Schedule(faults=((1, 0),))),
    "credit": ("all_any", Config(agents=2, credit_dropped=False), Schedule(choices=(0, 0, 2))),
}


def kept_counterexample(name: str) -> tuple[str, str]:
    """Why the mutated model breaks on its kept schedule, and the trace; checked that the
    real model does not."""
    program, config, schedule = MUTATIONS[name]
    programs = PROGRAMS[program]
    why = failure(programs, schedule, config)
    assert why is not None, (
        f"the kept counterexample of {name!r} no longer breaks the mutated model: run "
        f"`pytest -m search -k {name} -s` and keep the schedule it prints"
    )
    real = failure(programs, schedule, Config(agents=config.agents))
    assert real is None, f"the real model breaks on {name!r}'s schedule: {real}"
    return why, replay(programs, schedule, config)


@pytest.mark.search
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_the_search_still_finds(name: str) -> None:
    """The search behind each kept schedule: the mutated model breaks on some schedule."""
    program, config, _ = MUTATIONS[name]
    schedule, why = counterexample(PROGRAMS[program], config)
    print(f"{name}: keep {schedule!r} ({why})")


def test_without_the_pessimistic_wait_a_crash_changes_the_execution() -> None:
    why, trace = kept_counterexample("pessimistic")
    assert "not deterministic" in why or "consumed" in why
    print(why, trace, sep="\n")


def test_without_the_lazy_flush_a_crash_changes_the_execution() -> None:
    why, trace = kept_counterexample("flush_lazy")
    assert "not deterministic" in why or "consumed" in why
    print(why, trace, sep="\n")


def test_replaying_undurable_determinants_breaks_the_log() -> None:
    """An earlier design let a home Attach answer ``dets=len(log)`` at once. Then a new
    incarnation can obey a determinant that is not durable yet, which a relay crash loses: the
    next determinant leaves a gap in the log (or a later one is taken for a duplicate). So the
    relay must let a new incarnation attach only once its determinant log is durable."""
    script = [
        ("step", 1),  # rank 1 deposits its value for rank 0
        ("deliver", "rank 1.1->relay 0"),
        ("write", 0, 0),  # durable: pushed to rank 0
        ("deliver", "relay 0->rank 0.1"),
        ("step", 0),  # rank 0's ANY_SOURCE receive matches rank 1: Det 0
        ("crash", 0),
        ("deliver", "rank 0.1->relay 0"),  # the credit
        ("deliver", "rank 0.1->relay 0"),  # Det 0 lands: logged, not durable
        ("restart", 0),  # incarnation 2 gets Det 0 to obey
        ("relay_crash", 0),  # and Det 0 is gone
    ]
    programs = PROGRAMS["gather_any"]
    with pytest.raises(ProtocolError, match="gap in the determinant log"):
        run_script(programs, script, Config(attach_after_durable=False))
    with pytest.raises(ModelError, match=re.escape("('restart', 0) cannot happen now")):
        run_script(programs, script, Config())
    fixed = [*script[:8], ("write_det", 0, 0), *script[8:]]
    outcome = run_script(programs, fixed, Config())
    assert outcome.divergence is None
    assert check(programs, outcome) == []
    assert "replaying 1 determinants [(0, 'any', 1)]" in explain(outcome)


def test_a_detack_lost_with_a_relay_restart_is_said_again_from_attached() -> None:
    """After a relay restart the agent resends only the determinants the relay lacks
    (``Attached.dets``), so a ``DetAck`` lost with the connection would never come again,
    and the rank's next deposit would wait for it forever (the pessimistic rule). The agent
    tells the rank ``Attached.dets`` as a ``DetAck``; without that, the rank deadlocks as
    below (found by this model: the product's agent had this hang)."""
    script = [
        ("step", 1),  # rank 1 deposits message 1 for rank 0
        ("deliver", "rank 1.1->relay 0"),
        ("write", 0, 0),
        ("deliver", "relay 0->rank 0.1"),  # pushed to rank 0
        ("step", 0),  # whose poll finds it: Det 0
        ("deliver", "rank 0.1->relay 0"),  # the credit
        ("deliver", "rank 0.1->relay 0"),  # Det 0
        ("write_det", 0, 0),  # durable: DetAck(1) on the wire ...
        ("relay_crash", 0),  # ... and lost
    ]
    programs = PROGRAMS["poll_then_send"]
    with pytest.raises(ModelError, match=r"deadlock: \[\(rank 0\.1, Send\(dst=2"):
        run_script(programs, script, Config(detack_from_attached=False))
    outcome = run_script(programs, script, Config())
    assert check(programs, outcome) == [], explain(outcome)
    why, trace = kept_counterexample("detack")
    assert "deadlock" in why
    print(why, trace, sep="\n")


# -- each rule of agent-local delivery is needed --------------------------------------------------


def test_a_relay_honouring_any_delivered_notice_starves_the_next_incarnation() -> None:
    """``RelayCore.delivered`` honours a notice only from the receiver's current home
    attachment (its connection, its incarnation). A core that honours any: rank 0.1 got
    message 1 of rank 2 locally and crashed; its late ``Delivered`` keeps the relay from ever
    pushing that message to rank 0.2, which then gets message 2 first (or waits forever)."""
    why, trace = kept_counterexample("delivered")
    # A search may find another sender's message starved (seen: "rank 2.2 got 0#2 after
    # {1: 2}" as well as "got 2#2 after").
    assert re.search(r"got \d+#2 after", why) or "deadlock" in why or "consumed" in why, why
    print(why, trace, sep="\n")


def test_local_delivery_out_of_channel_order_loses_a_message() -> None:
    """``Delivery.local`` hands over only the next message of the channel. Without that rule
    a message overtakes an earlier one still to come from the relay, and the agent then drops
    the earlier one as delivered already."""
    why, trace = kept_counterexample("in_order")
    assert "deadlock" in why or "consumed" in why
    print(why, trace, sep="\n")


def test_a_locally_delivered_message_must_still_be_deposited() -> None:
    """The relay must log a locally delivered message all the same: else the channel's numbering
    has a gap at the relay, and a restarted receiver never gets the message."""
    why, trace = kept_counterexample("deposit")
    assert "a gap in the channel" in why or "deadlock" in why
    print(why, trace, sep="\n")


def test_a_dropped_push_must_still_be_credited() -> None:
    """The agent credits the pushes it drops (delivered locally already): else they fill the
    relay's window and the receiver's other messages stop coming."""
    why, trace = kept_counterexample("credit")
    assert "deadlock" in why
    print(why, trace, sep="\n")


def hidden(programs: list[Program], schedule: Schedule, config: Config) -> str | None:
    """Why this run of a program that is not deterministic went wrong unnoticed, or None:
    either the relays caught it, or the survivors are consistent with one execution."""
    try:
        outcome = run(programs, schedule, config)
    except (ModelError, ProtocolError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if outcome.divergence is not None:
        return None
    problems = check(programs, outcome)
    return "; ".join(problems) if problems else None


@pytest.mark.parametrize("agents", [1, 2])
@many
@given(schedules)
def test_a_program_that_is_not_deterministic_never_goes_unnoticed(
    agents: int, schedule: Schedule
) -> None:
    """With ranks sharing agents, crashes anywhere: the run is either consistent or the
    relays report the divergence (never a silent difference)."""
    programs = [stamped] * 3
    assert hidden(programs, schedule, Config(agents=agents)) is None


def test_without_settling_local_messages_a_divergence_can_hide() -> None:
    config = Config(agents=1, settle_local=False)
    programs = [stamped] * 3
    schedule = find(schedules, lambda s: hidden(programs, s, config) is not None, settings=search)
    why = hidden(programs, schedule, config)
    assert why is not None and "consumed" in why
    print(why, replay(programs, schedule, config), sep="\n")
