"""The coordinator's behaviour behind the HTTP routers: authentication, jobs, agents, relays.

One ``Coordinator`` per process. It owns the store, the blob files, the signing key and three
wake-up signals: ``work`` (new placements, including replacement incarnations of lost ranks,
for lease long-polls), ``changes`` (job states and
output, for output long-polls) and ``ended`` (a job or rank ended, so some rank may have to stop,
or a checkpoint was asked: for held heartbeats, which carry stop and checkpoint orders). Time
comes from the injected ``clock`` so tests can move it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import trio

from vpool import __version__, requirements
from vpool.coordinator import keys, scheduler
from vpool.coordinator.access import Action, Principal, check_job, check_operator, jobs_owner
from vpool.coordinator.blobs import BlobFiles, check_sha256
from vpool.coordinator.errors import BadRequest, Conflict, Forbidden, NotFound, Unauthorized
from vpool.coordinator.guesses import GuessLimiter
from vpool.coordinator.results import build_results_zip, files_digest
from vpool.coordinator.settings import CoordinatorSettings
from vpool.coordinator.sqlite_store import SqliteStore
from vpool.coordinator.store import Database, Quotas, Store
from vpool.coordinator.validation import Policy
from vpool.protocol import api
from vpool.protocol.errors import TokenError
from vpool.protocol.tokens import (
    AgentClaims,
    RankClaims,
    public_key_text,
    sign_token,
    verify_possession,
    verify_token,
)
from vpool.sizes import format_size

OUTPUT_PAGE_RECORDS = 1000
OUTPUT_PAGE_BYTES = 4 << 20
DETAIL_RECHECK = 1.0  # s between looks at a job's detail held by a long-poll, when no signal came
FINISHED_JOBS_WINDOW = 3600.0
BLOB_COLLECT_EVERY = 600.0  # s between looks for unused uploads

log = logging.getLogger(__name__)
MAX_AGENT_SLOTS = 4096
MAX_CHECKPOINT_EVERY = 7 * 24 * 3600.0
MAX_ISOLATION_REPORT = 16 << 10  # bytes of JSON kept per agent
MAX_ISOLATION_LEVEL = 40
MAX_LIMIT = 2**62
MAX_JOB_ID = 2**63 - 1
MAX_ENVIRONMENTS = 1000  # environment keys an agent may report
MAX_PAGE = 1000  # jobs in one listing
MAX_OFFSET = 2**31  # a limit of an isolation report (SQLite integers are 64-bit)
MAX_ACTIVITY_REASON = 200  # characters of an agent's activity reason kept
MAX_ODD_AGENTS = 1000  # agents remembered for logging an unknown activity once
MAX_FENCES = 10_000  # fences told to (or confirmed by) a relay in one heartbeat


class Signal:
    """A broadcast wake-up. Take ``current()`` *before* checking the condition you wait for,
    then wait on it: a change made while you were checking is not missed."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def current(self) -> trio.Event:
        return self._event

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()


