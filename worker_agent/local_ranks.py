"""The ranks this agent runs: one ``LocalRank`` per lease, found by secret or by (job, rank).

A ``LocalRank`` is shared by the task that runs its process (``ranks``), the task serving its
socket connection (``proxy``) and the relay links that push to it (``relay_link``). Only the
rank's runner touches the process; the others ask it to stop through ``request_stop``.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio

from vpool.protocol.api import Lease, RankState
from vpool.protocol.framing import Buffer, encode_frame
from vpool.protocol.messages import Abort, Failed, Message
from vpool.protocol.rank_link import Delivery, Held, is_current
from vpool.protocol.sealing import Sealer, message_key

if TYPE_CHECKING:
    from vpool.worker_agent.checkpoints import Checkpointer
    from vpool.worker_agent.relay_link import Connection, RelayLink

# One write to a rank's socket gathers frames up to about this many bytes.
_BATCH = 256 * 1024
# Agent-local delivery holds the sender back while this many bytes wait for a rank's socket
# (``has_room``, ``wait_room``).
LOCAL_BACKLOG = 8 * 1024 * 1024

RankKey = tuple[int, int]  # (job, rank)


class Outbox:
    """Frames waiting to be written to one rank's socket.

    Unbounded on purpose, and still bounded in practice: pushed ``Data`` is limited by the home
    relay's push window (it waits for our ``Credit``, sent only once the bytes are written),
    ``Ack``s are cumulative so only the newest per channel is kept, and ``Det``/``DetAck`` come
    one per determinant the rank logged (``Det`` only when replaying). Never blocking here is what
    keeps one slow rank from stalling the relay connection all the agent's ranks share.

    Write-through: once the rank's socket is known (``set_socket``), a pushed frame that finds
    nothing queued and no write in progress goes straight into the socket with one non-blocking
    ``writev``; only what the socket does not take waits for the writer task. A task switch per
    message is a large part of a small message's cost.
    """

    def __init__(self) -> None:
        # (parts, bytes to write, relay connection to credit, bytes to credit it)
        self._frames: deque[tuple[list[Buffer], int, Connection | None, int]] = deque()
        self._acks: dict[int, bytes] = {}
        self._wake = trio.Event()
        self._closed = False
        # The writer task is writing what ``take`` gave it.
        self.busy = False
        self._fd = -1
        # Called with (connection, nbytes) for pushed bytes written by write-through.
        self._on_written: Callable[[Connection, int], None] | None = None
        # Credit written but not yet sent, per relay connection (see Connection.credit_batch).
        self.held: dict[Connection, int] = {}
        # Bytes of the frames waiting (not yet taken by the writer task), and an event set
        # when they fall below LOCAL_BACKLOG.
        self.queued = 0
        self._room = trio.Event()

    def set_socket(self, fd: int, on_written: Callable[[Connection, int], None]) -> None:
        """Enable write-through into ``fd`` (non-blocking); ``fd=-1`` disables it."""
        self._fd = fd
        self._on_written = on_written

    def push_data(
        self, parts: list[Buffer], size: int, link: Connection | None, credit: int = -1
    ) -> None:
        """Queue a frame from a relay, in arrival order: pushed ``Data`` (credited back to
        ``link`` once written: ``credit`` bytes, the size the relay pushed, when it differs
        from the ``size`` written, as for a frame opened here) or, with ``link`` None, a
        ``Det``/``DetAck`` (not credited)."""
        if credit < 0:
            credit = size
        if self._fd >= 0 and not self._frames and not self.busy and not self._closed:
            try:
                n = os.writev(self._fd, parts)
            except OSError:
                n = 0  # full (or broken: the writer task finds out and says so)
            if n == size:
                if link is not None:
                    assert self._on_written is not None
                    self._on_written(link, credit)
                return
            if n:
                parts = _after(parts, n)
        self._frames.append((parts, size, link, credit))
        self.queued += size
        self._wake.set()

    def has_room(self) -> bool:
        """Whether agent-local delivery may add a frame now: the rank is reading (less than
        ``LOCAL_BACKLOG`` bytes wait). Pushed frames are bounded by the relay's window; local
        ones by this (``wait_room``)."""
        return self.queued < LOCAL_BACKLOG and not self._closed

    async def wait_room(self) -> None:
        """Wait until ``has_room`` (or the outbox is closed). The sender waits meanwhile, as
        a socket's sender does: a rank blocked writing still reads what comes to it (the
        runtime's transport), so two ranks sending each other much cannot deadlock."""
        while self.queued >= LOCAL_BACKLOG and not self._closed:
            if self._room.is_set():
                self._room = trio.Event()
            await self._room.wait()

    def push_ack(self, dst: int, frame: bytes) -> None:
        self._acks[dst] = frame
        self._wake.set()

    def push_control(self, frame: bytes) -> None:
        self._frames.append(([frame], 0, None, 0))
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._room.set()

    async def take(self) -> tuple[list[list[Buffer]], dict[Connection, int]]:
        """Wait for frames; return a batch and the bytes to credit back per relay link.

        Raises ``trio.EndOfChannel`` once closed and drained."""
        while not self._frames and not self._acks:
            if self._closed:
                raise trio.EndOfChannel
            self._wake = trio.Event()
            await self._wake.wait()
        batch: list[list[Buffer]] = []
        credits: dict[Connection, int] = {}
        total = 0
        frames = self._frames
        while frames and total < _BATCH:
            parts, size, link, credit = frames.popleft()
            self.queued -= size
            batch.append(parts)
            if link is not None:
                total += size
                credits[link] = credits.get(link, 0) + credit
            else:
                total += size or len(parts[0])
        if self._acks:
            batch.append(list(self._acks.values()))
            self._acks.clear()
        if self.queued < LOCAL_BACKLOG:
            self._room.set()
        self.busy = True
        return batch, credits

    def credit_due(self, link: Connection, nbytes: int) -> int:
        """Add written bytes to what is held for ``link``; the total to send now, or 0."""
        nbytes += self.held.pop(link, 0)
        if nbytes < link.credit_batch:
            self.held[link] = nbytes
            return 0
        return nbytes


