"""Numbered schema migrations of the SQLite store.

``schema_version`` holds one row: the number of migrations applied. ``migrate`` applies the
missing ones in order, each in its own transaction, so a crash leaves the db at a known version.
Append new migrations; never edit one that has shipped.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Callable

import sqlite_utils


def _m1_initial(db: sqlite_utils.Database) -> None:
    for sql in (
        """CREATE TABLE users (
            name TEXT PRIMARY KEY,
            token_hash TEXT NOT NULL UNIQUE,
            created REAL NOT NULL)""",
        """CREATE TABLE jobs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            user TEXT NOT NULL,
            name TEXT NOT NULL,
            state TEXT NOT NULL,
            ranks INTEGER NOT NULL,
            bundle TEXT NOT NULL,
            entry TEXT NOT NULL,
            args TEXT NOT NULL,
            stdin TEXT,
            exit_code INTEGER,
            reason TEXT NOT NULL DEFAULT '',
            created REAL NOT NULL,
            started REAL,
            finished REAL,
            relays TEXT NOT NULL DEFAULT '[]')""",
        "CREATE INDEX jobs_user ON jobs(user, id)",
        "CREATE INDEX jobs_state ON jobs(state, id)",
        """CREATE TABLE ranks (
            job INTEGER NOT NULL,
            rank INTEGER NOT NULL,
            incarnation INTEGER NOT NULL DEFAULT 0,
            agent TEXT,
            relay TEXT,
            state TEXT NOT NULL,
            exit_code INTEGER,
            PRIMARY KEY (job, rank))""",
        "CREATE INDEX ranks_agent ON ranks(agent, state)",
        """CREATE TABLE incarnations (
            job INTEGER NOT NULL,
            rank INTEGER NOT NULL,
            incarnation INTEGER NOT NULL,
            agent TEXT NOT NULL,
            relay TEXT NOT NULL,
            token TEXT NOT NULL,
            delivered REAL,
            created REAL NOT NULL,
            ended REAL,
            exit_code INTEGER,
            PRIMARY KEY (job, rank, incarnation))""",
        """CREATE TABLE agents (
            id TEXT PRIMARY KEY,
            public_key TEXT NOT NULL UNIQUE,
            name TEXT NOT NULL,
            slots INTEGER NOT NULL,
            free_slots INTEGER NOT NULL,
            software TEXT NOT NULL DEFAULT '',
            enrolled REAL NOT NULL,
            last_seen REAL NOT NULL,
            state TEXT NOT NULL)""",
        """CREATE TABLE relays (
            name TEXT PRIMARY KEY,
            host TEXT NOT NULL,
            port INTEGER NOT NULL,
            software TEXT NOT NULL DEFAULT '',
            registered REAL NOT NULL,
            last_seen REAL NOT NULL,
            state TEXT NOT NULL,
            load TEXT NOT NULL DEFAULT '{}')""",
        """CREATE TABLE blobs (
            sha256 TEXT PRIMARY KEY,
            size INTEGER NOT NULL,
            created REAL NOT NULL)""",
        """CREATE TABLE events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            job INTEGER NOT NULL,
            time REAL NOT NULL,
            kind TEXT NOT NULL,
            rank INTEGER,
            message TEXT NOT NULL)""",
        "CREATE INDEX events_job ON events(job, id)",
        """CREATE TABLE output (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            job INTEGER NOT NULL,
            rank INTEGER NOT NULL,
            stream TEXT NOT NULL,
            offset INTEGER NOT NULL,
            data BLOB NOT NULL,
            UNIQUE (job, rank, stream, offset))""",
        "CREATE INDEX output_job ON output(job, id)",
        """CREATE TABLE results (
            job INTEGER NOT NULL,
            rank INTEGER NOT NULL,
            incarnation INTEGER NOT NULL,
            blob TEXT NOT NULL,
            PRIMARY KEY (job, rank, incarnation))""",
    ):
        db.execute(sql)


def _m2_fault_tolerance(db: sqlite_utils.Database) -> None:
    """Replacement incarnations: restarts per job, the agent a replacement should avoid, why an
    incarnation was lost, the determinants it replays (reported once)."""
    for sql in (
        "ALTER TABLE jobs ADD COLUMN restarts INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE ranks ADD COLUMN avoid TEXT",
        "ALTER TABLE incarnations ADD COLUMN lost TEXT",
        "ALTER TABLE incarnations ADD COLUMN replay_dets INTEGER",
        "CREATE INDEX ranks_state ON ranks(state, job)",
    ):
        db.execute(sql)


def _m3_fault_tolerance_switch(db: sqlite_utils.Database) -> None:
    """Jobs submitted with fault tolerance off (``JobSubmit.fault_tolerance``): no logging, a
    lost rank fails the job. Jobs from before were all fault tolerant."""
    db.execute("ALTER TABLE jobs ADD COLUMN fault_tolerance INTEGER NOT NULL DEFAULT 1")


def _m4_checkpoints(db: sqlite_utils.Database) -> None:
    """Checkpoints (issue 5). Jobs get a random uid and image key (jobs from before get theirs
    here), ranks whether they can still start from the beginning and since when they wait for
    an agent that can restore them, incarnations the images chosen for them and the one they
    were restored from, agents their CRIU version and environment fingerprint. ``checkpoints``
    holds the committed images relays reported (``pos``: place in the relay's newest-first
    ``retained`` list); ``checkpoint_orders`` the ``vsdk checkpoint`` orders their agent has
    not acknowledged yet."""
    for sql in (
        "ALTER TABLE jobs ADD COLUMN job_uid TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE jobs ADD COLUMN ckpt_key TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE jobs ADD COLUMN checkpoint_every REAL NOT NULL DEFAULT 0",
        "ALTER TABLE ranks ADD COLUMN from_start INTEGER NOT NULL DEFAULT 1",
        "ALTER TABLE ranks ADD COLUMN waiting_since REAL",
        "ALTER TABLE incarnations ADD COLUMN restore TEXT NOT NULL DEFAULT '[]'",
        "ALTER TABLE incarnations ADD COLUMN restored_from INTEGER",
        "ALTER TABLE incarnations ADD COLUMN restore_reported REAL",
        "ALTER TABLE agents ADD COLUMN criu TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE agents ADD COLUMN fingerprint TEXT NOT NULL DEFAULT ''",
        """CREATE TABLE checkpoints (
            job INTEGER NOT NULL,
            rank INTEGER NOT NULL,
            ckpt INTEGER NOT NULL,
            incarnation INTEGER NOT NULL,
            relay TEXT NOT NULL,
            size INTEGER NOT NULL,
            sha256 TEXT NOT NULL,
            fingerprint TEXT NOT NULL,
            received TEXT NOT NULL,
            dets INTEGER NOT NULL,
            meta BLOB NOT NULL,
            pos INTEGER NOT NULL,
            created REAL NOT NULL,
            PRIMARY KEY (job, rank, ckpt))""",
        """CREATE TABLE checkpoint_orders (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            agent TEXT NOT NULL,
            job INTEGER NOT NULL,
            rank INTEGER NOT NULL,
            incarnation INTEGER NOT NULL)""",
        "CREATE INDEX checkpoint_orders_agent ON checkpoint_orders(agent, id)",
    ):
        db.execute(sql)
    for row in list(db.query("SELECT id FROM jobs")):
        db.execute(
            "UPDATE jobs SET job_uid = ?, ckpt_key = ? WHERE id = ?",
            [new_job_uid(), new_ckpt_key(), row["id"]],
        )


def _m5_image_digest_blake3(db: sqlite_utils.Database) -> None:
    """Checkpoint images are digested with BLAKE3-256 instead of SHA-256, so the column is
    ``digest``. The images recorded before carry a SHA-256 that every restore would refuse:
    their rows go (relays drop such images too), and a lost rank starts from the beginning
    when its log still does."""
    db.execute("DELETE FROM checkpoints")
    db.execute("ALTER TABLE checkpoints RENAME COLUMN sha256 TO digest")


def _m6_isolation(db: sqlite_utils.Database) -> None:
    """Sandboxes. Agents get what their heartbeats last said of how they isolate ranks
    (``AgentHeartbeat.isolation``): ``isolation`` its level ("": nothing yet, so no ranks go
    there, as for every agent from before), ``rank_memory`` the bytes a rank may use there
    (0: no limit) and ``isolation_report`` the whole report as JSON. Jobs get the memory each
    rank needs (0: whatever agents offer) and whether they accept unsandboxed agents; jobs
    from before need neither memory nor, like new ones by default, accept unsandboxed agents."""
    for sql in (
        "ALTER TABLE agents ADD COLUMN isolation TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE agents ADD COLUMN rank_memory INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE agents ADD COLUMN isolation_report TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE jobs ADD COLUMN memory INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN unsandboxed INTEGER NOT NULL DEFAULT 0",
    ):
        db.execute(sql)


def _m7_accounts(db: sqlite_utils.Database) -> None:
    """The web portal (issue 17). A user has a ``role`` (``user`` or ``operator``, who sees the
    whole pool) and any number of named API ``tokens``, each revocable; the one token a user
    had becomes their first. ``sessions`` are the portal's sign-ins: the sha256 of the cookie,
    the token it was opened with (revoking the token ends it), its CSRF secret and expiry."""
    for sql in (
        """CREATE TABLE accounts (
            name TEXT PRIMARY KEY,
            role TEXT NOT NULL DEFAULT 'user',
            created REAL NOT NULL)""",
        "INSERT INTO accounts (name, created) SELECT name, created FROM users",
        """CREATE TABLE tokens (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            user TEXT NOT NULL REFERENCES accounts(name),
            hash TEXT NOT NULL UNIQUE,
            label TEXT NOT NULL,
            created REAL NOT NULL,
            last_used REAL,
            revoked REAL)""",
        "CREATE INDEX tokens_user ON tokens(user, id)",
        "INSERT INTO tokens (user, hash, label, created) "
        "SELECT name, token_hash, 'first token', created FROM users",
        "DROP TABLE users",
        """CREATE TABLE sessions (
            hash TEXT PRIMARY KEY,
            token INTEGER NOT NULL REFERENCES tokens(id),
            csrf TEXT NOT NULL,
            created REAL NOT NULL,
            expires REAL NOT NULL)""",
        "CREATE INDEX sessions_token ON sessions(token)",
    ):
        db.execute(sql)


def _m8_queue_reasons(db: sqlite_utils.Database) -> None:
    """A queued job says why it waits (``scheduler.queue_reason``): ``waiting`` the reason
    ("" once placed) and ``never_fits`` whether the pool as it is can never run it."""
    for sql in (
        "ALTER TABLE jobs ADD COLUMN waiting TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE jobs ADD COLUMN never_fits INTEGER NOT NULL DEFAULT 0",
    ):
        db.execute(sql)


def _m9_environments(db: sqlite_utils.Database) -> None:
    """Job environments (issue 18): a job's ``requirements`` (JSON list, normalized) and, per
    agent, the ``environments`` it reported having built (JSON list of keys) and the
    fingerprints of checkpoint images made in them (``env_fingerprints``: it can restore
    those too)."""
    for sql in (
        "ALTER TABLE jobs ADD COLUMN requirements TEXT NOT NULL DEFAULT '[]'",
        "ALTER TABLE agents ADD COLUMN environments TEXT NOT NULL DEFAULT '[]'",
        "ALTER TABLE agents ADD COLUMN env_fingerprints TEXT NOT NULL DEFAULT '[]'",
    ):
        db.execute(sql)


def _m10_credentials(db: sqlite_utils.Database) -> None:
    """Trust between parties (issue 20). ``join_tokens``: what an operator hands a volunteer to
    enroll an agent (sha256 only; ``uses_left`` NULL = unlimited, ``expires`` NULL = never).
    ``relay_keys``: one key per relay name, registered by the operator (sha256 only). An agent
    records the join token that first admitted it; a banned agent has state ``banned`` and the
    operator's reason."""
    for sql in (
        """CREATE TABLE join_tokens (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            hash TEXT NOT NULL UNIQUE,
            label TEXT NOT NULL,
            created REAL NOT NULL,
            expires REAL,
            uses_left INTEGER,
            used INTEGER NOT NULL DEFAULT 0,
            revoked REAL)""",
        """CREATE TABLE relay_keys (
            name TEXT PRIMARY KEY,
            hash TEXT NOT NULL UNIQUE,
            created REAL NOT NULL,
            revoked REAL)""",
        "ALTER TABLE agents ADD COLUMN join_token INTEGER",
        "ALTER TABLE agents ADD COLUMN banned TEXT NOT NULL DEFAULT ''",
    ):
        db.execute(sql)