class Coordinator:
    def __init__(
        self,
        settings: CoordinatorSettings,
        *,
        clock: Callable[[], float] = time.time,
        store: Store | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        state = settings.state_path()
        state.mkdir(parents=True, exist_ok=True)
        self.key = keys.load_or_create_signing_key(state / "signing.key")
        self.signing_key = public_key_text(self.key.public_key())
        self.store: Store = (
            store
            if store is not None
            else SqliteStore(
                state / "vpool.db",
                restarts=scheduler.RestartPolicy(
                    max_restarts=settings.max_restarts,
                    backoff_first=settings.restart_backoff_first,
                    backoff_max=settings.restart_backoff_max,
                    quick=settings.restart_quick,
                ),
                restore_wait_timeout=settings.restore_wait_timeout,
                relay_down_timeout=settings.relay_down_timeout,
                quotas=Quotas.of(settings),
                validation=Policy(
                    validate_jobs=settings.validate_jobs,
                    trusted_after=settings.validation_trusted_after,
                    min_rate=settings.validation_min_rate,
                ),
            )
        )
        # Agents and relays count as seen now: nothing is lost because we were down.
        self.store.startup(clock())
        self.db = Database(self.store)
        self.blobs = BlobFiles(state / "blobs")
        self.guesses = GuessLimiter(settings.guess_limit, settings.guess_window)
        self.work = Signal()
        self._blobs_collected = -math.inf
        self.changes = Signal()
        self.ended = Signal()
        self._odd_activity: set[str] = set()  # agents whose unknown activity was logged

    def close(self) -> None:
        self.store.close()

    def pool_info(self, agents: int = 0, relays: int = 0) -> api.PoolInfo:
        return api.PoolInfo(
            name=self.settings.pool_name,
            version=__version__,
            signing_key=self.signing_key,
            agents=agents,
            relays=relays,
        )

    async def list_agents(self, who: Principal) -> list[api.AgentInfo]:
        """The pool's agents. Operators see who they are; users see what each offers (to choose
        ``--memory``), not the volunteers' names or ids."""
        agents = [agent_info(row) for row in await self.db.call(self.store.list_agents)]
        if who.operator:
            return agents
        # Nor why a volunteer's machine is suspended (it may name the programs they run).
        return [
            msgspec.structs.replace(a, id="", name=f"volunteer {n}", activity_reason="")
            for n, a in enumerate(agents, start=1)
        ]

    async def list_relays(self, who: Principal) -> list[api.RelayStatus]:
        check_operator(who)
        return [
            api.RelayStatus(
                name=r["name"],
                host=r["host"],
                port=r["port"],
                state=r["state"],
                last_seen=r["last_seen"],
                load=msgspec.convert(r["load"], api.RelayLoad),
                integrity_failures=r["integrity_failures"],
            )
            for r in await self.db.call(self.store.list_relays)
        ]

    async def pool_totals(self) -> api.PoolTotals:
        agents = await self.db.call(self.store.list_agents)
        relays = await self.db.call(self.store.list_relays)
        alive = [a for a in agents if a["state"] == "alive"]
        return api.PoolTotals(
            agents=len(alive),
            slots=sum(int(a["slots"]) for a in alive),
            busy=sum(int(a["active"]) for a in alive),
            relays=sum(1 for r in relays if r["state"] == "alive"),
            jobs=await self.db.call(self.store.count_jobs, None),
        )

    async def live_pool_info(self) -> api.PoolInfo:
        now = self.clock()
        agents, relays = await self.db.call(
            self.store.count_live,
            now - self.settings.agent_timeout,
            now - self.settings.relay_timeout,
        )
        return self.pool_info(agents, relays)

    def _sign_rank(self, claims: RankClaims) -> str:
        return sign_token(claims, self.key)

    # -- authentication -----------------------------------------------------------------------

    async def principal(self, token: str) -> Principal:
        """The user an API token belongs to."""
        who = await self.db.call(
            self.store.principal_by_token_hash, keys.hash_token(token), self.clock()
        )
        if who is None:
            raise Unauthorized("unknown or revoked API token", code="bad_token")
        return who

    async def sign_in(self, token: str) -> tuple[str, str, Principal]:
        """Open a portal session with an API token: (cookie, CSRF secret, who)."""
        who = await self.principal(token)
        cookie, csrf = keys.new_session_secret(), keys.new_session_secret()
        now = self.clock()
        await self.db.call(
            self.store.create_session,
            keys.hash_token(cookie),
            who.token,
            csrf,
            now,
            now + self.settings.session_lifetime,
        )
        return cookie, csrf, who

    async def session(self, cookie: str) -> tuple[Principal, str]:
        """The principal and CSRF secret of a portal session cookie."""
        found = await self.db.call(self.store.session, keys.hash_token(cookie), self.clock())
        if found is None:
            raise Unauthorized("not signed in, or the session ended", code="no_session")
        return found

    async def sign_out(self, cookie: str) -> None:
        await self.db.call(self.store.end_session, keys.hash_token(cookie))

    async def create_token(self, who: Principal, label: str) -> api.TokenCreated:
        token, token_hash = keys.new_api_token()
        info = await self.db.call(
            self.store.create_token, who.name, token_hash, label, self.clock()
        )
        return api.TokenCreated(info=info, token=token)

    async def list_tokens(self, who: Principal) -> list[api.TokenInfo]:
        return await self.db.call(self.store.list_tokens, who.name)

    async def revoke_token(self, who: Principal, token_id: int) -> api.TokenInfo:
        if not 0 < token_id <= MAX_JOB_ID:  # SQLite integers are 64-bit
            raise NotFound(f"no token {token_id}", code="unknown_token")
        return await self.db.call(self.store.revoke_token, who.name, token_id, self.clock())

    def agent_id(self, token: str) -> str:
        """The agent a token was issued to; checks the signature only (no database)."""
        try:
            claims = verify_token(token, self.key.public_key(), now=self.clock(), kind=AgentClaims)
        except TokenError as exc:
            raise Unauthorized(exc.message, code=exc.code) from exc
        return claims.agent

    async def agent_seen(
        self, agent_id: str, free_slots: int | None = None, address: str = ""
    ) -> str:
        """Record a sign of life of an enrolled agent (calling from ``address``)."""
        if not await self.db.call(
            self.store.touch_agent, agent_id, self.clock(), free_slots, address
        ):
            raise Unauthorized(
                f"agent {agent_id} is not enrolled here; enroll again", code="unknown_agent"
            )
        return agent_id

    async def agent(self, token: str) -> str:
        return await self.agent_seen(self.agent_id(token))

    async def relay(self, key: str) -> str:
        """The name of the relay whose key ``key`` is (``vpool-coordinator relay add``)."""
        name = (
            await self.db.call(self.store.relay_by_key_hash, keys.hash_token(key)) if key else None
        )
        if name is None:
            raise Unauthorized(
                "not a relay key of this pool (register the relay with "
                "`vpool-coordinator relay add NAME` and set its relay_key)",
                code="bad_token",
            )
        return name

    # -- blobs --------------------------------------------------------------------------------

    async def collect_blobs(self) -> int:
        """Delete the uploads no job or result has named for ``blob_keep`` seconds; how many.
        At most once per ``BLOB_COLLECT_EVERY`` (the monitor calls it every period)."""
        now = self.clock()
        if now - self._blobs_collected < min(BLOB_COLLECT_EVERY, self.settings.blob_keep):
            return 0
        self._blobs_collected = now
        gone = await self.db.call(self.store.unused_blobs, now - self.settings.blob_keep)
        for sha in gone:
            await trio.to_thread.run_sync(self.blobs.path(sha).unlink, True)
        if gone:
            log.info(
                "deleted %d upload(s) no job named for %g s", len(gone), self.settings.blob_keep
            )
        return len(gone)

    async def put_blob(
        self, who: Principal, sha256: str, chunks: AsyncIterator[bytes]
    ) -> api.BlobInfo:
        """Store ``who``'s upload. Refused (409 quota_exceeded) when ``who``'s uploads that no
        job names yet would hold more than ``max_user_blob_bytes``."""
        check_sha256(sha256)

        async def admit(digest: str, size: int) -> None:
            await self.db.call(self.store.check_upload, who.name, digest, size)

        digest, size = await self.blobs.write(
            chunks, expected=sha256, max_bytes=self.settings.max_blob_bytes, admit=admit
        )
        await self.db.call(self.store.add_blob, digest, size, self.clock(), who.name)
        return api.BlobInfo(sha256=digest, size=size)

    async def has_blob(self, who: Principal, sha256: str) -> bool:
        """Whether ``who`` uploaded blob ``sha256`` and it is still here. Another user's blob
        is not there for ``who`` (HEAD says 404, a submit naming it is refused): hashes are
        not capabilities, and a user who has the bytes uploads them and owns them too."""
        check_sha256(sha256)
        owned = await self.db.call(self.store.owns_blob, who.name, sha256)
        return owned and await self.blobs.exists(sha256)

    async def agent_blob_path(self, agent_id: str, sha256: str) -> Path:
        """The file of blob ``sha256`` for agent ``agent_id``, which must hold a rank of a job
        that names it (404 otherwise, as for a blob that is not there)."""
        check_sha256(sha256)
        allowed = await self.db.call(self.store.agent_may_fetch, agent_id, sha256)
        if not allowed or not await self.blobs.exists(sha256):
            raise NotFound(f"no blob {sha256} for this agent's ranks", code="unknown_blob")
        return self.blobs.path(sha256)

    # -- jobs ---------------------------------------------------------------------------------

    async def submit(self, who: Principal, sub: api.JobSubmit) -> api.JobInfo:
        limit = self.settings.max_ranks
        if not 1 <= sub.ranks <= limit:
            raise BadRequest(
                f"ranks must be between 1 and {limit}, not {sub.ranks}", code="bad_ranks"
            )
        if len(sub.name) > 200:
            raise BadRequest("the job name is longer than 200 characters")
        _check_args(sub.args)
        for blob, what in ((sub.bundle, "bundle"), (sub.stdin, "stdin")):
            if blob is not None and not await self.has_blob(who, blob):
                raise BadRequest(f"the {what} blob {blob} was not uploaded", code="unknown_blob")
        sub = _failure_mode(sub)
        sub = self._universe(sub)
        if sub.module and (len(sub.module) > 200 or not _MODULE.fullmatch(sub.module)):
            raise BadRequest(
                f"module {sub.module[:100]!r} is not a dotted Python module name (of at most "
                "200 characters)",
                code="bad_module",
            )
        self._check_checkpoint_every(sub)
        if (sub.validate or self.settings.validate_jobs) and not sub.fault_tolerance:
            raise BadRequest(
                "validation re-executes ranks from their message logs, which fault tolerance "
                "keeps: a validated job needs fault_tolerance on (on_failure transparent)"
                + (" (this pool validates every job)" if self.settings.validate_jobs else ""),
                code="bad_validate",
            )
        _check_memory(sub)
        try:
            wanted = requirements.normalize(sub.requirements)
        except requirements.RequirementsError as exc:
            raise BadRequest(str(exc), code="bad_requirements") from exc
        sub = msgspec.structs.replace(sub, requirements=wanted)
        await self.blobs.check_bundle(
            sub.bundle, sub.entry, max_members=self.settings.max_bundle_members
        )
        # Rank numbers to spawn into: for a job that may have more processes than ranks, and
        # for a "rebuild" one, whose new processes in lost ranks' places are spawns (as many
        # as were lost: its universe may be its ranks).
        spawns = sub.universe > sub.ranks or sub.on_failure == "rebuild"
        space = sub.ranks + (self.settings.max_spawned if spawns else 0)
        info = await self.db.call(self.store.create_job, who.name, sub, self.clock(), space)
        self.changes.fire()
        await self.schedule()
        # As scheduling left it: running, or queued with the reason it waits.
        placed = await self.db.call(self.store.job_info, info.id)
        assert placed is not None
        return placed

    def _universe(self, sub: api.JobSubmit) -> api.JobSubmit:
        """``sub`` with its universe decided: 0 is its ranks and the pool's ``spawn_default``
        (at most ``max_ranks``); one asked for is between its ranks and ``max_ranks``."""
        limit = self.settings.max_ranks
        if sub.universe == 0:
            universe = min(sub.ranks + self.settings.spawn_default, max(limit, sub.ranks))
            return msgspec.structs.replace(sub, universe=universe)
        if not sub.ranks <= sub.universe <= limit:
            raise BadRequest(
                f"universe must be between the job's {sub.ranks} ranks and {limit}, not "
                f"{sub.universe}",
                code="bad_universe",
            )
        return sub

    def _check_checkpoint_every(self, sub: api.JobSubmit) -> None:
        every, least = sub.checkpoint_every, self.settings.min_checkpoint_every
        if every == 0:
            return
        if not least <= every <= MAX_CHECKPOINT_EVERY:  # also refuses NaN
            raise BadRequest(
                f"checkpoint_every is 0 (no periodic checkpoints) or {least:g} to "
                f"{MAX_CHECKPOINT_EVERY:g} seconds, not {every:g}",
                code="bad_checkpoint_every",
            )
        if not sub.fault_tolerance:
            raise BadRequest(
                "checkpoints need fault tolerance: checkpoint_every must be 0 when "
                f"fault_tolerance is off (on_failure {sub.on_failure})",
                code="bad_checkpoint_every",
            )

    async def ask_checkpoint(
        self, who: Principal, job_id: int, ask: api.CheckpointAsk
    ) -> api.CheckpointAsked:
        """Queue checkpoint orders for the agents running the job's ranks (or one rank); they
        go out in each agent's next heartbeat answer."""
        await self.job(who, job_id, Action.CONTROL)
        orders = await self.db.call(self.store.ask_checkpoint, job_id, ask.rank)
        self.ended.fire()  # held heartbeats answer at once with the orders
        return api.CheckpointAsked(job=job_id, ranks=[o.rank for o in orders])

    async def job(self, who: Principal, job_id: int, action: Action = Action.READ) -> api.JobInfo:
        """The job, if ``who`` may do ``action`` on it (``access.check_job``)."""
        if not 0 < job_id <= MAX_JOB_ID:  # SQLite integers are 64-bit
            raise NotFound(f"no job {job_id}", code="unknown_job")
        info = await self.db.call(self.store.job_info, job_id)
        return check_job(who, info, job_id, action)

    async def find_jobs(
        self, who: Principal, query: api.JobQuery, *, everyone: bool = False
    ) -> api.JobPage:
        """A page of ``who``'s jobs (of everyone's, for an operator asking for it)."""
        if not (0 <= query.offset <= MAX_OFFSET and 1 <= query.limit <= MAX_PAGE):
            raise BadRequest(
                f"offset is 0 to {MAX_OFFSET} and limit 1 to {MAX_PAGE}", code="bad_page"
            )
        if len(query.name) > 200:
            raise BadRequest("a name filter is at most 200 characters", code="bad_page")
        return await self.db.call(self.store.find_jobs, jobs_owner(who, everyone), query)

    async def job_detail(
        self, who: Principal, job_id: int, wait: float = 0.0, seen: str = ""
    ) -> api.JobDetail:
        """The job, its ranks and events, with the ``mark`` that sums them up. With ``wait``
        and the ``mark`` of the last detail as ``seen``, held until the detail differs from
        that one (or ``wait`` seconds passed): a waiter learns of a change as it happens, at
        the cost of one query per change, not one a poll. A change is seen when the
        coordinator signals it (states, checkpoints, restores) or at the next recheck (a second
        at most) for any other."""
        deadline = trio.current_time() + max(0.0, min(wait, self.settings.max_wait))
        while True:
            changed = self.changes.current()
            await self.job(who, job_id)
            detail = await self.db.call(self.store.job_detail, job_id)
            assert detail is not None
            detail = msgspec.structs.replace(detail, mark=detail_mark(detail))
            if not seen or detail.mark != seen or trio.current_time() >= deadline:
                return detail
            with trio.move_on_at(min(deadline, trio.current_time() + DETAIL_RECHECK)):
                await changed.wait()

    async def cancel(self, who: Principal, job_id: int) -> api.JobInfo:
        await self.job(who, job_id, Action.CONTROL)
        info = await self.db.call(self.store.cancel_job, job_id, self.clock())
        self._states_changed()
        return info

    async def output(
        self,
        who: Principal,
        job_id: int,
        after: int,
        rank: int | None,
        wait: float,
        seen: str = "",
    ) -> api.OutputPage:
        """Records after ``after``; with ``wait``, held until there are some, the job ended or
        (given the ``mark`` of the last page as ``seen``) its state, reason or restarts
        changed."""
        deadline = trio.current_time() + max(0.0, min(wait, self.settings.max_wait))
        while True:
            changed = self.changes.current()
            # The state is read before the output: once terminal, every exited rank's output
            # is already stored, so the page below holds it.
            job = await self.job(who, job_id)
            if job.output_withheld():
                records: list[api.OutputRecord] = []
                more = False
            else:
                records, more = await self.db.call(
                    self.store.output_page,
                    job_id,
                    after,
                    rank,
                    OUTPUT_PAGE_RECORDS,
                    OUTPUT_PAGE_BYTES,
                )
            terminal = job.state in api.TERMINAL_STATES
            settle = 0.0 if not terminal else await self.settle_time(job)
            ended = terminal and settle <= 0
            running = await self.db.call(self.store.running_ranks, job_id)
            mark = progress_mark(job, running)
            moved = bool(seen) and mark != seen
            if records or ended or moved or trio.current_time() >= deadline:
                return api.OutputPage(
                    records=records,
                    next=records[-1].id if records else after,
                    complete=ended and not more,
                    state=job.state,
                    waiting=job.waiting,
                    never_fits=job.never_fits,
                    restarts=job.restarts,
                    running=running,
                    ranks=job.ranks,
                    mark=mark,
                    validation=job.validation,
                )
            with trio.move_on_at(
                min(deadline, trio.current_time() + settle) if terminal else deadline
            ):
                await changed.wait()

    async def settle_time(self, job: api.JobInfo) -> float:
        """Seconds an ended job's output may still grow: until every rank that was stopped has
        reported its exit (its last words come first), at most ``agent_timeout`` after the
        end (an agent silent that long is lost, and its ranks with it)."""
        left = (job.finished or 0.0) + self.settings.agent_timeout - self.clock()
        if left <= 0 or not await self.db.call(self.store.unsettled_ranks, job.id):
            return 0.0
        return left

    async def results(self, who: Principal, job_id: int) -> Path:
        """A temporary zip of the job's results; the caller deletes it."""
        job = await self.job(who, job_id)
        if job.output_withheld():
            raise Conflict(
                f"job {job_id} is validated by replay: its results are given once it ended",
                code="not_validated",
            )
        blobs = await self.db.call(self.store.job_results, job_id)
        streams = await self.db.call(self.store.output_streams, job_id)
        zips = {rank: self.blobs.path(sha) for rank, sha in blobs.items()}
        return await trio.to_thread.run_sync(
            build_results_zip, self.blobs.tmp, job.ranks, zips, streams
        )

    # -- agents -------------------------------------------------------------------------------

    async def enroll(self, req: api.EnrollRequest) -> api.EnrollResponse:
        if not 1 <= req.slots <= MAX_AGENT_SLOTS:
            raise BadRequest(f"slots must be between 1 and {MAX_AGENT_SLOTS}")
        if len(req.name) > 200:
            raise BadRequest("the agent name is longer than 200 characters")
        try:
            verify_possession(req.public_key, req.timestamp, req.signature, now=self.clock())
        except TokenError as exc:
            raise Unauthorized(exc.message, code=exc.code) from exc
        agent_id = await self.db.call(
            self.store.enroll_agent,
            req.public_key,
            req.name or "agent",
            req.slots,
            req.software,
            self.clock(),
            join_token_hash=keys.hash_token(req.join_token) if req.join_token else None,
            open_enrollment=self.settings.open_enrollment,
        )
        await self.schedule()
        return api.EnrollResponse(
            agent_id=agent_id,
            agent_token=self.agent_token(agent_id),
            signing_key=self.signing_key,
            heartbeat_interval=self.settings.heartbeat_interval,
        )

    def agent_token(self, agent_id: str) -> str:
        claims = AgentClaims(agent=agent_id, expires=self.clock() + scheduler.AGENT_TOKEN_LIFETIME)
        return sign_token(claims, self.key)

    async def lease(
        self,
        agent_id: str,
        req: api.LeaseRequest,
        gone: Callable[[], Awaitable[bool]] | None = None,
    ) -> api.LeaseResponse:
        """The agent's leases, waiting up to ``req.wait`` for some. ``gone``: whether the
        asker went away meanwhile (an agent restarted while its long-poll waited): then
        nothing is taken, else the leases would go to a connection nobody reads."""
        deadline = trio.current_time() + max(0.0, min(req.wait, self.settings.max_wait))
        while True:
            work = self.work.current()
            await self.schedule()
            if gone is not None and await gone():
                return api.LeaseResponse(leases=[])
            leases = await self.db.call(self.store.take_leases, agent_id, self.clock())
            if leases or trio.current_time() >= deadline:
                await self.db.call(self.store.touch_agent, agent_id, self.clock(), None)
                return api.LeaseResponse(leases=leases)
            with trio.move_on_at(deadline):
                await work.wait()

    async def heartbeat(self, agent_id: str, hb: api.AgentHeartbeat) -> api.AgentHeartbeatResponse:
        # Held (up to hb.wait, at most one heartbeat interval, so the agent keeps its pace) while
        # none of its ranks has to stop: when a rank fails, the others' stop orders go out at
        # once instead of at each agent's next heartbeat.
        if hb.isolation is not None:
            _check_isolation(hb.isolation)
        named = [*hb.environments, *hb.env_fingerprints]
        if len(named) > 2 * MAX_ENVIRONMENTS or any(len(k) > 64 for k in named):
            raise BadRequest(
                f"a heartbeat names at most {MAX_ENVIRONMENTS} environments of 64 characters",
                code="bad_environments",
            )
        hb = self._activity(agent_id, hb)
        hold = min(max(hb.wait, 0.0), self.settings.heartbeat_interval, self.settings.max_wait)
        deadline = trio.current_time() + hold
        ended = self.ended.current()
        stops, changed = await self.db.call(
            self.store.agent_heartbeat, agent_id, hb, self.clock(), self.settings.agent_timeout
        )
        if changed:
            self._states_changed()
        await self.schedule()
        # Checkpoint orders go out in every answer until a later heartbeat acknowledges them,
        # so an answer with orders is not held: the agent's next heartbeat, at its own pace,
        # carries the acks. Orders of ranks still starting stay queued and do not end the hold
        # (the heartbeat saying such a rank runs is the one that hands them out).
        acks = hb.checkpoint_acks
        orders = await self.db.call(self.store.take_checkpoint_orders, agent_id, acks)
        # Failed ranks the agent does not know of yet end the hold too: its ranks hear of a
        # failure the moment every relay has fenced the failed rank.
        failed = await self.db.call(self.store.failures_for_agent, agent_id)
        known = hb.failed_known
        while (
            not stops
            and not orders
            and failed == known
            and hb.ranks
            and trio.current_time() < deadline
        ):
            with trio.move_on_at(deadline):
                await ended.wait()
            ended = self.ended.current()
            stops = await self.db.call(self.store.stop_orders, agent_id, hb.ranks)
            orders = await self.db.call(self.store.take_checkpoint_orders, agent_id, [])
            failed = await self.db.call(self.store.failures_for_agent, agent_id)
        return api.AgentHeartbeatResponse(
            stop=stops,
            agent_token=self.agent_token(agent_id),
            checkpoint=orders,
            suspend_limit=scheduler.told_suspend_limit(self.settings.suspend_limit),
            failed=failed,
        )

    def _activity(self, agent_id: str, hb: api.AgentHeartbeat) -> api.AgentHeartbeat:
        """``hb`` with its activity as the store keeps it: a word this coordinator does not
        know counts as "available" (logged once per agent), and the reason is one line of
        printable text, at most ``MAX_ACTIVITY_REASON`` characters ("" when available)."""
        activity = hb.activity
        if activity not in scheduler.ACTIVITIES:
            if agent_id not in self._odd_activity and len(self._odd_activity) < MAX_ODD_AGENTS:
                self._odd_activity.add(agent_id)
                log.warning(
                    "agent %s reports the activity %r, which this coordinator does not know: "
                    "it counts as available",
                    agent_id,
                    activity[:40],
                )
            activity = "available"
        reason = ""
        if activity != "available":
            text = "".join(c if c.isprintable() else " " for c in hb.activity_reason)
            reason = " ".join(text.split())[:MAX_ACTIVITY_REASON]
        if (activity, reason) == (hb.activity, hb.activity_reason):
            return hb
        return msgspec.structs.replace(hb, activity=activity, activity_reason=reason)

    async def post_output(self, agent_id: str, batch: api.OutputBatch) -> None:
        for chunk in batch.chunks:
            if chunk.offset < 0:
                raise BadRequest("output offsets are >= 0")
        stored = await self.db.call(self.store.add_output, agent_id, batch.chunks, self.clock())
        if stored.ended:  # past max_job_output: its ranks stop, its slots are free
            self._states_changed()
            await self.schedule()
        elif stored.changed:
            self.changes.fire()

    async def rank_exit(self, agent_id: str, ex: api.RankExit) -> None:
        if await self.db.call(self.store.rank_exit, agent_id, ex, self.clock()):
            self._states_changed()
            await self.schedule()

    async def spawn(self, agent_id: str, ask: api.SpawnAsk) -> api.SpawnAnswer:
        now = self.clock()
        answer = await self.db.call(
            self.store.spawn, agent_id, ask, now, now - self.settings.agent_timeout
        )
        if answer.ranks:
            self._states_changed()
            await self.schedule()
        return answer

    async def rank_problem(self, agent_id: str, pr: api.RankProblem) -> None:
        if await self.db.call(self.store.rank_problem, agent_id, pr, self.clock()):
            self._states_changed()
            await self.schedule()

    async def checkpoint_failed(self, agent_id: str, cf: api.CheckpointFailed) -> None:
        if await self.db.call(self.store.checkpoint_failed, agent_id, cf, self.clock()):
            self.changes.fire()

    async def restore_report(self, agent_id: str, rr: api.RestoreReport) -> None:
        if await self.db.call(self.store.restore_report, agent_id, rr, self.clock()):
            self.changes.fire()

    async def put_result(
        self,
        agent_id: str,
        job: int,
        rank: int,
        incarnation: int,
        chunks: AsyncIterator[bytes],
    ) -> api.BlobInfo:
        sha, size = await self.blobs.write(
            chunks, expected=None, max_bytes=self.settings.max_blob_bytes
        )
        try:
            await self.blobs.check_zip(sha)
        except BadRequest as exc:
            raise BadRequest(exc.message, code="bad_results") from exc
        await self.db.call(self.store.add_blob, sha, size, self.clock())
        files = await trio.to_thread.run_sync(files_digest, self.blobs.path(sha))
        await self.db.call(self.store.add_result, agent_id, job, rank, incarnation, sha, files)
        return api.BlobInfo(sha256=sha, size=size)

    # -- relays -------------------------------------------------------------------------------

    async def register_relay(self, relay: str, reg: api.RelayRegister) -> api.RelayRegistered:
        _check_name(relay, reg.name)
        if not 0 < reg.port < 65536:
            raise BadRequest(f"port {reg.port} is not a TCP port")
        await self.db.call(self.store.register_relay, reg, self.clock())
        await self.schedule()
        return api.RelayRegistered(
            signing_key=self.signing_key, heartbeat_interval=self.settings.heartbeat_interval
        )

    async def relay_heartbeat(
        self, relay: str, hb: api.RelayHeartbeat
    ) -> api.RelayHeartbeatResponse:
        _check_name(relay, hb.name)
        now = self.clock()
        finished = await self.db.call(
            self.store.relay_heartbeat,
            hb.name,
            hb.load,
            now,
            now - FINISHED_JOBS_WINDOW,
            hb.jobs[: api.MAX_HELD_JOBS],
        )
        if finished is None:
            raise NotFound(
                f"relay {hb.name!r} is not registered; register again", code="unknown_relay"
            )
        if hb.fenced:
            fenced = hb.fenced[:MAX_FENCES]
            if await self.db.call(self.store.fences_put_up, hb.name, fenced, now):
                self.ended.fire()  # held agent heartbeats may now tell of the failures
        await self.schedule()
        fence = await self.db.call(self.store.fences_for_relay, hb.name)
        return api.RelayHeartbeatResponse(finished_jobs=finished, fence=fence[:MAX_FENCES])

    async def relay_lost(self, relay: str, report: api.RelayLost) -> None:
        _check_name(relay, report.name)
        if await self.db.call(self.store.relay_lost, report.name, report.lost, self.clock()):
            self._states_changed()
            await self.schedule()

    async def relay_diverged(self, relay: str, report: api.RelayDiverged) -> None:
        _check_name(relay, report.name)
        if await self.db.call(self.store.relay_diverged, report, self.clock()):
            self._states_changed()
            await self.schedule()

    async def relay_validated(self, relay: str, report: api.RelayValidated) -> None:
        """A relay's verdict on the messages of a re-execution for validation."""
        _check_name(relay, report.name)
        if await self.db.call(self.store.relay_validated, report, self.clock()):
            self._states_changed()
            await self.schedule()

    async def relay_refused(self, relay: str, report: api.RelayRefused) -> None:
        """The relay refuses the job's deposits for good (its quota, its disk): the job fails
        with the relay's reason."""
        _check_name(relay, report.name)
        if await self.db.call(self.store.relay_refused, report, self.clock()):
            self._states_changed()
            await self.schedule()

    async def relay_checkpoint(
        self, relay: str, report: api.RelayCheckpoint
    ) -> api.CheckpointAccepted:
        """Record a committed image; ``Conflict`` (409) tells the relay to delete it. A new
        image may let a rank waiting for a restorer start. The log behind it is trimmed
        unless the job is validated by replay (its re-executions start from the beginning)."""
        _check_name(relay, report.name)
        if await self.db.call(self.store.relay_checkpoint, report, self.clock()):
            self.changes.fire()
            await self.schedule()
        job = await self.db.call(self.store.job_info, report.job)
        return api.CheckpointAccepted(trim=not (job is not None and job.validate))

    # -- time-driven --------------------------------------------------------------------------

    async def schedule(self) -> None:
        now = self.clock()
        done = await self.db.call(
            self.store.schedule,
            now,
            now - self.settings.agent_timeout,
            now - self.settings.relay_timeout,
            self._sign_rank,
        )
        if done.started:
            self.work.fire()
        if done.started or done.explained:
            self.changes.fire()

    async def check_timeouts(self) -> None:
        now = self.clock()
        agents = await self.db.call(
            self.store.expire_agents, now - self.settings.agent_timeout, now
        )
        relays = await self.db.call(
            self.store.expire_relays,
            now - self.settings.relay_timeout,
            now - self.settings.relay_down_timeout,
            now,
        )
        waits = await self.db.call(self.store.expire_restore_waits, now)
        slow = await self.db.call(self.store.expire_validations, now)
        limit = self.settings.suspend_limit
        frozen = await self.db.call(
            self.store.expire_suspended,
            limit,
            scheduler.suspend_backstop(limit, self.settings.heartbeat_interval),
            now,
        )
        if agents or relays or waits or slow or frozen:
            self._states_changed()
            await self.schedule()

    def _states_changed(self) -> None:
        """Job or rank states changed: wake output long-polls and held heartbeats."""
        self.changes.fire()
        self.ended.fire()


_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*){0,15}")


