"""Scheduling and failure rules, as pure functions, plus the failure-detection loop.

The store applies these rules inside one transaction (see ``sqlite_jobs``); keeping them here
free of I/O lets them be read, and tested, on their own.

- Eligibility (``can_run``): a job's ranks (first incarnations and replacements alike) go only
  to agents that have reported how they isolate ranks, with a sandbox unless the job accepts
  unsandboxed agents, and that let a rank use the memory the job asks for (or set no limit).
- Activity: only agents whose last heartbeat said "available" get ranks, whatever free slots
  they reported; one that is "suspended" (its volunteer uses the machine, it runs on battery,
  it is outside its hours or paused) or "leaving" gets none (``AgentHeartbeat.activity``).
  Listings show an available agent with no free slot as "busy" (``shown_activity``).
- Gang placement: a job starts only when all its ranks fit in the free slots of eligible live
  agents at once. Ranks go round-robin over agents, the agent with most free slots first, then
  the one available longest (the callers list agents in that order).
- Home relays: up to ``ranks`` live relays, rotated by job id so jobs spread over relays;
  ``homes[r] = r % len(relays)``.
- Suspended ranks: a rank its agent reports suspended for longer than the pool's
  ``suspend_limit`` plus a grace (``suspend_backstop``) is lost, and replaced like any lost
  rank: its agent should have checkpointed it and handed it back by then, and did not.
- Replacements: a lost rank's next incarnation goes to the live agent with most free slots,
  another one than the lost incarnation's when that agent itself is suspect (if there is one).
  Replacements are placed before any queued job. A rank with checkpoint images prefers an
  agent that can restore one (CRIU and the image's environment fingerprint); one that can no
  longer start from the beginning goes only to such an agent (``sqlite_checkpoints``).
- Queue reasons (``queue_reason``): a queued job that is not placed says why, in the order a
  user can act on: no relay, no agent, no agent that may run it (isolation, memory), more
  ranks than those agents have slots in all (it can never run on the pool as it is: flagged),
  or not enough free slots now.
- Restart storms (``RestartPolicy``): a lost rank is replaced at once, but a rank lost again
  and again soon after each start (``quick`` seconds) waits before each replacement, a delay
  that doubles from ``backoff_first`` up to ``backoff_max``, plus up to ``jitter`` of it at
  random (``restart_delay``). A failure its agents word the same way (``failure``: a frame
  that did not open, a start that failed, an error of the agent's) that happens on two agents,
  or three times in a row, ends the job at once with that reason (``repeated_failure``): it is
  the program's or the pool's, not the volunteers'.
- Job end: a non-zero exit (or ``MPI.Abort``) fails the job with that code; every rank's
  current incarnation exiting 0 makes it succeed; too many restarts, a repeated failure, a
  relay down for too long or a divergence report fail it with no exit code.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from vpool.sizes import format_duration, format_size

if TYPE_CHECKING:
    from vpool.coordinator.service import Coordinator

RANK_TOKEN_LIFETIME = 7 * 24 * 3600.0
AGENT_TOKEN_LIFETIME = 24 * 3600.0
ACTIVE_RANK_STATES = ("leased", "running")
# The exit code an agent reports for a rank it could not start, for a reason every agent
# would have (its bundle or environment), with the reason as the exit's message.
EXIT_CANNOT_START = 126
# ``IsolationReport.level``s that sandbox ranks; any other level (e.g. "none") is acceptable
# only to a job that accepts unsandboxed agents.
SANDBOXED = frozenset({"sandbox", "sandbox-rlimits"})
# ``AgentHeartbeat.activity``: what the volunteer's preferences let the agent do. Any other word
# (an agent newer than this coordinator) counts as "available", as an agent from before
# activities does.
ACTIVITIES = ("available", "suspended", "leaving")
# A rank reported suspended for ``suspend_limit`` + SUSPEND_GRACE_BEATS heartbeat intervals +
# SUSPEND_GRACE seconds is replaced by the coordinator: by then its agent should have thawed
# it, checkpointed it (CRIU and the upload of a large image take tens of seconds) and handed it
# back (``RankProblem``), and the report of that should have arrived.
SUSPEND_GRACE = 60.0
SUSPEND_GRACE_BEATS = 2
# What a pool that never moves suspended ranks (``suspend_limit`` 0) tells its agents:
# ``AgentHeartbeatResponse.suspend_limit`` 0 means "the agent's own default" on the wire.
SUSPEND_NEVER = 10 * 365 * 86400.0
# Times a lease is handed out before a rank whose agent never reported it counts as lost:
# once more after an answer lost on its way (``JobsMixin.agent_heartbeat``).
LEASE_OFFERS = 2


def suspend_backstop(limit: float, heartbeat_interval: float) -> float | None:
    """Seconds a rank may be reported suspended before the coordinator replaces it itself;
    None when the pool's ``limit`` is 0 (never move a rank: it waits for the owner)."""
    if limit <= 0:
        return None
    return limit + SUSPEND_GRACE_BEATS * heartbeat_interval + SUSPEND_GRACE