def _m11_relay_outages(db: sqlite_utils.Database) -> None:
    """Restarts that wait (issue 20): a rank lost because an agent could not reach one of its
    job's relays is restarted no sooner than ``not_before`` (a backoff growing with
    ``relay_losses``, the losses in a row), without using the job's restart budget; its job
    fails once the relay has been unreachable since ``relay_since`` for longer than
    ``relay_down_timeout``. A running incarnation clears both."""
    for sql in (
        "ALTER TABLE ranks ADD COLUMN not_before REAL",
        "ALTER TABLE ranks ADD COLUMN relay_losses INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE ranks ADD COLUMN relay_since REAL",
    ):
        db.execute(sql)


def _m12_quotas(db: sqlite_utils.Database) -> None:
    """Quotas (issue 20): the bytes of output stored per job (``output_bytes``, counted as
    they are stored, so the quota is checked without summing the output table) and when its
    output was first cut at ``max_job_output`` (``output_cut``); jobs of an older database
    start from what they stored. An index finds a user's unfinished jobs (``max_queued_jobs``,
    ``max_user_blob_bytes``)."""
    for sql in (
        "ALTER TABLE jobs ADD COLUMN output_bytes INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN output_cut REAL",
        "UPDATE jobs SET output_bytes = (SELECT COALESCE(SUM(length(o.data)), 0) "
        "FROM output o WHERE o.job = jobs.id)",
        "CREATE INDEX jobs_user_state ON jobs(user, state)",
    ):
        db.execute(sql)


