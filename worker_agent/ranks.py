"""Running one lease: bundle, relays, process, output, results, exit report.

``run_rank`` owns the rank's process from spawn to reap. In order:

1. fetch the bundle (and rank 0's stdin) into the verified blob cache and extract the bundle
   into a fresh work directory;
2. attach the rank to every relay of its job (home on ``relays[homes[rank]]``), so that what
   the rank sends can be deposited the moment it starts; the home relay's ``Attached.dets``
   (determinants logged by earlier incarnations) becomes ``RankWelcome.replay_dets``;
3. spawn ``[python, entry, *args]`` in its own process group (in the agent's session, see
   ``_spawn``) with the environment of
   docs/internals.md, pump its output, and stop it when asked (``Stop`` to the rank, SIGTERM,
   then SIGKILL after ``stop_grace``);
4. once it is gone: post the remaining output, upload the files it created or changed, report
   ``RankExit`` (``lost`` when a signal the agent did not send killed it: the coordinator then
   restarts it), detach from the relays and delete the work directory.

A rank that cannot be prepared (bad bundle, relay refusing it) is reported as a ``RankProblem``
and never started.

Checkpoints (docs/internals.md, "Checkpoints"): with ``Lease.job_uid`` the rank's directory is
``{rank_root}/{job_uid}-{rank}-{incarnation}-XXXX`` (a checkpoint restores to the same path);
a running rank has a ``checkpoints.Checkpointer``; a lease with ``restore`` images starts from
one of them (``restore``) instead of from the beginning, when it can.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import ssl
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import trio

from vpool import paths
from vpool.niceness import run_niced
from vpool.protocol.api import (
    Lease,
    OutputBatch,
    RankExit,
    RankProblem,
    RelayInfo,
    RestoreAttempt,
    RestoreReport,
)
from vpool.protocol.framing import encode_frame
from vpool.protocol.messages import Stop
from vpool.protocol.rank_link import restarted
from vpool.reasons import describe
from vpool.sizes import format_size
from vpool.worker_agent import (
    bundle,
    cgroups,
    desktop,
    rank_tree,
    restore,
    sandbox,
    sandboxed,
)
from vpool.worker_agent.checkpoints import Capability, Checkpointer, checkpoint_signal
from vpool.worker_agent.checkpoints import checkpoints_enabled as _ckpt_disabled_because
from vpool.worker_agent.ckpt_workers import CkptWorkers
from vpool.worker_agent.coordinator import CoordinatorClient
from vpool.worker_agent.environments import EnvironmentRejected, Environments
from vpool.worker_agent.errors import (
    BundleError,
    BundleRejected,
    CoordinatorRejected,
    NoRoom,
    RelayLinkError,
)
from vpool.worker_agent.local_ranks import LocalRank, LocalRanks
from vpool.worker_agent.output import OutputPump
from vpool.worker_agent.relay_links import RelayLinks
from vpool.worker_agent.settings import AgentSettings
from vpool.worker_agent.store_client import Aborter, StoreConnection, StoreError, open_store

log = logging.getLogger("vpool.agent")

# Variables of the agent's own environment a program may reasonably need. Nothing else is
# passed on: the agent's environment can hold its enroll secret and tokens.
_PASSED_ENV = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "SYSTEMROOT")
# How long the rank's pipes may stay open after it exited (a child it left behind).
_PIPE_GRACE = 5.0
# Clean-up after a rank, even while the agent shuts down: its last frames (2 s), its
# detaches (each may wait LOCAL_SETTLE for what it gave other ranks to be logged), files.
_SHIELDED_CLEANUP = 8.0
EXIT_BAD_BUNDLE = 126  # as a shell says of a program it cannot run
_DISK_EVERY = 2.0  # s between looks at a sandboxed rank's disk use, at least
_DISK_WORK_RATIO = 20  # and at least 20 times as long as the last look took
# The rank's secret, in its directory until the runtime reads (and deletes) it.
SECRET_FILE = ".vpool-secret"
# Signals a process gets for its own faults: its exit is the program's error, not a loss.
_CRASH_SIGNALS = frozenset(
    int(getattr(signal, name))
    for name in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT", "SIGSYS", "SIGTRAP")
    if hasattr(signal, name)
)


def shim_dir() -> Path:
    """The directory that contains vpool's ``mpi4py`` shim package."""
    import vpool.mpi

    return Path(vpool.mpi.__file__).parent / "shim"