def told_suspend_limit(limit: float) -> float:
    """``AgentHeartbeatResponse.suspend_limit`` for the pool's ``suspend_limit``."""
    return limit if limit > 0 else SUSPEND_NEVER


def suspended_since(now: float, suspended_for: float, started: float) -> float:
    """When a rank that its agent says has been frozen for ``suspended_for`` seconds was
    frozen: not before ``started`` (when it was handed to the agent) nor after ``now``; an
    odd duration (negative, not a number) counts as 0."""
    frozen = suspended_for if math.isfinite(suspended_for) and suspended_for > 0 else 0.0
    return min(now, max(now - frozen, started))


def suspended_reason(rank: int, agent: str, frozen: float, limit: float) -> str:
    """The loss reason of a rank the coordinator replaces because it stayed suspended."""
    return (
        f"rank {rank} lost: suspended on agent {agent} for {format_duration(frozen)}, longer "
        f"than the pool's suspend_limit ({format_duration(limit)}), and its agent did not "
        "move it"
    )


def shown_activity(activity: str, slots: int, reported_free: int, active: int) -> str:
    """What listings show of an agent's ``activity``: "busy" for an available agent with no
    free slot (``free_slots``), the activity otherwise."""
    if activity == "available" and free_slots(slots, reported_free, active) == 0:
        return "busy"
    return activity


@dataclass(frozen=True)
class Offer:
    """What an agent's last isolation report offers a rank: its ``level`` ("": none
    reported) and ``rank_memory`` (bytes a rank may use, 0: no limit)."""

    level: str = ""
    rank_memory: int = 0


def can_run(offer: Offer, *, memory: int, unsandboxed: bool) -> bool:
    """Whether an agent may get ranks of a job that asks ``memory`` bytes per rank (0: any)
    and accepts unsandboxed agents or not. An agent that has not reported its isolation yet
    gets none: it may be one from before sandboxes."""
    if not offer.level:
        return False
    if offer.level not in SANDBOXED and not unsandboxed:
        return False
    return memory == 0 or offer.rank_memory == 0 or offer.rank_memory >= memory


def open_to(
    free: Mapping[str, int], offers: Mapping[str, Offer], *, memory: int, unsandboxed: bool
) -> dict[str, int]:
    """The free slots (``free``: agent id -> free slots) of the agents that may run the job."""
    return {
        agent: n
        for agent, n in free.items()
        if can_run(offers.get(agent, Offer()), memory=memory, unsandboxed=unsandboxed)
    }


@dataclass(frozen=True)
class AgentView:
    """A live agent as the queue sees it: its slots, how many are free now, its offer, and
    whether it takes work now (``available``: its activity; one that does not has no free
    slot)."""

    slots: int
    free: int
    offer: Offer
    available: bool = True


