"""The SQLite implementation of ``Store``: blobs, agents, relays, output and results.

Users, tokens and sessions are in ``sqlite_accounts``; job life cycles (placement, exits,
losses) in ``sqlite_jobs``. Every method is synchronous and runs one transaction;
``store.Database`` calls them on a worker thread, one at a time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import sqlite_utils

from vpool.coordinator import migrations, scheduler
from vpool.coordinator.errors import Conflict, Forbidden
from vpool.coordinator.settings import CoordinatorSettings
from vpool.coordinator.sqlite_accounts import AccountsMixin
from vpool.coordinator.sqlite_credentials import CredentialsMixin
from vpool.coordinator.sqlite_jobs import JobsMixin
from vpool.coordinator.sqlite_spawn import SpawnMixin
from vpool.coordinator.store import OutputStored, Quotas
from vpool.coordinator.validation import Policy
from vpool.protocol import api
from vpool.sizes import format_size

# Seconds a transaction waits for another process's (``vpool-coordinator user add`` next to a
# running coordinator) before "database is locked".
BUSY_TIMEOUT = 10.0


class _Database(sqlite_utils.Database):
    """sqlite-utils' database whose transactions take the write lock at once (``BEGIN
    IMMEDIATE``). A deferred transaction that reads, then writes while another process (``user
    add`` next to a running coordinator) writes, gets "database is locked" at once: SQLite does
    not wait there, lest the two deadlock. An immediate one waits for the lock instead."""

    @contextlib.contextmanager
    def atomic(self) -> Iterator[sqlite_utils.Database]:
        if self.conn.in_transaction:
            with super().atomic() as db:  # a savepoint inside ours
                yield db
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self
        except BaseException:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
        else:
            self.conn.execute("COMMIT")


class SqliteStore(AccountsMixin, JobsMixin, SpawnMixin, CredentialsMixin):
    def __init__(
        self,
        path: Path | str,
        *,
        restarts: scheduler.RestartPolicy | None = None,
        restore_wait_timeout: float = 600.0,
        relay_down_timeout: float = 300.0,
        quotas: Quotas | None = None,
        validation: Policy | None = None,
    ) -> None:
        self.quotas = quotas or Quotas.of(CoordinatorSettings())
        self.validation = validation or Policy()
        self.restarts = restarts or scheduler.RestartPolicy()
        self.restore_wait_timeout = restore_wait_timeout
        self.relay_down_timeout = relay_down_timeout
        # check_same_thread=False: calls come from trio's worker threads, serialized by the
        # Database limiter. isolation_level=None: transactions are explicit (db.atomic()).
        conn = sqlite3.connect(
            str(path), check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT
        )
        self.db = _Database(conn)
        if str(path) != ":memory:":
            self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.schema_version = migrations.migrate(self.db)

    def close(self) -> None:
        self.db.close()

    def _one(self, sql: str, params: Any = ()) -> dict[str, Any] | None:
        rows = list(self.db.query(sql, params))
        return rows[0] if rows else None

    # -- blobs --------------------------------------------------------------------------------

    def add_blob(self, sha256: str, size: int, now: float, uploader: str | None = None) -> None:
        """Record an upload (by user ``uploader``; None: a rank's results); uploading a blob
        again makes it new (``unused_blobs``) and its uploader's."""
        self.db.execute(
            "INSERT INTO blobs (sha256, size, created, uploader) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(sha256) DO UPDATE SET created = excluded.created, "
            "uploader = COALESCE(excluded.uploader, uploader)",
            [sha256, size, now, uploader],
        )
        if uploader is not None:
            self.db.execute(
                "INSERT OR IGNORE INTO blob_owners (sha256, user) VALUES (?, ?)",
                [sha256, uploader],
            )

    def owns_blob(self, user: str, sha256: str) -> bool:
        """Whether ``user`` uploaded blob ``sha256`` (a hash alone gives nobody a blob)."""
        return bool(
            self._one(
                "SELECT 1 FROM blob_owners o JOIN blobs b ON b.sha256 = o.sha256 "
                "WHERE o.sha256 = ? AND o.user = ?",
                [sha256, user],
            )
        )

    def agent_may_fetch(self, agent: str, sha256: str) -> bool:
        """Whether ``agent`` holds a rank (an incarnation not ended) of a job whose bundle or
        stdin is blob ``sha256``: an agent fetches what it was leased, nothing else."""
        return bool(
            self._one(
                "SELECT 1 FROM incarnations i JOIN jobs j ON j.id = i.job "
                "WHERE i.agent = ? AND i.ended IS NULL AND (j.bundle = ? OR j.stdin = ?) "
                "LIMIT 1",
                [agent, sha256, sha256],
            )
        )

    def check_upload(self, user: str, sha256: str, size: int) -> None:
        """Refuse (``Conflict`` quota_exceeded) an upload that would take ``user``'s uploads
        that no job or result names yet past ``max_user_blob_bytes`` (a blob some job names
        already is always taken: it adds nothing)."""
        if self._one("SELECT 1 FROM jobs WHERE bundle = ? OR stdin = ? LIMIT 1", [sha256, sha256]):
            return
        row = self._one(
            "SELECT COALESCE(SUM(size), 0) AS n FROM blobs b WHERE uploader = ? "
            "AND sha256 != ? AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.bundle = b.sha256 "
            "OR j.stdin = b.sha256) "
            "AND NOT EXISTS (SELECT 1 FROM results r WHERE r.blob = b.sha256)",
            [user, sha256],
        )
        idle = int(row["n"]) if row else 0
        limit = self.quotas.max_user_blob_bytes
        if idle + size > limit:
            raise Conflict(
                f"with this upload ({format_size(size)}), your uploads that no job uses yet "
                f"would hold {format_size(idle + size)}, more than max_user_blob_bytes "
                f"({format_size(limit)}); submit jobs with the ones you uploaded (unused "
                "uploads are deleted a while after they were made)",
                code="quota_exceeded",
            )

    def unused_blobs(self, before: float) -> list[str]:
        """Forget the blobs uploaded before ``before`` that no job (bundle, stdin) and no
        result names, and return them: their files are to be deleted."""
        with self.db.atomic():
            rows = list(
                self.db.query(
                    "SELECT sha256 FROM blobs b WHERE created < ? "
                    "AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.bundle = b.sha256 "
                    "OR j.stdin = b.sha256) "
                    "AND NOT EXISTS (SELECT 1 FROM results r WHERE r.blob = b.sha256) "
                    "ORDER BY created LIMIT 10000",
                    [before],
                )
            )
            gone = [str(r["sha256"]) for r in rows]
            for sha in gone:
                self.db.execute("DELETE FROM blobs WHERE sha256 = ?", [sha])
                self.db.execute("DELETE FROM blob_owners WHERE sha256 = ?", [sha])
        return gone

    def blob_size(self, sha256: str) -> int | None:
        row = self._one("SELECT size FROM blobs WHERE sha256 = ?", [sha256])
        return None if row is None else int(row["size"])

    # -- agents -------------------------------------------------------------------------------

    def enroll_agent(
        self,
        public_key: str,
        name: str,
        slots: int,
        software: str,
        now: float,
        *,
        join_token_hash: str | None = None,
        open_enrollment: bool = False,
    ) -> str:
        """Id of the agent holding ``public_key``: the same key always gets the same id.
        ``Forbidden`` when the key may not enroll (``CredentialsMixin._admit_agent``)."""
        agent_id = "agent-" + hashlib.sha256(public_key.encode()).hexdigest()[:16]
        with self.db.atomic():
            admitted_by = self._admit_agent(agent_id, join_token_hash, now, open_=open_enrollment)
            if self._one("SELECT id FROM agents WHERE id = ?", [agent_id]):
                self.db.execute(
                    # A restarted agent's checkpoint capability and isolation are unknown
                    # until it says.
                    "UPDATE agents SET name = ?, slots = ?, free_slots = ?, software = ?, "
                    "last_seen = ?, state = 'alive', criu = '', fingerprint = '', "
                    "isolation = '', rank_memory = 0, isolation_report = '', "
                    "activity = 'available', activity_reason = '', activity_since = ? "
                    "WHERE id = ?",
                    [name, slots, slots, software, now, now, agent_id],
                )
            else:
                self.db.execute(
                    "INSERT INTO agents (id, public_key, name, slots, free_slots, software, "
                    "enrolled, last_seen, state, join_token, activity_since) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'alive', ?, ?)",
                    [
                        agent_id,
                        public_key,
                        name,
                        slots,
                        slots,
                        software,
                        now,
                        now,
                        admitted_by,
                        now,
                    ],
                )
        return agent_id

    def touch_agent(
        self, agent_id: str, now: float, free_slots: int | None, address: str = ""
    ) -> bool:
        """Record a sign of life (from ``address``, when known); False if the agent is
        unknown or banned. An agent lost or gone that is heard from again is alive, and its
        activity counts from now."""
        with self.db.atomic():
            if not self._one(
                "SELECT id FROM agents WHERE id = ? AND state != 'banned'", [agent_id]
            ):
                return False
            self.db.execute(
                "UPDATE agents SET last_seen = ?, state = 'alive', "
                "activity_since = CASE WHEN state = 'alive' THEN activity_since ELSE ? END, "
                "free_slots = COALESCE(?, free_slots), "
                "address = CASE WHEN ? = '' THEN address ELSE ? END WHERE id = ?",
                [
                    now,
                    now,
                    None if free_slots is None else max(0, free_slots),
                    address,
                    address,
                    agent_id,
                ],
            )
        return True

    def list_agents(self) -> list[dict[str, Any]]:
        return list(
            self.db.query(
                "SELECT a.id, a.name, a.slots, a.free_slots, a.last_seen, a.state, a.software, "
                "a.criu, a.fingerprint, a.isolation, a.rank_memory, a.isolation_report, a.banned, "
                "a.enrolled, a.join_token, a.agreed, a.agreed_streak, a.wrong, "
                "a.activity, a.activity_reason, a.activity_since, a.integrity_failures, "
                "(SELECT COUNT(*) FROM ranks r WHERE r.agent = a.id "
                "AND r.state IN ('leased', 'running')) AS active FROM agents a ORDER BY a.name"
            )
        )

    def count_live(self, agent_deadline: float, relay_deadline: float) -> tuple[int, int]:
        """Agents and relays that are alive and heard from since their deadline."""
        agents = self._one(
            "SELECT COUNT(*) AS n FROM agents WHERE state = 'alive' AND last_seen >= ?",
            [agent_deadline],
        )
        relays = self._one(
            "SELECT COUNT(*) AS n FROM relays WHERE state = 'alive' AND last_seen >= ?",
            [relay_deadline],
        )
        return (int(agents["n"]) if agents else 0, int(relays["n"]) if relays else 0)

    # -- relays -------------------------------------------------------------------------------

    def register_relay(self, reg: api.RelayRegister, now: float) -> None:
        with self.db.atomic():
            row = self._one("SELECT state FROM relays WHERE name = ?", [reg.name])
            if row is not None and row["state"] != "alive":
                self._relay_back(reg.name, now)
            self._upsert_relay(reg, now)

    def _upsert_relay(self, reg: api.RelayRegister, now: float) -> None:
        self.db.execute(
            "INSERT INTO relays (name, host, port, software, registered, last_seen, state) "
            "VALUES (?, ?, ?, ?, ?, ?, 'alive') ON CONFLICT(name) DO UPDATE SET "
            "host = excluded.host, port = excluded.port, software = excluded.software, "
            "registered = excluded.registered, last_seen = excluded.last_seen, state = 'alive'",
            [reg.name, reg.host, reg.port, reg.software, now, now],
        )

    def relay_heartbeat(
        self, name: str, load: api.RelayLoad, now: float, since: float, held: Sequence[int] = ()
    ) -> list[int] | None:
        """Record the heartbeat; return the jobs finished since ``since`` that used the relay
        and those of ``held`` (what the relay holds files of) that do not run on it (over long
        ago, never started, unknown), or None if the relay is unknown."""
        with self.db.atomic():
            row = self._one("SELECT state FROM relays WHERE name = ?", [name])
            if row is None:
                return None
            if row["state"] != "alive":
                self._relay_back(name, now)
            self.db.execute(
                "UPDATE relays SET last_seen = ?, state = 'alive', load = ? WHERE name = ?",
                [now, json.dumps(_load_dict(load)), name],
            )
            rows = self.db.query(
                "SELECT DISTINCT j.id FROM jobs j, json_each(j.relays) r WHERE r.value = ? "
                "AND j.state IN ('succeeded', 'failed', 'cancelled') AND j.finished >= ? "
                "ORDER BY j.id",
                [name, since],
            )
            over = {int(r["id"]) for r in rows}
            if held:
                running = {
                    int(r["id"])
                    for r in self.db.query(
                        "SELECT DISTINCT j.id FROM jobs j, json_each(j.relays) r "
                        "WHERE r.value = ? AND j.state = 'running'",
                        [name],
                    )
                }
                over.update(job for job in held if job not in running)
            return sorted(over)

    def list_relays(self) -> list[dict[str, Any]]:
        rows = list(self.db.query("SELECT * FROM relays ORDER BY name"))
        for row in rows:
            row["load"] = json.loads(row["load"])
        return rows

    # -- output and results -------------------------------------------------------------------

    def add_output(
        self, agent_id: str, chunks: list[api.OutputChunk], now: float | None = None
    ) -> OutputStored:
        """Store the new bytes of each chunk; return the jobs that got new output, and those
        that failed because their output went past ``max_job_output``.

        Only the rank's current incarnation is heard, and per (job, rank, stream) only bytes
        beyond the end of what is stored: a re-sent chunk, a restarted incarnation re-emitting
        its output from offset 0 and a replaced incarnation's late output add nothing. A job
        stores at most ``max_job_output`` bytes (``_output_room``). ``now`` is when a job that
        goes past it ends (the wall clock if None, for callers that never get that far)."""
        done = OutputStored()
        when = time.time() if now is None else now
        with self.db.atomic():
            for chunk in chunks:
                self._check_runs(agent_id, chunk.job, chunk.rank, chunk.incarnation)
                if not chunk.data or not self._is_current(chunk.job, chunk.rank, chunk.incarnation):
                    continue
                if self._validating_round(chunk.job, chunk.rank, chunk.incarnation):
                    self._add_validation_output(chunk, self.quotas.max_job_output)
                    continue
                last = self._one(
                    "SELECT offset, length(data) AS n FROM output WHERE job = ? AND rank = ? "
                    "AND stream = ? ORDER BY offset DESC LIMIT 1",
                    [chunk.job, chunk.rank, chunk.stream],
                )
                end = int(last["offset"]) + int(last["n"]) if last else 0
                skip = end - chunk.offset
                if skip >= len(chunk.data):
                    continue
                offset, data = (end, chunk.data[skip:]) if skip > 0 else (chunk.offset, chunk.data)
                data = data[: self._output_room(chunk, len(data), when, done)]
                if not data:
                    continue
                cursor = self.db.execute(
                    "INSERT OR IGNORE INTO output (job, rank, stream, offset, data) "
                    "VALUES (?, ?, ?, ?, ?)",
                    [chunk.job, chunk.rank, chunk.stream, offset, data],
                )
                if cursor.rowcount:
                    self.db.execute(
                        "UPDATE jobs SET output_bytes = output_bytes + ? WHERE id = ?",
                        [len(data), chunk.job],
                    )
                    done.changed.add(chunk.job)
        return done

    def _output_room(
        self, chunk: api.OutputChunk, size: int, now: float, done: OutputStored
    ) -> int:
        """How many of ``size`` new bytes of ``chunk`` its job may still store. The first
        time a job's output goes past ``max_job_output``, a job still running fails (its
        ranks get stop orders) and one that ended already gets an ``output_cut`` event."""
        limit = self.quotas.max_job_output
        job = self._one(
            "SELECT state, output_bytes, output_cut FROM jobs WHERE id = ?", [chunk.job]
        )
        assert job is not None  # the chunk's incarnation is current, so its job exists
        room = max(0, limit - int(job["output_bytes"]))
        if size <= room or job["output_cut"] is not None:
            return min(size, room)
        self.db.execute("UPDATE jobs SET output_cut = ? WHERE id = ?", [now, chunk.job])
        reason = (
            f"job output exceeded max_job_output ({format_size(limit)}): rank {chunk.rank}'s "
            f"{chunk.stream} went past it, and output beyond it is not stored"
        )
        if job["state"] in api.TERMINAL_STATES:
            self._event(chunk.job, now, "output_cut", reason, chunk.rank)
        else:
            self._end(chunk.job, "failed", None, reason, now)
            done.ended.add(chunk.job)
        return room

    def output_page(
        self, job: int, after: int, rank: int | None, limit: int, max_bytes: int = 0
    ) -> tuple[list[api.OutputRecord], bool]:
        """Records with id > ``after`` (at most ``limit``, and no more than ``max_bytes`` of
        data but for the first) and whether more remain. Rows past the bound are never read:
        a page of a job with 48 MiB of output holds what it shows, not the whole of it."""
        sql = "SELECT id, rank, stream, data FROM output WHERE job = ? AND id > ?"
        params: list[Any] = [job, after]
        if rank is not None:
            sql += " AND rank = ?"
            params.append(rank)
        records: list[api.OutputRecord] = []
        total = 0
        more = False
        cursor = self.db.execute(sql + " ORDER BY id LIMIT ?", [*params, limit + 1])
        try:
            for r in cursor:
                size = len(r[3])
                if len(records) == limit or (max_bytes and records and total + size > max_bytes):
                    more = True
                    break
                total += size
                records.append(api.OutputRecord(id=r[0], rank=r[1], stream=r[2], data=r[3]))
        finally:
            cursor.close()
        return records, more

    def running_ranks(self, job: int) -> int:
        row = self._one(
            "SELECT COUNT(*) AS n FROM ranks WHERE job = ? AND state = 'running'", [job]
        )
        return int(row["n"]) if row else 0

    def unsettled_ranks(self, job: int) -> int:
        """Ranks of an ended job whose current incarnation was handed to an agent and has not
        reported its exit yet: their last output (a traceback, say) may still come."""
        row = self._one(
            "SELECT COUNT(*) AS n FROM ranks r JOIN incarnations i ON i.job = r.job "
            "AND i.rank = r.rank AND i.incarnation = r.incarnation "
            "WHERE r.job = ? AND r.state = 'killed' AND i.delivered IS NOT NULL "
            "AND i.ended IS NULL",
            [job],
        )
        return int(row["n"]) if row else 0

    def output_streams(self, job: int) -> dict[tuple[int, str], bytes]:
        """Each rank's stdout and stderr, reassembled by offset."""
        streams: dict[tuple[int, str], bytearray] = {}
        for r in self.db.query(
            "SELECT rank, stream, offset, data FROM output WHERE job = ? "
            "ORDER BY rank, stream, offset",
            [job],
        ):
            buf = streams.setdefault((r["rank"], r["stream"]), bytearray())
            # Re-sent chunks may overlap what we hold: keep only the new tail.
            skip = len(buf) - r["offset"]
            data = r["data"][skip:] if skip > 0 else r["data"]
            buf += data
        return {key: bytes(value) for key, value in streams.items()}

    def add_result(
        self, agent_id: str, job: int, rank: int, incarnation: int, blob: str, files: str = ""
    ) -> None:
        """A run's results zip ``blob`` whose files have digest ``files``
        (``results.files_digest``)."""
        with self.db.atomic():
            self._check_runs(agent_id, job, rank, incarnation)
            if not self._is_current(job, rank, incarnation):
                return  # a replaced incarnation's results are not the job's
            round_ = self._validating_round(job, rank, incarnation)
            if round_:
                # A re-execution for validation: its files are compared, and become the
                # rank's if the original's are found wrong (``_replace_results``).
                self.db.execute(
                    "UPDATE validations SET files = ?, blob = ? WHERE job = ? AND rank = ? "
                    "AND round = ?",
                    [files, blob, job, rank, round_],
                )
                return
            self.db.execute(
                "INSERT OR REPLACE INTO results (job, rank, incarnation, blob, files) "
                "VALUES (?, ?, ?, ?, ?)",
                [job, rank, incarnation, blob, files],
            )

    def job_results(self, job: int) -> dict[int, str]:
        """Results blob of each rank: its newest incarnation's that uploaded some (only a
        current incarnation's are kept, and never a re-execution's for validation)."""
        rows = self.db.query(
            "SELECT s.rank, s.blob FROM results s WHERE s.job = ? AND s.incarnation = "
            "(SELECT MAX(t.incarnation) FROM results t WHERE t.job = s.job AND t.rank = s.rank)",
            [job],
        )
        return {int(r["rank"]): str(r["blob"]) for r in rows}

    def _is_current(self, job: int, rank: int, incarnation: int) -> bool:
        return bool(
            self._one(
                "SELECT 1 FROM ranks WHERE job = ? AND rank = ? AND incarnation = ?",
                [job, rank, incarnation],
            )
        )

    def _check_runs(self, agent_id: str, job: int, rank: int, incarnation: int) -> None:
        if not self._one(
            "SELECT 1 FROM incarnations WHERE job = ? AND rank = ? AND incarnation = ? "
            "AND agent = ?",
            [job, rank, incarnation, agent_id],
        ):
            raise Forbidden(
                f"job {job} rank {rank} incarnation {incarnation} is not leased to this agent",
                code="not_your_rank",
            )


def _load_dict(load: api.RelayLoad) -> dict[str, int]:
    return msgspec.structs.asdict(load)
