"""Taking checkpoints of a running rank (docs/internals.md, "Checkpoints", Agent).

One ``Checkpointer`` per running rank, one checkpoint at a time, started by its timer
(``Lease.checkpoint_every``: a period, ``next_periodic``) or by a ``CheckpointOrder`` from a
heartbeat answer (``LocalRank.checkpoint_wanted``). One checkpoint:

1. request: hold the rank's output pump (nothing more is read from its pipes) and note how much
   of each stream it read; ``CheckpointRequest(ckpt)`` into the rank's outbox and the
   checkpoint signal to its pid, again every 50 ms until ``CkptForked`` comes (``HOLD_MAX`` at
   most: the rank's output may fill its pipes meanwhile);
2. ``CkptForked(pid, counters, pending)``: the rank flushed its stdio and forked, without
   waiting for the agent; the image's output offsets are what was read plus what the rank
   found still in the pipes. The pump goes on;
3. a checkpoint worker process (``ckpt_workers``, ``ckpt_worker``) runs ``criu dump`` of the
   clone into a scratch directory, packs the images and the rank directory
   (``ckpt_image.ImageWriter``) and streams them to the home relay's store;
4. before ``CkptEnd``, the agent waits until the relays acknowledged everything the rank said
   it sent (the clone counts it as acknowledged), then the worker waits for ``CkptStored``.

Any failure kills the clone and is reported as ``CheckpointFailed``; the rank runs on.
"""

from __future__ import annotations

import base64
import functools
import logging
import math
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from vpool.protocol.api import CheckpointFailed, Lease, RelayInfo
from vpool.protocol.framing import encode_frame
from vpool.protocol.messages import CheckpointRequest, CkptForked, CkptPut
from vpool.protocol.rank_link import RankLink
from vpool.reasons import describe
from vpool.worker_agent import ckpt_worker, criu, sandbox
from vpool.worker_agent.errors import AgentError, CoordinatorRejected
from vpool.worker_agent.local_ranks import LocalRank
from vpool.worker_agent.output import STREAMS, OutputPump

if TYPE_CHECKING:
    from vpool.worker_agent.ranks import Prepared, RankServices

log = logging.getLogger("vpool.agent")

SIGNAL_EVERY = 0.05  # s between checkpoint signals to a rank that has not forked yet
HOLD_MAX = 2.0  # s the output pump is held for a request at most
DUMP_TIMEOUT = 120.0
ACK_TIMEOUT = 120.0  # s the relays may take to acknowledge what the rank sent
STORE_TIMEOUT = 300.0  # s for CkptEnd -> CkptStored
_ACK_POLL = 0.01
CONTROL_WAIT = 10.0  # s an ordered checkpoint waits for the rank's control connection
CLONE_LET_GO = 2.0  # s a clone may take to close its agent connections before it is dumped
# Dumps of one checkpoint CRIU may refuse for a socket the clone opened after it was let go.
DUMP_TRIES = 3
_EXTERNAL_SOCKET = "External socket is used"  # CRIU's words (criu/sk-unix.c)
# s to wait for the orphaned clone's own CkptForked when the rank died with a request out
ORPHAN_REPORT_WAIT = 2.0
# s a failed periodic checkpoint waits for its rank's exit before it is reported
RANK_END_WAIT = 1.0


async def _first(*events: trio.Event) -> None:
    """Wait until one of ``events`` is set."""
    async with trio.open_nursery() as race:

        async def one(event: trio.Event) -> None:
            await event.wait()
            race.cancel_scope.cancel()

        for event in events:
            race.start_soon(one, event)


def checkpoint_signal() -> int:
    return int(signal.SIGRTMIN) + 4


@dataclass
class Capability:
    """What this agent can do with checkpoints, found at start (``criu check``, the
    environment fingerprint); ``ready`` once both are known."""

    criu: str = ""
    fingerprint: str = ""
    files: dict[str, str] = field(default_factory=dict)
    ready: trio.Event = field(default_factory=trio.Event)


