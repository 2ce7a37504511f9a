"""Spawning in SQLite (``MPI.Comm.Spawn``): a running job's ranks ask for new processes, which
become more ranks of the same job.

The root of a spawn asks through its agent (``api.SpawnAsk``). The answer is decided once and
kept (``spawns``, keyed by the root rank and its count of spawns), so an incarnation that
replays its run after a restart asks again and gets the same ranks: what a rank sees stays
what its log says.

A spawn is granted new rank numbers after the job's highest (``jobs.spawned`` counts them; the
job's tokens cover ``jobs.space`` numbers). At most ``jobs.universe`` processes of the job are
alive at once (MPI's universe size). A soft spawn (``least`` < ``maxprocs``, mpi4py.futures'
``{"soft": "1:N"}``) gets what the pool's free slots can take now, at least ``least`` (maybe
none when ``least`` is 0: a farm growing as volunteers come); a hard one gets ``maxprocs`` or
nothing. The new ranks are pending like replacements and are placed by
``place_replacements``; their leases say their world, parents and command (``_spawn_of``).
"""

from __future__ import annotations

import json
import re
from typing import Any

import sqlite_utils

from vpool.coordinator import scheduler
from vpool.coordinator.errors import Forbidden
from vpool.protocol import api

MAX_COMMAND = 64  # arguments of a spawned command
MAX_ARG = 4096  # characters of one argument
_PYTHON = re.compile(r"python[0-9.]*")


def python_arguments(command: list[str]) -> list[str] | None:
    """What a spawned process runs, as Python's arguments after the interpreter: a command
    naming a Python interpreter (``sys.executable`` of the parent, which is this agent's or
    another's path) runs its arguments under the agent's interpreter; a ``.py`` program runs
    as a script of the job's bundle. None: not a Python program."""
    if not command:
        return None
    first = command[0].rsplit("/", 1)[-1]
    if _PYTHON.fullmatch(first):
        return command[1:] or None
    if first.endswith(".py"):
        return list(command)
    return None


