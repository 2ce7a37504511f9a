"""A simulated relay of the fault-tolerance model: the product's ``protocol.relay_core.RelayCore``
(attachments, fencing, deposits, acks, determinism, determinant logs, delivery) with the model's
links for connections and its scheduler for disks; see ``ftmodel`` ("A relay")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vpool.protocol import messages as m
from vpool.protocol.api import RankLost, RelayDiverged, RelayValidated
from vpool.protocol.detlog import DetLog
from vpool.protocol.relay_core import Attachment, Box, RelayCore

from .ftmodel_config import Divergence, ModelError
from .ftmodel_frames import Ack, Credit, Delivered, Det, DetAck, Link, Push, digest

if TYPE_CHECKING:
    from .ftmodel import World
    from .ftmodel_rank import SimRank

JOB = 0


def frame_digest(frame: Any) -> bytes:
    return digest(frame.src, frame.dst, frame.seq, frame.payload)


class UnclampedCore(RelayCore[Link, Any]):
    """The core with one rule taken out, for the test that shows the model notices: acks
    claim what the log holds, whoever deposited it."""

    def ackable(self, att: Attachment[Link], dst: int, seq: int) -> int:
        return seq


class LaxDeliveredCore(RelayCore[Link, Any]):
    """The core with another rule taken out: a ``Delivered`` is honoured whoever sent it (a
    replaced incarnation, another connection), as long as someone receives the box."""

    def delivered(
        self, conn: Link, job: int, rank: int, incarnation: int, src: int, seq: int
    ) -> None:
        box = self.boxes.get((job, rank))
        if box is not None:
            box.mailbox.delivered(src, seq)


class SimRelay:
    def __init__(self, world: World, index: int) -> None:
        self.world, self.index = world, index
        self.homed = [r for r in world.ranks if world.home(r) == index]
        self.unwritten: dict[int, set[int]] = {r: set() for r in self.homed}  # dets being written
        self.recorded: dict[int, int] = {}  # rank -> incarnation, on "disk" (survives a crash)
        self.peer: dict[Link, Link] = {}  # an agent's link to us -> our link back (the conn)
        self.core = self._core()

    def _core(self) -> RelayCore[Link, Any]:
        config = self.world.config
        kind: type[RelayCore[Link, Any]] = RelayCore
        if not config.acks_by_attachment:
            kind = UnclampedCore
        elif not config.delivered_by_attachment:
            kind = LaxDeliveredCore
        core: RelayCore[Link, Any] = kind(
            self,
            name=f"relay {self.index}",
            window=config.window,
            lost_grace=float("inf"),  # the model reports nothing to a coordinator
            digest=frame_digest,
        )
        for rank, inc in self.recorded.items():
            core.fence[(JOB, rank)] = inc
        for r in self.homed:
            core.box(JOB, r)
        return core

    # The core's boxes, as the world inspects them.
    @property
    def mailboxes(self) -> dict[int, Any]:
        return {r: self.core.boxes[(JOB, r)].mailbox for r in self.homed}

    @property
    def detlogs(self) -> dict[int, DetLog[Any]]:
        return {r: self.core.boxes[(JOB, r)].dets for r in self.homed}

    # -- what the core asks (``relay_core.Shell``) ------------------------------------------

    def open_box(self, box: Box[Link, Any]) -> None:
        box.io = None  # the model's disk is the scheduler's "write" events

    def queue_ack(self, conn: Link, job: int, src: int, dst: int, seq: int) -> None:
        self.world.send(conn, Ack(dst, seq))

    def send(self, conn: Link, msg: m.Error | m.DetAck | m.Det) -> None:
        if isinstance(msg, m.DetAck):
            self.world.send(conn, DetAck(msg.count))
        # An Error (not_deterministic) ends the job: ``report_diverged`` says so.

    def stop(self, conn: Link, stop: m.Stop) -> None:
        pass  # a replaced incarnation is dead already in the model

    def wake(self, conn: Link) -> None:
        pass  # the model pushes eagerly (``pump``) after every event

    def record_incarnation(self, job: int, rank: int, incarnation: int) -> None:
        self.recorded[rank] = incarnation

    def report_lost(self, report: RankLost) -> None:
        raise ModelError(f"relay {self.index} reported a loss: {report}")

    def report_diverged(self, report: RelayDiverged) -> None:
        raise Divergence(report.message)

    def report_validated(self, report: RelayValidated) -> None:
        raise ModelError(f"relay {self.index} judged a validation the model never runs: {report}")

    # -- the model's events -------------------------------------------------------------------

    def attach(self, rank: SimRank, received: dict[int, int]) -> None:
        """``Attach`` from ``rank``'s agent (fresh incarnation or re-attach after our restart)."""
        up = self.world.link(Link(f"{rank}->relay {self.index}", self, rank, False))
        down = self.world.link(Link(f"relay {self.index}->{rank}", self, rank, True))
        rank.up[self.index] = up
        self.peer[up] = down
        self.core.attach(
            down,
            job=JOB,
            rank=rank.rank,
            incarnation=rank.inc,
            size=self.world.size,
            home=rank.rank in self.homed,
            received=received,
        )
        self.pump()

    def rank_crashed(self, rank: SimRank) -> None:
        """``rank``'s process died: nothing more reaches it; what it sent is still on the way,
        and the relay reads that before it sees the connection end (``_drained``)."""
        up = rank.up.get(self.index)
        down = self.peer.get(up) if up is not None else None
        if down is None:
            return
        down.alive = False
        self._drained(up, down)

    def _drained(self, up: Link, conn: Link) -> None:
        if conn.rank.state == "down" and not up.frames and conn in self.core.links:
            self.core.closed(conn, f"{conn.rank} crashed", now=0.0)

    def pending_writes(self) -> list[tuple[Any, ...]]:
        events: list[tuple[Any, ...]] = []
        for (_, dst), box in self.core.boxes.items():
            events += [
                ("write", self.index, dst, e) for e in box.mailbox.entries() if not e.written
            ]
        for rank, indexes in self.unwritten.items():
            events += [("write_det", self.index, rank, i) for i in sorted(indexes)]
        return events

    def written(self, dst: int, entry: Any) -> str:
        box = self.core.boxes[(JOB, dst)]
        box.mailbox.written(entry)
        self.core.written(box)  # acks in log order, cumulative per channel
        self.pump()
        return f"relay {self.index}: {entry.src}->{dst}#{entry.seq} written"

    def det_written(self, rank: int, index: int) -> str:
        box = self.core.boxes[(JOB, rank)]
        box.dets.written(index)
        self.unwritten[rank].discard(index)
        self.core.dets_written(box)  # DetAck(durable count) to the rank's home attachment
        return f"relay {self.index}: det {index} of rank {rank} written"

    def receive(self, link: Link, frame: Any) -> None:
        conn = self.peer[link]
        core = self.core
        if isinstance(frame, Credit):
            core.credit(conn, JOB, frame.rank, 1, None)
        elif isinstance(frame, Delivered):
            core.delivered(conn, JOB, frame.rank, frame.inc, frame.src, frame.seq)
        elif isinstance(frame, Det):
            box = core.det(conn, JOB, frame.rank, frame.index)
            if box is not None:
                box.dets.append(frame.index, frame.record)
                self.unwritten[frame.rank].add(frame.index)
            else:
                self._same_det(conn, frame)
        else:
            box = core.deposit(conn, JOB, frame.src, frame.dst, frame.seq, frame)
            if box is not None:
                box.mailbox.append(frame.src, frame.seq, 1, frame.payload, frame_digest(frame))
        self._drained(link, conn)
        self.pump()

    def _same_det(self, conn: Link, frame: Det) -> None:
        """A determinant the current attachment sent again equals the logged one (an
        invariant of the model: the product does not compare them)."""
        att = self.core.attachments.get((JOB, frame.rank))
        dets = self.core.boxes[(JOB, frame.rank)].dets
        if att is not None and att.conn is conn and frame.index < len(dets):
            logged = dets.replay(frame.index)[0]
            if logged != frame.record:
                raise ModelError(
                    f"relay {self.index}: det {frame.index} {frame.record} != {logged}"
                )

    def pump(self) -> None:
        """Push every durable message the window allows (the relay pushes eagerly)."""
        for r in self.homed:
            box = self.core.boxes[(JOB, r)]
            conn = box.receiver
            if conn is None:
                continue
            while (entry := box.mailbox.next_push()) is not None:
                self.world.send(conn, Push(entry.src, entry.seq, entry.ref))

    def crash(self) -> None:
        """Lose what is not durable and every connection; rebuild from the durable state (and
        the incarnations recorded on disk)."""
        old = self.core
        self.core = self._core()
        for r in self.homed:
            was, box = old.boxes[(JOB, r)], self.core.boxes[(JOB, r)]
            for e in list(was.mailbox.entries())[: was.mailbox.durable_count]:
                box.mailbox.written(box.mailbox.append(e.src, e.seq, e.size, e.ref, e.digest))
            box.mailbox.advance()
            for i, ref in enumerate(was.dets.replay(0)[: was.dets.durable]):
                box.dets.append(i, ref)
                box.dets.written(i)
            box.dets.advance()
            self.unwritten[r].clear()
        self.peer.clear()
        self.world.cut(self)
