"""Faults in SQLite: lost incarnations and their replacements, stale incarnations, relays that
go down (and come back), divergence reports, and the grace given after a coordinator restart.

A lost incarnation i of a running job's rank is ended (``incarnations.lost`` says why) and the
rank becomes ``pending`` with incarnation i+1 and no agent; ``place_replacements`` (called by
``schedule`` before any queued job is considered) gives it a slot, a fresh signed token and the
same home relay. From then on every report of incarnation i is stale: its exit is recorded as
``rank_fenced``, its output and results are dropped and its agent gets a stop order.

In a job whose failure mode reports failures (``api.REPORTING_MODES``) a lost rank is not
replaced: it is declared ``failed``, and fenced at every relay of the job (``fences``: the relays
learn of it in their heartbeat answers and confirm in their next heartbeat). Once every relay
has confirmed, the agents of the other ranks learn of it in theirs and tell their ranks, which
see it as the job's mode says (ULFM's way, or FT-MPI's). So a failed rank that comes back (its
volunteer's machine was frozen, or cut off) is refused everywhere before anybody acts on its
failure: it is never a revenant.
"""

from __future__ import annotations

import json
import random
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import sqlite_utils

from vpool.coordinator import scheduler
from vpool.coordinator.errors import BadRequest, Forbidden
from vpool.coordinator.sqlite_checkpoints import CheckpointsMixin, Plan
from vpool.coordinator.sqlite_validation import ValidationMixin
from vpool.protocol import api
from vpool.protocol.errors import divergence_message
from vpool.protocol.tokens import RankClaims

Signer = Callable[[RankClaims], str]
MAX_MESSAGE = 2000
_random = secrets.SystemRandom()  # re-executors: unpredictable to whoever would be one


# A rank lost because its agent could not reach a relay of its job is restarted after
# RELAY_BACKOFF_FIRST s, doubling with each such loss in a row up to RELAY_BACKOFF_MAX s.
RELAY_BACKOFF_FIRST = 0.5
RELAY_BACKOFF_MAX = 30.0


def _mode_words(mode: str) -> str:
    return mode if " " in mode else f"on-failure {mode}"


def relay_backoff(losses: int) -> float:
    """Seconds before the replacement of a rank's ``losses``-th relay-caused loss in a row."""
    return float(min(RELAY_BACKOFF_MAX, RELAY_BACKOFF_FIRST * 2 ** min(max(losses - 1, 0), 16)))


