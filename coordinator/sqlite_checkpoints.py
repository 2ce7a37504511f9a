"""Checkpoints in SQLite: committed images, agents' restore capability, checkpoint orders,
restore reports, and the choice of images (and agent) for a replacement incarnation.

Per rank the coordinator keeps the images its home relay committed (``RelayCheckpoint``; the
relay's ``retained`` list replaces the rank's list, newest first) and ``ranks.from_start``:
false once an image was accepted, since the relay then drops the log entries behind it. A
replacement incarnation (``FaultsMixin.place_replacements``) is placed through
``_plan_replacement``: agents with CRIU and the fingerprint of one of the rank's images first;
the lease then carries those images (``_lease_restore``), never one made for another
fingerprint. With no such agent a rank that can still start from the beginning does; one that
cannot waits (``ranks.waiting_since``) and its job fails after ``restore_wait_timeout``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import sqlite_utils

from vpool.coordinator import scheduler
from vpool.coordinator.errors import BadRequest, Conflict, Forbidden
from vpool.protocol import api

MAX_TEXT = 2000
MAX_FINGERPRINT = 200
MAX_CKPT = 2**62
MAX_ATTEMPTS = 100
MAX_ACKS = 1024  # order ids one heartbeat acknowledges (as many as an agent remembers)
DIGEST_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Plan:
    """Where a pending replacement goes: ``agent`` (None: it waits) and why, for events.
    ``note`` is set when the rank has images but starts from the beginning anyway;
    ``waiting`` when it cannot be placed because no free agent can restore it."""

    agent: str | None
    restore: list[int]
    note: str = ""
    waiting: str = ""


class CheckpointsMixin:
    db: sqlite_utils.Database
    restore_wait_timeout: float

    # Provided by SqliteStore / JobsMixin.
    def _one(self, sql: str, params: Any = ()) -> dict[str, Any] | None:
        raise NotImplementedError

    def job_row(self, job_id: int) -> dict[str, Any] | None:
        raise NotImplementedError

    def _current(
        self, agent_id: str, job: int, rank: int, incarnation: int
    ) -> dict[str, Any] | None:
        raise NotImplementedError

    def _end(self, job: int, state: str, exit_code: int | None, reason: str, now: float) -> None:
        raise NotImplementedError

    def _event(
        self, job: int, now: float, kind: str, message: str, rank: int | None = None
    ) -> None:
        raise NotImplementedError

    def _agent_name(self, agent_id: str) -> str:
        raise NotImplementedError

    def _validating_round(self, job: int, rank: int, incarnation: int) -> int:
        raise NotImplementedError  # ValidationMixin

    # -- relays: committed images -------------------------------------------------------------

    def relay_checkpoint(self, report: api.RelayCheckpoint, now: float) -> bool:
        """Record a committed image; raises ``Conflict`` when the relay should delete it (the
        job is over or unknown, the rank or incarnation unknown)."""
        _check_report(report)
        with self.db.atomic():
            job = self.job_row(report.job)
            if job is None:
                raise Conflict(f"no job {report.job}", code="unknown_job")
            if report.name not in json.loads(job["relays"]):
                raise Forbidden(
                    f"relay {report.name} does not serve job {report.job}", code="not_your_job"
                )
            if job["state"] != "running":
                raise Conflict(f"job {report.job} is {job['state']}", code="job_over")
            row = self._one(
                "SELECT incarnation, relay FROM ranks WHERE job = ? AND rank = ?",
                [report.job, report.rank],
            )
            if row is None:
                raise Conflict(f"job {report.job} has no rank {report.rank}", code="unknown_rank")
            if row["relay"] != report.name:
                # A rank's images are kept by its home relay only.
                raise Forbidden(
                    f"relay {report.name} is not the home of job {report.job} rank {report.rank}",
                    code="not_your_rank",
                )
            if self._validating_round(report.job, report.rank, report.incarnation):
                raise Conflict(
                    f"job {report.job} rank {report.rank} incarnation {report.incarnation} "
                    "re-executes the rank for validation: its images are not kept",
                    code="validating_incarnation",
                )
            # An older incarnation's image is as good a starting point as the current one's:
            # the log entries after it are still held.
            if not 1 <= report.incarnation <= row["incarnation"]:
                raise Conflict(
                    f"job {report.job} rank {report.rank} has no incarnation {report.incarnation}",
                    code="unknown_incarnation",
                )
            old = self._one(
                "SELECT digest FROM checkpoints WHERE job = ? AND rank = ? AND ckpt = ?",
                [report.job, report.rank, report.ckpt],
            )
            self.db.execute(
                "INSERT OR REPLACE INTO checkpoints (job, rank, ckpt, incarnation, relay, size, "
                "digest, fingerprint, received, dets, meta, pos, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                [
                    report.job,
                    report.rank,
                    report.ckpt,
                    report.incarnation,
                    report.name,
                    report.size,
                    report.digest,
                    report.fingerprint,
                    msgspec.json.encode(report.received).decode(),
                    report.dets,
                    report.meta,
                    now,
                ],
            )
            keep = list(dict.fromkeys(report.retained))
            self.db.execute(
                "DELETE FROM checkpoints WHERE job = ? AND rank = ? AND ckpt NOT IN "
                "(SELECT value FROM json_each(?))",
                [report.job, report.rank, json.dumps(keep)],
            )
            for pos, ckpt in enumerate(keep):
                self.db.execute(
                    "UPDATE checkpoints SET pos = ? WHERE job = ? AND rank = ? AND ckpt = ?",
                    [pos, report.job, report.rank, ckpt],
                )
            if not job["validate"]:
                # The relay trims the log behind the image; a validated job's log is whole
                # (``api.CheckpointAccepted.trim``): its re-executions start from the beginning.
                self.db.execute(
                    "UPDATE ranks SET from_start = 0 WHERE job = ? AND rank = ?",
                    [report.job, report.rank],
                )
            if old is None or old["digest"] != report.digest:
                self._event(
                    report.job,
                    now,
                    "checkpoint",
                    f"rank {report.rank}: checkpoint {report.ckpt} committed "
                    f"({human_size(report.size)}{_timings(report.meta)})",
                    report.rank,
                )
        return True

    def rank_images(self, job: int, rank: int) -> list[dict[str, Any]]:
        """The rank's committed images, newest first."""
        return list(
            self.db.query(
                "SELECT * FROM checkpoints WHERE job = ? AND rank = ? ORDER BY pos, ckpt DESC",
                [job, rank],
            )
        )

    # -- users: checkpoint now ----------------------------------------------------------------

    def ask_checkpoint(self, job_id: int, rank: int | None) -> list[api.CheckpointOrder]:
        """Queue a checkpoint order for each running rank asked (all when ``rank`` is None)
        for the agent that runs it; return the orders."""
        with self.db.atomic():
            job = self.job_row(job_id)
            assert job is not None  # the caller checked the job is the user's
            if job["state"] != "running":
                raise Conflict(
                    f"job {job_id} is {job['state']}: only a running job can be checkpointed",
                    code="job_not_running",
                )
            if not job["fault_tolerance"]:
                raise Conflict(
                    f"job {job_id} runs with fault tolerance off: checkpoints need it",
                    code="fault_tolerance_off",
                )
            if rank is not None and not 0 <= rank < job["ranks"]:
                raise BadRequest(
                    f"job {job_id} has ranks 0 to {job['ranks'] - 1}, not {rank}", code="bad_rank"
                )
            rows = list(
                self.db.query(
                    "SELECT r.rank, r.incarnation, r.agent, r.state, a.criu FROM ranks r "
                    "LEFT JOIN agents a ON a.id = r.agent WHERE r.job = ? "
                    "AND (? IS NULL OR r.rank = ?) ORDER BY r.rank",
                    [job_id, rank, rank],
                )
            )
            running = [r for r in rows if r["state"] == "running" and r["agent"]]
            if not running:
                what = (
                    f"rank {rank} is {rows[0]['state']}, not running"
                    if rank is not None
                    else "no rank is running"
                )
                raise Conflict(
                    f"job {job_id}: {what}: nothing to checkpoint now", code="not_running"
                )
            # An agent without CRIU cannot make images: its ranks are not asked.
            running = [r for r in running if r["criu"]]
            if not running:
                what = f"rank {rank} runs" if rank is not None else "its ranks run"
                raise Conflict(
                    f"job {job_id}: {what} on agents without CRIU, which cannot checkpoint",
                    code="cannot_checkpoint",
                )
            orders = []
            for r in running:
                order = api.CheckpointOrder(
                    job=job_id, rank=r["rank"], incarnation=r["incarnation"]
                )
                self.db.execute(
                    "DELETE FROM checkpoint_orders WHERE job = ? AND rank = ?", [job_id, r["rank"]]
                )
                self.db.execute(
                    "INSERT INTO checkpoint_orders (agent, job, rank, incarnation) "
                    "VALUES (?, ?, ?, ?)",
                    [r["agent"], job_id, r["rank"], r["incarnation"]],
                )
                orders.append(order)
        return orders

    def take_checkpoint_orders(self, agent_id: str, acks: list[int]) -> list[api.CheckpointOrder]:
        """Forget the agent's orders it acknowledged (``acks``) and every order that can never
        apply; return the agent's orders whose rank now runs.

        At-least-once: an order is handed out in every heartbeat answer until the agent
        acknowledges its id (an answer may be lost: a held heartbeat the agent gave up, a broken
        connection); the agent de-duplicates by id. An order whose rank is still starting
        (``leased``) stays queued, not handed out. One that can never apply (the rank's
        incarnation moved on, the rank is on another agent, the rank or its job ended) is
        deleted, whichever agent it was for, so a dead agent's orders go too. No age limit:
        ``ask_checkpoint`` keeps at most one order per rank, so the table never holds more than
        the ranks of running jobs; an order for a rank slow to start must not expire."""
        with self.db.atomic():
            if acks:
                self.db.execute(
                    "DELETE FROM checkpoint_orders WHERE agent = ? "
                    "AND id IN (SELECT value FROM json_each(?))",
                    [agent_id, json.dumps(acks[:MAX_ACKS])],
                )
            self.db.execute(
                "DELETE FROM checkpoint_orders WHERE id IN (SELECT o.id FROM checkpoint_orders o "
                "LEFT JOIN ranks r ON r.job = o.job AND r.rank = o.rank "
                "LEFT JOIN jobs j ON j.id = o.job WHERE r.rank IS NULL "
                "OR j.state IS NOT 'running' OR r.incarnation != o.incarnation "
                "OR r.agent IS NOT o.agent OR r.state NOT IN ('leased', 'running'))"
            )
            rows = list(
                self.db.query(
                    "SELECT o.id, o.job, o.rank, o.incarnation FROM checkpoint_orders o "
                    "JOIN ranks r ON r.job = o.job AND r.rank = o.rank "
                    "WHERE o.agent = ? AND r.state = 'running' ORDER BY o.job, o.rank",
                    [agent_id],
                )
            )
        return [
            api.CheckpointOrder(
                job=r["job"], rank=r["rank"], incarnation=r["incarnation"], id=r["id"]
            )
            for r in rows
        ]

    # -- agents: capability, failures, restore reports ----------------------------------------

    def _agent_caps(self, agent_id: str, criu: str, fingerprint: str) -> None:
        """Remember what an agent's heartbeat says it can restore (inside its transaction)."""
        criu, fingerprint = criu[:MAX_FINGERPRINT], fingerprint[:MAX_FINGERPRINT]
        self.db.execute(
            "UPDATE agents SET criu = ?, fingerprint = ? WHERE id = ? "
            "AND (criu != ? OR fingerprint != ?)",
            [criu, fingerprint, agent_id, criu, fingerprint],
        )

    def _restored_from(self, rs: api.RankState) -> None:
        if rs.restored_from >= 0:
            self.db.execute(
                "UPDATE incarnations SET restored_from = ? WHERE job = ? AND rank = ? "
                "AND incarnation = ? AND restored_from IS NULL",
                [rs.restored_from, rs.job, rs.rank, rs.incarnation],
            )

    def checkpoint_failed(self, agent_id: str, cf: api.CheckpointFailed, now: float) -> bool:
        with self.db.atomic():
            if self._current(agent_id, cf.job, cf.rank, cf.incarnation) is None:
                return False
            message = " ".join(cf.message.split())[:MAX_TEXT] or "no reason given"
            self._event(
                cf.job,
                now,
                "checkpoint_failed",
                f"rank {cf.rank} incarnation {cf.incarnation}: checkpoint {cf.ckpt} failed on "
                f"agent {self._agent_name(agent_id)}: {message}",
                cf.rank,
            )
        return True

    def restore_report(self, agent_id: str, rr: api.RestoreReport, now: float) -> bool:
        """How a replacement incarnation started: events ``restore_failed`` for each image it
        could not use and ``rank_restored`` when one worked. Once per incarnation."""
        if rr.ckpt < -1 or len(rr.tried) > MAX_ATTEMPTS:
            raise BadRequest("a restore report names a checkpoint >= -1 and at most 100 tries")
        with self.db.atomic():
            if self._current(agent_id, rr.job, rr.rank, rr.incarnation) is None:
                return False
            cursor = self.db.execute(
                "UPDATE incarnations SET restore_reported = ?, "
                "restored_from = COALESCE(restored_from, ?) WHERE job = ? AND rank = ? "
                "AND incarnation = ? AND restore_reported IS NULL",
                [now, rr.ckpt if rr.ckpt >= 0 else None, rr.job, rr.rank, rr.incarnation],
            )
            if not cursor.rowcount:
                return False
            who = f"rank {rr.rank} incarnation {rr.incarnation}"
            for attempt in rr.tried:
                reason = " ".join(attempt.reason.split())[:MAX_TEXT] or "no reason given"
                self._event(
                    rr.job,
                    now,
                    "restore_failed",
                    f"{who}: checkpoint {attempt.ckpt} not used: {reason}",
                    rr.rank,
                )
            if rr.ckpt >= 0:
                self._event(
                    rr.job,
                    now,
                    "rank_restored",
                    f"{who} restored from checkpoint {rr.ckpt}",
                    rr.rank,
                )
        return True

    # -- replacements -------------------------------------------------------------------------

    def _plan_replacement(
        self, p: dict[str, Any], free: dict[str, int], caps: dict[str, Cap]
    ) -> Plan:
        """Choose the agent (from ``free``) and the images for pending rank ``p``."""
        images = self.rank_images(p["job"], p["rank"])
        if not images and p["from_start"]:
            return Plan(scheduler.pick_agent(free, p["avoid"]), [])
        if not images:
            return Plan(None, [], waiting="none of its checkpoint images is left")
        able = restorers(images, caps)
        open_able = {a: n for a, n in free.items() if a in able}
        if p["from_start"]:
            agent = scheduler.pick_agent(free, p["avoid"], prefer=able)
        else:
            agent = scheduler.pick_agent(open_able, p["avoid"])
        if agent is not None:
            restore = matching(images, caps.get(agent))
            note = "" if restore else self._why_not_restored(images, caps.get(agent), agent)
            return Plan(agent, restore, note=note)
        if p["from_start"]:
            return Plan(None, [])  # no free slot at all: it waits like any replacement
        fingerprints = ", ".join(sorted({short(i["fingerprint"]) for i in images}))
        ckpts = ", ".join(str(i["ckpt"]) for i in images)
        if any(a in able for a in free):
            why = "every agent that can restore its checkpoint images is busy"
        else:
            why = (
                f"no live agent has CRIU and the environment fingerprint ({fingerprints}) "
                f"of its checkpoint images ({ckpts})"
            )
        return Plan(None, [], waiting=why)

    def _why_not_restored(self, images: list[dict[str, Any]], cap: Cap | None, agent: str) -> str:
        ckpts = ", ".join(str(i["ckpt"]) for i in images)
        criu, fingerprint, _ = cap or Cap("", "")
        name = self._agent_name(agent)
        if not criu:
            return f"agent {name} cannot restore its checkpoint images ({ckpts}): no CRIU"
        return (
            f"its checkpoint images ({ckpts}) were made for another environment than agent "
            f"{name}'s (fingerprint {short(fingerprint)})"
        )

    def _agent_capabilities(self) -> dict[str, Cap]:
        return {str(r["id"]): _cap(r) for r in self.db.query(CAP_QUERY)}

    def _wait_for_restorer(self, p: dict[str, Any], why: str, now: float) -> None:
        """A replacement that can only start from an image found no agent: event once."""
        cursor = self.db.execute(
            "UPDATE ranks SET waiting_since = ? WHERE job = ? AND rank = ? "
            "AND waiting_since IS NULL",
            [now, p["job"], p["rank"]],
        )
        if cursor.rowcount:
            self._event(
                p["job"],
                now,
                "rank_waiting_restore",
                f"rank {p['rank']} incarnation {p['incarnation']} waits: it can only restart "
                f"from a checkpoint image (its home relay dropped the log before it) and {why}; "
                f"the job fails if it cannot start within {self.restore_wait_timeout:g} s",
                p["rank"],
            )

    def expire_restore_waits(self, now: float) -> bool:
        """Fail the jobs of ranks that waited longer than ``restore_wait_timeout`` for an agent
        that can restore them."""
        changed = False
        with self.db.atomic():
            rows = list(
                self.db.query(
                    "SELECT r.job, r.rank FROM ranks r JOIN jobs j ON j.id = r.job "
                    "WHERE r.state = 'pending' AND j.state = 'running' "
                    "AND r.waiting_since < ? ORDER BY r.job, r.rank",
                    [now - self.restore_wait_timeout],
                )
            )
            for r in rows:
                images = self.rank_images(r["job"], r["rank"])
                fingerprints = ", ".join(sorted({short(i["fingerprint"]) for i in images}))
                reason = (
                    f"rank {r['rank']} could not be restarted: it can only start from a "
                    f"checkpoint image, and no agent with CRIU and its environment fingerprint "
                    f"({fingerprints or 'none'}) had a free slot within "
                    f"{self.restore_wait_timeout:g} s"
                )
                self._end(r["job"], "failed", None, reason, now)
                changed = True
        return changed

    def _lease_restore(
        self, job: int, rank: int, agent_id: str, relays: list[str]
    ) -> list[api.CheckpointRef]:
        """The images a lease of (job, rank) on this agent carries, newest first: only those
        made for the agent's fingerprint, and none if it has no CRIU."""
        row = self._one(f"{CAP_QUERY} WHERE id = ?", [agent_id])
        cap = _cap(row) if row is not None else None
        if cap is None or not cap.criu or not cap.fingerprint:
            return []
        return [
            api.CheckpointRef(
                ckpt=i["ckpt"],
                incarnation=i["incarnation"],
                relay=relays.index(i["relay"]),
                size=i["size"],
                digest=i["digest"],
                fingerprint=i["fingerprint"],
                received=msgspec.json.decode(i["received"], type=dict[int, int]),
                dets=i["dets"],
                meta=i["meta"],
            )
            for i in self.rank_images(job, rank)
            if cap.fits(i["fingerprint"]) and i["relay"] in relays
        ]