class ReportProblem(Protocol):
    """``Agent.report_problem``: tell the coordinator once that a rank cannot go on."""

    def __call__(
        self,
        rank: LocalRank,
        message: str,
        relay: str = "",
        *,
        failure: str = "",
        unopened_from: str = "",
    ) -> Awaitable[None]: ...


@dataclass
class RankServices:
    """What running a rank needs from the agent."""

    settings: AgentSettings
    client: CoordinatorClient
    links: RelayLinks
    blobs: bundle.BlobCache
    ranks: LocalRanks
    socket_path: Path
    report_problem: ReportProblem
    # Called once the rank's process is gone and its exit is reported: its slot is free for the
    # next lease (a replacement of a lost rank, often) while the clean-up goes on.
    release_slot: Callable[[LocalRank], None] = lambda rank: None
    # Called when a rank's state changes (it started running): the coordinator hears it at once
    # (a replacement counts as running from then on), not at the next heartbeat.
    state_changed: Callable[[], None] = lambda: None
    # Checkpoints: CRIU and the environment fingerprint (found at start), and the TLS context
    # for the relays' checkpoint stores.
    capability: Capability = field(default_factory=Capability)
    ssl_context: ssl.SSLContext | None = None
    # The sandbox (found at start; off until then) and what each rank may use in it.
    isolation: sandboxed.Isolation = field(default_factory=sandboxed.Isolation)
    limits: sandboxed.RankLimits = field(default_factory=sandboxed.RankLimits)
    # The environments jobs need, built here once each.
    environments: Environments | None = None
    # What extractions may take of the volunteer's disk, every rank's together.
    disk_room: bundle.DiskRoom = field(default_factory=bundle.DiskRoom)
    # The processes that dump and upload checkpoints (``checkpoint_workers``).
    _ckpt_workers: CkptWorkers | None = None

    def limits_for(self, lease: Lease) -> sandboxed.RankLimits:
        """What a rank of ``lease`` may use here: the volunteer's limits, lowered by the job's."""
        limits = self.limits
        if lease.memory > 0 and (not limits.memory or lease.memory < limits.memory):
            limits = dataclasses.replace(limits, memory=lease.memory)
        return limits

    def checkpoint_workers(self) -> CkptWorkers:
        """The agent's checkpoint worker processes (made at the first checkpoint)."""
        if self._ckpt_workers is None:
            self._ckpt_workers = CkptWorkers(self.settings.checkpoint_nice)
        return self._ckpt_workers

    async def aclose(self) -> None:
        """End what the services started (the idle checkpoint workers)."""
        if self._ckpt_workers is not None:
            await self._ckpt_workers.aclose()

    def open_store(self, relay: RelayInfo, aborter: Aborter) -> StoreConnection:
        """A connection to ``relay``'s checkpoint store as this agent (blocking: open it in
        the worker thread that uses it; ``aborter`` lets trio end it)."""
        if self.ssl_context is None:
            raise StoreError("no TLS context for the relays' checkpoint stores")
        return open_store(
            relay,
            ssl_context=self.ssl_context,
            token=self.client.token,
            max_payload=self.settings.max_payload,
            aborter=aborter,
            local=self.settings.store_local_socket,
        )


@dataclass
class Prepared:
    rank_dir: Path
    work: Path
    home: Path
    entry: Path
    stdin: Path | None
    before: bundle.Snapshot