class FaultsMixin(ValidationMixin, CheckpointsMixin):
    db: sqlite_utils.Database
    restarts: scheduler.RestartPolicy
    relay_down_timeout: float

    # -- start-up -----------------------------------------------------------------------------

    def startup(self, now: float) -> None:
        """The coordinator (re)starts: every agent and relay counts as seen now, so nothing is
        declared lost because the coordinator itself was down; running jobs continue."""
        with self.db.atomic():
            self.db.execute("UPDATE agents SET last_seen = MAX(last_seen, ?)", [now])
            self.db.execute("UPDATE relays SET last_seen = MAX(last_seen, ?)", [now])

    # -- reports of lost ranks ----------------------------------------------------------------

    def rank_problem(self, agent_id: str, pr: api.RankProblem, now: float) -> bool:
        with self.db.atomic():
            if self._current(agent_id, pr.job, pr.rank, pr.incarnation) is None:
                return False
            name = self._agent_name(agent_id)
            if self._leaving(agent_id):
                # Handed back by an agent that stops cleanly: not a fault of it.
                reason = f"{scheduler.left_reason(pr.rank, name)} ({pr.message})"
                return self._lose(pr.job, pr.rank, reason, now, suspect=False)
            failure = pr.failure[:MAX_MESSAGE]
            job = self.job_row(pr.job)
            relays = json.loads(job["relays"]) if job is not None else []
            if pr.unopened_from and pr.unopened_from in relays:
                return self._unopened(agent_id, name, pr, failure, now)
            reason = f"rank {pr.rank} lost: agent {name} reported: {pr.message}"
            if pr.relay and pr.relay in relays:
                # The relay's outage, not the agent's fault or the rank's.
                return self._lose(pr.job, pr.rank, reason, now, suspect=False, outage=pr.relay)
            return self._lose(pr.job, pr.rank, reason, now, suspect=True, failure=failure)

    def _unopened(
        self, agent_id: str, name: str, pr: api.RankProblem, failure: str, now: float
    ) -> bool:
        """A sealed message that relay ``pr.unopened_from`` pushed did not open at the agent:
        it was changed after it was sealed, by the relay or on the agent (its disk, its memory,
        its software). Not a lost rank: counted against both, not against the job's restarts;
        the rank is restarted (on another agent if there is one) and fetches the message again,
        and the same failure on a second agent ends the job (the relay's copy is bad, or every
        agent's software is)."""
        relay = pr.unopened_from
        self.db.execute(
            "UPDATE agents SET integrity_failures = integrity_failures + 1 WHERE id = ?",
            [agent_id],
        )
        self.db.execute(
            "UPDATE relays SET integrity_failures = integrity_failures + 1 WHERE name = ?",
            [relay],
        )
        reason = (
            f"rank {pr.rank}: a message relay {relay} pushed did not open at agent {name} "
            f"(counted against relay {relay} and agent {name}, not as a lost rank): "
            f"{failure or pr.message}"
        )
        return self._lose(
            pr.job,
            pr.rank,
            reason,
            now,
            suspect=True,
            counted=False,
            failure=failure,
            kind="integrity_failure",
        )

    def relay_lost(self, relay: str, lost: list[api.RankLost], now: float) -> bool:
        """Ranks whose connection to ``relay`` dropped and did not come back. A relay speaks
        only of ranks of jobs it serves (every rank of a job attaches to each of its relays):
        a report naming another job is refused whole (``Forbidden``) and changes nothing."""
        changed = False
        with self.db.atomic():
            for item in lost:
                self._check_serves(relay, item.job)
            for item in lost:
                row = self._one(
                    "SELECT incarnation, agent FROM ranks WHERE job = ? AND rank = ?",
                    [item.job, item.rank],
                )
                if row is None or row["incarnation"] != item.incarnation:
                    continue
                if self._validator_unfinished(item.job, item.rank, item.incarnation, now):
                    changed = True
                    continue
                # The relay knows agents by id only; people know them by name.
                where = f" (on agent {self._agent_name(row['agent'])})" if row["agent"] else ""
                reason = f"rank {item.rank}{where} lost: relay {relay} reported: {item.reason}"
                changed = self._lose(item.job, item.rank, reason, now, suspect=True) or changed
        return changed

    def relay_diverged(self, report: api.RelayDiverged, now: float) -> bool:
        """A relay found a re-sent message that differs from the logged one: fail the job."""
        with self.db.atomic():
            row = self._check_serves(report.name, report.job)
            if row is None:
                return False
            if not 0 <= report.rank < row["ranks"]:
                raise BadRequest(f"job {report.job} has no rank {report.rank}")
            if row["state"] != "running":
                return False
            message = report.message[:MAX_MESSAGE] or divergence_message(report.rank)
            if self._validating_round(report.job, report.rank, report.incarnation):
                # A re-execution for validation (a relay that reports it the old way).
                return self._relay_verdict(
                    report.name, report.job, report.rank, report.incarnation, False, message, now
                )
            self._event(
                report.job,
                now,
                "job_failed",
                f"relay {report.name}, rank {report.rank} incarnation {report.incarnation}: "
                f"{message}",
                report.rank,
            )
            self._end(report.job, "failed", None, message, now)
        return True

    def relay_refused(self, report: api.RelayRefused, now: float) -> bool:
        """A relay refuses the job's deposits for good: fail the job (once) with its reason."""
        with self.db.atomic():
            row = self._check_serves(report.name, report.job)
            if row is None or row["state"] != "running":
                return False
            message = report.message[:MAX_MESSAGE] or f"relay {report.name} refused the job"
            self._event(report.job, now, "job_failed", f"relay {report.name}: {message}")
            self._end(report.job, "failed", None, message, now)
        return True

    def _check_serves(self, relay: str, job: int) -> dict[str, Any] | None:
        """The row of ``job`` (None: no such job) if ``relay`` is one of its relays."""
        row = self.job_row(job)
        if row is not None and relay not in json.loads(row["relays"]):
            raise Forbidden(f"relay {relay} does not serve job {job}", code="not_your_job")
        return row

    # -- failure detection --------------------------------------------------------------------

    def expire_agents(self, deadline: float, now: float) -> bool:
        """Agents silent since ``deadline`` are lost, and their ranks with them; one whose
        last heartbeat said it was leaving is gone instead (it stopped cleanly), and its ranks'
        events say so."""
        changed = False
        with self.db.atomic():
            silent = list(
                self.db.query(
                    "SELECT id, name, activity FROM agents WHERE state = 'alive' AND last_seen < ?",
                    [deadline],
                )
            )
            for agent in silent:
                left = agent["activity"] == "leaving"
                self.db.execute(
                    "UPDATE agents SET state = ? WHERE id = ?",
                    ["gone" if left else "lost", agent["id"]],
                )
                for r in list(
                    self.db.query(
                        "SELECT job, rank FROM ranks WHERE agent = ? AND state IN "
                        "('leased', 'running') ORDER BY job, rank",
                        [agent["id"]],
                    )
                ):
                    if left:
                        reason = scheduler.left_reason(r["rank"], agent["name"])
                    else:
                        reason = (
                            f"rank {r['rank']} lost: agent {agent['name']} stopped heartbeating"
                        )
                    lost = self._lose(r["job"], r["rank"], reason, now, suspect=not left)
                    changed = lost or changed
        return changed

    def expire_suspended(self, limit: float, backstop: float | None, now: float) -> bool:
        """Ranks reported suspended for longer than ``backstop`` seconds (None: never) are
        lost and replaced elsewhere, from their newest checkpoint: their agent should have
        moved them once they were suspended for the pool's ``limit``, and did not (its
        checkpoint failed, or it is an agent from before suspensions)."""
        if backstop is None:
            return False
        changed = False
        with self.db.atomic():
            rows = list(
                self.db.query(
                    "SELECT r.job, r.rank, r.agent, i.suspended_since FROM ranks r "
                    "JOIN incarnations i ON i.job = r.job AND i.rank = r.rank "
                    "AND i.incarnation = r.incarnation JOIN jobs j ON j.id = r.job "
                    "WHERE r.state IN ('leased', 'running') AND j.state = 'running' "
                    "AND i.suspended_since < ? ORDER BY r.job, r.rank",
                    [now - backstop],
                )
            )
            for r in rows:
                frozen = now - float(r["suspended_since"])
                reason = scheduler.suspended_reason(
                    r["rank"], self._agent_name(r["agent"]), frozen, limit
                )
                changed = self._lose(r["job"], r["rank"], reason, now, suspect=True) or changed
        return changed

    def _activity_of(self, agent_id: str) -> str:
        """What the agent's last heartbeat said its volunteer lets it do ("" if unknown)."""
        row = self._one("SELECT activity FROM agents WHERE id = ?", [agent_id])
        return "" if row is None else str(row["activity"])

    def _leaving(self, agent_id: str) -> bool:
        """The agent's last heartbeat said it is leaving (stopping cleanly)."""
        return self._activity_of(agent_id) == "leaving"

    def expire_relays(self, deadline: float, down_deadline: float, now: float) -> bool:
        """Relays silent since ``deadline`` are down: no new jobs go to them, and their running
        jobs wait. Jobs of a relay down since before ``down_deadline`` fail."""
        changed = False
        with self.db.atomic():
            silent = [
                str(r["name"])
                for r in self.db.query(
                    "SELECT name FROM relays WHERE state = 'alive' AND last_seen < ?", [deadline]
                )
            ]
            wait = max(0.0, now - down_deadline)
            for name in silent:
                self.db.execute("UPDATE relays SET state = 'lost' WHERE name = ?", [name])
                for job in self._running_jobs_of(name):
                    self._event(
                        job,
                        now,
                        "relay_down",
                        f"relay {name} stopped heartbeating; the job waits up to {wait:g} s "
                        "for it to come back",
                    )
                    changed = True
            gone = [
                str(r["name"])
                for r in self.db.query(
                    "SELECT name FROM relays WHERE state = 'lost' AND last_seen < ?",
                    [down_deadline],
                )
            ]
            for name in gone:
                for job in self._running_jobs_of(name):
                    reason = (
                        f"relay {name} stopped heartbeating and did not come back within {wait:g} s"
                    )
                    self._end(job, "failed", None, reason, now)
                    changed = True
        return changed

    def _running_jobs_of(self, relay: str) -> list[int]:
        return [
            int(r["id"])
            for r in self.db.query(
                "SELECT DISTINCT j.id FROM jobs j, json_each(j.relays) r "
                "WHERE j.state = 'running' AND r.value = ? ORDER BY j.id",
                [relay],
            )
        ]

    def _relay_back(self, relay: str, now: float) -> None:
        """A down relay heartbeats again (called inside the heartbeat's transaction)."""
        for job in self._running_jobs_of(relay):
            self._event(job, now, "relay_up", f"relay {relay} is back")

    # -- losing and replacing -----------------------------------------------------------------

    def _lose(
        self,
        job: int,
        rank: int,
        reason: str,
        now: float,
        *,
        suspect: bool,
        exit_code: int | None = None,
        outage: str = "",
        counted: bool = True,
        failure: str = "",
        kind: str = "rank_lost",
    ) -> bool:
        """End the rank's current incarnation as lost. In a running job, the rank gets a new
        incarnation waiting for a slot (avoiding the old agent if it is ``suspect``), unless
        the job has had ``max_restarts`` restarts already or runs with fault tolerance off: then
        the job fails. In a job whose failure mode reports failures (``api.REPORTING_MODES``)
        the rank is declared failed instead (``_declare_failed``). A loss caused by relay
        ``outage`` (its agent could not reach it) does not count as a restart: the replacement
        waits a backoff instead, and the job fails only once the relay has been unreachable for
        ``relay_down_timeout``. Nor does one that is not ``counted`` (a lease given back before
        it ran, a message that did not open: the relay's or the agent's fault).

        Restart storms (``scheduler.RestartPolicy``): a quick loss after another waits
        ``scheduler.restart_delay``; ``failure`` (how it failed, as any agent would say it)
        is kept with the incarnation, and the same failure on two agents or three times in a
        row ends the job (``scheduler.repeated_failure``). The event is ``kind``."""
        with self.db.atomic():
            row = self._one(
                "SELECT r.state, r.incarnation, r.agent, r.relay_losses, r.relay_since, "
                "r.quick_losses, r.validating, i.created, i.delivered, "
                "j.state AS job_state, j.restarts, j.fault_tolerance, j.on_failure, "
                "COALESCE(s.reported, 0) AS reported "
                "FROM ranks r JOIN jobs j ON j.id = r.job LEFT JOIN spawns s ON s.id = r.spawn "
                "LEFT JOIN incarnations i ON i.job = r.job AND i.rank = r.rank "
                "AND i.incarnation = r.incarnation "
                "WHERE r.job = ? AND r.rank = ?",
                [job, rank],
            )
            if row is None or row["state"] not in scheduler.ACTIVE_RANK_STATES:
                return False
            incarnation = int(row["incarnation"])
            self.db.execute(
                "UPDATE incarnations SET ended = COALESCE(ended, ?), lost = ?, "
                "exit_code = COALESCE(exit_code, ?), failure = ? WHERE job = ? AND rank = ? "
                "AND incarnation = ?",
                [now, reason, exit_code, failure[:MAX_MESSAGE], job, rank, incarnation],
            )
            if row["job_state"] == "running" and (
                row["on_failure"] in api.REPORTING_MODES or row["reported"]
            ):
                mode = "spawned with failures reported" if row["reported"] else row["on_failure"]
                self._declare_failed(job, rank, incarnation, reason, mode, now)
                return True
            policy = self.restarts
            since = row["relay_since"] if row["relay_since"] is not None else now
            losses = int(row["relay_losses"]) + 1 if outage else 0
            delay = relay_backoff(losses) if outage else 0.0
            handed = row["delivered"] if row["delivered"] is not None else row["created"]
            quick = handed is not None and now - float(handed) < policy.quick
            # A validation's re-execution and a relay outage have rules of their own.
            storm = not outage and not row["validating"]
            streak = int(row["quick_losses"]) + 1 if quick and storm else 0
            wait = scheduler.restart_delay(streak, policy, random.random())
            repeated = self._repeated_failure(job, rank) if storm and failure else ""
            if not row["fault_tolerance"]:
                why = f"{reason} (fault tolerance is off for this job)"
            elif repeated:
                why = repeated
            elif outage and now - since >= self.relay_down_timeout:
                why = (
                    f"relay {outage} has been unreachable for {now - since:.0f} s "
                    f"(relay_down_timeout is {self.relay_down_timeout:g} s): {reason}"
                )
            elif outage:
                why = ""
                reason += (
                    f" (relay {outage} unreachable; restarting in {delay:g} s, "
                    "not counted as a restart)"
                )
            elif counted and row["restarts"] >= policy.max_restarts:
                why = (
                    f"{reason} (not restarted: the job had {row['restarts']} restarts, "
                    f"max_restarts is {policy.max_restarts})"
                )
            else:
                why = ""
                if wait:
                    reason += (
                        f" (lost {streak} times in a row soon after starting: "
                        f"restarting in {wait:.1f} s)"
                    )
            self._event(job, now, kind, reason, rank)
            if row["job_state"] != "running" or why:
                self.db.execute(
                    "UPDATE ranks SET state = 'lost' WHERE job = ? AND rank = ?", [job, rank]
                )
                self._end(job, "failed", None, why or reason, now)
                return True
            if not outage and counted:
                self.db.execute("UPDATE jobs SET restarts = restarts + 1 WHERE id = ?", [job])
            delay = max(delay, wait)
            self.db.execute(
                "UPDATE ranks SET incarnation = ?, state = 'pending', agent = NULL, "
                "exit_code = NULL, avoid = ?, not_before = ?, relay_losses = ?, "
                "relay_since = ?, quick_losses = ? WHERE job = ? AND rank = ?",
                [
                    incarnation + 1,
                    row["agent"] if suspect else None,
                    now + delay if delay else None,
                    losses,
                    since if outage else None,
                    streak,
                    job,
                    rank,
                ],
            )
        return True

    def _repeated_failure(self, job: int, rank: int) -> str:
        """``scheduler.repeated_failure`` over the rank's incarnations (its current one, just
        lost, first), each agent by its name, or by name and id where two of them share a
        name (volunteers name their machines as they like)."""
        rows = list(
            self.db.query(
                "SELECT i.agent, i.failure, a.name FROM incarnations i "
                "LEFT JOIN agents a ON a.id = i.agent WHERE i.job = ? AND i.rank = ? "
                "AND i.validates = 0 ORDER BY i.incarnation DESC",
                [job, rank],
            )
        )
        ids: dict[str, set[str]] = {}
        for r in rows:
            ids.setdefault(str(r["name"] or r["agent"]), set()).add(str(r["agent"]))

        def label(r: dict[str, Any]) -> str:
            name = str(r["name"] or r["agent"])
            return name if len(ids[name]) == 1 else f"{name} ({r['agent']})"

        return scheduler.repeated_failure(rank, [(label(r), str(r["failure"])) for r in rows])

    def _declare_failed(
        self, job: int, rank: int, incarnation: int, reason: str, mode: str, now: float
    ) -> None:
        """The rank is failed for good: it gets no new incarnation, every relay of the job is
        told to fence ``incarnation`` (``fences_for_relay``), and once all have, the agents of
        the other ranks tell them (``failures_for_agent``). The job goes on; it fails only when
        no rank is left, and succeeds when every other rank exited with code 0."""
        self.db.execute("UPDATE ranks SET state = 'failed' WHERE job = ? AND rank = ?", [job, rank])
        jrow = self._one("SELECT relays, failed_ranks FROM jobs WHERE id = ?", [job])
        assert jrow is not None
        failed = sorted({*json.loads(jrow["failed_ranks"]), rank})
        self.db.execute("UPDATE jobs SET failed_ranks = ? WHERE id = ?", [json.dumps(failed), job])
        for relay in json.loads(jrow["relays"]):
            self.db.execute(
                "INSERT OR REPLACE INTO fences (job, rank, incarnation, relay, confirmed) "
                "VALUES (?, ?, ?, ?, NULL)",
                [job, rank, incarnation, relay],
            )
        self._event(
            job,
            now,
            "rank_failed",
            f"{reason}: declared failed; the other ranks are told ({_mode_words(mode)})",
            rank,
        )
        alive = self._one(
            "SELECT COUNT(*) AS n FROM ranks WHERE job = ? AND state != 'failed'", [job]
        )
        if alive is not None and alive["n"] == 0:
            self._end(job, "failed", None, f"every rank failed; the last: {reason}", now)
        else:
            self._maybe_all_exited(job, now)

    def fences_for_relay(self, relay: str) -> list[api.RankFence]:
        """The fences ``relay`` has yet to put up, of running jobs."""
        return [
            api.RankFence(job=r["job"], rank=r["rank"], incarnation=r["incarnation"])
            for r in self.db.query(
                "SELECT f.job, f.rank, f.incarnation FROM fences f JOIN jobs j ON j.id = f.job "
                "WHERE f.relay = ? AND f.confirmed IS NULL AND j.state = 'running' "
                "ORDER BY f.job, f.rank",
                [relay],
            )
        ]

    def fences_put_up(self, relay: str, fenced: Sequence[api.RankFence], now: float) -> bool:
        """``relay`` has put up these fences; True if one was new (the agents of the ranks'
        jobs may have failures to tell)."""
        new = False
        with self.db.atomic():
            for f in fenced:
                cur = self.db.execute(
                    "UPDATE fences SET confirmed = ? WHERE job = ? AND rank = ? AND relay = ? "
                    "AND incarnation = ? AND confirmed IS NULL",
                    [now, f.job, f.rank, relay, f.incarnation],
                )
                new = new or cur.rowcount > 0
        return new

    def failures_for_agent(self, agent_id: str) -> list[api.JobFailures]:
        """The failed ranks to tell ``agent_id``'s ranks: of the running jobs it runs ranks of,
        each rank declared failed whose fence is up at every relay of the job. A relay that is
        down holds the news back until it is back (the job waits for it anyway), so that no
        rank hears of a failure while some relay would still take the failed rank's frames."""
        rows = self.db.query(
            "SELECT j.id, j.failed_ranks FROM jobs j WHERE j.state = 'running' "
            "AND j.failed_ranks != '[]' AND EXISTS (SELECT 1 FROM ranks r WHERE r.job = j.id "
            "AND r.agent = ? AND r.state IN ('leased', 'running')) ORDER BY j.id",
            [agent_id],
        )
        out: list[api.JobFailures] = []
        for row in rows:
            waiting = {
                int(r["rank"])
                for r in self.db.query(
                    "SELECT rank FROM fences WHERE job = ? AND confirmed IS NULL",
                    [row["id"]],
                )
            }
            ranks = [r for r in json.loads(row["failed_ranks"]) if r not in waiting]
            if ranks:
                out.append(api.JobFailures(job=int(row["id"]), ranks=ranks))
        return out

    def place_replacements(
        self,
        free: dict[str, int],
        offers: dict[str, scheduler.Offer],
        now: float,
        sign: Signer,
    ) -> list[int]:
        """Give pending replacement incarnations a slot from ``free`` (agent id -> free slots,
        updated in place) on an agent that may run the job (``offers``: what each agent's
        isolation report offers, ``scheduler.can_run``); return the jobs that got one. Runs
        inside ``schedule``'s transaction, before queued jobs, so new jobs never starve a
        running one. The agent is chosen with the rank's checkpoint images in mind
        (``_plan_replacement``)."""
        placed: list[int] = []
        pending = list(
            self.db.query(
                "SELECT r.job, r.rank, r.incarnation, r.relay, r.avoid, r.from_start, "
                "r.validating, r.spawn, COALESCE(NULLIF(j.space, 0), j.ranks) AS size, j.memory, "
                "j.unsandboxed "
                "FROM ranks r JOIN jobs j ON j.id = r.job "
                "WHERE r.state = 'pending' AND j.state = 'running' "
                "AND (r.not_before IS NULL OR r.not_before <= ?) "
                # A job with a relay down waits for it (its ranks could not attach), at most
                # relay_down_timeout (expire_relays).
                "AND NOT EXISTS (SELECT 1 FROM json_each(j.relays) jr JOIN relays rl "
                "ON rl.name = jr.value WHERE rl.state != 'alive') "
                "ORDER BY r.job, r.rank",
                [now],
            )
        )
        caps = self._agent_capabilities() if pending else {}
        for p in pending:
            fit = scheduler.open_to(
                free, offers, memory=p["memory"], unsandboxed=bool(p["unsandboxed"])
            )
            job, rank, incarnation = int(p["job"]), int(p["rank"]), int(p["incarnation"])
            round_ = int(p["validating"])
            if round_:
                # A re-execution for validation: an unrelated agent, from the beginning.
                # Drawn at random: a colluder cannot make itself the pick by its free slots.
                unrelated = [a for a, n in self._unrelated(job, rank, round_, fit).items() if n]
                plan = Plan(_random.choice(unrelated) if unrelated else None, [])
                if plan.agent is None:
                    self._validation_waits(job, rank, round_)
            else:
                plan = self._plan_replacement(p, fit, caps)
            agent = plan.agent
            if agent is None:
                if plan.waiting:
                    self._wait_for_restorer(p, plan.waiting, now)
                continue
            free[agent] -= 1
            claims = RankClaims(
                job=job,
                rank=rank,
                incarnation=incarnation,
                size=int(p["size"]),
                agent=agent,
                expires=now + scheduler.RANK_TOKEN_LIFETIME,
                validating=bool(round_),
            )
            self.db.execute(
                "UPDATE ranks SET agent = ?, state = 'leased', avoid = NULL, "
                "waiting_since = NULL WHERE job = ? AND rank = ?",
                [agent, job, rank],
            )
            self.db.execute(
                "INSERT INTO incarnations (job, rank, incarnation, agent, relay, token, created, "
                "validates) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [job, rank, incarnation, agent, p["relay"], sign(claims), now, round_],
            )
            if round_:
                self._validator_placed(job, rank, round_, incarnation, agent, now)
                placed.append(job)
                continue
            where = f"rank {rank} incarnation {incarnation} on agent {self._agent_name(agent)}"
            if p["spawn"] is not None and incarnation == 1:
                self._event(job, now, "rank_spawned", f"spawned {where}", rank)
            elif plan.restore:
                ckpts = ", ".join(str(c) for c in plan.restore)
                self._event(
                    job, now, "rank_restarted", f"{where}, to restore from checkpoint {ckpts}", rank
                )
            else:
                self._event(job, now, "rank_restarted", where, rank)
            if plan.note:
                self._event(
                    job,
                    now,
                    "rank_replaying",
                    f"rank {rank} incarnation {incarnation} starts from the beginning: {plan.note}",
                    rank,
                )
            placed.append(job)
        return placed

    # -- stale incarnations -------------------------------------------------------------------

    def _fenced_exit(self, agent_id: str, ex: api.RankExit, current: int, now: float) -> bool:
        """A replaced incarnation reports its exit: record it, change nothing else."""
        cursor = self.db.execute(
            "UPDATE incarnations SET exit_code = ?, ended = COALESCE(ended, ?) "
            "WHERE job = ? AND rank = ? AND incarnation = ? AND exit_code IS NULL",
            [ex.code, now, ex.job, ex.rank, ex.incarnation],
        )
        if not cursor.rowcount:
            return False
        self._event(
            ex.job,
            now,
            "rank_fenced",
            f"rank {ex.rank} incarnation {ex.incarnation} on agent {self._agent_name(agent_id)} "
            f"exited with code {ex.code} after it was replaced by incarnation {current}; "
            "ignored",
            ex.rank,
        )
        return True

    def _replaying(self, rs: api.RankState, now: float) -> bool:
        """The first heartbeat of a restarted incarnation: it re-runs from the beginning and
        replays its logged messages, and its determinants if it has any. A restored one is
        the ``rank_restored`` event of its restore report; one given images says nothing
        until its restore report says it starts from the beginning after all."""
        if (rs.incarnation <= 1 and rs.replay_dets <= 0) or rs.restored_from >= 0:
            return False
        cursor = self.db.execute(
            "UPDATE incarnations SET replay_dets = ? WHERE job = ? AND rank = ? "
            "AND incarnation = ? AND replay_dets IS NULL AND restored_from IS NULL "
            "AND (restore = '[]' OR restore_reported IS NOT NULL)",
            [rs.replay_dets, rs.job, rs.rank, rs.incarnation],
        )
        if not cursor.rowcount:
            return False
        self._event(
            rs.job,
            now,
            "rank_replaying",
            f"rank {rs.rank} incarnation {rs.incarnation} replays its logged messages and "
            f"{rs.replay_dets} determinant frame{'s' * (rs.replay_dets != 1)}",
            rs.rank,
        )
        return True
