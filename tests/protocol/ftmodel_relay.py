"""A simulated relay of the fault-tolerance model, around the real sans-IO state machines
(``Mailbox`` per destination, ``DetLog`` per rank); see ``ftmodel`` ("A relay")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vpool.protocol.detlog import DetLog, DetOffer
from vpool.protocol.mailbox import Mailbox, Offer

from .ftmodel_config import Divergence, ModelError
from .ftmodel_frames import Ack, Credit, Data, Det, DetAck, Link, Push, digest

if TYPE_CHECKING:
    from .ftmodel import World
    from .ftmodel_rank import SimRank


class SimRelay:
    def __init__(self, world: World, index: int) -> None:
        self.world, self.index = world, index
        self.homed = [r for r in world.ranks if world.home(r) == index]
        self.mailboxes: dict[int, Mailbox[Any]] = {
            r: Mailbox(window=world.config.window) for r in self.homed
        }
        self.detlogs: dict[int, DetLog[Any]] = {r: DetLog() for r in self.homed}
        self.unwritten: dict[int, set[int]] = {r: set() for r in self.homed}  # dets being written
        self.fence: dict[int, int] = {}  # rank -> newest incarnation attached
        self.down: dict[int, Link] = {}  # rank -> link to its current incarnation
        # rank -> dst -> the highest seq its current attachment deposited or re-sent: acks never
        # claim more (the product's ``Attachment.offered``), so a successor is not told that
        # a dead incarnation's message is its own.
        self.offered: dict[int, dict[int, int]] = {}

    def attach(self, rank: SimRank, received: dict[int, int]) -> None:
        """``Attach`` from ``rank``'s agent (fresh incarnation or re-attach after our restart)."""
        self.fence[rank.rank] = rank.inc
        self.offered[rank.rank] = {}
        rank.up[self.index] = self.world.link(
            Link(f"{rank}->relay {self.index}", self, rank, False)
        )
        self.down[rank.rank] = self.world.link(
            Link(f"relay {self.index}->{rank}", self, rank, True)
        )
        if rank.rank in self.mailboxes:
            self.mailboxes[rank.rank].attach(received)
            self.pump()

    def pending_writes(self) -> list[tuple[Any, ...]]:
        events: list[tuple[Any, ...]] = []
        for dst, box in self.mailboxes.items():
            events += [("write", self.index, dst, e) for e in box.entries() if not e.written]
        for rank, indexes in self.unwritten.items():
            events += [("write_det", self.index, rank, i) for i in sorted(indexes)]
        return events

    def _ackable(self, src: int, dst: int, seq: int) -> int:
        if not self.world.config.acks_by_attachment:
            return seq
        return min(seq, self.offered.get(src, {}).get(dst, 0))

    def written(self, dst: int, entry: Any) -> str:
        box = self.mailboxes[dst]
        box.written(entry)
        for e in box.advance():  # acked in log order, cumulative per channel
            seq = self._ackable(e.src, dst, e.seq)
            if seq > 0:
                self._to(e.src, Ack(dst, seq))
        self.pump()
        return f"relay {self.index}: {entry.src}->{dst}#{entry.seq} written"

    def det_written(self, rank: int, index: int) -> str:
        log = self.detlogs[rank]
        log.written(index)
        self.unwritten[rank].discard(index)
        before = log.durable
        if log.advance() > before:
            self._to(rank, DetAck(log.durable))
        return f"relay {self.index}: det {index} of rank {rank} written"

    def receive(self, frame: Any) -> None:
        sender = frame.src if isinstance(frame, Data) else frame.rank
        if self.fence.get(sender) != frame.inc:
            return  # a stale incarnation's frame, still on the wire: fenced
        if isinstance(frame, Credit):
            self.mailboxes[frame.rank].credit(1)
        elif isinstance(frame, Det):
            self._det(frame)
        else:
            self._deposit(frame)
        self.pump()

    def _deposit(self, frame: Data) -> None:
        box = self.mailboxes[frame.dst]
        mark = digest(frame.src, frame.dst, frame.seq, frame.payload)
        offer = box.offer(frame.src, frame.seq)
        offered = self.offered.setdefault(frame.src, {})
        offered[frame.dst] = max(offered.get(frame.dst, 0), frame.seq)
        if offer is Offer.NEW:
            box.append(frame.src, frame.seq, 1, frame.payload, mark)
            return
        logged = box.entry(frame.src, frame.seq)
        assert logged is not None
        if logged.digest != mark:
            raise Divergence(
                f"program is not deterministic: rank {frame.src} re-sent message {frame.seq} to "
                f"rank {frame.dst} (channel {frame.src}->{frame.dst}) with different content "
                f"({frame.payload!r}, logged {logged.ref!r})"
            )
        if offer is Offer.DUPLICATE:
            self._to(
                frame.src, Ack(frame.dst, self._ackable(frame.src, frame.dst, box.acked(frame.src)))
            )

    def _det(self, frame: Det) -> None:
        log = self.detlogs[frame.rank]
        if log.offer(frame.index) is DetOffer.NEW:
            log.append(frame.index, frame.record)
            self.unwritten[frame.rank].add(frame.index)
            return
        logged = log.replay(frame.index)[0]
        if logged != frame.record:
            raise ModelError(f"relay {self.index}: det {frame.index} {frame.record} != {logged}")
        self._to(frame.rank, DetAck(log.durable))

    def _to(self, rank: int, frame: Any) -> None:
        link = self.down.get(rank)
        if link is not None and link.alive:
            self.world.send(link, frame)

    def pump(self) -> None:
        """Push every durable message the window allows (the relay pushes eagerly)."""
        for dst, box in self.mailboxes.items():
            while (entry := box.next_push()) is not None:
                self._to(dst, Push(entry.src, entry.seq, entry.ref))

    def crash(self) -> None:
        """Lose what is not durable and every connection; rebuild from the durable state."""
        for dst, box in self.mailboxes.items():
            fresh: Mailbox[Any] = Mailbox(window=self.world.config.window)
            for e in list(box.entries())[: box.durable_count]:
                fresh.written(fresh.append(e.src, e.seq, e.size, e.ref, e.digest))
            fresh.advance()
            self.mailboxes[dst] = fresh
        for rank, log in self.detlogs.items():
            rebuilt: DetLog[Any] = DetLog()
            for i, ref in enumerate(log.replay(0)[: log.durable]):
                rebuilt.append(i, ref)
                rebuilt.written(i)
            rebuilt.advance()
            self.detlogs[rank] = rebuilt
            self.unwritten[rank].clear()
        self.fence.clear()
        self.offered.clear()
        self.down.clear()
        self.world.cut(self)