def rank_env(
    lease: Lease,
    *,
    secret_file: str,
    socket_path: Path | str,
    shim: Path,
    home: Path | str,
    rank_dir: Path | str | None = None,
    checkpoints: bool = False,
    clone_timeout: float = 600.0,
    orphan_wait: float = 0.0,
    tmpdir: str = "",
    env_path: str = "",
) -> dict[str, str]:
    """The rank's environment, with paths as the rank sees them (its sandbox's).
    ``checkpoints``: the runtime takes them (it gets the signal to expect and its rank
    directory). The rank's secret is not in it: the runtime reads ``secret_file`` and
    deletes it (an environment can be read by others: ``/proc/PID/environ``)."""
    env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
    env["HOME"] = str(home)
    env["TMPDIR"] = tmpdir or str(home)
    env.update(lease.env)
    # The shim must come first so it wins over a real mpi4py in the same environment.
    pythonpath = [str(shim)]
    if env_path:  # the job's installed requirements, after vpool's mpi4py
        pythonpath.append(env_path)
    if lease.env.get("PYTHONPATH"):
        pythonpath.append(lease.env["PYTHONPATH"])
    env.update(
        PYTHONPATH=os.pathsep.join(pythonpath),
        VPOOL_AGENT_SOCKET=str(socket_path),
        VPOOL_RANK_SECRET_FILE=secret_file,
        PYTHONHASHSEED="0",
        PYTHONUNBUFFERED="1",
        VPOOL_JOB=str(lease.job),
        VPOOL_RANK=str(lease.rank),
        VPOOL_SIZE=str(lease.size),
        VPOOL_INCARNATION=str(lease.incarnation),
    )
    if checkpoints and rank_dir is not None:
        env.update(
            VPOOL_RANK_DIR=str(rank_dir),
            VPOOL_CKPT_SIGNAL=str(checkpoint_signal()),
            VPOOL_CKPT_CLONE_TIMEOUT=f"{clone_timeout:g}",
            VPOOL_CKPT_ORPHAN_WAIT=f"{orphan_wait:g}",
        )
    return env


async def prepare(svc: RankServices, lease: Lease) -> Prepared:
    """Fetch and extract the bundle into a fresh directory (raises ``BundleError``)."""
    settings = svc.settings
    entry_rel = bundle.safe_member_path(lease.entry)
    zip_path = await svc.blobs.get(lease.bundle)
    stdin = await svc.blobs.get(lease.stdin) if lease.stdin and lease.rank == 0 else None
    # Unsandboxed, a checkpoint restores the directory where it was (``rank_root``: the same
    # path on the agents of a pool); sandboxed, wherever it is, it is /vpool/rank inside.
    ranks_dir = await trio.to_thread.run_sync(paths.private_dir, settings.rank_root_path)
    prefix = f"{lease.job_uid or lease.job}-{lease.rank}-{lease.incarnation}-"
    rank_dir = Path(tempfile.mkdtemp(prefix=prefix, dir=ranks_dir))
    try:
        work, home = rank_dir / "work", rank_dir / "home"
        work.mkdir()
        home.mkdir()
        # What the rank may hold on disk bounds what its bundle may extract to: a zip bomb is
        # refused before it fills the volunteer's disk, not after.
        most = settings.max_bundle_bytes
        if svc.isolation.on and settings.rank_disk:
            most = min(most, settings.rank_disk)
        members = settings.max_bundle_members
        size = await trio.to_thread.run_sync(
            lambda: bundle.extracted_size(zip_path, max_bytes=most, max_members=members)
        )
        with svc.disk_room.reserve(ranks_dir, size):  # the agent's bound, every rank's together
            await trio.to_thread.run_sync(
                lambda: bundle.extract_bundle(zip_path, work, max_bytes=most, max_members=members)
            )
        before = await trio.to_thread.run_sync(bundle.snapshot, work)
        if lease.job_uid:
            # Travels with the rank directory in checkpoints: a restored rank's results are
            # what changed since this extraction.
            restore.save_snapshot(rank_dir / restore.SNAPSHOT_FILE, before)
    except BaseException:
        await _remove(rank_dir)
        raise
    return Prepared(rank_dir, work, home, work.joinpath(*entry_rel.parts), stdin, before)


async def attach(svc: RankServices, rank: LocalRank) -> None:
    """Attach ``rank`` to every relay of its job; fill its route (raises ``RelayLinkError``)."""
    lease = rank.lease
    if not lease.relays:
        return  # a rank that was given no relays can run but not communicate
    if len(lease.homes) != lease.size or not all(0 <= h < len(lease.relays) for h in lease.homes):
        raise RelayLinkError(
            f"the lease's homes {lease.homes} do not fit {lease.size} ranks and "
            f"{len(lease.relays)} relays"
        )
    home = lease.homes[lease.rank]
    links = []
    for i, info in enumerate(lease.relays):
        link = await svc.links.get(info)
        links.append(link)
        rank.links.append(link)
        attached = await link.attach(rank, home=i == home)
        if i == home:
            rank.replay_dets = attached.dets
        # What the relays hold from an earlier incarnation of this rank: a replaying runtime
        # sends asynchronously only as its determinants say until it has re-sent that much.
        for dst, seq in attached.stored.items():
            if seq > rank.replay_sent.get(dst, 0):
                rank.replay_sent[dst] = seq
    rank.route = [links[h] for h in lease.homes]