def _m13_validation(db: sqlite_utils.Database) -> None:
    """Validation by replay (issue 20, ``coordinator.validation``). Per job: whether it is
    validated and what came of it so far, in words. Per rank: the round of re-execution in
    progress (0: none) and its outcome. Per incarnation: the round it re-executes (0: an
    ordinary one). Per agent: agreements (in all, and in a row since it was last found wrong)
    and times it was found wrong. ``validations``: each execution compared (round 0 is the
    original: its agents, exit code and stdout digest; ``relays`` maps each relay's name to
    its verdict, "" when it agreed). ``validation_output``: a re-execution's stdout."""
    for sql in (
        "ALTER TABLE jobs ADD COLUMN validate INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN validation TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE ranks ADD COLUMN validating INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE ranks ADD COLUMN validation TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE ranks ADD COLUMN validated_by TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE incarnations ADD COLUMN validates INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE agents ADD COLUMN agreed INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE agents ADD COLUMN agreed_streak INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE agents ADD COLUMN wrong INTEGER NOT NULL DEFAULT 0",
        """CREATE TABLE validations (
            job INTEGER NOT NULL,
            rank INTEGER NOT NULL,
            round INTEGER NOT NULL,
            incarnation INTEGER,
            agents TEXT NOT NULL DEFAULT '[]',
            exit_code INTEGER,
            stdout TEXT,
            relays TEXT NOT NULL DEFAULT '{}',
            exited REAL,
            PRIMARY KEY (job, rank, round))""",
        """CREATE TABLE validation_output (
            job INTEGER NOT NULL,
            rank INTEGER NOT NULL,
            incarnation INTEGER NOT NULL,
            offset INTEGER NOT NULL,
            data BLOB NOT NULL,
            PRIMARY KEY (job, rank, incarnation, offset))""",
    ):
        db.execute(sql)


