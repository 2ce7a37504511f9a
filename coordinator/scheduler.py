"""Scheduling and failure rules, as pure functions, plus the failure-detection loop.

The store applies these rules inside one transaction (see ``sqlite_jobs``); keeping them here
free of I/O lets them be read, and tested, on their own.

- Gang placement: a job starts only when all its ranks fit in the free slots of live agents at
  once. Ranks go round-robin over agents, the agent with most free slots first.
- Home relays: up to ``ranks`` live relays, rotated by job id so jobs spread over relays;
  ``homes[r] = r % len(relays)``.
- Replacements: a lost rank's next incarnation goes to the live agent with most free slots,
  another one than the lost incarnation's when that agent itself is suspect (if there is one).
  Replacements are placed before any queued job. A rank with checkpoint images prefers an
  agent that can restore one (CRIU and the image's environment fingerprint); one that can no
  longer start from the beginning goes only to such an agent (``sqlite_checkpoints``).
- Job end: a non-zero exit (or ``MPI.Abort``) fails the job with that code; every rank's
  current incarnation exiting 0 makes it succeed; too many restarts, a relay down for too long
  or a divergence report fail it with no exit code.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from vpool.coordinator.service import Coordinator

RANK_TOKEN_LIFETIME = 7 * 24 * 3600.0
AGENT_TOKEN_LIFETIME = 24 * 3600.0
ACTIVE_RANK_STATES = ("leased", "running")


def free_slots(slots: int, reported_free: int, active: int) -> int:
    """Free slots of an agent: our own book (slots minus ranks we placed there) capped by what
    the agent last reported, since a killed rank may still be running there for a moment."""
    return max(0, min(slots - active, reported_free))


def plan_gang(ranks: int, agents: Sequence[tuple[str, int]]) -> list[str] | None:
    """Agent id for each rank, or None if the ranks do not all fit at once.

    ``agents`` holds ``(agent_id, free_slots)`` of live agents.
    """
    order = sorted((a for a in agents if a[1] > 0), key=lambda a: (-a[1], a[0]))
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
    ``avoid`` only if no other agent has a free slot."""
    candidates = [(agent, n) for agent, n in free.items() if n > 0]
    if not candidates:
        return None
    return min(candidates, key=lambda a: (a[0] not in prefer, a[0] == avoid, -a[1], a[0]))[0]


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
        await trio.sleep(period)