class Cap(NamedTuple):
    """What an agent can restore: CRIU (its version, "" for none), its environment
    fingerprint, and the fingerprints of images made in the job environments it has built
    (``AgentHeartbeat.env_fingerprints``)."""

    criu: str
    fingerprint: str
    env: frozenset[str] = frozenset()

    def fits(self, fingerprint: str) -> bool:
        if not self.criu or not self.fingerprint:
            return False
        return fingerprint == self.fingerprint or fingerprint in self.env


def restorers(images: list[dict[str, Any]], caps: dict[str, Cap]) -> set[str]:
    """Agents that could restore one of ``images``: CRIU present and a fingerprint of one."""
    return {a for a, cap in caps.items() if any(cap.fits(i["fingerprint"]) for i in images)}


def matching(images: list[dict[str, Any]], cap: Cap | None) -> list[int]:
    if cap is None:
        return []
    return [int(i["ckpt"]) for i in images if cap.fits(i["fingerprint"])]


CAP_QUERY = "SELECT id, criu, fingerprint, env_fingerprints FROM agents"


def _cap(row: dict[str, Any]) -> Cap:
    env = frozenset(json.loads(row["env_fingerprints"] or "[]"))
    return Cap(str(row["criu"]), str(row["fingerprint"]), env)


def short(fingerprint: str) -> str:
    return fingerprint[:12] or "none"