def _m14_uploaders(db: sqlite_utils.Database) -> None:
    """Who uploaded each blob last (issue 20): a user's uploads that no job or result names
    yet are held to ``max_user_blob_bytes`` too. NULL: a rank's results, or an upload from
    before."""
    db.execute("ALTER TABLE blobs ADD COLUMN uploader TEXT")
    db.execute("CREATE INDEX blobs_uploader ON blobs(uploader)")


def _m15_activity(db: sqlite_utils.Database) -> None:
    """What each agent's volunteer lets it do now (issue 22), as its last heartbeat said:
    ``activity`` "available", "suspended" or "leaving", ``activity_reason`` why (for people)
    and ``activity_since`` since when (enrollment, for agents from before). An incarnation
    frozen on its agent has ``suspended_since`` (NULL: it is not). An agent that said it was
    leaving and went silent is in state 'gone' (not 'lost')."""
    for sql in (
        "ALTER TABLE agents ADD COLUMN activity TEXT NOT NULL DEFAULT 'available'",
        "ALTER TABLE agents ADD COLUMN activity_reason TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE agents ADD COLUMN activity_since REAL NOT NULL DEFAULT 0",
        "UPDATE agents SET activity_since = enrolled",
        "ALTER TABLE incarnations ADD COLUMN suspended_since REAL",
    ):
        db.execute(sql)