async def run_rank(svc: RankServices, rank: LocalRank) -> None:
    lease = rank.lease
    prepared: Prepared | None = None
    restored: restore.Restored | None = None
    try:
        try:
            tried: list[RestoreAttempt] = []
            if lease.requirements:
                await _environment(svc, rank)
            if lease.restore:
                restored, tried = await restore.restore_rank(svc, rank, attach)
                if restored is None and not lease.from_start:
                    reasons = "; ".join(f"checkpoint {t.ckpt}: {t.reason}" for t in tried)
                    await _report_start(svc, rank, tried)  # the events say why, per image
                    await svc.report_problem(
                        rank,
                        f"{rank.label} cannot start: no checkpoint image could be restored "
                        f"({reasons or 'none given'}) and the relays no longer hold its start",
                        "",
                    )
                    return
            if restored is not None:
                prepared = restored.prepared
                svc.ranks.dir_owner[prepared.rank_dir] = rank
            else:
                prepared = await prepare(svc, lease)
                svc.ranks.dir_owner[prepared.rank_dir] = rank
                await attach(svc, rank)
        except BundleRejected as exc:
            # The bundle breaks a rule: every agent would refuse it, so the job ends now, once,
            # with the reason, instead of the rank being lost and started again and again.
            log.error("%s cannot start: %s", rank.label, exc)
            await _post_exit(svc, rank, EXIT_BAD_BUNDLE, f"rank {lease.rank} cannot start: {exc}")
            return
        except (BundleError, RelayLinkError, CoordinatorRejected, NoRoom) as exc:
            log.error("%s cannot start: %s", rank.label, exc)
            relay = exc.relay if isinstance(exc, RelayLinkError) else ""
            # Worded as any agent would say it: the same failure on another agent ends the job
            # (its bundle, its relays' answers), rather than restarting it again and again. A
            # coordinator's refusal may be this agent's own (its token), so it is not compared.
            same = isinstance(exc, BundleError) or (isinstance(exc, RelayLinkError) and not relay)
            await svc.report_problem(
                rank,
                f"{rank.label} cannot start: {exc}",
                relay,
                failure=f"cannot start: {exc}" if same else "",
            )
            return
        code, message, lost = await execute(svc, rank, prepared, restored, tried)
        await _upload_results(svc, rank, prepared, code, message, lost)
        svc.release_slot(rank)
    except BaseException as exc:
        # Cancelled (possibly inside exception groups) means the agent is shutting down; the
        # coordinator hears it now rather than after a heartbeat timeout.
        if not rank.problem_reported and not rank.ended:
            rank.problem_reported = True
            name = svc.settings.agent_name
            cancelled = _only_cancelled(exc)
            why = "is shutting down" if cancelled else f"failed: {describe(exc)}"
            # An error of the agent's that the rank brings about would be every agent's.
            failure = "" if cancelled else f"the agent failed running it: {describe(exc)}"
            with trio.move_on_after(2, shield=True):
                await svc.client.post_problem(_problem(rank, f"agent {name} {why}", failure))
        raise
    finally:
        rank.ended = True
        rank.outbox.close()
        if rank.env_key is not None and svc.environments is not None:
            svc.environments.release(rank.env_key)
        with trio.move_on_after(_SHIELDED_CLEANUP, shield=True):
            if rank.hello_seen:
                # Frames the rank wrote just before it ended may still be on their way to a
                # relay; a Detach overtaking them would make the relay refuse them.
                with trio.move_on_after(2):
                    await rank.conn_done.wait()
            for link in rank.links:
                await link.detach(rank)
            if restored is not None:
                await trio.to_thread.run_sync(restored.cleanup)
            if prepared is not None:
                # A newer incarnation restored here may have taken the directory over.
                owner = svc.ranks.dir_owner.get(prepared.rank_dir)
                if owner is rank:
                    del svc.ranks.dir_owner[prepared.rank_dir]
                if owner in (rank, None) and not svc.settings.keep_workdirs:
                    await _remove(prepared.rank_dir)
            svc.ranks.remove(rank)