def _failure_mode(sub: api.JobSubmit) -> api.JobSubmit:
    """``sub`` with its failure mode and fault tolerance agreeing: fault tolerance off alone
    means "abort", and every mode but "transparent" turns it off (nothing is replayed, so
    nothing is logged)."""
    if sub.on_failure == "transparent":
        if sub.fault_tolerance:
            return sub
        return msgspec.structs.replace(sub, on_failure="abort")
    if not sub.fault_tolerance:
        return sub
    return msgspec.structs.replace(sub, fault_tolerance=False)


def detail_mark(detail: api.JobDetail) -> str:
    """A digest of everything a job's detail shows (its ``mark`` left out)."""
    text = msgspec.json.encode(msgspec.structs.replace(detail, mark=""))
    return hashlib.blake2s(text, digest_size=8).hexdigest()


def progress_mark(job: api.JobInfo, running: int) -> str:
    """A short digest of what a follower of the job reports: state, reason, restarts, ranks
    running and what validation did."""
    text = (
        f"{job.state}\0{job.waiting}\0{job.never_fits}\0{job.restarts}\0{running}\0{job.validation}"
    )
    return hashlib.blake2s(text.encode(), digest_size=6).hexdigest()


def _check_name(relay: str, name: str) -> None:
    """A relay speaks for itself only: the name in its request is the one its key belongs to."""
    if name != relay:
        raise Forbidden(
            f"this key is relay {relay!r}'s; it cannot speak for relay {name[:200]!r}",
            code="not_your_name",
        )


