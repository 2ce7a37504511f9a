"""Trimming a rank's incoming log behind its oldest retained checkpoint image.

Once the coordinator accepted a checkpoint image of a rank (``ckptstore``), a restored
process never needs the messages the image had already received, nor the determinants it had
already obeyed. The trim point of a rank is, per source, the highest seq it no longer needs
(``received``) and the index of its first determinant still needed (``dets``). Trimming:

1. saves the trim point in ``trim.json`` beside the segments (written to a temporary file,
   fsynced, renamed: it survives a SIGKILL at any point);
2. drops the entries from the in-memory mailbox and determinant log (``RelayCore.trim``);
3. deletes the segments left holding only dropped frames, and rewrites ``dets.log`` without
   the dropped determinants when no determinant write is pending.

A relay restarted after step 1 skips everything at or below the trim point while rebuilding
(``log.open_log``, ``log.open_dets``) and finishes step 3 itself. The rules (what is dropped, a
home ``Attach`` asking for something below the trim point refused ``trimmed``) are
``protocol.relay_core``; this module is their files.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from vpool.protocol.framing import encode_frame
from vpool.protocol.relay_core import TrimPoint
from vpool.relay import log as logfiles
from vpool.relay.errors import StorageError

if TYPE_CHECKING:
    from vpool.relay.hub import Box, Hub

logger = logging.getLogger(__name__)

TRIM_FILE = "trim.json"


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


def apply(hub: Hub, box: Box, point: TrimPoint) -> None:
    """Trim ``box`` to ``point`` (saved by the caller first): memory (``RelayCore.trim``),
    segments, dets.log. Runs in the event loop without awaiting, so no frame is staged
    meanwhile."""
    dropped = hub.core.trim(box, point)
    mailbox = box.mailbox
    for e in dropped:
        hub.pushed(e)
    hub.messages_stored -= len(dropped)
    nbytes = sum(e.size for e in dropped)
    hub.bytes_stored -= nbytes
    hub.quotas.freed(box.job, nbytes)
    live = {id(e.ref.segment) for e in mailbox.entries()}
    chan = box.io.log
    dead = [seg for seg in chan.segments[:-1] if id(seg) not in live]
    freed = chan.retire(dead) if dead else 0
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
    chan, dets = box.io.log, box.dets
    seg = chan.dets
    if seg is None or chan.closed or dets.durable != len(dets):
        return
    kept = dets.replay(dets.first)
    frames = [encode_frame(d) for d in kept]
    if seg.end == sum(len(f) for f in frames):
        return  # nothing to drop
    path, fd, end = logfiles.write_dets(chan.directory, frames, fsync=chan.fsync)
    chan.replace_dets(path, fd, end)