async def find_capability(
    cap: Capability, *, criu_path: str, python: str, rank_root: str, salt: str
) -> None:
    """Fill ``cap`` (a CRIU that fails its check leaves ``criu`` empty)."""
    try:
        cap.criu = await criu.criu_check(criu_path)
        # Abandoned if the agent stops meanwhile: it only reads files.
        cap.fingerprint, cap.files = await trio.to_thread.run_sync(
            lambda: criu.environment_fingerprint(python, rank_root=rank_root, salt=salt),
            abandon_on_cancel=True,
        )
    finally:
        cap.ready.set()
    log.info(
        "checkpoints: %s; environment fingerprint %s",
        f"CRIU {cap.criu}" if cap.criu else "no usable CRIU",
        cap.fingerprint[:16],
    )


def image_fingerprint(svc: RankServices, rank: LocalRank) -> str:
    """The fingerprint an image of ``rank`` made here carries: the agent's, with the job's
    environment's contents when it has one."""
    base = svc.capability.fingerprint
    if rank.env_key is None or svc.environments is None:
        return base
    return criu.with_environment(base, svc.environments.digest(rank.env_key))


def checkpoints_enabled(cap: Capability, lease: Lease) -> str:
    """Why ranks of ``lease`` cannot take checkpoints here ("" = they can)."""
    if not cap.criu:
        return "this agent has no usable CRIU"
    if lease.env.get("VPOOL_FT") == "0":
        return "fault tolerance is off for this job"
    if not lease.ckpt_key or not lease.job_uid:
        return "the lease carries no checkpoint key"
    return ""


def job_key(lease: Lease) -> bytes:
    """The job's AES-256-GCM key (``Lease.ckpt_key``, base64url, padding optional)."""
    text = lease.ckpt_key
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class CheckpointError(AgentError):
    """One checkpoint could not be made or stored."""


@dataclass
class _Taking:
    """The checkpoint in flight."""

    ckpt: int
    read: dict[str, int] = field(default_factory=dict)  # output read when the pump was held
    offsets: dict[str, int] = field(default_factory=dict)
    forked: CkptForked | None = None
    clone: int = -1  # the clone's pid until it was dumped (criu kills it) or killed
    scratch: Path | None = None
    got: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)  # stored, failed or given up


