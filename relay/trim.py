"""Trimming a rank's incoming log behind its oldest retained checkpoint image.

Once the coordinator accepted a checkpoint image of a rank (``ckptstore``), a restored
process never needs the messages the image had already received, nor the determinants it had
already obeyed. The trim point of a rank is, per source, the highest seq it no longer needs
(``received``) and the index of its first determinant still needed (``dets``). Trimming:

1. saves the trim point in ``trim.json`` beside the segments (written to a temporary file,
   fsynced, renamed: it survives a SIGKILL at any point);
2. drops the entries from the in-memory mailbox and determinant log (``TrimmableMailbox``);
3. deletes the segments left holding only dropped frames, and rewrites ``dets.log`` without
   the dropped determinants when no determinant write is pending.

A relay restarted after step 1 skips everything at or below the trim point while rebuilding
(``log.open_log``, ``log.open_dets``) and finishes step 3 itself. A home ``Attach`` asking
for something below the trim point gets ``Error(ErrorCode.TRIMMED)``: the log cannot serve it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from vpool.protocol.detlog import DetLog
from vpool.protocol.errors import ErrorCode
from vpool.protocol.framing import encode_frame
from vpool.protocol.mailbox import Entry, Mailbox
from vpool.protocol.messages import Attach, Det
from vpool.relay import log as logfiles
from vpool.relay.errors import Rejected, StorageError

if TYPE_CHECKING:
    from vpool.relay.hub import Box, Hub

logger = logging.getLogger(__name__)

TRIM_FILE = "trim.json"
R = TypeVar("R")


@dataclass
class TrimPoint:
    """Per source the highest seq dropped, and the first determinant kept."""

    received: dict[int, int] = field(default_factory=dict)
    dets: int = 0

    def __bool__(self) -> bool:
        return self.dets > 0 or any(seq > 0 for seq in self.received.values())

    def merged(self, received: Mapping[int, int], dets: int) -> TrimPoint:
        """This point moved forward to (``received``, ``dets``), never back."""
        out = dict(self.received)
        for src, seq in received.items():
            if seq > out.get(src, 0):
                out[src] = seq
        return TrimPoint(out, max(self.dets, dets))


class TrimmableMailbox(Mailbox[R]):
    """A ``Mailbox`` whose durable entries can be dropped per source up to a seq, and which
    gives the core the relay's time (``clock``) with each credit that comes without one, for
    the push window's round trips (``protocol.window``).

    It reaches into the base class's private state; the trim belongs in
    ``protocol.mailbox`` and can move there unchanged."""

    def __init__(
        self,
        *,
        window: int,
        window_max: int | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(window=window, window_max=window_max)
        self.clock = clock

    def credit(self, nbytes: int, now: float | None = None) -> None:
        if now is None and self.clock is not None:
            now = self.clock()
        super().credit(nbytes, now)

    def seed(self, floor: Mapping[int, int]) -> None:
        """A rebuilt log of a trimmed rank: every source's channel continues after
        ``floor[src]``, which counts as stored and durable. Call before any ``append``."""
        for src, seq in floor.items():
            if seq > 0:
                self._stored[src] = seq
                self._acked[src] = seq

    def trim(self, floor: Mapping[int, int]) -> list[Entry[R]]:
        """Drop the durable entries with ``seq <= floor[src]``; return them. The delivery
        cursor keeps its place among the entries kept."""
        log, durable, cursor = self._log, self._durable, self._cursor
        kept: list[Entry[R]] = []
        dropped: list[Entry[R]] = []
        new_durable = new_cursor = 0
        for i, e in enumerate(log):
            if i < durable and e.seq <= floor.get(e.src, 0):
                dropped.append(e)
                continue
            kept.append(e)
            if i < durable:
                new_durable += 1
            if i < cursor:
                new_cursor += 1
        if not dropped:
            return []
        self._log = kept
        self._durable = new_durable
        self._cursor = new_cursor
        self._by_src = {}
        self._first_seq = {}
        for i, e in enumerate(kept):
            positions = self._by_src.get(e.src)
            if positions is None:
                self._by_src[e.src] = [i]
                self._first_seq[e.src] = e.seq
            else:
                positions.append(i)
        self._bytes -= sum(e.size for e in dropped)
        return dropped


def trimmed_dets(dets: DetLog[Det], first: int) -> DetLog[Det]:
    """A determinant log holding the entries of ``dets`` from index ``first`` on, with the
    same written/durable state."""
    if first <= dets.first:
        return dets
    out: DetLog[Det] = DetLog(first=first)
    end = len(dets)
    if first >= end:
        return out
    for index, det in enumerate(dets.replay(first), start=first):
        out.append(index, det)
        if index < dets.durable:
            out.written(index)
    out.advance()
    return out


def read_point(directory: Path) -> TrimPoint:
    path = directory / TRIM_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return TrimPoint()
    except (OSError, ValueError) as exc:
        raise StorageError(f"cannot read the trim point {path}: {exc}") from exc
    return TrimPoint({int(k): int(v) for k, v in raw["received"].items()}, int(raw["dets"]))


def write_point(directory: Path, point: TrimPoint) -> None:
    """Save a trim point atomically and durably (always fsynced: deleting segments relies on
    it)."""
    path = directory / TRIM_FILE
    tmp = directory / (TRIM_FILE + ".tmp")
    body = json.dumps(
        {"received": {str(k): v for k, v in point.received.items()}, "dets": point.dets}
    )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, body.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        raise StorageError(f"cannot save the trim point {path}: {exc}") from exc


def check_attach(box: Box | None, msg: Attach, job: int, rank: int) -> None:
    """Refuse a home attachment that asks for messages or determinants below the trim point."""
    if box is None or not box.trim:
        return
    point = box.trim
    for src, seq in sorted(point.received.items()):
        if msg.received.get(src, 0) < seq:
            raise Rejected(
                ErrorCode.TRIMMED,
                f"the log of rank {rank} of job {job} no longer holds messages <= {seq} from "
                f"rank {src} (asked from {msg.received.get(src, 0) + 1}): restore from a "
                "checkpoint",
                job=job,
                rank=rank,
            )
    if msg.dets_from < point.dets:
        raise Rejected(
            ErrorCode.TRIMMED,
            f"the log of rank {rank} of job {job} no longer holds determinants below "
            f"{point.dets} (asked from {msg.dets_from}): restore from a checkpoint",
            job=job,
            rank=rank,
        )


def apply(hub: Hub, box: Box, point: TrimPoint) -> None:
    """Trim ``box`` to ``point`` (saved by the caller first): memory, segments, dets.log.
    Runs in the event loop without awaiting, so no frame is staged meanwhile."""
    box.trim = point
    mailbox = box.mailbox
    assert isinstance(mailbox, TrimmableMailbox)
    dropped = mailbox.trim(point.received)
    for e in dropped:
        hub.pushed(e)
    hub.messages_stored -= len(dropped)
    hub.bytes_stored -= sum(e.size for e in dropped)
    live = {id(e.ref.segment) for e in mailbox.entries()}
    dead = [seg for seg in box.log.segments[:-1] if id(seg) not in live]
    freed = box.log.retire(dead) if dead else 0
    box.dets = trimmed_dets(box.dets, point.dets)
    rewrite_dets(box)
    logger.info(
        "job %d rank %d: log trimmed to %s, dets from %d (%d messages, %d segment bytes freed)",
        box.job,
        box.dst,
        point.received,
        point.dets,
        len(dropped),
        freed,
    )


def rewrite_dets(box: Box) -> None:
    """Rewrite ``dets.log`` without the dropped determinants, when no write to it is pending
    (otherwise the next trim, or the next start, does it)."""
    chan, dets = box.log, box.dets
    seg = chan.dets
    if seg is None or chan.closed or dets.durable != len(dets):
        return
    kept = dets.replay(dets.first)
    frames = [encode_frame(d) for d in kept]
    if seg.end == sum(len(f) for f in frames):
        return  # nothing to drop
    path, fd, end = logfiles.write_dets(chan.directory, frames, fsync=chan.fsync)
    chan.replace_dets(path, fd, end)