# A program's arguments: what ``execve`` takes on every agent (its limit is 2 MiB of
# arguments and environment together; each string at most 128 KiB).
MAX_ARGS = 4096
MAX_ARGS_BYTES = 256 * 1024


def _check_args(args: list[str]) -> None:
    """Arguments no agent could start the program with are refused at submit (else every
    attempt to start a rank fails the same way)."""
    if len(args) > MAX_ARGS:
        raise BadRequest(f"at most {MAX_ARGS} arguments, not {len(args)}", code="bad_args")
    size = 0
    for i, arg in enumerate(args):
        if "\0" in arg:
            raise BadRequest(
                f"argument {i} holds a NUL character, which no program can be given",
                code="bad_args",
            )
        size += len(arg.encode(errors="surrogateescape")) + 1
    if size > MAX_ARGS_BYTES:
        raise BadRequest(
            f"the arguments take {size} bytes, more than the limit of {MAX_ARGS_BYTES}",
            code="bad_args",
        )


def _check_memory(sub: api.JobSubmit) -> None:
    least, most = api.MIN_JOB_MEMORY, api.MAX_JOB_MEMORY
    if sub.memory != 0 and not least <= sub.memory <= most:
        raise BadRequest(
            f"memory is 0 (what each agent offers) or {least} ({format_size(least)}) "
            f"to {most} bytes per rank, not {sub.memory}",
            code="bad_memory",
        )