class Checkpointer:
    """Checkpoints of one running rank."""

    def __init__(
        self, svc: RankServices, rank: LocalRank, prepared: Prepared, pump: OutputPump
    ) -> None:
        self.svc = svc
        self.rank = rank
        self.prepared = prepared
        self.pump = pump
        # Increasing per rank across incarnations (nothing persists: wall clock, ms).
        self.last_ckpt = max(rank.restored_from, 0)
        self.taking: _Taking | None = None
        self.pauses: list[float] = []  # the rank's pause (s) of each checkpoint taken
        self.closing = False  # the rank's process ended: no new checkpoint starts
        self.ended = trio.Event()  # set with ``closing`` (``close``)
        # Checkpoints ended so far (stored or not), whether the last one was stored, and an
        # event set at the end of each (``checkpoint_now`` waits on it).
        self.taken = 0
        self.last_stored = False
        self._took = trio.Event()

    async def run(self) -> None:
        """Serve the control connection and take checkpoints until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._control_reader)
            every = self.rank.lease.checkpoint_every
            next_at = trio.current_time() + every if every > 0 else math.inf
            while True:
                with trio.move_on_at(next_at):
                    await self.rank.checkpoint_wanted.wait()
                if self.closing:
                    return
                # A frozen rank cannot fork its clone: the checkpoint waits for the thaw (an
                # evacuation thaws the rank for its last one, ``suspend.py``).
                await _first(self.rank.unfrozen, self.ended)
                if self.closing:
                    return
                ordered = self.rank.checkpoint_wanted.is_set()
                self.rank.checkpoint_wanted = trio.Event()
                if ordered and self.rank.control is None and not self.unable_at_all():
                    # Ordered as soon as the rank ran: its runtime opens the control
                    # connection right after its data connection, on a busy machine later.
                    with trio.move_on_after(CONTROL_WAIT):
                        await _first(self.rank.control_opened, self.ended)
                started = trio.current_time()
                await self.take(ordered=ordered)
                if every > 0:
                    periodic = None if ordered else started
                    next_at = next_periodic(every, next_at, periodic, trio.current_time())

    def close(self) -> None:
        """The rank's process ended: no new checkpoint starts, and a periodic one it takes
        down with it is not reported as failed."""
        self.closing = True
        self.ended.set()

    def unable_at_all(self) -> str:
        """Why the rank can never take a checkpoint ("" = it may, once connected)."""
        return checkpoints_enabled(self.svc.capability, self.rank.lease)

    def unable(self) -> str:
        """Why the rank cannot take a checkpoint now ("" = it can)."""
        why = checkpoints_enabled(self.svc.capability, self.rank.lease)
        if not why and (self.rank.control is None or self.rank.pid is None):
            why = (
                "the rank has no checkpoint control connection (its program did not "
                "initialize MPI, or its runtime takes no checkpoints)"
            )
        return why

    async def checkpoint_now(self) -> bool:
        """A checkpoint of the rank as it is now (one already being taken counts): asks for
        one unless one is under way and waits for its end. True when it was stored."""
        if self.closing:
            return False
        if self.taking is None:
            self.rank.checkpoint_wanted.set()
        target = self.taken + 1
        while self.taken < target and not self.closing:
            await _first(self._took, self.ended)
        return self.taken >= target and self.last_stored

    def forked_in_flight(self) -> tuple[int, trio.Event] | None:
        """The id and end event of the checkpoint in flight once the rank forked its clone
        (the clone holds the rank's state even if the rank dies now); None otherwise."""
        taking = self.taking
        if taking is None or taking.forked is None or taking.forked.pid <= 0:
            return None
        return taking.ckpt, taking.done

    async def finish_in_flight(self, grace: float, stop: trio.Event) -> None:
        """The rank was lost (killed from outside): if a checkpoint of it is past its fork,
        the clone holds the freshest state there is. Let that checkpoint finish (for at most
        ``grace`` seconds, or until ``stop``) before the loss is reported, so that the
        replacement restores from it instead of from an older image or the beginning."""
        taking = self.taking
        if grace <= 0 or taking is None:
            return
        with trio.move_on_after(grace):
            if taking.forked is None:
                # Asked, no answer yet: the rank may have forked just before it died (its
                # orphaned clone then says so), or not (``_take`` gives up soon).
                await _first(taking.got, taking.done, stop)
            flight = self.forked_in_flight()
            if flight is None or stop.is_set():
                return
            ckpt, done = flight
            log.info(
                "%s lost with checkpoint %d in flight: letting it finish (at most %g s)",
                self.rank.label,
                ckpt,
                grace,
            )
            await _first(done, stop)

    # -- the control connection -------------------------------------------------------------

    async def _control_reader(self) -> None:
        """Route what the rank sends on its control connection: the ``CkptForked`` of the
        checkpoint in flight, or the kill of a clone nobody will dump (a request given up)."""
        async for msg in self.rank.control_recv:
            if not isinstance(msg, CkptForked):
                continue  # the proxy lets only CkptForked through
            taking = self.taking
            if taking is not None and taking.forked is None and msg.ckpt == taking.ckpt:
                # Still held: nothing of the output was read since the rank forked.
                taking.offsets = {
                    name: taking.read[name] + (msg.pending[i] if i < len(msg.pending) else 0)
                    for i, name in enumerate(STREAMS)
                }
                self.pump.release()
                taking.forked = msg
                if msg.orphan:
                    taking.clone = msg.pid  # the agent's own view of it (SO_PEERCRED)
                elif msg.pid > 0:
                    # A restored rank names its clone by its own PID namespace's pid.
                    taking.clone = self._host_pid(msg.pid)
                taking.got.set()
            elif taking is not None and msg.ckpt == taking.ckpt:
                pass  # the orphaned clone of the one in flight says what its rank said already
            elif msg.pid > 0:
                _kill(self._host_pid(msg.pid))

    def _namespace_of(self) -> int | None:
        """A host pid whose namespaces are the rank's, when it has its own (a sandbox, a
        restore): CRIU enters them to dump its clone."""
        if self.rank.ns_holder:
            return self.rank.ns_holder
        pid = self.rank.pid
        return pid if pid is not None and criu.nested_pid_namespace(pid) else None

    def _host_pid(self, pid: int) -> int:
        """The host pid of the rank's child ``pid`` as the rank names it (-1: no process of
        the rank's has that pid). Nothing a rank says is believed: a pid it names is looked
        for among its own descendants only, so it cannot have the agent kill another."""
        parent = self._namespace_of() or self.rank.pid
        if parent is None or pid <= 0:
            return -1
        found = criu.descendant_host_pid(parent, pid)
        return found if found is not None else -1

    # -- one checkpoint ---------------------------------------------------------------------

    async def take(self, *, ordered: bool) -> bool:
        """Take one checkpoint; report a failure (a periodic one only when the rank could
        take checkpoints at all). True when it was stored."""
        rank = self.rank
        # Increasing per rank across incarnations (nothing persists: wall clock, ms).
        self.last_ckpt = max(self.last_ckpt + 1, int(time.time() * 1000))
        taking = self.taking = _Taking(ckpt=self.last_ckpt)
        stored = False
        # No report of a periodic checkpoint of a rank that cannot take any, or that ended.
        quiet = False
        try:
            why = self.unable()
            if why:
                quiet = not ordered
                raise CheckpointError(why)
            await self._take(taking)
            stored = True
            return True
        except Exception as exc:
            message = describe(exc)
            if isinstance(exc, criu.CriuError):
                message = f"criu dump failed: {message}"
            _kill(taking.clone)
            taking.clone = -1
            if not quiet and not ordered:
                # A rank that ends during its checkpoint takes the dump with it (a restored
                # rank's clone is in the rank's PID namespace, which dies with it): the job
                # ending, not a failure. Its exit may reach the agent just after the dump's.
                with trio.move_on_after(RANK_END_WAIT):
                    await self.ended.wait()
                quiet = self.ended.is_set()
            level = logging.DEBUG if quiet else logging.WARNING
            log.log(level, "checkpoint %d of %s failed: %s", taking.ckpt, rank.label, message)
            if not quiet:
                await self._report_failed(taking.ckpt, message)
            return False
        finally:
            # Also when cancelled (the rank stops): no clone may outlive its checkpoint.
            self.pump.release()
            _kill(taking.clone)
            self.taking = None
            taking.done.set()
            self.taken += 1
            self.last_stored = stored
            self._took.set()
            self._took = trio.Event()
            if taking.scratch is not None:
                with trio.move_on_after(10, shield=True):
                    await _remove(taking.scratch)

    async def _report_failed(self, ckpt: int, message: str) -> None:
        lease = self.rank.lease
        try:
            await self.svc.client.post_checkpoint_failed(
                CheckpointFailed(
                    job=lease.job,
                    rank=lease.rank,
                    incarnation=lease.incarnation,
                    ckpt=ckpt,
                    message=message,
                )
            )
        except CoordinatorRejected as exc:
            log.warning("checkpoint failure report for %s refused: %s", self.rank.label, exc)

    async def _take(self, taking: _Taking) -> None:
        rank, lease, settings = self.rank, self.rank.lease, self.svc.settings
        # 1. request, the output held
        await self.pump.hold()
        taking.read = dict(self.pump.read)
        rank.outbox.push_control(encode_frame(CheckpointRequest(request=taking.ckpt)))
        sig = checkpoint_signal()
        gone = False
        with trio.move_on_after(HOLD_MAX):
            while not taking.got.is_set():
                # ``closing``: the process was reaped, its pid may be another process's now.
                if self.closing or rank.pid is None:
                    gone = True
                    break
                try:
                    os.kill(rank.pid, sig)
                except ProcessLookupError:
                    gone = True
                    break
                with trio.move_on_after(SIGNAL_EVERY):
                    await taking.got.wait()
        if gone and not taking.got.is_set():
            # It may have died right after its fork, before it said so: then the orphaned clone
            # connects and says it (``RankHello.orphan``), if the agent waits for lost ranks'
            # checkpoints at all.
            with trio.move_on_after(min(ORPHAN_REPORT_WAIT, settings.lost_checkpoint_grace)):
                await taking.got.wait()
        forked = taking.forked
        if forked is None:
            if gone:
                raise CheckpointError("the rank's process is gone")
            raise CheckpointError(
                f"the rank reached no safe point within {HOLD_MAX:g} s (busy replaying, "
                "blocking the signal, or blocked writing output)"
            )
        pause = forked.pause_us / 1e6
        if not forked.orphan:
            self.pauses.append(pause)
        if forked.pid <= 0:
            raise CheckpointError(f"the rank could not fork: {forked.message}")
        ready = forked
        # 3. dump
        scratch_root = settings.scratch_path
        scratch_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        taking.scratch = Path(
            tempfile.mkdtemp(prefix=f"{lease.job}-{lease.rank}-{taking.ckpt}-", dir=scratch_root)
        )
        (taking.scratch / "images").mkdir()
        # 4. store
        # The rank's directories as it knows them: its sandbox's, the same on every agent.
        seen = Path(sandbox.RANK_DIR) if self.svc.isolation.on else self.prepared.rank_dir
        manifest: dict[str, Any] = {
            "rank_dir": str(seen),
            "work": str(seen / self.prepared.work.name),
            "home": str(seen / self.prepared.home.name),
            "out_offsets": dict(taking.offsets),
            "sent": list(ready.sent),
            "incarnation": lease.incarnation,
            "python": settings.python_path,
            "created": time.time(),
        }
        if forked.orphan:
            manifest["orphan"] = True  # its rank died: the pauses are unknown
        else:
            manifest["pause_ms"] = round(pause * 1000, 3)
            manifest["pause_cpu_ms"] = round(forked.pause_cpu_us / 1000, 3)
        svc = self.svc
        put = CkptPut(
            token=lease.token,
            ckpt=taking.ckpt,
            received={src: seq for src, seq in enumerate(ready.received) if seq > 0},
            dets=ready.dets,
            fingerprint=image_fingerprint(svc, self.rank),
            meta=msgspec.msgpack.encode(manifest),
        )
        task = ckpt_worker.Task(
            ckpt=taking.ckpt,
            # The clone as CRIU names it: in the rank's namespaces when it has its own (an
            # orphan's pid came from the socket, as the agent sees it).
            clone=_clone_pid(forked, self._namespace_of()),
            enter=self._namespace_of(),
            scratch=str(taking.scratch),
            rank_dir=str(self.prepared.rank_dir),
            stream_pages=settings.checkpoint_stream_pages,
            criu=settings.criu,
            dump_timeout=DUMP_TIMEOUT,
            key=job_key(lease),
            job=lease.job,
            rank=lease.rank,
            level=settings.checkpoint_zstd_level,
            put=put,
            relay=_home_relay(lease),
            tls=svc.ssl_context is not None,
            ca=str(settings.ca_path) if settings.ca_path else None,
            agent_token=svc.client.token,
            max_payload=settings.max_payload,
            store_timeout=STORE_TIMEOUT,
            local=settings.store_local_socket,
        )
        dumps: list[float] = []

        def dumped(seconds: float) -> None:
            taking.clone = -1  # criu ends the dumped process
            dumps.append(seconds)

        started = trio.current_time()
        for attempt in range(1, DUMP_TRIES + 1):
            if taking.clone > 0:
                await _clone_let_go(taking.clone)
            try:
                # Dumped, packed and sent by a worker process (``ckpt_workers``), not in the
                # agent.
                size = await svc.checkpoint_workers().run(
                    task, dumped=dumped, acked=functools.partial(self._acked_in_time, ready)
                )
                break
            except criu.CriuError as exc:
                if attempt == DUMP_TRIES or not _socket_in_the_way(exc, taking.clone):
                    raise
                # Refused before any page was written (nothing was sent to the store): the
                # clone opened a socket after it was let go, which an orphaned clone does
                # when its rank dies then (``RankHello.orphan``). It closes it soon.
                log.info(
                    "checkpoint %d of %s: the clone held a socket at the dump; again (%d/%d)",
                    taking.ckpt,
                    rank.label,
                    attempt + 1,
                    DUMP_TRIES,
                )
                await _remove(Path(task.scratch))
                (Path(task.scratch) / "images").mkdir(parents=True)
        log.info(
            "checkpoint %d of %s: %s, dump %.2f s, %.1f MB in %.2f s",
            taking.ckpt,
            rank.label,
            "from the orphaned clone"
            if forked.orphan
            else f"pause {pause * 1000:.1f} ms (cpu {forked.pause_cpu_us / 1000:.1f} ms)",
            dumps[0] if dumps else 0.0,
            size / 1e6,
            trio.current_time() - started,
        )

    async def _acked_in_time(self, ready: CkptForked) -> None:
        with trio.move_on_after(ACK_TIMEOUT) as waited:
            await self._wait_acked(ready)
        if waited.cancelled_caught:
            raise CheckpointError(
                f"the relays did not acknowledge the rank's messages within {ACK_TIMEOUT:g} s"
            )

    async def _wait_acked(self, ready: CkptForked) -> None:
        # Polled: acknowledgements land in the relay links' books, which signal nobody.
        while not acknowledged(self.rank, ready):  # noqa: ASYNC110
            await trio.sleep(_ACK_POLL)


def next_periodic(every: float, due: float, started: float | None, now: float) -> float:
    """When the next periodic checkpoint is due, one having just ended at ``now``.

    ``every`` is a period: a periodic checkpoint that started at ``started`` is followed by
    one at ``started + every`` (so that on a rank killed at a random moment the newest image
    is at most ``every`` plus one checkpoint's duration old, not ``every`` plus a whole
    checkpoint's duration later each time). An ordered one (``started`` None) leaves the
    schedule (``due``) alone. Either way at least half a period passes between the end of
    one and the start of the next, so that a checkpoint slower than the period does not take
    every cycle of the machine."""
    target = due if started is None else started + every
    return max(target, now + every / 2)


def _clone_pid(forked: CkptForked, namespace: int | None) -> int:
    if forked.orphan and namespace is not None:
        return criu.namespace_pid(forked.pid) or forked.pid
    return forked.pid


def acknowledged(rank: LocalRank, ready: CkptForked) -> bool:
    """Whether the relays hold every ``Data`` the rank counted as sent in ``ready`` and its
    home relay every ``Det`` (raises ``CheckpointError`` if a link can no longer say)."""
    me = rank.lease.rank
    for dst, seq in enumerate(ready.sent):
        if seq <= 0 or dst == me:
            continue  # messages to self never leave the process
        if rank.deposited.get(dst, 0) < seq:
            return False  # still on its way from the rank's socket
        if dst >= len(rank.route):
            raise CheckpointError(f"the rank sent to {dst}, which has no route")
        if not _unacked(rank, rank.route[dst]).holds_data(dst, seq):
            return False
    if ready.dets > 0:
        if rank.delivery.dets < ready.dets:
            return False
        if not rank.route:
            raise CheckpointError("the rank logged determinants but has no home relay")
        if not _unacked(rank, rank.route[me]).holds_dets(ready.dets):
            return False
    return True


def _unacked(rank: LocalRank, link: Any) -> RankLink:
    store = link.unacked(rank.key)
    if store is None or link.broken is not None:
        raise CheckpointError(f"{link.where} no longer carries the rank ({link.broken or 'gone'})")
    return store


def _home_relay(lease: Lease) -> RelayInfo | None:
    """The relay whose store keeps the rank's images; None for a rank given no relays (it
    runs, ``ranks`` checked its homes, but has nowhere to store)."""
    return lease.relays[lease.homes[lease.rank]] if lease.relays else None


async def _clone_let_go(pid: int, wait: float = CLONE_LET_GO) -> None:
    """Until the clone (host pid ``pid``) holds no unix socket, at most ``wait`` s: it closes
    its connections to the agent right after the fork, but an idle-class process on a busy
    machine may not have run since, and CRIU refuses a socket whose peer is outside the dump
    ("External socket is used"). A program's own unix sockets only cost it the wait."""
    deadline = trio.current_time() + wait
    while trio.current_time() < deadline:
        if not await trio.to_thread.run_sync(_holds_unix_socket, pid):
            return
        await trio.sleep(0.01)


def _socket_in_the_way(exc: criu.CriuError, clone: int) -> bool:
    """Whether CRIU refused the live clone ``clone`` only for a unix socket it held."""
    return clone > 0 and _EXTERNAL_SOCKET in str(exc) and os.path.exists(f"/proc/{clone}")


def _holds_unix_socket(pid: int) -> bool:
    try:
        unix = {
            line.split()[6]
            for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
            if len(line.split()) >= 7
        }
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False  # gone: the dump will say so
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in unix:
            return True
    return False


def _kill(pid: int | None) -> None:
    if pid is not None and pid > 0:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


async def _remove(path: Path) -> None:
    await trio.to_thread.run_sync(lambda: shutil.rmtree(path, ignore_errors=True))
