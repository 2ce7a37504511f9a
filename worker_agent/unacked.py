"""What one rank deposited through one relay link that the relay has not acknowledged yet.

Kept so that a dropped relay connection loses nothing: after reconnecting and re-attaching, the
link resends every unacknowledged frame (the relay drops copies it holds after comparing
digests). Entries are references to the very buffers that were forwarded (no copy), dropped as
``Ack``s (cumulative per channel) and ``DetAck``s (cumulative count) come in, so the fault-free
path pays one append and one pop per frame.
"""

from __future__ import annotations

from collections import deque

from vpool.protocol.framing import Buffer

Frame = tuple[int, list[Buffer]]  # (seq or index, the frame's parts)


class Unacked:
    """Unacknowledged ``Data`` per destination and ``Det``s of one rank on one link."""

    __slots__ = ("data", "dets")

    def __init__(self) -> None:
        self.data: dict[int, deque[Frame]] = {}
        self.dets: deque[Frame] = deque()

    def add_data(self, dst: int, seq: int, parts: list[Buffer]) -> None:
        queue = self.data.get(dst)
        if queue is None:
            queue = self.data[dst] = deque()
        queue.append((seq, parts))

    def ack(self, dst: int, seq: int) -> None:
        """Everything of channel (this rank, ``dst``) up to ``seq`` is in the relay's log."""
        queue = self.data.get(dst)
        if queue:
            while queue and queue[0][0] <= seq:
                queue.popleft()

    def add_det(self, index: int, parts: list[Buffer]) -> None:
        self.dets.append((index, parts))

    def det_ack(self, count: int) -> None:
        """Determinants ``0 .. count-1`` are durable at the home relay."""
        dets = self.dets
        while dets and dets[0][0] < count:
            dets.popleft()

    def to_resend(self, stored: dict[int, int], dets_logged: int | None) -> list[list[Buffer]]:
        """What to send again after a re-attachment, in deposit order, the determinants first.

        Every unacknowledged ``Data`` goes again, even those ``stored`` says the relay holds:
        the relay compares a re-sent message with its logged copy (digest), and that check is
        what catches a replaying incarnation that diverged under a seq its predecessor logged
        (found by tests/protocol/test_ft_model.py). Determinants the relay has
        (``dets_logged``, None when this is not the rank's home link) are dropped: an index
        identifies one."""
        del stored  # see above: kept in the signature for the callers' symmetry
        if dets_logged is not None:
            self.det_ack(dets_logged)
        frames = [parts for _, parts in self.dets]
        for queue in self.data.values():
            frames.extend(parts for _, parts in queue)
        return frames

    def __len__(self) -> int:
        return len(self.dets) + sum(map(len, self.data.values()))