def _check_isolation(report: api.IsolationReport) -> None:
    limits = (report.rank_memory, report.rank_processes, report.rank_disk)
    if not all(0 <= n <= MAX_LIMIT for n in limits):
        raise BadRequest(
            f"the limits of an isolation report are 0 to {MAX_LIMIT}", code="bad_isolation"
        )
    if len(report.level) > MAX_ISOLATION_LEVEL:
        raise BadRequest(
            f"an isolation level is at most {MAX_ISOLATION_LEVEL} characters", code="bad_isolation"
        )
    if len(msgspec.json.encode(report)) > MAX_ISOLATION_REPORT:
        raise BadRequest(
            f"an isolation report is at most {MAX_ISOLATION_REPORT} bytes of JSON",
            code="bad_isolation",
        )


def agent_info(row: dict[str, Any]) -> api.AgentInfo:
    """An agent as ``list_agents`` shows it, from its row of ``Store.list_agents``."""
    detail = ""
    if row["isolation_report"]:
        detail = msgspec.json.decode(row["isolation_report"], type=api.IsolationReport).detail
    return api.AgentInfo(
        id=row["id"],
        name=row["name"],
        state=row["state"],
        slots=row["slots"],
        ranks=row["active"],
        last_seen=row["last_seen"],
        isolation=row["isolation"],
        isolation_detail=detail,
        rank_memory=row["rank_memory"],
        checkpoints=bool(row["criu"]),
        activity=scheduler.shown_activity(
            row["activity"], row["slots"], row["free_slots"], row["active"]
        ),
        activity_reason=row["activity_reason"],
        activity_since=row["activity_since"],
        integrity_failures=row["integrity_failures"],
    )