def _m16_failure_modes(db: sqlite_utils.Database) -> None:
    """What a lost rank means to each job (issue 23, ``JobSubmit.on_failure``): jobs from
    before with fault tolerance off were "abort" ones. ``failed_ranks``: the ranks declared
    failed (JSON list), in a job whose mode reports failures. ``fences``: each failed rank's
    fence at each relay of its job, ``confirmed`` once the relay has put it up: the other ranks
    hear of a failure only when every relay of the job refuses the failed rank."""
    for sql in (
        "ALTER TABLE jobs ADD COLUMN on_failure TEXT NOT NULL DEFAULT 'transparent'",
        "UPDATE jobs SET on_failure = 'abort' WHERE fault_tolerance = 0",
        "ALTER TABLE jobs ADD COLUMN failed_ranks TEXT NOT NULL DEFAULT '[]'",
        "CREATE TABLE fences (job INTEGER NOT NULL, rank INTEGER NOT NULL, "
        "incarnation INTEGER NOT NULL, relay TEXT NOT NULL, confirmed REAL, "
        "PRIMARY KEY (job, rank, relay))",
        "CREATE INDEX fences_relay ON fences(relay, confirmed)",
    ):
        db.execute(sql)


def _m17_spawn(db: sqlite_utils.Database) -> None:
    """Spawning (issue 23, ``MPI.Comm.Spawn``): each job's ``universe`` (processes alive at once;
    0 for jobs from before: their ranks) and ``space`` (rank numbers its tokens cover: its
    ranks plus what it may spawn over its run). ``spawns``: every spawn, keyed by its root rank
    and that rank's count of spawns (a replaying rank asks again and gets the same answer);
    ``ranks.spawn`` names the spawn a rank came from (NULL: one of the job's first ranks)."""
    for sql in (
        "ALTER TABLE jobs ADD COLUMN universe INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN space INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN spawned INTEGER NOT NULL DEFAULT 0",
        "CREATE TABLE spawns (id INTEGER PRIMARY KEY, job INTEGER NOT NULL, "
        "root INTEGER NOT NULL, seq INTEGER NOT NULL, first INTEGER NOT NULL, "
        "count INTEGER NOT NULL, command TEXT NOT NULL, parent TEXT NOT NULL, "
        "ctx INTEGER NOT NULL, reported INTEGER NOT NULL, error TEXT NOT NULL, "
        "created REAL NOT NULL, UNIQUE (job, root, seq))",
        "ALTER TABLE ranks ADD COLUMN spawn INTEGER",
        # ``JobSubmit.module``: its ranks run ``python -m MODULE ENTRY ARGS``.
        "ALTER TABLE jobs ADD COLUMN module TEXT NOT NULL DEFAULT ''",
    ):
        db.execute(sql)


def _m18_restart_storms(db: sqlite_utils.Database) -> None:
    """Restart storms (issue 34, ``scheduler.RestartPolicy``): ``ranks.quick_losses``, the
    rank's incarnations lost soon after they were handed out, in a row; ``incarnations.failure``,
    how one failed in words every agent would use ("" unknown), compared across incarnations
    (``scheduler.repeated_failure``); ``integrity_failures`` of agents and relays: sealed
    messages a relay pushed that did not open at an agent, counted against both."""
    for sql in (
        "ALTER TABLE ranks ADD COLUMN quick_losses INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE incarnations ADD COLUMN failure TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE agents ADD COLUMN integrity_failures INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE relays ADD COLUMN integrity_failures INTEGER NOT NULL DEFAULT 0",
    ):
        db.execute(sql)


def _m19_blob_owners(db: sqlite_utils.Database) -> None:
    """Uploads belong to the users who made them (issue 35): a blob's hash is not a
    capability. ``blob_owners`` has a row per user who uploaded a blob (identical bytes
    uploaded by two users are both users'); filled from the last uploader recorded and from
    the jobs that name a blob, so that nobody loses what they could submit before."""
    db.execute(
        """CREATE TABLE blob_owners (
            sha256 TEXT NOT NULL,
            user TEXT NOT NULL,
            PRIMARY KEY (sha256, user))"""
    )
    db.execute(
        "INSERT OR IGNORE INTO blob_owners (sha256, user) "
        "SELECT sha256, uploader FROM blobs WHERE uploader IS NOT NULL"
    )
    for column in ("bundle", "stdin"):
        db.execute(
            f"INSERT OR IGNORE INTO blob_owners (sha256, user) "
            f"SELECT {column}, user FROM jobs WHERE {column} IS NOT NULL"
        )