@dataclass(frozen=True)
class Waiting:
    """Why a queued job is not placed; ``never``: it cannot be placed on the pool as it is
    (every live agent idle would not be enough), until other volunteers join."""

    reason: str
    never: bool = False


def queue_reason(
    ranks: int, *, memory: int, unsandboxed: bool, agents: Sequence[AgentView], relays: int
) -> Waiting:
    """Why a job of ``ranks`` ranks (``memory`` bytes each, 0: any) is not placed now."""
    if relays == 0:
        return Waiting("no relay is up: ranks talk through relays")
    if not agents:
        return Waiting("no volunteer's agent is online", never=True)
    reported = [a for a in agents if a.offer.level]
    if not reported:
        return Waiting("the agents online have not said yet how they isolate ranks")
    allowed = [a for a in reported if a.offer.level in SANDBOXED or unsandboxed]
    if not allowed:
        return Waiting(
            "no agent online can sandbox ranks, and the job does not accept unsandboxed "
            "agents (vsdk submit --allow-unsandboxed)",
            never=True,
        )
    fit = [a for a in allowed if can_run(a.offer, memory=memory, unsandboxed=unsandboxed)]
    if not fit:
        most = max(a.offer.rank_memory for a in allowed)
        return Waiting(
            f"no agent online offers {format_size(memory)} per rank (the most is "
            f"{format_size(most)}; vsdk submit --memory asks for less)",
            never=True,
        )
    total, free = sum(a.slots for a in fit), sum(a.free for a in fit)
    if total < ranks:
        others = sum(a.slots for a in agents) - total
        why = f" ({others} more on agents that cannot run it)" if others else ""
        return Waiting(
            f"needs {ranks} slots; the agents that may run it have {total} in all{why}",
            never=True,
        )
    away = sum(a.slots for a in fit if not a.available)
    busy = total - free - away
    held = f", {away} are on agents whose volunteers need their machines now" if away else ""
    return Waiting(
        f"needs {ranks} slots; {free} are free now ({busy} run other ranks{held})"
        if free < ranks
        else f"needs {ranks} slots; the free ones went to earlier jobs"
    )


@dataclass
class Scheduled:
    """What one scheduling pass did: jobs that got placements, and queued jobs whose reason
    for waiting changed."""

    started: list[int] = field(default_factory=list)
    explained: list[int] = field(default_factory=list)


def free_slots(slots: int, reported_free: int, active: int) -> int:
    """Free slots of an agent: our own book (slots minus ranks we placed there) capped by what
    the agent last reported, since a killed rank may still be running there for a moment."""
    return max(0, min(slots - active, reported_free))


def plan_gang(
    ranks: int, agents: Sequence[tuple[str, int]], *, prefer: Collection[str] = ()
) -> list[str] | None:
    """Agent id for each rank, or None if the ranks do not all fit at once.

    ``agents`` holds ``(agent_id, free_slots)`` of live agents; those in ``prefer`` (that
    have the job's environment built already) are filled first, then those with most free
    slots; ties keep the order of ``agents`` (the agent available longest first).
    """
    order = sorted((a for a in agents if a[1] > 0), key=lambda a: (a[0] not in prefer, -a[1]))
    if prefer and any(a[0] in prefer for a in order):
        # Only as many agents as needed, the preferred first, so the others stay clear.
        needed, kept = 0, []
        for offer in order:
            kept.append(offer)
            needed += offer[1]
            if needed >= ranks:
                break
        order = kept
    if sum(free for _, free in order) < ranks:
        return None
    remaining = dict(order)
    placement: list[str] = []
    i = 0
    while len(placement) < ranks:
        agent = order[i % len(order)][0]
        if remaining[agent] > 0:
            placement.append(agent)
            remaining[agent] -= 1
        i += 1
    return placement