def _only_cancelled(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancelled(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


def _problem(rank: LocalRank, message: str, failure: str = "") -> RankProblem:
    lease = rank.lease
    return RankProblem(
        job=lease.job,
        rank=lease.rank,
        incarnation=lease.incarnation,
        message=message,
        failure=failure,
    )


@dataclass
class _Launched:
    """A rank process as ``execute`` drives it: spawned here, or restored (``restore``)."""

    process: trio.Process
    pid: int
    stdout: trio.abc.ReceiveStream | None
    stderr: trio.abc.ReceiveStream | None
    restored: restore.Restored | None = None
    box: sandboxed.Sandboxed | None = None  # its sandbox (a fresh start in one)

    def signal(self, sig: int) -> None:
        if self.restored is not None:
            self.restored.signal(sig)
        elif self.box is not None:
            self.box.signal(sig)
        else:
            _signal_group(self.process, sig)

    async def wait(self) -> None:
        """Until the rank ended (a sandbox may live on a moment: a clone being dumped)."""
        if self.box is not None:
            await self.box.wait_ended()
        else:
            await self.process.wait()

    def returncode(self) -> int | None:
        """The rank's exit status once it ended (None: unknown)."""
        if self.restored is not None:
            return self.restored.returncode()
        if self.box is not None:
            return self.box.returncode()
        return self.process.returncode

    def _sandbox(self) -> sandboxed.Sandboxed | None:
        return self.box or (self.restored.box if self.restored is not None else None)

    def freeze(self, frozen: bool) -> str:
        """Freeze or thaw every process of the rank: its cgroup's freezer where it has one
        (nothing in the group runs until thawed, whatever it forks), else SIGSTOP/SIGCONT to
        each process of its tree (one that left the tree meanwhile runs on). Blocks."""
        box = self._sandbox()
        if box is not None and box.cgroup is not None and box.cgroup.can_freeze:
            if not box.cgroup.freeze(frozen):
                verb = "freeze" if frozen else "thaw"
                log.warning("%s's processes did not %s in time", box.cgroup, verb)
            return "cgroup freezer"
        sig = signal.SIGSTOP if frozen else signal.SIGCONT
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        return "SIGSTOP" if frozen else "SIGCONT"

    def pids(self) -> list[int]:
        box = self._sandbox()
        if box is not None and box.cgroup is not None:
            try:
                return box.cgroup.pids()
            except cgroups.CgroupError:
                return []
        root = box.init_pid if box is not None else self.process.pid
        return desktop.process_tree(root)


async def execute(
    svc: RankServices,
    rank: LocalRank,
    prepared: Prepared,
    restored: restore.Restored | None = None,
    tried: list[RestoreAttempt] | None = None,
) -> tuple[int, str, bool]:
    """Run the rank's process (or drive the ``restored`` one) to its end; return its exit
    code, a note about how it ended and whether it was lost (see ``_describe_exit``)."""
    lease, settings = rank.lease, svc.settings
    if rank.stop_requested.is_set():
        if restored is not None:
            restored.signal(signal.SIGKILL)
            await restored.process.wait()
        return 128 + signal.SIGTERM, f"stopped before it started: {rank.stop_reason}", False
    if restored is not None:
        launched = _Launched(
            restored.process, restored.pid, restored.stdout, restored.stderr, restored
        )
    else:
        spawned = await _spawn(svc, rank, prepared)
        if isinstance(spawned, tuple):
            return spawned
        launched = spawned
    process = launched.process
    limit = ""
    rank.state = "running"
    rank.pid = launched.pid
    rank.process = launched
    box = launched.box or (restored.box if restored is not None else None)
    rank.ns_holder = box.init_pid if box is not None else None
    svc.state_changed()
    log.info("started %s (pid %d)", rank.label, launched.pid)
    pump = OutputPump(
        lease,
        functools.partial(_post_output, svc.client, rank),
        start=restored.out_offsets if restored is not None else None,
    )
    checkpointer = rank.checkpointer = Checkpointer(svc, rank, prepared, pump)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run, launched.stdout, launched.stderr)
            if lease.restore or restarted(lease.incarnation):
                nursery.start_soon(_report_start, svc, rank, tried or [])
            async with trio.open_nursery() as watch:
                watch.start_soon(_stop_when_asked, rank, launched, settings.stop_grace)
                watch.start_soon(checkpointer.run)
                if box is not None and box.limits.disk:
                    nice = svc.settings.checkpoint_nice
                    watch.start_soon(_watch_disk, prepared.rank_dir, box, nice)
                await launched.wait()
                checkpointer.close()  # no new checkpoint of a process that is gone
                returncode = launched.returncode()
                if returncode is not None and _describe_exit(rank, returncode)[2]:
                    grace = settings.lost_checkpoint_grace
                    await checkpointer.finish_in_flight(grace, rank.stop_requested)
                watch.cancel_scope.cancel()
            # Whatever the rank left running would keep its pipes (and maybe a slot) busy.
            launched.signal(signal.SIGKILL)
            if restored is not None:
                restored.release_holders()
            with trio.move_on_after(_PIPE_GRACE):
                await pump.done.wait()
            for pipe in (launched.stdout, launched.stderr):
                if pipe is not None:
                    await pipe.aclose()
    finally:
        rank.pid = None
        rank.process = None
        rank.suspended_since = None
        rank.unfrozen.set()
        rank.ns_holder = None
        if process.returncode is None:
            with trio.move_on_after(_SHIELDED_CLEANUP, shield=True):
                launched.signal(signal.SIGKILL)
                await process.wait()
        if box is not None:
            # Which limit ended it, read before its cgroup goes.
            limit = box.limit_reason()
            await box.aclose()
    returncode = launched.returncode() if process.returncode is not None else None
    if returncode is None and restored is not None and rank.stop_reason is None:
        return -signal.SIGKILL, "the restored process ended without an exit status", True
    if not limit and box is not None and box.limits.disk and returncode != 0:
        # A write past RLIMIT_FSIZE fails (EFBIG; Python ignores SIGXFSZ) and the program
        # ends with its own error before the next look at its disk.
        why = await trio.to_thread.run_sync(_over_disk, prepared.rank_dir, box.limits.disk)
        if why:
            limit = f"exceeded its disk limit of {format_size(box.limits.disk)}"
    if limit and rank.stop_reason is None:
        # The program's doing, not a loss: a replacement would hit the same limit.
        if returncode is None:
            code = 128 + signal.SIGKILL
        else:
            code = returncode if returncode >= 0 else 128 - returncode
        return code, f"rank {lease.rank} {limit}", False
    # None only if even SIGKILL did not end it within the cleanup time: report it as killed.
    return _describe_exit(rank, -signal.SIGKILL if returncode is None else returncode)


async def _spawn(
    svc: RankServices, rank: LocalRank, prepared: Prepared
) -> _Launched | tuple[int, str, bool]:
    """Start ``[python, entry, *args]`` (in its sandbox when the agent has one); the process,
    or how the rank ended if it cannot."""
    lease, settings = rank.lease, svc.settings
    boxed = svc.isolation.on
    inside = _inside(prepared) if boxed else None
    secret_file = prepared.rank_dir / SECRET_FILE
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, rank.secret.encode())
    finally:
        os.close(fd)
    env = rank_env(
        lease,
        secret_file=f"{sandbox.RANK_DIR}/{SECRET_FILE}" if boxed else str(secret_file),
        socket_path=sandbox.SOCKET if boxed else svc.socket_path,
        shim=shim_dir(),
        home=f"{sandbox.RANK_DIR}/home" if boxed else prepared.home,
        rank_dir=sandbox.RANK_DIR if boxed else prepared.rank_dir,
        checkpoints=not _ckpt_disabled_because(svc.capability, lease),
        clone_timeout=settings.checkpoint_clone_timeout,
        orphan_wait=settings.lost_checkpoint_grace,
        tmpdir="/tmp" if boxed else "",
        env_path=(sandbox.ENV_DIR if boxed else str(rank.env_site)) if rank.env_site else "",
    )
    python = settings.python_path
    limits = svc.limits_for(lease)
    if inside is not None:
        # A spawned process runs its spawn's command (Python's arguments, in the job's
        # directory), the others the job's program.
        program = [python, *lease.command] if lease.command else [python, inside, *lease.args]
        try:
            box = await sandboxed.start(
                svc.isolation,
                sandbox.Mounts(
                    prepared.rank_dir, svc.socket_path, stdin=prepared.stdin, env_dir=rank.env_site
                ),
                lambda status_fd: sandbox.init_argv(
                    python,
                    program,
                    status_fd=status_fd,
                    linger=settings.lost_checkpoint_grace,
                    stdin=prepared.stdin is not None,
                    nofile=limits.open_files,
                    fsize=limits.disk,
                    sched_idle=limits.sched_idle,
                    # Without a cgroup, rlimits stand in for its memory and process limits.
                    data=0 if svc.isolation.has_cgroup else limits.memory,
                    nproc=0 if svc.isolation.has_cgroup else limits.processes,
                ),
                name=f"{lease.job}-{lease.rank}-{lease.incarnation}-{os.getpid()}",
                limits=limits,
                env=env,
                cwd=prepared.work,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        except sandboxed.SandboxStartError as exc:
            return 127, f"cannot start the rank's sandbox: {exc}", False
        if not box.pid:
            await box.aclose()
            return 127, "the rank's sandbox started no program", False
        process = box.process
        return _Launched(process, box.pid, process.stdout, process.stderr, box=box)
    stdin = open(prepared.stdin or os.devnull, "rb")  # noqa: ASYNC230 - only an fd for the child
    try:
        process = await trio.lowlevel.open_process(
            [python, *lease.command]
            if lease.command
            else [python, str(prepared.entry), *lease.args],
            cwd=prepared.work,
            env=env,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # Its own process group: signals for the agent's terminal do not reach it, and
            # the agent can end whatever the rank itself started. Not its own session: a new
            # session is a new scheduler autogroup, and niceness only weighs threads within
            # one, so the agent's niced checkpoint chores would take a rank's share of the CPU.
            process_group=0,
        )
    except OSError as exc:
        return 127, f"cannot start {python}: {describe(exc)}", False
    finally:
        stdin.close()
    return _Launched(process, process.pid, process.stdout, process.stderr)


def _inside(prepared: Prepared) -> str:
    """The program's path as the sandboxed rank sees it."""
    return str(Path(sandbox.RANK_DIR) / prepared.entry.relative_to(prepared.rank_dir))


async def _watch_disk(rank_dir: Path, box: sandboxed.Sandboxed, nice: int) -> None:
    """End the rank once its directory takes more than its disk limit (a single file is
    bounded by RLIMIT_FSIZE already; this bounds their sum, every entry counted at least
    ``rank_tree.INODE_BYTES``). The walk runs ``nice`` steps nicer than the agent, and the
    longer it takes, the less often it runs: a rank's 300,000 files must not cost its agent a
    core."""
    limit = box.limits.disk
    while True:
        started = trio.current_time()
        why = await trio.to_thread.run_sync(run_niced, lambda: _over_disk(rank_dir, limit), nice)
        if why:
            box.killed_for = f"exceeded its disk limit of {format_size(limit)} ({why})"
            log.warning("stopping %s: %s", box.pid, box.killed_for)
            box.signal(signal.SIGKILL)
            return
        took = trio.current_time() - started
        await trio.sleep(max(_DISK_EVERY, _DISK_WORK_RATIO * took))


def _over_disk(rank_dir: Path, limit: int) -> str:
    """Why the tree under ``rank_dir`` is past ``limit`` ("" if it is not)."""
    try:
        used = rank_tree.usage(rank_dir, stop_past=limit)
    except rank_tree.TooDeep as exc:
        return str(exc)
    if used.charged <= limit:
        return ""
    return (
        f"{format_size(used.bytes)} in {used.entries} files and directories in its work "
        "directory, or more"
    )


async def _report_start(svc: RankServices, rank: LocalRank, tried: list[RestoreAttempt]) -> None:
    """Tell the coordinator how this incarnation started (``RestoreReport``)."""
    lease = rank.lease
    ckpt = rank.restored_from
    if ckpt >= 0:
        message = f"restored from checkpoint {ckpt}"
    elif lease.restore and not lease.from_start:
        message = "not started: no checkpoint image could be restored, no start to replay from"
    elif lease.restore:
        message = "started from the beginning: no checkpoint image could be restored"
    else:
        message = "started from the beginning"
    try:
        await svc.client.post_restored(
            RestoreReport(
                job=lease.job,
                rank=lease.rank,
                incarnation=lease.incarnation,
                ckpt=ckpt,
                tried=tried,
                message=message,
            )
        )
    except CoordinatorRejected as exc:
        log.warning("start report of %s refused: %s", rank.label, exc)


async def _post_output(client: CoordinatorClient, rank: LocalRank, batch: OutputBatch) -> None:
    try:
        await client.post_output(batch)
    except CoordinatorRejected as exc:
        # Typically the job is over on the coordinator's side; the rank is about to be stopped.
        log.warning("output of %s refused, dropped: %s", rank.label, exc)


def _describe_exit(rank: LocalRank, returncode: int) -> tuple[int, str, bool]:
    """(code, message, lost). A rank killed by a signal the agent did not send (it signals
    only ranks it was told to stop) is lost, code -signal: the OOM killer, a volunteer's kill,
    not the program's doing, so the coordinator restarts it. Except the signals a program
    brings on itself (a crash: SIGSEGV, SIGABRT, ...): a replay would crash again, so they
    fail the job like any error exit, code 128 + signal as a shell reports it."""
    if rank.stop_reason is not None:
        code = 128 - returncode if returncode < 0 else returncode
        return code, f"stopped: {rank.stop_reason}", rank.stop_lost
    if returncode >= 0:
        return returncode, "", False
    sig = -returncode
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    if sig in _CRASH_SIGNALS:
        return 128 + sig, f"crashed: {name}", False
    return returncode, f"killed by {name}, not by the agent", True


async def _stop_when_asked(rank: LocalRank, launched: _Launched, grace: float) -> None:
    await rank.stop_requested.wait()
    lease = rank.lease
    log.info("stopping %s: %s", rank.label, rank.stop_reason)
    if rank.suspended_since is not None:
        # A frozen process handles no signal: thawed, it ends as asked (SIGTERM first).
        await trio.to_thread.run_sync(launched.freeze, False)
        rank.suspended_since = None
        rank.unfrozen.set()
    rank.outbox.push_control(
        encode_frame(
            Stop(
                job=lease.job,
                rank=lease.rank,
                incarnation=lease.incarnation,
                reason=rank.stop_reason or "",
            )
        )
    )
    launched.signal(signal.SIGTERM)
    await trio.sleep(grace)
    launched.signal(signal.SIGKILL)


def _signal_group(process: trio.Process, sig: int) -> None:
    """Signal the rank's process group, whose id is the rank's pid (``process_group=0``).

    Safe after the rank was reaped: the kernel does not hand out a pid that is still some
    process group's id, so the group is ours for as long as it exists."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def _upload_results(
    svc: RankServices, rank: LocalRank, prepared: Prepared, code: int, message: str, lost: bool
) -> None:
    lease, settings, client = rank.lease, svc.settings, svc.client
    # A lost rank's files are nobody's results (its replacement makes them again): its exit
    # report goes at once, so the replacement starts sooner.
    try:
        data, skipped = (
            (None, [])
            if lost
            else await trio.to_thread.run_sync(
                lambda: bundle.results_zip(
                    prepared.work, prepared.before, max_bytes=settings.max_results_bytes
                )
            )
        )
    except rank_tree.TooDeep as exc:
        data, skipped = None, []
        note = f"no results: the rank's directory is too deep to read ({exc})"
        message = f"{message}; {note}" if message else note
    if skipped:
        note = (
            f"results over {settings.max_results_bytes} bytes: left out {len(skipped)} "
            f"file(s): {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}"
        )
        message = f"{message}; {note}" if message else note
    if data is not None:
        try:
            await client.put_results(lease.job, lease.rank, lease.incarnation, data)
        except CoordinatorRejected as exc:
            log.warning("results of %s refused: %s", rank.label, exc)
    abort = rank.abort
    report = RankExit(
        job=lease.job,
        rank=lease.rank,
        incarnation=lease.incarnation,
        code=abort.code if abort is not None else code,
        aborted=abort is not None,
        message=(abort.message if abort is not None else message),
        lost=lost and abort is None,
    )
    try:
        await client.post_exit(report)
    except CoordinatorRejected as exc:
        log.warning("exit report of %s refused: %s", rank.label, exc)
    log.info(
        "%s exited with code %d%s%s",
        rank.label,
        report.code,
        " (aborted)" * report.aborted,
        " (lost)" * report.lost,
    )


async def _environment(svc: RankServices, rank: LocalRank) -> None:
    """Build (or find) the job's environment before the rank starts or is restored."""
    if svc.environments is None:
        raise EnvironmentRejected("this agent does not install job environments")
    name = svc.settings.agent_name
    rank.env_key, rank.env_site = await svc.environments.acquire(rank.lease.requirements, name)


async def _post_exit(svc: RankServices, rank: LocalRank, code: int, message: str) -> None:
    lease = rank.lease
    rank.ended = True
    report = RankExit(
        job=lease.job, rank=lease.rank, incarnation=lease.incarnation, code=code, message=message
    )
    try:
        await svc.client.post_exit(report)
    except CoordinatorRejected as exc:
        log.warning("exit report of %s refused: %s", rank.label, exc)


async def _remove(path: Path) -> None:
    await trio.to_thread.run_sync(rank_tree.remove, path)