def _after(parts: list[Buffer], n: int) -> list[Buffer]:
    """What is left of ``parts`` once their first ``n`` bytes are written."""
    out: list[Buffer] = []
    for part in parts:
        size = len(part)
        if n >= size:
            n -= size
            continue
        out.append(memoryview(part)[n:] if n else part)
        n = 0
    return out


class RankProcess(Protocol):
    """A rank's processes as the agent drives them while they run (``ranks._Launched``)."""

    def freeze(self, frozen: bool) -> str:
        """Freeze them all (or thaw them); how ("cgroup freezer", "SIGSTOP"). Blocks."""
        ...

    def pids(self) -> list[int]:
        """Every process of the rank (its sandbox's included). Blocks (reads /proc)."""
        ...


class LocalRank:
    """One incarnation of one rank on this agent."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.key: RankKey = (lease.job, lease.rank)
        # Opens the sealed Data relays push (``protocol.sealing``); ``seal``: this agent seals
        # what the rank sends (the agent's ``seal_messages``).
        self.sealer = Sealer(message_key(lease.ckpt_key)) if lease.ckpt_key else None
        self.seal = False
        self.secret = secrets.token_urlsafe(32)
        self.state = "starting"
        self.pid: int | None = None
        # A host pid whose namespaces are the rank's (its sandbox's init), while it has some.
        self.ns_holder: int | None = None
        self.outbox = Outbox()
        # route[dst] = link to the home relay of dst, filled once every relay is attached.
        self.route: list[RelayLink] = []
        self.links: list[RelayLink] = []
        # What the home relay gave this rank so far, for resuming after a reconnection: per
        # source the highest Data seq put into the outbox; and the determinants the rank has
        # (count): those replayed to it and those it created, so a re-attach never gets the
        # rank's own determinants pushed back (``Attach.dets_from``).
        self.delivery = Delivery()
        # Determinants the home relay held when this incarnation attached, and per destination
        # the highest seq the relays held from this rank (RankWelcome.replay_dets/replay_sent).
        self.replay_dets = 0
        self.replay_sent: dict[int, int] = {}
        # Per destination the highest Data seq forwarded to a relay (a checkpoint waits until
        # the relays acknowledged what the rank says it sent).
        self.deposited: dict[int, int] = {}
        # What the rank sent, as the agent checks it before forwarding anything (``proxy``):
        # per destination the highest seq it sent, and one past the highest determinant index.
        self.sent_seq: dict[int, int] = {}
        self.sent_dets = 0
        self.orphan_reports = 0  # connections of orphaned clones open (``proxy``)
        # The largest payload the agent takes from this rank: what its memory limit allows
        # (0: the relays' own limit). A frame is held whole before it is forwarded.
        self.max_payload = 0
        # What the agent holds of the rank's frames until the relays log them (bytes, over
        # all its links), and the most it holds before it stops reading the rank
        # (``room_for``): the rank's memory limit, or the agent's ``max_payload`` without one
        # (0: no bound). The volunteer's machine pays for no more than the rank could hold.
        self.held = Held(self._released)
        self.budget = 0
        self._room = trio.Event()
        # Checkpoints: the image this incarnation was restored from (-1: none); the rank's
        # control connection and what arrives on it (CkptForked); a checkpoint asked by the
        # coordinator.
        self.restored_from = -1
        self.control: trio.abc.SendStream | None = None
        self.control_opened = trio.Event()  # set once the rank opened its control connection
        self.control_send, self.control_recv = trio.open_memory_channel[Message](16)
        self.checkpoint_wanted = trio.Event()
        self.checkpointer: Checkpointer | None = None  # while the process runs
        self.abort: Abort | None = None
        self.finalized = False
        self.hello_seen = False
        self.slot_released = False
        self.conn_done = trio.Event()
        self.stop_reason: str | None = None
        self.stop_lost = False
        self.stop_requested = trio.Event()
        self.ended = False
        self.problem_reported = False
        # The job's environment (``environments``): its key and ``site`` directory here.
        self.env_key: str | None = None
        self.env_site: Path | None = None
        # Suspension (``suspend.py``): the rank's processes while they run (``ranks.execute``),
        # since when (trio clock) they are frozen, set while they are not; a reason once the
        # rank is being handed back to run elsewhere.
        self.process: RankProcess | None = None
        self.suspended_since: float | None = None
        self.unfrozen = trio.Event()
        self.unfrozen.set()
        self.evacuating = ""
        # What the volunteer's ``vpool-agent status`` shows: when it started here (wall
        # clock), and the CPU seconds and resident bytes its processes used when last looked.
        self.started_at = time.time()
        self.cpu_seconds = 0.0
        self.rss = 0
        # The job's ranks declared failed that this rank was told of (``tell_failed``).
        self.failed_told: list[int] = []

    def __repr__(self) -> str:
        lease = self.lease
        return f"<rank {lease.rank} of job {lease.job}, incarnation {lease.incarnation}>"

    @property
    def label(self) -> str:
        return f"rank {self.lease.rank} of job {self.lease.job}"

    def _released(self) -> None:
        self._room.set()

    def full(self, nbytes: int = 0) -> bool:
        """Whether what the agent holds and ``nbytes`` more would pass the budget. With
        nothing held, any frame the rank may send goes (one as large as the budget too)."""
        held = self.held.bytes
        return bool(self.budget and held and held + nbytes > self.budget)

    async def room_for(self, nbytes: int) -> None:
        """Wait until the agent may take ``nbytes`` more of the rank's frames (``full``),
        until the relays acknowledge some."""
        while self.full(nbytes):
            self._room = trio.Event()
            await self._room.wait()

    def tell_failed(self, ranks: list[int]) -> None:
        """Tell the rank which ranks of its job are declared failed (``messages.Failed``: in a
        job whose failure mode reports failures, or workers of a spawn that reports them),
        when that is news to it. The frame waits in the outbox until the rank's welcome has
        gone."""
        if ranks and ranks != self.failed_told:
            self.failed_told = list(ranks)
            self.outbox.push_control(encode_frame(Failed(ranks=self.failed_told)))

    def request_stop(self, reason: str, *, lost: bool = False) -> None:
        """Stop the process; ``lost``: the coordinator is to start it again (it is reported
        lost, not failed)."""
        if self.stop_reason is None:
            self.stop_reason = reason
            self.stop_lost = lost
        self.stop_requested.set()


class LocalRanks:
    def __init__(self) -> None:
        self.by_secret: dict[str, LocalRank] = {}
        self.by_key: dict[RankKey, LocalRank] = {}
        # Rank directory -> the rank using it. A restored incarnation takes over the directory
        # of the image's maker, which may be an older incarnation here still cleaning up.
        self.dir_owner: dict[Path, LocalRank] = {}

    def add(self, rank: LocalRank) -> None:
        self.by_secret[rank.secret] = rank
        self.by_key[rank.key] = rank

    def remove(self, rank: LocalRank) -> None:
        self.by_secret.pop(rank.secret, None)
        if self.by_key.get(rank.key) is rank:
            del self.by_key[rank.key]

    def __iter__(self) -> Iterator[LocalRank]:
        return iter(list(self.by_key.values()))

    def __len__(self) -> int:
        return len(self.by_key)

    def find(self, job: int, rank: int, incarnation: int) -> LocalRank | None:
        found = self.by_key.get((job, rank))
        if found is None or not is_current(found.lease.incarnation, incarnation):
            return None
        return found

    def states(self) -> list[RankState]:
        now = trio.current_time()
        return [
            RankState(
                job=r.lease.job,
                rank=r.lease.rank,
                incarnation=r.lease.incarnation,
                state="suspended" if r.suspended_since is not None else r.state,
                replay_dets=r.replay_dets,
                restored_from=r.restored_from,
                suspended_for=now - r.suspended_since if r.suspended_since is not None else 0.0,
            )
            for r in self
        ]
