"""Job life cycles in SQLite: submission, gang placement, leases, heartbeats, exits.

The rules come from ``scheduler``; this module applies them, one transaction per call, and writes
an event row for every transition and fault. Losses, replacements and relay faults are in
``sqlite_faults``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
import sqlite_utils

from vpool import requirements
from vpool.coordinator import migrations, scheduler
from vpool.coordinator.errors import BadRequest, Conflict, Forbidden, NotFound
from vpool.coordinator.sqlite_faults import FaultsMixin
from vpool.coordinator.sqlite_spawn import python_arguments
from vpool.coordinator.store import Quotas
from vpool.protocol import api
from vpool.protocol.tokens import RankClaims
from vpool.sizes import format_duration, format_size

Signer = Callable[[RankClaims], str]
TERMINAL_SQL = "('succeeded', 'failed', 'cancelled')"
MAX_REASON = 2000  # characters of an agent's message kept as a job's reason
UNFINISHED_OF_USER = "user = ? AND state IN ('queued', 'running')"  # what quotas count


class JobsMixin(FaultsMixin):
    db: sqlite_utils.Database
    quotas: Quotas

    def _one(self, sql: str, params: Any = ()) -> dict[str, Any] | None:
        raise NotImplementedError

    # -- reading ------------------------------------------------------------------------------

    def job_row(self, job_id: int) -> dict[str, Any] | None:
        return self._one("SELECT * FROM jobs WHERE id = ?", [job_id])

    def job_info(self, job_id: int) -> api.JobInfo | None:
        row = self.job_row(job_id)
        return None if row is None else _info(row)

    def list_jobs(self, user: str | None, limit: int) -> list[api.JobInfo]:
        return self.find_jobs(user, api.JobQuery(limit=limit)).jobs

    def find_jobs(self, user: str | None, query: api.JobQuery) -> api.JobPage:
        """``query``'s page of ``user``'s jobs (everyone's for None)."""
        where, params = ["1"], []
        if user is not None:
            where.append("user = ?")
            params.append(user)
        counts = self.count_jobs(user)
        if query.state is not None:
            where.append("state = ?")
            params.append(query.state)
        if query.name:
            where.append("instr(lower(name), ?) > 0")
            params.append(query.name.lower())
        cond = " AND ".join(where)
        total = self._one(f"SELECT COUNT(*) AS n FROM jobs WHERE {cond}", params)
        order = "DESC" if query.descending else "ASC"
        # ``query.sort`` is one of api.JOB_SORTS (msgspec checked it): a column name.
        assert query.sort in api.JOB_SORTS
        rows = self.db.query(
            f"SELECT * FROM jobs WHERE {cond} ORDER BY {query.sort} {order}, id {order} "
            "LIMIT ? OFFSET ?",
            [*params, query.limit, query.offset],
        )
        return api.JobPage(
            jobs=[_info(r) for r in rows], total=int(total["n"]) if total else 0, counts=counts
        )

    def job_detail(self, job_id: int) -> api.JobDetail | None:
        row = self.job_row(job_id)
        if row is None:
            return None
        ranks = [
            api.RankInfo(
                rank=r["rank"],
                incarnation=r["incarnation"],
                agent=r["agent"],
                relay=r["relay"],
                state=r["state"],
                exit_code=r["exit_code"],
                restored_from=-1 if r["restored_from"] is None else r["restored_from"],
                agent_name=r["agent_name"] or "",
                last_checkpoint=r["last_checkpoint"],
                validation=r["validation"],
                validated_by=r["validated_by"],
                suspended_since=(
                    r["suspended_since"] if r["state"] in scheduler.ACTIVE_RANK_STATES else None
                ),
            )
            for r in self.db.query(
                "SELECT r.*, i.restored_from, i.suspended_since, a.name AS agent_name, "
                "(SELECT MAX(c.created) FROM checkpoints c WHERE c.job = r.job AND c.rank = r.rank)"
                " AS last_checkpoint FROM ranks r LEFT JOIN incarnations i "
                "ON i.job = r.job AND i.rank = r.rank AND i.incarnation = r.incarnation "
                "LEFT JOIN agents a ON a.id = r.agent WHERE r.job = ? ORDER BY r.rank",
                [job_id],
            )
        ]
        events = [
            api.JobEvent(
                time=e["time"], kind=e["kind"], message=e["message"], rank=e["rank"], id=e["id"]
            )
            for e in self.db.query("SELECT * FROM events WHERE job = ? ORDER BY id", [job_id])
        ]
        return api.JobDetail(job=_info(row), ranks=ranks, events=events)

    def count_jobs(self, user: str | None = None) -> dict[str, int]:
        if user is None:
            rows = self.db.query("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state")
        else:
            rows = self.db.query(
                "SELECT state, COUNT(*) AS n FROM jobs WHERE user = ? GROUP BY state", [user]
            )
        return {str(r["state"]): int(r["n"]) for r in rows}

    # -- user actions -------------------------------------------------------------------------

    def create_job(self, user: str, sub: api.JobSubmit, now: float, space: int = 0) -> api.JobInfo:
        """Queue the job; ``Conflict`` (quota_exceeded) if it would take ``user`` past a
        quota (``_check_quotas``)."""
        validate = sub.validate or self.validation.validate_jobs
        with self.db.atomic():
            for blob, what in ((sub.bundle, "bundle"), (sub.stdin, "stdin")):
                # Checked again here: unused uploads are collected (``unused_blobs``) in a
                # transaction of their own, which this one either follows or precedes.
                if blob is not None and not self._one(
                    "SELECT 1 FROM blobs WHERE sha256 = ?", [blob]
                ):
                    raise BadRequest(
                        f"the {what} blob {blob} was not uploaded", code="unknown_blob"
                    )
            self._check_quotas(user, sub)
            cursor = self.db.execute(
                "INSERT INTO jobs (user, name, state, ranks, bundle, entry, args, stdin, created, "
                "fault_tolerance, job_uid, ckpt_key, checkpoint_every, memory, unsandboxed, "
                "requirements, validate, on_failure, universe, space, module) "
                "VALUES (?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    user,
                    sub.name,
                    sub.ranks,
                    sub.bundle,
                    sub.entry,
                    json.dumps(sub.args),
                    sub.stdin,
                    now,
                    int(sub.fault_tolerance),
                    migrations.new_job_uid(),
                    migrations.new_ckpt_key(),
                    sub.checkpoint_every,
                    sub.memory,
                    int(sub.unsandboxed),
                    json.dumps(sub.requirements),
                    int(validate),
                    sub.on_failure,
                    sub.universe or sub.ranks,
                    space or sub.ranks,
                    sub.module,
                ],
            )
            job_id = int(cursor.lastrowid or 0)
            for rank in range(sub.ranks):
                self.db.execute(
                    "INSERT INTO ranks (job, rank, state) VALUES (?, ?, 'pending')",
                    [job_id, rank],
                )
            if sub.on_failure in api.REPORTING_MODES:
                off = f", lost ranks are reported to the program (on-failure {sub.on_failure})"
            elif sub.on_failure == "abort":
                off = ", a lost rank fails the job (on-failure abort)"
            else:
                off = "" if sub.fault_tolerance else ", fault tolerance off"
            if sub.checkpoint_every > 0:
                off += f", a checkpoint every {sub.checkpoint_every:g} s"
            if sub.memory:
                off += f", {format_size(sub.memory)} of memory per rank"
            if sub.unsandboxed:
                off += ", unsandboxed agents accepted"
            if sub.requirements:
                off += f", needs {', '.join(sub.requirements)}"
            if validate:
                off += ", validated by replay" + (
                    "" if sub.validate else " (the pool validates every job)"
                )
            self._event(job_id, now, "queued", f"submitted by {user}: {sub.ranks} ranks{off}")
        info = self.job_info(job_id)
        assert info is not None
        return info

    def _check_quotas(self, user: str, sub: api.JobSubmit) -> None:
        """Refuse a job that would take ``user`` past ``max_queued_jobs`` jobs queued or
        running, or past ``max_user_blob_bytes`` of uploads held by those jobs (each distinct
        blob once: a sweep over one bundle holds it once). Inside ``create_job``'s
        transaction, so two submissions at once cannot both take the last place."""
        quotas = self.quotas
        row = self._one(f"SELECT COUNT(*) AS n FROM jobs WHERE {UNFINISHED_OF_USER}", [user])
        queued = int(row["n"]) if row else 0
        if queued >= quotas.max_queued_jobs:
            raise Conflict(
                f"you have {queued} jobs queued or running, as many as max_queued_jobs "
                f"({quotas.max_queued_jobs}) allows; submit more once some have ended",
                code="quota_exceeded",
            )
        mine = [sub.bundle, sub.stdin]
        own = self._blob_bytes("SELECT ? UNION SELECT ?", mine)
        held = self._blob_bytes(
            f"SELECT bundle FROM jobs WHERE {UNFINISHED_OF_USER} UNION "
            f"SELECT stdin FROM jobs WHERE {UNFINISHED_OF_USER} UNION SELECT ? UNION SELECT ?",
            [user, user, *mine],
        )
        limit = quotas.max_user_blob_bytes
        if own > limit:
            raise Conflict(
                f"this job's bundle and stdin hold {format_size(own)}, more than "
                f"max_user_blob_bytes ({format_size(limit)}) allows a user's unfinished jobs",
                code="quota_exceeded",
            )
        if held > limit:
            raise Conflict(
                f"with this job, the bundles and stdin of your queued and running jobs would "
                f"hold {format_size(held)}, more than max_user_blob_bytes "
                f"({format_size(limit)}); submit it once some of them have ended",
                code="quota_exceeded",
            )

    def _blob_bytes(self, shas: str, params: list[Any]) -> int:
        """Bytes of the distinct blobs the query ``shas`` names."""
        row = self._one(
            f"SELECT COALESCE(SUM(size), 0) AS n FROM blobs WHERE sha256 IN ({shas})", params
        )
        return int(row["n"]) if row else 0

    def cancel_job(self, job_id: int, now: float) -> api.JobInfo:
        with self.db.atomic():
            row = self.job_row(job_id)
            if row is None:
                raise NotFound(f"no job {job_id}", code="unknown_job")
            if row["state"] in api.TERMINAL_STATES:
                raise Conflict(
                    f"job {job_id} already ended ({row['state']}); there is nothing to cancel",
                    code="job_ended",
                )
            self._end(job_id, "cancelled", None, "cancelled by user", now)
        info = self.job_info(job_id)
        assert info is not None
        return info

    # -- scheduling ---------------------------------------------------------------------------

    def schedule(
        self, now: float, agent_deadline: float, relay_deadline: float, sign: Signer
    ) -> scheduler.Scheduled:
        """Place pending replacement incarnations, then start every queued job whose ranks all
        fit now on agents that may run them (``scheduler.can_run``), oldest first; the others
        get the reason they wait (``scheduler.queue_reason``). Only agents whose activity is
        "available" have free slots, the one available longest first among equals."""
        with self.db.atomic():
            live, free, offers = self._free_slots(agent_deadline)
            done = scheduler.Scheduled(started=self.place_replacements(free, offers, now, sign))
            queued = list(self.db.query("SELECT * FROM jobs WHERE state = 'queued' ORDER BY id"))
            if not queued:
                return done
            relays = [
                str(r["name"])
                for r in self.db.query(
                    "SELECT name FROM relays WHERE state = 'alive' AND last_seen >= ?",
                    [relay_deadline],
                )
            ]
            for job in queued:
                fit = scheduler.open_to(
                    free, offers, memory=job["memory"], unsandboxed=bool(job["unsandboxed"])
                )
                key = requirements.key(json.loads(job["requirements"]))
                has = {str(a["id"]) for a in live if key in json.loads(a["environments"])}
                placement = (
                    scheduler.plan_gang(job["ranks"], list(fit.items()), prefer=has)
                    if relays
                    else None
                )
                if placement is None:
                    views = [
                        scheduler.AgentView(
                            int(a["slots"]),
                            free[str(a["id"])],
                            offers[str(a["id"])],
                            available=a["activity"] == "available",
                        )
                        for a in live
                    ]
                    waiting = scheduler.queue_reason(
                        job["ranks"],
                        memory=job["memory"],
                        unsandboxed=bool(job["unsandboxed"]),
                        agents=views,
                        relays=len(relays),
                    )
                    if (waiting.reason, waiting.never) != (job["waiting"], bool(job["never_fits"])):
                        self.db.execute(
                            "UPDATE jobs SET waiting = ?, never_fits = ? WHERE id = ?",
                            [waiting.reason, int(waiting.never), job["id"]],
                        )
                        done.explained.append(int(job["id"]))
                    continue
                for agent in placement:
                    free[agent] -= 1
                self._start(job, placement, relays, now, sign)
                done.started.append(int(job["id"]))
        return done

    def _free_slots(
        self, agent_deadline: float
    ) -> tuple[list[dict[str, Any]], dict[str, int], dict[str, scheduler.Offer]]:
        """The live agents, the free slots of each (none unless it is available, the one
        available longest first), and what each offers (``scheduler.Offer``)."""
        live = list(
            self.db.query(
                "SELECT a.id, a.slots, a.free_slots, a.isolation, a.rank_memory, "
                "a.environments, a.activity, "
                "(SELECT COUNT(*) FROM ranks r WHERE r.agent = a.id "
                "AND r.state IN ('leased', 'running')) AS active "
                "FROM agents a WHERE a.state = 'alive' AND a.last_seen >= ? "
                "ORDER BY a.activity_since, a.id",
                [agent_deadline],
            )
        )
        free = {
            str(a["id"]): (
                scheduler.free_slots(a["slots"], a["free_slots"], a["active"])
                if a["activity"] == "available"
                else 0
            )
            for a in live
        }
        offers = {
            str(a["id"]): scheduler.Offer(str(a["isolation"]), int(a["rank_memory"])) for a in live
        }
        return live, free, offers

    def _start(
        self,
        job: dict[str, Any],
        placement: list[str],
        live: list[str],
        now: float,
        sign: Signer,
    ) -> None:
        job_id, size = int(job["id"]), space_of(job)
        # As many relays as first ranks (at most): what it spawns shares them, and a relay is
        # believed only about the jobs it serves.
        relays = scheduler.pick_relays(live, int(job["ranks"]), job_id)
        homes = scheduler.homes(size, len(relays))
        self.db.execute(
            "UPDATE jobs SET state = 'running', started = ?, relays = ?, waiting = '', "
            "never_fits = 0 WHERE id = ?",
            [now, json.dumps(relays), job_id],
        )
        for rank, agent in enumerate(placement):
            relay = relays[homes[rank]]
            claims = RankClaims(
                job=job_id,
                rank=rank,
                incarnation=1,
                size=size,
                agent=agent,
                expires=now + scheduler.RANK_TOKEN_LIFETIME,
            )
            self.db.execute(
                "UPDATE ranks SET incarnation = 1, agent = ?, relay = ?, state = 'leased' "
                "WHERE job = ? AND rank = ?",
                [agent, relay, job_id, rank],
            )
            self.db.execute(
                "INSERT INTO incarnations (job, rank, incarnation, agent, relay, token, created) "
                "VALUES (?, ?, 1, ?, ?, ?, ?)",
                [job_id, rank, agent, relay, sign(claims), now],
            )
        agents = len(set(placement))
        self._event(
            job_id,
            now,
            "running",
            f"placed {len(placement)} ranks on {agents} agent(s), relays {', '.join(relays)}",
        )

    def take_leases(self, agent_id: str, now: float) -> list[api.Lease]:
        """Leases placed on this agent and not yet handed out; each is handed out once. None
        while the agent is not available (suspended or leaving): those placed on it before
        wait (or go elsewhere: ``_give_back``)."""
        leases: list[api.Lease] = []
        with self.db.atomic():
            if self._one(
                "SELECT 1 FROM agents WHERE id = ? AND activity != 'available'", [agent_id]
            ):
                return leases
            rows = list(
                self.db.query(
                    "SELECT i.job, i.rank, i.incarnation, i.token, i.validates, r.from_start "
                    "FROM incarnations i "
                    "JOIN ranks r ON r.job = i.job AND r.rank = i.rank "
                    "AND r.incarnation = i.incarnation JOIN jobs j ON j.id = i.job "
                    "WHERE i.agent = ? AND i.delivered IS NULL AND r.state = 'leased' "
                    "AND j.state = 'running' ORDER BY i.job, i.rank",
                    [agent_id],
                )
            )
            jobs: dict[int, dict[str, Any]] = {}
            for row in rows:
                job = jobs.get(row["job"])
                if job is None:
                    job = jobs[row["job"]] = self._lease_context(row["job"])
                # A re-execution for validation never starts from an image: the original's
                # agent made them. Nor does it make any.
                validating = bool(row["validates"])
                restore = (
                    []
                    if validating
                    else self._lease_restore(row["job"], row["rank"], agent_id, job["names"])
                )
                spawn = self._spawn_of(row["job"], row["rank"])
                leases.append(
                    api.Lease(
                        job=row["job"],
                        rank=row["rank"],
                        incarnation=row["incarnation"],
                        size=job["space"],
                        token=row["token"],
                        bundle=job["bundle"],
                        entry=job["entry"],
                        args=job["args"],
                        stdin=job["stdin"],
                        relays=job["relays"],
                        homes=job["homes"],
                        env=job["env"],
                        job_uid=job["job_uid"],
                        ckpt_key=job["ckpt_key"],
                        checkpoint_every=0.0 if validating else job["checkpoint_every"],
                        restore=restore,
                        from_start=bool(row["from_start"]),
                        memory=job["memory"],
                        requirements=job["requirements"],
                        user=job["user"],
                        on_failure=job["on_failure"],
                        universe=job["universe"],
                        **spawn,
                    )
                )
                self.db.execute(
                    "UPDATE incarnations SET delivered = ?, restore = ? WHERE job = ? "
                    "AND rank = ? AND incarnation = ?",
                    [
                        now,
                        json.dumps([ref.ckpt for ref in restore]),
                        row["job"],
                        row["rank"],
                        row["incarnation"],
                    ],
                )
        return leases

    def _spawn_of(self, job: int, rank: int) -> dict[str, Any]:
        """The ``Lease`` fields that place a rank in its world: for one of the job's first
        ranks, its world is them all (said only when the job may spawn); for a spawned one,
        its spawn's processes, its parents and what it runs."""
        row = self._one(
            "SELECT j.ranks, j.space, j.module, j.entry, j.args, s.first, s.count, s.command, "
            "s.parent, s.ctx "
            "FROM ranks r JOIN jobs j ON j.id = r.job LEFT JOIN spawns s ON s.id = r.spawn "
            "WHERE r.job = ? AND r.rank = ?",
            [job, rank],
        )
        assert row is not None
        if row["first"] is None:
            space = row["space"] or row["ranks"]
            fields: dict[str, Any] = {
                "world": [] if space == row["ranks"] else list(range(row["ranks"]))
            }
            if row["module"]:
                args = json.loads(row["args"])
                fields["command"] = ["-m", row["module"], row["entry"], *args]
            return fields
        return {
            "world": list(range(row["first"], row["first"] + row["count"])),
            "parent": json.loads(row["parent"]),
            "parent_ctx": row["ctx"],
            "command": python_arguments(json.loads(row["command"])) or [],
        }

    def _lease_context(self, job_id: int) -> dict[str, Any]:
        job = self.job_row(job_id)
        assert job is not None
        names: list[str] = json.loads(job["relays"])
        info = {
            r["name"]: api.RelayInfo(name=r["name"], host=r["host"], port=r["port"])
            for r in self.db.query("SELECT name, host, port FROM relays")
        }
        space = space_of(job)
        homes = scheduler.homes(space, len(names))
        for r in self.db.query("SELECT rank, relay FROM ranks WHERE job = ?", [job_id]):
            homes[r["rank"]] = names.index(r["relay"])
        return {
            "ranks": job["ranks"],
            "space": space,
            "bundle": job["bundle"],
            "entry": job["entry"],
            "args": json.loads(job["args"]),
            "stdin": job["stdin"],
            "relays": [info[n] for n in names],
            "names": names,
            "homes": homes,
            # The rank runtime reads it once at Init: no determinants, no waiting for DetAck.
            "env": {} if job["fault_tolerance"] else {"VPOOL_FT": "0"},
            # Only agents ever see the key: it is in leases, never in JobInfo or JobDetail.
            "job_uid": job["job_uid"],
            "ckpt_key": job["ckpt_key"],
            "checkpoint_every": job["checkpoint_every"],
            # The agent lowers its own limit per rank to it (never raises it).
            "memory": job["memory"],
            "requirements": json.loads(job["requirements"]),
            # Who submitted it (the volunteer's ``vpool-agent status`` shows it).
            "user": job["user"] or "",
            "on_failure": job["on_failure"],
            "universe": job["universe"] or job["ranks"],
        }

    # -- agent reports ------------------------------------------------------------------------

    def agent_heartbeat(
        self, agent_id: str, hb: api.AgentHeartbeat, now: float, grace: float
    ) -> tuple[list[api.StopOrder], bool]:
        """Record the agent's activity and its ranks' states. Return stop orders for every rank
        the agent should not run, and whether a job changed. A rank handed to the agent more
        than ``grace`` seconds ago that the agent no longer reports is lost (e.g. the agent
        restarted). A rank reported suspended (or no longer) gets an event when that changes.
        An agent that is not available gives back the leases it has not taken yet."""
        stops: list[api.StopOrder] = []
        changed = False
        activity = hb.activity if hb.activity in scheduler.ACTIVITIES else "available"
        with self.db.atomic():
            self._agent_activity(agent_id, activity, hb.activity_reason, now)
            self._agent_caps(agent_id, hb.criu, hb.fingerprint)
            self._agent_isolation(agent_id, hb.isolation)
            self._agent_environments(agent_id, hb.environments, hb.env_fingerprints)
            for rs in hb.ranks:
                row = self._rank_row(rs)
                reason = _stop_reason(row, agent_id, rs.incarnation)
                if reason:
                    stops.append(_stop_order(rs, reason))
                    continue
                assert row is not None
                if rs.state == "running" and row["state"] == "leased":
                    self.db.execute(
                        # Running means attached to every relay: an outage streak is over.
                        "UPDATE ranks SET state = 'running', relay_losses = 0, "
                        "relay_since = NULL WHERE job = ? AND rank = ?",
                        [rs.job, rs.rank],
                    )
                    self._event(rs.job, now, "rank_running", f"rank {rs.rank} is running", rs.rank)
                    changed = True
                changed = self._suspension(rs, row, agent_id, hb.activity_reason, now) or changed
                self._restored_from(rs)
                changed = self._replaying(rs, now) or changed
            if activity != "available":
                changed = self._give_back(agent_id, activity, hb.activity_reason, now) or changed
            reported = {(rs.job, rs.rank, rs.incarnation) for rs in hb.ranks}
            missing = [
                r
                for r in self.db.query(
                    "SELECT r.job, r.rank, r.incarnation, r.state, i.offers FROM ranks r "
                    "JOIN incarnations i "
                    "ON i.job = r.job AND i.rank = r.rank AND i.incarnation = r.incarnation "
                    "WHERE r.agent = ? AND r.state IN ('leased', 'running') "
                    "AND i.delivered < ? ORDER BY r.job, r.rank",
                    [agent_id, now - grace],
                )
                if (r["job"], r["rank"], r["incarnation"]) not in reported
            ]
            if missing:
                name = self._agent_name(agent_id)
                for r in missing:
                    if (
                        activity == "available"
                        and r["state"] == "leased"
                        and r["offers"] < scheduler.LEASE_OFFERS
                    ):
                        # Never heard of at the agent: the answer that carried the lease was
                        # lost (an agent reports a rank from the moment it gets it). Handed
                        # out again, not restarted as lost.
                        self.db.execute(
                            "UPDATE incarnations SET delivered = NULL, offers = offers + 1 "
                            "WHERE job = ? AND rank = ? AND incarnation = ?",
                            [r["job"], r["rank"], r["incarnation"]],
                        )
                        self._event(
                            r["job"],
                            now,
                            "lease_offered_again",
                            f"rank {r['rank']} incarnation {r['incarnation']}: agent {name} "
                            "never reported its lease; offered again",
                            r["rank"],
                        )
                        changed = True
                        continue
                    reason = (
                        scheduler.left_reason(r["rank"], name)
                        if activity == "leaving"
                        else f"rank {r['rank']} lost: agent {name} no longer runs it"
                    )
                    lost = self._lose(r["job"], r["rank"], reason, now, suspect=False)
                    changed = lost or changed
        return stops, changed

    def _agent_activity(self, agent_id: str, activity: str, reason: str, now: float) -> None:
        """Remember what the agent's volunteer lets it do (inside its heartbeat's
        transaction), and since when: ``activity_since`` changes with the activity only."""
        self.db.execute(
            "UPDATE agents SET activity_since = CASE WHEN activity = ? THEN activity_since "
            "ELSE ? END, activity = ?, activity_reason = ? WHERE id = ? "
            "AND (activity != ? OR activity_reason != ?)",
            [activity, now, activity, reason, agent_id, activity, reason],
        )

    def _suspension(
        self, rs: api.RankState, row: dict[str, Any], agent_id: str, why: str, now: float
    ) -> bool:
        """A rank's first report as suspended (``rank_suspended``, with the agent's reason),
        or its first as not suspended after that (``rank_resumed``); True if either."""
        key = [rs.job, rs.rank, rs.incarnation]
        if rs.state == "suspended":
            if row["suspended_since"] is not None:
                return False
            since = scheduler.suspended_since(now, rs.suspended_for, row["handed"])
            self.db.execute(
                "UPDATE incarnations SET suspended_since = ? WHERE job = ? AND rank = ? "
                "AND incarnation = ?",
                [since, *key],
            )
            message = f"rank {rs.rank} suspended on agent {self._agent_name(agent_id)}"
            self._event(
                rs.job, now, "rank_suspended", f"{message}: {why}" if why else message, rs.rank
            )
            return True
        if row["suspended_since"] is None:
            return False
        self.db.execute(
            "UPDATE incarnations SET suspended_since = NULL WHERE job = ? AND rank = ? "
            "AND incarnation = ?",
            key,
        )
        frozen = format_duration(now - float(row["suspended_since"]))
        self._event(rs.job, now, "rank_resumed", f"rank {rs.rank} resumed after {frozen}", rs.rank)
        return True

    def _give_back(self, agent_id: str, activity: str, why: str, now: float) -> bool:
        """An agent that is suspended or leaving takes no new work: the leases placed on it
        that it has not taken yet go elsewhere (not counted as restarts: they never ran). Not
        those of a job without fault tolerance, whose ranks are never replaced: they wait."""
        rows = list(
            self.db.query(
                "SELECT r.job, r.rank FROM ranks r JOIN incarnations i ON i.job = r.job "
                "AND i.rank = r.rank AND i.incarnation = r.incarnation JOIN jobs j "
                "ON j.id = r.job WHERE r.agent = ? AND r.state = 'leased' "
                "AND i.delivered IS NULL AND j.state = 'running' AND j.fault_tolerance "
                "ORDER BY r.job, r.rank",
                [agent_id],
            )
        )
        changed = False
        for r in rows:
            reason = (
                f"rank {r['rank']} moved before it started: agent "
                f"{self._agent_name(agent_id)} is {activity}" + (f" ({why})" if why else "")
            )
            lost = self._lose(r["job"], r["rank"], reason, now, suspect=True, counted=False)
            changed = lost or changed
        return changed

    def _agent_environments(self, agent_id: str, keys: list[str], fps: list[str]) -> None:
        envs, prints = json.dumps(sorted(set(keys))), json.dumps(sorted(set(fps)))
        self.db.execute(
            "UPDATE agents SET environments = ?, env_fingerprints = ? WHERE id = ? "
            "AND (environments != ? OR env_fingerprints != ?)",
            [envs, prints, agent_id, envs, prints],
        )

    def _agent_isolation(self, agent_id: str, report: api.IsolationReport | None) -> None:
        """Remember how the agent isolates ranks, as its heartbeat says (inside its
        transaction). Every heartbeat says it: None (an agent from before sandboxes, or one
        still finding out) makes the agent ineligible again, like a fresh enrollment."""
        text = "" if report is None else msgspec.json.encode(report).decode()
        level = "" if report is None else report.level
        memory = 0 if report is None else report.rank_memory
        self.db.execute(
            "UPDATE agents SET isolation = ?, rank_memory = ?, isolation_report = ? "
            "WHERE id = ? AND isolation_report != ?",
            [level, memory, text, agent_id, text],
        )

    def stop_orders(self, agent_id: str, ranks: list[api.RankState]) -> list[api.StopOrder]:
        """The stop orders ``agent_heartbeat`` would give for ``ranks``, changing nothing."""
        stops = []
        for rs in ranks:
            reason = _stop_reason(self._rank_row(rs), agent_id, rs.incarnation)
            if reason:
                stops.append(_stop_order(rs, reason))
        return stops

    def _rank_row(self, rs: api.RankState) -> dict[str, Any] | None:
        """The rank of a reported incarnation, with its current incarnation's suspension and
        when it was handed to its agent."""
        return self._one(
            "SELECT r.incarnation, r.agent, r.state, j.state AS job_state, j.reason, "
            "i.suspended_since, COALESCE(i.delivered, i.created) AS handed "
            "FROM ranks r JOIN jobs j ON j.id = r.job LEFT JOIN incarnations i "
            "ON i.job = r.job AND i.rank = r.rank AND i.incarnation = r.incarnation "
            "WHERE r.job = ? AND r.rank = ?",
            [rs.job, rs.rank],
        )

    def rank_exit(self, agent_id: str, ex: api.RankExit, now: float) -> bool:
        """Apply a rank's exit; True if the job changed. The exit of a replaced incarnation
        changes nothing (event ``rank_fenced``); a ``lost`` exit of a running job's current
        incarnation gets it replaced."""
        with self.db.atomic():
            row = self._current(agent_id, ex.job, ex.rank, ex.incarnation)
            if (
                row is not None
                and row["validating"]
                and row["state"] in scheduler.ACTIVE_RANK_STATES
                and not ex.lost
            ):
                return self._validator_exited(agent_id, ex, int(row["validating"]), now)
            if row is None:
                now_row = self._one(
                    "SELECT incarnation FROM ranks WHERE job = ? AND rank = ?", [ex.job, ex.rank]
                )
                current = int(now_row["incarnation"]) if now_row else 0
                return self._fenced_exit(agent_id, ex, current, now)
            if row["state"] in ("exited", "lost", "failed"):
                return False
            if ex.lost and row["state"] in scheduler.ACTIVE_RANK_STATES:
                why = ex.message or (
                    f"killed by signal {-ex.code}" if ex.code < 0 else f"exit code {ex.code}"
                )
                name = self._agent_name(agent_id)
                activity = self._activity_of(agent_id)
                if activity == "leaving":
                    reason = f"{scheduler.left_reason(ex.rank, name)} ({why})"
                elif activity == "suspended":  # moved off a machine its owner uses
                    reason = f"rank {ex.rank} lost: agent {name} handed it back ({why})"
                else:
                    reason = f"rank {ex.rank} lost: its process on agent {name} died ({why})"
                return self._lose(ex.job, ex.rank, reason, now, suspect=False, exit_code=ex.code)
            claim = "" if row["state"] == "killed" else self._failure_claim(agent_id, ex, row, now)
            if claim is None:
                return True  # re-executed elsewhere before the job fails
            self.db.execute(
                "UPDATE incarnations SET ended = ?, exit_code = ? WHERE job = ? AND rank = ? "
                "AND incarnation = ?",
                [now, ex.code, ex.job, ex.rank, ex.incarnation],
            )
            if row["state"] == "killed":
                self.db.execute(
                    "UPDATE ranks SET exit_code = ? WHERE job = ? AND rank = ?",
                    [ex.code, ex.job, ex.rank],
                )
                return True  # its job's output may now be complete: wake the followers
            self.db.execute(
                "UPDATE ranks SET state = 'exited', exit_code = ? WHERE job = ? AND rank = ?",
                [ex.code, ex.job, ex.rank],
            )
            if ex.code != 0 or ex.aborted:
                reason = scheduler.exit_reason(ex.rank, ex.code, ex.aborted) + claim
                detail = f"{reason}: {ex.message}" if ex.message else reason
                self._event(ex.job, now, "rank_failed", detail, ex.rank)
                if ex.code == scheduler.EXIT_CANNOT_START and ex.message:
                    # The agent could not start it (a bundle or environment no agent could
                    # use): its words are the reason.
                    reason = ex.message[:MAX_REASON]
                self._end(ex.job, "failed", ex.code, reason, now)
                return True
            self._event(ex.job, now, "rank_exited", f"rank {ex.rank} exited with code 0", ex.rank)
            self._maybe_all_exited(ex.job, now)
            return True

    def _failure_claim(
        self, agent_id: str, ex: api.RankExit, row: dict[str, Any], now: float
    ) -> str | None:
        """A validated job does not take one agent's word that its rank failed (a rogue could
        fail an honest run at will): the first non-zero exit of a rank is re-executed on
        another agent, replaying its log, and None is returned. The re-execution's exit
        decides: the same failure fails the job (the returned words say it was confirmed), a
        clean exit proves the first agent wrong (it loses its validation streak, as an agent
        found wrong by validation does). "" when there is nothing to weigh."""
        failed = ex.code != 0 or ex.aborted
        claimed, claimant = row.get("claimed_exit"), row.get("claimed_by")
        job = self.job_row(ex.job)
        if job is None or not job["validate"]:
            return ""
        name = self._agent_name(agent_id)
        if claimant is None:
            if not failed:
                return ""
            self.db.execute(
                "UPDATE ranks SET claimed_exit = ?, claimed_by = ? WHERE job = ? AND rank = ?",
                [ex.code, agent_id, ex.job, ex.rank],
            )
            said = scheduler.exit_reason(ex.rank, ex.code, ex.aborted)
            self._lose(
                ex.job,
                ex.rank,
                f"{said} on agent {name}: a validated job's failure is re-executed on another "
                "agent before the job fails",
                now,
                suspect=True,
                counted=False,
                kind="rank_failure_challenged",
            )
            return None
        self.db.execute(
            "UPDATE ranks SET claimed_exit = NULL, claimed_by = NULL WHERE job = ? AND rank = ?",
            [ex.job, ex.rank],
        )
        first = self._agent_name(str(claimant))
        if not failed:
            self.db.execute(
                "UPDATE agents SET wrong = wrong + 1, agreed_streak = 0 WHERE id = ?",
                [claimant],
            )
            self._event(
                ex.job,
                now,
                "validation_wrong",
                f"rank {ex.rank}: agent {first} reported exit code {claimed}, its re-execution "
                f"on agent {name} exited 0: agent {first} was wrong",
                ex.rank,
            )
            return ""
        if ex.code == claimed:
            return f" (confirmed by its re-execution on agent {name})"
        return f" (agent {first} reported code {claimed} for it)"

    # -- helpers ------------------------------------------------------------------------------

    def _current(
        self, agent_id: str, job: int, rank: int, incarnation: int
    ) -> dict[str, Any] | None:
        """The rank row if ``incarnation`` is its current one; reports on stale incarnations
        are ignored. Raises if that incarnation was never leased to this agent."""
        inc = self._one(
            "SELECT agent FROM incarnations WHERE job = ? AND rank = ? AND incarnation = ?",
            [job, rank, incarnation],
        )
        if inc is None or inc["agent"] != agent_id:
            raise Forbidden(
                f"job {job} rank {rank} incarnation {incarnation} is not leased to this agent",
                code="not_your_rank",
            )
        row = self._one("SELECT * FROM ranks WHERE job = ? AND rank = ?", [job, rank])
        if row is None or row["incarnation"] != incarnation:
            return None
        return row

    def _end(self, job: int, state: str, exit_code: int | None, reason: str, now: float) -> None:
        """Move a job to a terminal state (no-op if it is already in one)."""
        row = self.job_row(job)
        if row is None or row["state"] in api.TERMINAL_STATES:
            return
        self.db.execute(
            "UPDATE jobs SET state = ?, exit_code = ?, reason = ?, finished = ? WHERE id = ?",
            [state, exit_code, reason, now, job],
        )
        # Ranks still running get stop orders in their agent's next heartbeat (see
        # agent_heartbeat); from here on they no longer hold a slot in our book.
        self.db.execute(
            "UPDATE ranks SET state = 'killed' WHERE job = ? AND state IN "
            "('pending', 'leased', 'running')",
            [job],
        )
        # A re-execution's stdout served its comparison (a corrected rank's is the job's now).
        self.db.execute("DELETE FROM validation_output WHERE job = ?", [job])
        self._event(job, now, state, reason)

    def _event(
        self, job: int, now: float, kind: str, message: str, rank: int | None = None
    ) -> None:
        self.db.execute(
            "INSERT INTO events (job, time, kind, rank, message) VALUES (?, ?, ?, ?, ?)",
            [job, now, kind, rank, message],
        )

    def _agent_name(self, agent_id: str) -> str:
        row = self._one("SELECT name FROM agents WHERE id = ?", [agent_id])
        return str(row["name"]) if row and row["name"] else agent_id