def pick_agent(free: dict[str, int], avoid: str | None, prefer: Collection[str] = ()) -> str | None:
    """The agent for one replacement incarnation: one of ``prefer`` (those that can restore
    the rank's checkpoint images) if any has a free slot, then most free slots first,
    ``avoid`` only if no other agent has a free slot; ties go to the first in ``free``'s order
    (the agent available longest)."""
    candidates = [(agent, n) for agent, n in free.items() if n > 0]
    if not candidates:
        return None
    return min(candidates, key=lambda a: (a[0] not in prefer, a[0] == avoid, -a[1]))[0]


def pick_relays(live: Sequence[str], ranks: int, job_id: int) -> list[str]:
    """The relays of a job: at most ``ranks`` live relays, starting at a job-dependent offset."""
    names = sorted(live)
    if not names:
        return []
    start = job_id % len(names)
    rotated = names[start:] + names[:start]
    return rotated[: min(ranks, len(rotated))]


def homes(ranks: int, relays: int) -> list[int]:
    return [r % relays for r in range(ranks)]


def exit_reason(rank: int, code: int, aborted: bool) -> str:
    if aborted:
        return f"rank {rank} called MPI.Abort({code})"
    return f"rank {rank} exited with code {code}"


@dataclass(frozen=True)
class RestartPolicy:
    """How a running job's lost ranks are restarted (the coordinator's settings of the same
    names): at most ``max_restarts`` in all; an incarnation lost less than ``quick`` seconds
    after it was handed to its agent is a quick loss, and the replacement of the n-th quick
    loss in a row (n >= 2) waits ``restart_delay(n)``."""

    max_restarts: int = 50
    backoff_first: float = 1.0
    backoff_max: float = 60.0
    quick: float = 60.0
    jitter: float = 0.5


def restart_delay(streak: int, policy: RestartPolicy, draw: float) -> float:
    """Seconds before the replacement of a rank's ``streak``-th quick loss in a row: none for
    the first (a volunteer leaving is no storm), then ``backoff_first`` doubling with each up
    to ``backoff_max``, that times 1 to 1 + ``jitter`` (``draw`` in [0, 1) picks where), so
    that the ranks of one job lost together do not all come back at the same instant."""
    if streak < 2:
        return 0.0
    base = min(policy.backoff_max, policy.backoff_first * 2.0 ** min(streak - 2, 60))
    return base * (1.0 + policy.jitter * draw)


SAME_IN_A_ROW = 3  # a failure seen this many times in a row ends the job, even on one agent


def repeated_failure(rank: int, history: Sequence[tuple[str, str]]) -> str:
    """Why a rank's job ends now, or "" if it does not: ``history`` is (agent, failure) of
    the rank's incarnations, newest (the one just lost) first, ``failure`` "" where it is not
    known. It ends when the newest failure was seen before on another agent, or ends the last
    ``SAME_IN_A_ROW`` incarnations."""
    if not history or not history[0][1]:
        return ""
    agent, failure = history[0]
    others = [a for a, f in history[1:] if f == failure and a != agent]
    if others:
        return f"rank {rank} failed the same way on agents {others[0]} and {agent}: {failure}"
    row = 0
    for _, f in history:
        if f != failure:
            break
        row += 1
    if row >= SAME_IN_A_ROW:
        return f"rank {rank} failed the same way {row} times in a row on agent {agent}: {failure}"
    return ""


def left_reason(rank: int, agent: str) -> str:
    """The loss reason of a rank whose agent left the pool cleanly: it said it was leaving
    (``AgentHeartbeat.activity``), then handed the rank back or went silent."""
    return f"rank {rank} stopped: its agent {agent} left the pool"


def stop_reason(state: str, reason: str) -> str:
    if state == "cancelled":
        return "job cancelled"
    if state == "failed":
        return f"job failed: {reason}"
    return f"job {state}"


async def monitor(coordinator: Coordinator, *, period: float) -> None:
    """Detect silent agents and relays, and retry scheduling, every ``period`` seconds."""
    while True:
        await coordinator.check_timeouts()
        await coordinator.schedule()
        await coordinator.collect_blobs()
        await trio.sleep(period)