def human_size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value >= 10 else f"{value:.1f} {unit}"
    return f"{n} bytes"


def _check_report(report: api.RelayCheckpoint) -> None:
    if not 0 <= report.ckpt <= MAX_CKPT or report.size < 0 or report.dets < 0:
        raise BadRequest("ckpt, size and dets of a checkpoint report are >= 0")
    if not DIGEST_HEX.fullmatch(report.digest):
        raise BadRequest("digest of a checkpoint report is 64 lowercase hex digits")
    if not report.fingerprint or len(report.fingerprint) > MAX_FINGERPRINT:
        raise BadRequest(f"fingerprint of a checkpoint report is 1 to {MAX_FINGERPRINT} chars")
    if any(not 0 <= c <= MAX_CKPT for c in report.retained):
        raise BadRequest("retained checkpoints are >= 0")


def _timings(meta: bytes) -> str:
    """The text ", pause 1.2 ms, dump 0.31 s" from the agent's manifest (msgpack; opaque to relays),
    or "" when it says nothing usable."""
    try:
        manifest = msgspec.msgpack.decode(meta)
    except (msgspec.DecodeError, ValueError):
        return ""
    if not isinstance(manifest, dict):
        return ""
    out = ""
    for key, label, unit in (
        ("pause_ms", "pause", "ms"),
        ("pause_cpu_ms", "pause cpu", "ms"),
        ("dump_s", "dump", "s"),
    ):
        value = manifest.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out += f", {label} {value:.2f} {unit}" if unit == "s" else f", {label} {value:.1f} ms"
    return out