def _stop_order(rs: api.RankState, reason: str) -> api.StopOrder:
    return api.StopOrder(job=rs.job, rank=rs.rank, incarnation=rs.incarnation, reason=reason)


def _stop_reason(row: dict[str, Any] | None, agent_id: str, incarnation: int) -> str:
    if row is None:
        return "unknown job or rank"
    if row["job_state"] in api.TERMINAL_STATES:
        return scheduler.stop_reason(row["job_state"], row["reason"])
    if row["incarnation"] != incarnation:
        return f"incarnation {incarnation} was replaced by incarnation {row['incarnation']}"
    if row["agent"] != agent_id:
        return "the rank is not leased to this agent"
    if row["state"] == "failed":
        return "the rank was declared failed: the other ranks carry on without it"
    if row["state"] not in scheduler.ACTIVE_RANK_STATES:
        return f"rank is {row['state']}"
    return ""


def space_of(job: dict[str, Any]) -> int:
    """The rank numbers a job's tokens and routes cover (``jobs.space``; its ranks for a job
    from before spawning)."""
    return int(job["space"] or job["ranks"])


def _info(row: dict[str, Any]) -> api.JobInfo:
    return api.JobInfo(
        id=row["id"],
        name=row["name"],
        user=row["user"],
        state=row["state"],
        ranks=row["ranks"],
        exit_code=row["exit_code"],
        reason=row["reason"],
        created=row["created"],
        started=row["started"],
        finished=row["finished"],
        fault_tolerance=bool(row["fault_tolerance"]),
        checkpoint_every=row["checkpoint_every"],
        memory=row["memory"],
        unsandboxed=bool(row["unsandboxed"]),
        waiting=row["waiting"],
        never_fits=bool(row["never_fits"]),
        restarts=row["restarts"],
        requirements=json.loads(row["requirements"]),
        validate=bool(row["validate"]),
        validation=row["validation"],
        on_failure=row["on_failure"],
        failed_ranks=json.loads(row["failed_ranks"]),
        universe=row["universe"],
        spawned=row["spawned"],
        module=row["module"],
    )
