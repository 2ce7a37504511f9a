"""The agent's main loop: enroll, then lease, run and heartbeat until cancelled.

``run_agent`` is the whole agent as one trio task. It reports ``AgentStarted`` through
``task_status`` once enrolled and listening on its socket; cancelling it kills every rank
process it started (each rank's runner reaps its own) and tells the coordinator those ranks
are gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import resource
import socket
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from vpool import tls
from vpool.protocol.api import (
    AgentHeartbeat,
    EnrollResponse,
    IsolationReport,
    JobFailures,
    Lease,
    RankProblem,
)
from vpool.protocol.rank_link import replaces
from vpool.reasons import describe
from vpool.worker_agent import cgroups, control, identity, sandbox, sandboxed, selftest
from vpool.worker_agent.bundle import BlobCache, DiskRoom
from vpool.worker_agent.checkpoints import Capability, Checkpointer, find_capability
from vpool.worker_agent.coordinator import CoordinatorClient
from vpool.worker_agent.environments import Environments
from vpool.worker_agent.errors import CoordinatorRejected, CoordinatorUnreachable
from vpool.worker_agent.local_ranks import LocalRank, LocalRanks
from vpool.worker_agent.proxy import RankProxy, choose_socket_path
from vpool.worker_agent.ranks import RankServices, run_rank
from vpool.worker_agent.relay_links import RelayLinks
from vpool.worker_agent.settings import AgentSettings
from vpool.worker_agent.suspend import Suspender

log = logging.getLogger("vpool.agent")

SOCKET_NAME = "agent.sock"
_MIN_EMPTY_POLL = 0.25  # s between two lease calls that both came back empty
_MIN_HEARTBEAT = 0.05  # s; guards against a heartbeat interval of 0
_FIRST_RETRY = 0.2  # s before the first retry of a heartbeat that found no coordinator
_AFTER_STOP = 0.2  # s from a heartbeat whose answer had stop orders to the next one
_MAX_ORDER_IDS = 1024  # checkpoint order ids remembered (to ignore a re-delivery), to ack


class CheckpointOrderIds:
    """At-least-once checkpoint orders, agent side. The coordinator hands an order out in every
    heartbeat answer until a heartbeat acknowledges its id: each id received is acknowledged in
    the following heartbeats until an answer to one that carried it came back, and acted on
    only the first time it is seen. Both sets are bounded (oldest forgotten first); orders are
    few (at most one queued per rank), so the bound is never reached in practice."""

    def __init__(self, limit: int = _MAX_ORDER_IDS) -> None:
        self.limit = limit
        self._seen: dict[int, None] = {}  # insertion-ordered sets
        self._acks: dict[int, None] = {}

    def acks(self) -> list[int]:
        """The ids the next heartbeat acknowledges."""
        return list(self._acks)

    def answered(self, acks: list[int]) -> None:
        """A heartbeat that carried ``acks`` got its answer: the coordinator deleted them."""
        for order_id in acks:
            self._acks.pop(order_id, None)

    def received(self, order_id: int) -> bool:
        """Note an order received; True the first time (act on it), False for a re-delivery.
        Id 0 is an order of a coordinator that numbers none: acted on, never acknowledged."""
        if order_id == 0:
            return True
        _add(self._acks, order_id, self.limit)
        if order_id in self._seen:
            return False
        _add(self._seen, order_id, self.limit)
        return True


def _add(ids: dict[int, None], order_id: int, limit: int) -> None:
    ids[order_id] = None
    while len(ids) > limit:
        del ids[next(iter(ids))]


@dataclass(frozen=True)
class AgentStarted:
    agent_id: str
    name: str
    socket_path: Path
    pid: int


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        client: CoordinatorClient,
        enrolled: EnrollResponse,
        nursery: trio.Nursery,
    ) -> None:
        self.settings = settings
        self.client = client
        self.enrolled = enrolled
        self.nursery = nursery
        self.ranks = LocalRanks()
        self.slots = settings.slot_count
        self.busy = 0
        self._slot_freed = trio.Event()
        self._enroll_lock = trio.Lock()
        self._beat = trio.CancelScope()  # the heartbeat being waited for, or the pause after it
        self.socket_path = choose_socket_path(settings.work_path, SOCKET_NAME)
        self.capability = Capability()
        self.checkpoint_orders = CheckpointOrderIds()
        # The failed ranks of our ranks' jobs as the coordinator last told them (echoed in each
        # heartbeat, so that a held answer comes at once when there is more).
        self.failed_known: list[JobFailures] = []
        self.leaving = False  # stopping: no more leases
        # Reads the settings again from their file (``vpool-agent prefs``); None: no file.
        self.reload_settings: Callable[[], AgentSettings] | None = None
        # The owner's preferences: ranks frozen, thawed or handed back (``suspend.py``).
        self.manners = Suspender(settings, self.ranks, self._activity_changed)
        # Set once a heartbeat carried the capability: leases are asked for only then, so the
        # coordinator never places a restore here on what it knew of an earlier run of this
        # agent (enrolling clears it).
        self.capability_told = trio.Event()
        self.isolation_known = trio.Event()  # ``services.isolation`` is what it will be
        self.isolation: IsolationReport | None = None
        # Set once a heartbeat carrying ``isolation`` was answered: from then on the
        # coordinator can place ranks here (``run_agent`` reports the agent started then).
        self.isolation_told = trio.Event()
        ssl_context = tls.client_context(settings.ca_path)
        self.links = RelayLinks(
            nursery,
            ssl_context=ssl_context,
            token=lambda: client.token,
            on_problem=self._problem_soon,
            max_payload=settings.max_payload,
            reconnect=settings.relay_reconnect,
            ping_interval=settings.relay_ping_interval,
            dead_after=settings.relay_dead_after,
        )
        self.environments = Environments(settings)
        self.services = RankServices(
            settings=settings,
            client=client,
            links=self.links,
            blobs=BlobCache(settings.work_path / "blobs", client.fetch_blob),
            ranks=self.ranks,
            socket_path=self.socket_path,
            report_problem=self.report_problem,
            release_slot=self._release_slot,
            state_changed=self._beat_now,
            capability=self.capability,
            ssl_context=ssl_context,
            environments=self.environments,
            disk_room=DiskRoom(settings.disk_keep_free),
        )
        self.proxy = RankProxy(
            self.ranks,
            processor=socket.gethostname(),
            max_payload=settings.max_payload,
            local_delivery=settings.local_delivery,
            spawner=self.client.spawn,
        )

    @property
    def free_slots(self) -> int:
        if self.isolation_known.is_set() and not self.takes_ranks:
            return 0
        if not self.manners.available:
            return 0  # suspended by its owner's preferences, or leaving
        return max(0, self.slots - self.busy)

    @property
    def takes_ranks(self) -> bool:
        """False where the sandbox is required and cannot be made (known once
        ``isolation_known``)."""
        return self.services.isolation.on or self.settings.sandbox != "on"

    # -- problems ---------------------------------------------------------------------------

    def _problem_soon(self, rank: LocalRank, message: str, relay: str, **details: str) -> None:
        """``report_problem`` in the background (``details``: its keyword arguments)."""
        self.nursery.start_soon(partial(self.report_problem, rank, message, relay, **details))

    async def report_problem(
        self,
        rank: LocalRank,
        message: str,
        relay: str = "",
        *,
        failure: str = "",
        unopened_from: str = "",
    ) -> None:
        """Tell the coordinator once that ``rank`` cannot go on; ``relay``: the relay it could
        not reach, if that is why; ``failure`` and ``unopened_from``: as ``RankProblem``."""
        if rank.problem_reported or rank.ended:
            return
        rank.problem_reported = True
        lease = rank.lease
        log.warning("%s: %s", rank.label, message)
        try:
            await self.client.post_problem(
                RankProblem(
                    job=lease.job,
                    rank=lease.rank,
                    incarnation=lease.incarnation,
                    message=message,
                    relay=relay,
                    failure=failure,
                    unopened_from=unopened_from,
                )
            )
        except CoordinatorRejected as exc:
            log.warning("problem report for %s refused: %s", rank.label, exc)

    # -- enrollment -------------------------------------------------------------------------

    async def reenroll(self, refused_token: str) -> None:
        """Enroll again after the coordinator refused ``refused_token`` (once, however many
        loops saw the refusal)."""
        async with self._enroll_lock:
            if self.client.token != refused_token:
                return  # another loop enrolled meanwhile
            key = identity.load_or_create_key(self.settings.identity_path)
            self.enrolled = await enroll(self.settings, self.client, key)

    # -- loops ------------------------------------------------------------------------------

    async def find_capability(self) -> None:
        """``criu check`` and the environment fingerprint, in the background (hashing the
        interpreter's libraries takes a while); heartbeats carry them once known."""
        settings = self.settings
        iso = self.services.isolation = await trio.to_thread.run_sync(
            sandboxed.find_isolation, settings
        )
        self.services.limits = sandboxed.rank_limits(settings)
        try:
            await find_capability(
                self.capability,
                criu_path=settings.criu,
                python=settings.python_path,
                # A sandboxed rank's directory is the same path inside every sandbox, and its
                # image restores only into another sandbox.
                rank_root=sandbox.RANK_DIR if iso.on else str(settings.rank_root_path),
                salt=settings.fingerprint_salt + ("|sandboxed" if iso.on else ""),
            )
        except Exception as exc:
            # Checkpoints need both: without them this agent simply takes none.
            self.capability.criu = ""
            log.warning("checkpoints disabled: %s", describe(exc))
        await self._selftest()
        self._beat_now()
        if self.capability.criu:
            try:
                await self.services.checkpoint_workers().prewarm()
            except OSError as exc:
                log.warning("cannot start a checkpoint worker: %s", describe(exc))

    async def _selftest(self) -> None:
        """Probe the sandbox (``selftest``) before any rank runs in it; what it found is the
        isolation this agent reports, and a sandbox that lets a probe through is no sandbox."""
        settings, svc = self.settings, self.services
        try:
            found = await selftest.run_cached(
                settings, svc.isolation, svc.limits, criu_ok=bool(self.capability.criu)
            )
        except Exception as exc:
            found = selftest.SelfTest(level="none", detail=f"the selftest failed: {describe(exc)}")
        if found.level == "none" and svc.isolation.on:
            svc.isolation = sandboxed.Isolation(reason=found.detail)
        self.isolation = found.report(svc.limits)
        if found.level != "none":
            log.info(
                "ranks run sandboxed (%s); limits per rank: %s; checkpoints of sandboxed ranks: %s",
                found.level + (f": {found.detail}" if found.detail else ""),
                svc.limits.describe(),
                found.checkpoints,
            )
        elif settings.sandbox == "on":
            log.error(
                "this agent cannot sandbox ranks (%s) and takes none: install bubblewrap, or "
                "set sandbox = 'prefer' to run ranks unsandboxed",
                found.detail,
            )
        else:
            log.warning("ranks run unsandboxed: %s", found.detail)
        self.isolation_known.set()

    async def lease_loop(self) -> None:
        delay = 0.5
        await self.isolation_known.wait()
        if not self.takes_ranks:
            return  # no ranks without a sandbox (logged by _selftest)
        with trio.move_on_after(CAPABILITY_WAIT):
            await self.capability_told.wait()
        while not self.leaving:
            while self.free_slots == 0:
                self._slot_freed = trio.Event()
                await self._slot_freed.wait()
            token = self.client.token
            asked_at = trio.current_time()
            try:
                leases = await self.client.lease(self.free_slots, self.settings.lease_wait)
            except CoordinatorUnreachable as exc:
                log.warning("lease: %s; retrying in %.1f s", exc, delay)
                await trio.sleep(delay * (0.75 + random.random() / 2))
                delay = min(delay * 2, self.settings.retry_max_delay)
                continue
            except CoordinatorRejected as exc:
                if exc.status == 401:
                    log.warning("lease refused (%s); enrolling again", exc)
                    await self.reenroll(token)
                    continue
                # Not worth dying for: the ranks running here would die with the agent.
                log.error("lease refused: %s; retrying in %.1f s", exc, delay)
                await trio.sleep(delay)
                delay = min(delay * 2, self.settings.retry_max_delay)
                continue
            delay = 0.5
            # Leases that arrive while leaving start too: the coordinator has them placed
            # here, and they are handed back as any lost rank once the agent stops.
            for lease in leases:
                self.start(lease)
            if not leases:
                # A coordinator that answers "nothing" at once must not be asked in a tight loop.
                await trio.sleep_until(asked_at + _MIN_EMPTY_POLL)

    async def leave(self, grace: float) -> None:
        """The agent is stopping (its volunteer quits, logs out, suspends the machine): ask no
        more leases and checkpoint every rank that can take one, for at most ``grace`` s, so
        that its replacement elsewhere restores from now instead of from an older image or
        the beginning. The ranks run on meanwhile; the caller stops them afterwards."""
        self.leaving = True
        self.manners.stopping = True
        self.manners.wake()  # frozen ranks are thawed for their checkpoints
        self._activity_changed()  # the coordinator hears "leaving": gone, not lost, soon
        ranks = [
            (rank, ckpt)
            for rank in self.ranks
            if (ckpt := rank.checkpointer) is not None and not ckpt.unable()
        ]
        if not ranks or grace <= 0:
            return
        log.info("leaving: checkpointing %d rank(s) first, for at most %g s", len(ranks), grace)
        stored: list[str] = []

        async def one(rank: LocalRank, checkpointer: Checkpointer) -> None:
            if await checkpointer.checkpoint_now():
                stored.append(rank.label)

        with trio.move_on_after(grace):
            async with trio.open_nursery() as nursery:
                for rank, ckpt in ranks:
                    nursery.start_soon(one, rank, ckpt)
        log.info(
            "leaving: %d of %d rank(s) checkpointed%s",
            len(stored),
            len(ranks),
            f" ({', '.join(stored)})" if stored else "",
        )

    def start(self, lease: Lease) -> None:
        existing = self.ranks.by_key.get((lease.job, lease.rank))
        if existing is not None and not replaces(lease.incarnation, existing.lease.incarnation):
            log.warning("ignoring a repeated lease for rank %d of job %d", lease.rank, lease.job)
            return
        if existing is not None:
            existing.request_stop(f"replaced by incarnation {lease.incarnation}")
        rank = LocalRank(lease)
        rank.seal = self.settings.seal_messages and rank.sealer is not None
        rank.max_payload = self.services.limits_for(lease).memory
        rank.budget = rank.max_payload or self.settings.max_payload
        self.ranks.add(rank)
        self.busy += 1
        # A held heartbeat covers only the ranks it lists: report the new one now, so that its
        # stop order, should its job end early, goes out at once too.
        self._beat.cancel()
        log.info(
            "leased rank %d of job %d (incarnation %d, COMM_WORLD of %d)",
            lease.rank,
            lease.job,
            lease.incarnation,
            len(lease.world) or lease.size,
        )
        self.nursery.start_soon(self._run, rank)

    async def _run(self, rank: LocalRank) -> None:
        try:
            await run_rank(self.services, rank)
        except Exception:
            # A bug met by one rank must not take the agent, and every other rank, down; the
            # rank's runner already reported it as a problem.
            log.exception("running %s failed", rank.label)
        finally:
            self._release_slot(rank)

    def _beat_now(self) -> None:
        """Send a heartbeat now (the held one, or the pause after it, ends)."""
        self._beat.cancel()

    def reload_preferences(self) -> list[str]:
        """Read the settings file again and apply the owner's preferences and slots now;
        what could not be applied yet (it needs a restart)."""
        if self.reload_settings is None:
            raise control.ControlError("the agent was started without a settings file")
        new = self.reload_settings()
        later = [
            name
            for name in ("memory", "rank_memory", "coordinator_url", "work_dir", "sandbox")
            if getattr(new, name) != getattr(self.settings, name)
        ]
        self.manners.configure(new)
        if new.slot_count != self.slots:
            log.info("slots: %d -> %d", self.slots, new.slot_count)
            self.slots = new.slot_count
        self._activity_changed()
        return later

    def _activity_changed(self) -> None:
        """Suspended, resumed, leaving: the coordinator hears it now, and the lease loop
        looks again at whether to ask for work."""
        self._beat_now()
        self._slot_freed.set()

    def _release_slot(self, rank: LocalRank) -> None:
        if rank.slot_released:
            return
        rank.slot_released = True
        self.busy -= 1
        self.manners.rank_ended(rank)
        self._slot_freed.set()

    async def heartbeat_loop(self) -> None:
        """Heartbeat every interval. While the coordinator is unreachable (restarting), retry
        sooner, with backoff up to ``retry_max_delay``: a restarted coordinator counts this agent
        as seen at its start and must hear from it again before its agent timeout. The ranks
        keep running meanwhile; nothing is reported lost for it."""
        retry = _FIRST_RETRY
        while True:
            token = self.client.token
            interval = max(self.enrolled.heartbeat_interval, _MIN_HEARTBEAT)
            sent = trio.current_time()
            acks = self.checkpoint_orders.acks()
            told_isolation = self.isolation_known.is_set()
            resp, refused, unreachable = None, None, False
            with trio.CancelScope() as self._beat:
                try:
                    # The coordinator holds the answer for up to one interval unless it has
                    # stop orders, so a job that fails elsewhere stops its ranks here at once.
                    resp = await self.client.heartbeat(
                        AgentHeartbeat(
                            ranks=self.ranks.states(),
                            free_slots=self.free_slots,
                            criu=self.capability.criu if self.capability.ready.is_set() else "",
                            fingerprint=self.capability.fingerprint,
                            # Not held when it first tells the capability: leases wait for it.
                            wait=interval
                            if self.capability_told.is_set() or not self.capability.ready.is_set()
                            else 0.0,
                            checkpoint_acks=acks,
                            isolation=self.isolation if told_isolation else None,
                            environments=self.environments.built(),  # a directory listing
                            env_fingerprints=self.environments.fingerprints(
                                self.capability.fingerprint
                            ),
                            activity=self.manners.activity,
                            activity_reason=self.manners.reason,
                            failed_known=self.failed_known,
                        )
                    )
                except CoordinatorUnreachable as exc:
                    log.warning("heartbeat: %s; retrying in %.1f s", exc, retry)
                    unreachable = True
                except CoordinatorRejected as exc:
                    refused = exc
            if resp is not None and self.capability.ready.is_set():
                self.capability_told.set()
            if resp is not None and told_isolation:
                self.isolation_told.set()
            if unreachable and not self._beat.cancelled_caught:
                with trio.CancelScope() as self._beat:
                    await trio.sleep(retry * (0.75 + random.random() / 2))
                retry = min(retry * 2, max(self.settings.retry_max_delay, _MIN_HEARTBEAT))
                continue
            retry = _FIRST_RETRY
            if refused is not None and refused.status == 401:
                log.warning("heartbeat refused (%s); enrolling again", refused)
                await self.reenroll(token)
            elif refused is not None:
                log.error("heartbeat refused: %s", refused)
            if resp is not None:
                self.manners.pool_limit = resp.suspend_limit
                for order in resp.stop:
                    rank = self.ranks.find(order.job, order.rank, order.incarnation)
                    if rank is not None:
                        rank.request_stop(order.reason)
                self.checkpoint_orders.answered(acks)
                self.failed_known = resp.failed
                failed = {f.job: f.ranks for f in resp.failed}
                for rank in self.ranks:
                    rank.tell_failed(failed.get(rank.lease.job, []))
                for ckpt_order in resp.checkpoint:
                    if not self.checkpoint_orders.received(ckpt_order.id):
                        continue  # re-delivered: our acknowledgement had not arrived yet
                    rank = self.ranks.find(ckpt_order.job, ckpt_order.rank, ckpt_order.incarnation)
                    if rank is not None:
                        rank.checkpoint_wanted.set()
            if self._beat.cancelled_caught:
                continue  # a rank started: send its heartbeat now
            # After stop orders, ask again soon: the coordinator may follow them at once with
            # more, such as the failure of a rank it just declared failed (a rank here that was
            # lost), which the other ranks here must hear as soon as the relays fenced it.
            pause = _AFTER_STOP if resp is not None and resp.stop else interval
            with trio.CancelScope() as self._beat:
                await trio.sleep_until(sent + min(pause, interval))


# How long the lease loop waits for the first heartbeat that tells the coordinator this agent's
# checkpoint capability (``criu check`` and the fingerprint take about a second).
CAPABILITY_WAIT = 15.0


async def enroll(
    settings: AgentSettings, client: CoordinatorClient, key: Ed25519PrivateKey
) -> EnrollResponse:
    req = identity.enroll_request(
        key,
        name=settings.agent_name,
        slots=settings.slot_count,
        join_token=settings.join_token,
    )
    enrolled = await client.enroll(req)
    log.info("enrolled with %s as %s", settings.coordinator_url, enrolled.agent_id)
    return enrolled


async def _leave_when(agent: Agent, leaving: trio.Event, scope: trio.CancelScope) -> None:
    await leaving.wait()
    await agent.leave(agent.settings.leave_checkpoint_grace)
    scope.cancel()


READY_WAIT = 120.0  # s an agent waits at start to have told the coordinator its isolation


def drop_scratch(settings: AgentSettings) -> None:
    """Remove the agent's own checkpoint scratch directory (in /dev/shm, made at its first
    checkpoint or restore) if it is empty, so agents that come and go leave nothing behind.
    A directory the volunteer named (``checkpoint_scratch``) is theirs: left alone."""
    if settings.checkpoint_scratch:
        return
    with contextlib.suppress(OSError):  # not there, or not empty
        settings.scratch_path.rmdir()


def _open_files_to_the_hard_limit() -> None:
    """Every rank's connections, relay links and pipes count against the agent's descriptors:
    take up to 65,536 of what the system allows (the soft limit is often 1,024). Ranks have
    their own limit (``rank_open_files``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (OSError, ValueError) as exc:
            log.debug("open files stay at %d: %s", soft, exc)


async def run_agent(
    settings: AgentSettings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    leaving: trio.Event | None = None,
    reload: Callable[[], AgentSettings] | None = None,
    task_status: trio.TaskStatus[AgentStarted] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the agent until cancelled, or until ``leaving`` is set and its ranks are
    checkpointed (``Agent.leave``). ``transport`` replaces the network to the coordinator;
    ``reload`` reads the settings again from their file (``vpool-agent prefs``)."""
    key = identity.load_or_create_key(settings.identity_path)
    settings.work_path.mkdir(parents=True, exist_ok=True, mode=0o700)
    _open_files_to_the_hard_limit()
    swept = await trio.to_thread.run_sync(cgroups.sweep)
    if swept:
        log.info("removed the empty cgroups of %d agent(s) that are gone", len(swept))
    async with CoordinatorClient.of(settings, transport) as client:
        enrolled = await enroll(settings, client, key)
        agent: Agent | None = None
        try:
            async with trio.open_nursery() as nursery:
                agent = Agent(settings, client, enrolled, nursery)
                agent.reload_settings = reload
                path = await nursery.start(agent.proxy.serve, agent.socket_path)
                nursery.start_soon(agent.find_capability)
                nursery.start_soon(agent.heartbeat_loop)
                nursery.start_soon(agent.lease_loop)
                nursery.start_soon(agent.manners.run)
                await nursery.start(control.serve, agent, control.socket_path(settings))
                if leaving is not None:
                    nursery.start_soon(_leave_when, agent, leaving, nursery.cancel_scope)
                # Started means ready for ranks: the sandbox probed and the coordinator told
                # (a pool whose agents are "up" places a job on all of them, not on the first
                # to finish its selftest).
                with trio.move_on_after(READY_WAIT):
                    await agent.isolation_told.wait()
                task_status.started(
                    AgentStarted(
                        agent_id=enrolled.agent_id,
                        name=settings.agent_name,
                        socket_path=path,
                        pid=os.getpid(),
                    )
                )
        finally:
            # Every task is done: no checkpoint worker can start after this.
            if agent is not None:
                await agent.services.aclose()
            drop_scratch(settings)