def _m20_lease_offers(db: sqlite_utils.Database) -> None:
    """``incarnations.offers``: how many times a lease was handed out. One the coordinator
    handed out but whose agent never reported it (the answer lost on its way) is handed out
    again, once, before its rank counts as lost (``JobsMixin.agent_heartbeat``)."""
    db.execute("ALTER TABLE incarnations ADD COLUMN offers INTEGER NOT NULL DEFAULT 1")


def _m21_failure_claims(db: sqlite_utils.Database) -> None:
    """Validation's gaps (issue 35). A validated job's rank that exits non-zero is re-executed
    on another agent before the job fails: ``ranks.claimed_exit`` is the code its agent
    reported, ``ranks.claimed_by`` that agent, until the re-execution confirms or refutes it.
    ``agents.address``: the address the agent last called from, whose network (/24, /48)
    keeps re-executors apart from the agents they check (``validation.network``).
    ``results.files``, ``validations.files``: the digest of a run's result files."""
    db.execute("ALTER TABLE ranks ADD COLUMN claimed_exit INTEGER")
    db.execute("ALTER TABLE ranks ADD COLUMN claimed_by TEXT")
    db.execute("ALTER TABLE agents ADD COLUMN address TEXT NOT NULL DEFAULT ''")
    # The digest of a run's result files (``results.files_digest``), compared by validation.
    db.execute("ALTER TABLE results ADD COLUMN files TEXT NOT NULL DEFAULT ''")
    db.execute("ALTER TABLE validations ADD COLUMN files TEXT NOT NULL DEFAULT ''")
    db.execute("ALTER TABLE validations ADD COLUMN blob TEXT")  # a re-execution's results zip


def _m22_validation_stderr(db: sqlite_utils.Database) -> None:
    """Validation compares stderr too (issue 35): ``validation_output`` keeps both streams of
    a re-execution (``stream``), ``validations.stderr`` the digest of a run's stderr with its
    paths normalised (``validation.StderrPaths``)."""
    db.execute("ALTER TABLE validations ADD COLUMN stderr TEXT")
    db.execute("ALTER TABLE validation_output RENAME TO validation_output_old")
    db.execute(
        """CREATE TABLE validation_output (
            job INTEGER NOT NULL,
            rank INTEGER NOT NULL,
            incarnation INTEGER NOT NULL,
            stream TEXT NOT NULL,
            offset INTEGER NOT NULL,
            data BLOB NOT NULL,
            PRIMARY KEY (job, rank, incarnation, stream, offset))"""
    )
    db.execute(
        "INSERT INTO validation_output (job, rank, incarnation, stream, offset, data) "
        "SELECT job, rank, incarnation, 'stdout', offset, data FROM validation_output_old"
    )
    db.execute("DROP TABLE validation_output_old")


def new_job_uid() -> str:
    return secrets.token_hex(16)


def new_ckpt_key() -> str:
    """32 random bytes, base64url without padding (like every key in ``protocol.tokens``)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode("ascii")


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [
    _m1_initial,
    _m2_fault_tolerance,
    _m3_fault_tolerance_switch,
    _m4_checkpoints,
    _m5_image_digest_blake3,
    _m6_isolation,
    _m7_accounts,
    _m8_queue_reasons,
    _m9_environments,
    _m10_credentials,
    _m11_relay_outages,
    _m12_quotas,
    _m13_validation,
    _m14_uploaders,
    _m15_activity,
    _m16_failure_modes,
    _m17_spawn,
    _m18_restart_storms,
    _m19_blob_owners,
    _m20_lease_offers,
    _m21_failure_claims,
    _m22_validation_stderr,
]


def current_version(db: sqlite_utils.Database) -> int:
    if not db["schema_version"].exists():
        return 0
    rows = list(db.query("SELECT version FROM schema_version"))
    return int(rows[0]["version"]) if rows else 0


def migrate(db: sqlite_utils.Database) -> int:
    """Bring the schema up to date; return the version reached."""
    with db.atomic():
        db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        if not list(db.query("SELECT version FROM schema_version")):
            db.execute("INSERT INTO schema_version (version) VALUES (0)")
    version = current_version(db)
    if version > len(MIGRATIONS):
        raise RuntimeError(
            f"the database is at schema version {version}, newer than this coordinator "
            f"({len(MIGRATIONS)}); upgrade vpool"
        )
    for number, step in enumerate(MIGRATIONS[version:], start=version + 1):
        with db.atomic():
            step(db)
            db.execute("UPDATE schema_version SET version = ?", [number])
    return len(MIGRATIONS)