class SpawnMixin:
    db: sqlite_utils.Database

    def _one(self, sql: str, params: Any = ()) -> dict[str, Any] | None:
        raise NotImplementedError

    def _event(
        self, job: int, now: float, kind: str, message: str, rank: int | None = None
    ) -> None:
        raise NotImplementedError

    def _free_slots(
        self, agent_deadline: float
    ) -> tuple[list[dict[str, Any]], dict[str, int], dict[str, scheduler.Offer]]:
        raise NotImplementedError

    def spawn(
        self, agent_id: str, ask: api.SpawnAsk, now: float, agent_deadline: float
    ) -> api.SpawnAnswer:
        """Grant (or refuse) a spawn; the same answer every time it is asked again."""
        with self.db.atomic():
            inc = self._one(
                "SELECT agent FROM incarnations WHERE job = ? AND rank = ? AND incarnation = ?",
                [ask.job, ask.rank, ask.incarnation],
            )
            if inc is None or inc["agent"] != agent_id:
                raise Forbidden(
                    f"job {ask.job} rank {ask.rank} incarnation {ask.incarnation} is not "
                    "leased to this agent",
                    code="not_your_rank",
                )
            kept = self._one(
                "SELECT first, count, error FROM spawns WHERE job = ? AND root = ? AND seq = ?",
                [ask.job, ask.rank, ask.seq],
            )
            if kept is not None:
                return _answer(kept)
            job = self._one("SELECT * FROM jobs WHERE id = ?", [ask.job])
            assert job is not None
            first = int(job["ranks"]) + int(job["spawned"])
            error = self._refusal(ask, job, first)
            count = 0
            if not error:
                count, error = self._granted(ask, job, first, agent_deadline)
            spawn_id = self.db.execute(
                "INSERT INTO spawns (job, root, seq, first, count, command, parent, ctx, "
                "reported, error, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    ask.job,
                    ask.rank,
                    ask.seq,
                    first,
                    count,
                    json.dumps(ask.command),
                    json.dumps(ask.parent),
                    ask.ctx,
                    int(ask.reported),
                    error,
                    now,
                ],
            ).lastrowid
            if error:
                self._event(ask.job, now, "spawn_refused", f"rank {ask.rank}: {error}", ask.rank)
                return api.SpawnAnswer(error=error)
            if not count:  # a soft spawn that may get nothing, while no slot is free
                return api.SpawnAnswer()
            relays: list[str] = json.loads(job["relays"])
            space = int(job["space"] or job["ranks"])
            homes = scheduler.homes(space, len(relays))
            for rank in range(first, first + count):
                self.db.execute(
                    "INSERT INTO ranks (job, rank, state, incarnation, relay, spawn) "
                    "VALUES (?, ?, 'pending', 1, ?, ?)",
                    [ask.job, rank, relays[homes[rank]], spawn_id],
                )
            self.db.execute("UPDATE jobs SET spawned = spawned + ? WHERE id = ?", [count, ask.job])
            what = " ".join(ask.command)[:200]
            self._event(
                ask.job,
                now,
                "spawn",
                f"rank {ask.rank} spawned ranks {first} to {first + count - 1}: {what}",
                ask.rank,
            )
            return api.SpawnAnswer(ranks=list(range(first, first + count)))

    def _refusal(self, ask: api.SpawnAsk, job: dict[str, Any], first: int) -> str:
        """Why the spawn cannot be granted at all ("" when it can be considered)."""
        if job["state"] != "running":
            return f"the job is {job['state']}"
        if not 1 <= ask.maxprocs or not 0 <= ask.least <= ask.maxprocs:
            return f"cannot start {ask.least} to {ask.maxprocs} processes"
        if ask.rank not in ask.parent or len(set(ask.parent)) != len(ask.parent):
            return "the spawning group must hold the root once"
        if any(not 0 <= p < first for p in ask.parent):
            return "the spawning group names ranks the job does not have"
        if not 0 <= ask.ctx < 1 << 62:
            return f"context {ask.ctx} is out of range"
        if len(ask.command) > MAX_COMMAND or any(len(a) > MAX_ARG for a in ask.command):
            return f"the command is longer than {MAX_COMMAND} arguments of {MAX_ARG} characters"
        if python_arguments(ask.command) is None:
            return (
                f"{ask.command[0] if ask.command else 'an empty command'!r} is not a Python "
                "program: vpool spawns Python interpreters and .py programs of the job's bundle"
            )
        return ""

    def _granted(
        self, ask: api.SpawnAsk, job: dict[str, Any], first: int, agent_deadline: float
    ) -> tuple[int, str]:
        """How many processes the spawn gets, or why none."""
        universe = int(job["universe"] or job["ranks"])
        space = int(job["space"] or job["ranks"])
        alive_row = self._one(
            "SELECT COUNT(*) AS n FROM ranks WHERE job = ? AND state IN "
            "('pending', 'leased', 'running')",
            [ask.job],
        )
        alive = int(alive_row["n"]) if alive_row else 0
        room = min(universe - alive, space - first)
        if room < ask.least or (room < 1 and ask.least == ask.maxprocs):
            if space - first < universe - alive:
                return 0, (
                    f"the job has spawned {first - int(job['ranks'])} processes, the most a job "
                    f"may over its run (the pool's max_spawned)"
                )
            return 0, (
                f"the job's universe is {universe} processes at once and {alive} are alive: "
                f"no room for {ask.least if ask.least else ask.maxprocs} more (submit with a "
                "larger --universe)"
            )
        count = min(ask.maxprocs, room)
        if ask.least < ask.maxprocs:
            _, free, offers = self._free_slots(agent_deadline)
            fit = scheduler.open_to(
                free, offers, memory=job["memory"], unsandboxed=bool(job["unsandboxed"])
            )
            waiting_row = self._one(
                "SELECT COUNT(*) AS n FROM ranks r JOIN jobs j ON j.id = r.job "
                "WHERE r.state = 'pending' AND j.state = 'running'"
            )
            waiting = int(waiting_row["n"]) if waiting_row else 0
            count = max(ask.least, min(count, sum(fit.values()) - waiting))
        return count, ""


def _answer(row: dict[str, Any]) -> api.SpawnAnswer:
    if row["error"]:
        return api.SpawnAnswer(error=row["error"])
    first, count = int(row["first"]), int(row["count"])
    return api.SpawnAnswer(ranks=list(range(first, first + count)))
