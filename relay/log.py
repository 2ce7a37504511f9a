"""On-disk message logs: one directory of append-only segment files per (job, destination).

Layout: ``data_dir/jobs/<job>/<dst>/<00000000>.seg``. A segment holds whole frames exactly as
they were deposited (prefix, header, payload), so a pushed frame is the stored bytes and a
restarted relay rebuilds its index (and the frames' digests) by scanning them. Beside them,
``dets.log`` holds the rank's determinants, as the ``Det`` frames it sent, in index order.

After a checkpoint the log is trimmed (``relay.trim``): ``trim.json`` beside the segments holds
the trim point (per source the highest seq dropped, and the first determinant kept), segments
holding only dropped frames are deleted and ``dets.log`` is rewritten without the dropped
determinants. Scanning skips what lies at or below the trim point.

Writers reserve a frame's place (segment, offset) synchronously, when the message is appended
to the mailbox, and write it later with ``pwritev`` at that offset, possibly from a worker
thread. File order therefore always equals log order, even when two connections' writes
complete out of order. A relay killed between two such writes leaves a hole (zeros) or a torn
record; ``open_log`` truncates the segment at the first record that does not parse or does not
continue its channel, and drops later segments. Nothing after that point was acknowledged,
because acknowledgements only cover a durable prefix of the log (``protocol.mailbox``).

Everything here is blocking file I/O; the caller decides what runs in a thread.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vpool.protocol.errors import RemoteProtocolError
from vpool.protocol.framing import PREFIX_SIZE, frames_in
from vpool.protocol.messages import Data, Det, decode
from vpool.relay.errors import StorageError

log = logging.getLogger(__name__)

SUFFIX = ".seg"
DETS = "dets.log"
Buffer = bytes | bytearray | memoryview
# Linux's IOV_MAX; pwritev refuses more buffers per call.
IOV_MAX = 1024


class Segment:
    __slots__ = ("end", "fd", "number", "path")

    def __init__(self, number: int, path: Path, fd: int, end: int) -> None:
        self.number = number
        self.path = path
        self.fd = fd
        self.end = end  # next free offset (reserved, maybe not yet written)


class Location:
    """Where a frame lives: its segment and offset, plus the bytes while kept in memory and
    the connection they count against (``Hub.stage``)."""

    __slots__ = ("frame", "offset", "owner", "segment")

    def __init__(self, segment: Segment, offset: int, frame: Buffer | None) -> None:
        self.segment = segment
        self.offset = offset
        self.frame = frame
        self.owner: Any = None


@dataclass(frozen=True, slots=True)
class Record:
    """A frame found by scanning a segment at start-up."""

    src: int
    seq: int
    size: int
    location: Location
    digest: bytes


def _openssl_blake2b() -> bool:
    try:
        hashlib.new("blake2b512", b"")
    except ValueError:
        return False
    return True


if _openssl_blake2b():

    def digest(frame: Buffer) -> bytes:
        """A logged frame's digest, to tell whether a re-sent copy has the same content: 128
        bits of BLAKE2b. OpenSSL's BLAKE2b-512 cut to 16 bytes: Python 3.11's own ``blake2b``
        is 4-5 times slower, which would show on the message path. Kept in memory only."""
        return hashlib.new("blake2b512", frame).digest()[:16]

else:  # pragma: no cover - an OpenSSL without BLAKE2

    def digest(frame: Buffer) -> bytes:
        """BLAKE2b-128 of a logged frame (see above)."""
        return hashlib.blake2b(frame, digest_size=16).digest()


class ChannelLog:
    """The segment files of one destination rank's log."""

    def __init__(self, directory: Path, *, segment_size: int, fsync: bool) -> None:
        self.directory = directory
        self.segment_size = segment_size
        self.fsync = fsync
        self.segments: list[Segment] = []
        # The determinant log of the same rank (``dets.log``), created with its first entry.
        self.dets: Segment | None = None
        self.closed = False
        # Worker threads using the segments' descriptors; closing waits for them, since a
        # descriptor closed under a write could be reused by another file.
        self.busy = 0
        # Descriptors of deleted segments (trimmed), closed once no thread uses them.
        self._retired: list[int] = []

    def _new_segment(self) -> Segment:
        number = self.segments[-1].number + 1 if self.segments else 0
        path = self.directory / f"{number:08d}{SUFFIX}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            if self.fsync:
                _fsync_dir(self.directory)
        except OSError as exc:
            raise StorageError(f"cannot create log segment {path}: {exc}") from exc
        seg = Segment(number, path, fd, 0)
        self.segments.append(seg)
        return seg

    def reserve(self, size: int, frame: Buffer | None) -> Location:
        """Place for a frame of ``size`` bytes at the end of the log."""
        seg = self.segments[-1] if self.segments else self._new_segment()
        if seg.end >= self.segment_size:
            seg = self._new_segment()
        loc = Location(seg, seg.end, frame)
        seg.end += size
        return loc

    def reserve_det(self, size: int) -> Location:
        """Place for a ``Det`` frame at the end of the determinant log."""
        seg = self.dets
        if seg is None:
            path = self.directory / DETS
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                if self.fsync:
                    _fsync_dir(self.directory)
            except OSError as exc:
                raise StorageError(f"cannot create the determinant log {path}: {exc}") from exc
            seg = self.dets = Segment(-1, path, fd, 0)
        loc = Location(seg, seg.end, None)
        seg.end += size
        return loc

    def read(self, loc: Location, size: int) -> bytes:
        try:
            data = os.pread(loc.segment.fd, size, loc.offset)
        except OSError as exc:
            raise StorageError(f"cannot read {loc.segment.path}: {exc}") from exc
        if len(data) != size:
            raise StorageError(f"{loc.segment.path} is shorter than its index says")
        return data

    def acquire(self) -> None:
        self.busy += 1

    def release(self) -> None:
        self.busy -= 1
        if not self.busy:
            self._close_retired()
            if self.closed:
                self._close_fds()

    def retire(self, dead: Sequence[Segment]) -> int:
        """Delete segments that hold only trimmed frames (never the last one, which takes new
        frames); return the bytes freed. Their descriptors close when no thread uses them."""
        gone = {id(seg) for seg in dead if seg is not self.segments[-1]}
        freed = 0
        keep: list[Segment] = []
        for seg in self.segments:
            if id(seg) not in gone:
                keep.append(seg)
                continue
            try:
                seg.path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise StorageError(f"cannot delete log segment {seg.path}: {exc}") from exc
            freed += seg.end
            self._retired.append(seg.fd)
        self.segments = keep
        if freed and self.fsync:
            _fsync_dir(self.directory)
        if not self.busy:
            self._close_retired()
        return freed

    def replace_dets(self, path: Path, fd: int, end: int) -> None:
        """Swap in a rewritten determinant log (``write_dets``) already renamed over the old
        one. The caller makes sure no write to the old one is pending."""
        old = self.dets
        self.dets = Segment(-1, path, fd, end)
        if old is not None:
            self._retired.append(old.fd)
        if not self.busy:
            self._close_retired()

    def _close_retired(self) -> None:
        for fd in self._retired:
            os.close(fd)
        self._retired.clear()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.busy:
            self._close_fds()

    def _close_fds(self) -> None:
        self._close_retired()
        for seg in self.segments:
            os.close(seg.fd)
        self.segments.clear()
        if self.dets is not None:
            os.close(self.dets.fd)
            self.dets = None


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# A run is a contiguous stretch of one segment: (segment, offset, buffers).
Run = tuple[Segment, int, list[Buffer]]


def group_runs(items: Sequence[tuple[Location, Buffer]]) -> list[Run]:
    """Merge frames that sit back to back in the same segment into one ``pwritev`` each."""
    runs: list[Run] = []
    nxt = -1
    for loc, frame in items:
        if runs and loc.segment is runs[-1][0] and loc.offset == nxt and len(runs[-1][2]) < IOV_MAX:
            runs[-1][2].append(frame)
        else:
            runs.append((loc.segment, loc.offset, [frame]))
            nxt = loc.offset
        nxt += len(frame)
    return runs


def write_runs(runs: Sequence[Run], *, fsync: bool) -> None:
    """Write every run at its offset (and flush to the device with ``fsync``)."""
    try:
        for seg, offset, bufs in runs:
            total = sum(len(b) for b in bufs)
            written = os.pwritev(seg.fd, bufs, offset)
            if written != total:
                # Short writes on regular files are rare (a signal, a full disk); finish them.
                blob = b"".join(bufs)
                while written < total:
                    n = os.pwrite(seg.fd, memoryview(blob)[written:], offset + written)
                    if n <= 0:
                        raise OSError("pwrite wrote nothing")
                    written += n
        if fsync:
            for fd in {seg.fd for seg, _, _ in runs}:
                os.fdatasync(fd)
    except OSError as exc:
        raise StorageError(f"cannot write the message log: {exc}") from exc


# -- start-up --------------------------------------------------------------------------------


def job_dir(data_dir: Path, job: int) -> Path:
    return data_dir / "jobs" / str(job)


def box_dir(data_dir: Path, job: int, dst: int) -> Path:
    return job_dir(data_dir, job) / str(dst)


def existing_boxes(data_dir: Path) -> Iterator[tuple[int, int, Path]]:
    """``(job, dst, directory)`` of every log directory left by an earlier run."""
    jobs = data_dir / "jobs"
    if not jobs.is_dir():
        return
    for jd in sorted(jobs.iterdir()):
        if not jd.is_dir() or not jd.name.isdigit():
            continue
        for dd in sorted(jd.iterdir()):
            if dd.is_dir() and dd.name.isdigit():
                yield int(jd.name), int(dd.name), dd


def create_log(directory: Path, *, segment_size: int, fsync: bool) -> ChannelLog:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot create {directory}: {exc}") from exc
    return ChannelLog(directory, segment_size=segment_size, fsync=fsync)


def open_log(
    directory: Path,
    job: int,
    dst: int,
    *,
    segment_size: int,
    fsync: bool,
    floor: dict[int, int] | None = None,
) -> tuple[ChannelLog, list[Record]]:
    """Reopen a log directory, returning its records in log order; a torn or corrupt tail is
    cut off (see the module docstring). Records with ``seq <= floor[src]`` (trimmed) are
    skipped, and segments left with none of the others are deleted."""
    chan = ChannelLog(directory, segment_size=segment_size, fsync=fsync)
    records: list[Record] = []
    stored: dict[int, int] = {src: seq for src, seq in (floor or {}).items() if seq > 0}
    floor = dict(stored)
    empty: list[Segment] = []
    paths = sorted(p for p in directory.iterdir() if p.suffix == SUFFIX and p.stem.isdigit())
    intact = True
    for path in paths:
        if not intact:
            log.warning("dropping log segment %s after a torn record", path)
            path.unlink()
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise StorageError(f"cannot open log segment {path}: {exc}") from exc
        seg = Segment(int(path.stem), path, fd, 0)
        chan.segments.append(seg)
        before = len(records)
        end, intact = _scan(seg, job, dst, stored, records, floor)
        if len(records) == before and end > 0:
            empty.append(seg)
        size = os.fstat(fd).st_size
        if end != size:
            log.warning("truncating log segment %s from %d to %d bytes", path, size, end)
            os.ftruncate(fd, end)
        seg.end = end
    if empty and chan.segments:
        chan.retire(empty)
    return chan, records


def _scan(
    seg: Segment,
    job: int,
    dst: int,
    stored: dict[int, int],
    out: list[Record],
    floor: dict[int, int],
) -> tuple[int, bool]:
    """Append the valid records of one segment to ``out`` (those above ``floor``); return
    (end of the valid part, whether the whole file was valid)."""
    size = os.fstat(seg.fd).st_size
    if size == 0:
        return 0, True
    pos = 0  # end of the valid part
    with mmap.mmap(seg.fd, 0, access=mmap.ACCESS_READ) as mm:
        for start, header_len, payload_len in frames_in(mm):
            end = start + PREFIX_SIZE + header_len + payload_len
            try:
                msg = decode(mm[start + PREFIX_SIZE : start + PREFIX_SIZE + header_len])
            except RemoteProtocolError:
                return pos, False
            if not isinstance(msg, Data) or msg.job != job or msg.dst != dst or msg.seq < 1:
                return pos, False
            if msg.seq <= floor.get(msg.src, 0):
                pos = end  # trimmed, in a segment that also holds frames kept
                continue
            last = stored.get(msg.src)
            if last is not None and msg.seq != last + 1:
                return pos, False
            stored[msg.src] = msg.seq
            loc = Location(seg, start, None)
            out.append(Record(msg.src, msg.seq, end - start, loc, digest(mm[start:end])))
            pos = end
    return pos, pos == size


def open_dets(chan: ChannelLog, job: int, rank: int, first: int = 0) -> list[Det]:
    """Reopen the determinant log of ``chan``'s rank, if it has one, returning its entries
    from index ``first`` on, in index order (the file may start at any index up to ``first``:
    it is rewritten after the trim point is saved); a torn or corrupt tail is cut off like a
    segment's."""
    path = chan.directory / DETS
    if not path.exists():
        return []
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        data = os.pread(fd, os.fstat(fd).st_size, 0)
    except OSError as exc:
        raise StorageError(f"cannot open the determinant log {path}: {exc}") from exc
    seg = chan.dets = Segment(-1, path, fd, 0)
    dets: list[Det] = []
    nxt = -1  # index of the next record; the first one sets it
    pos, size = 0, len(data)
    for start, header_len, _ in frames_in(data, max_payload=0):
        end = start + PREFIX_SIZE + header_len
        try:
            msg = decode(data[start + PREFIX_SIZE : end])
        except RemoteProtocolError:
            break
        if not isinstance(msg, Det) or (msg.job, msg.rank) != (job, rank):
            break
        if nxt < 0 and msg.index > first:
            break  # the file starts at 0 or at an earlier trim point, never later
        if nxt >= 0 and msg.index != nxt:
            break
        nxt = msg.index + 1
        if msg.index >= first:
            dets.append(msg)
        pos = end
    if pos != size:
        log.warning("truncating determinant log %s from %d to %d bytes", path, size, pos)
        try:
            os.ftruncate(fd, pos)
        except OSError as exc:
            raise StorageError(f"cannot truncate {path}: {exc}") from exc
    seg.end = pos
    return dets


def write_dets(directory: Path, frames: Sequence[Buffer], *, fsync: bool) -> tuple[Path, int, int]:
    """Write a new determinant log of ``frames`` and rename it over ``dets.log``; return its
    path, an open descriptor and its size (for ``ChannelLog.replace_dets``)."""
    path = directory / DETS
    tmp = directory / (DETS + ".tmp")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            end = 0
            for frame in frames:
                os.pwrite(fd, frame, end)
                end += len(frame)
            if fsync:
                os.fsync(fd)
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            raise
        if fsync:
            _fsync_dir(directory)
    except OSError as exc:
        raise StorageError(f"cannot rewrite the determinant log {path}: {exc}") from exc
    return path, fd, end


def record_incarnation(data_dir: Path, job: int, rank: int, incarnation: int) -> None:
    """Remember a replacement incarnation, so a restarted relay still fences older ones."""
    directory = job_dir(data_dir, job)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with (directory / "incarnations").open("a") as f:
            f.write(f"{rank} {incarnation}\n")
    except OSError as exc:
        raise StorageError(f"cannot record an incarnation in {directory}: {exc}") from exc


def recorded_incarnations(data_dir: Path) -> dict[tuple[int, int], int]:
    """``(job, rank) -> highest incarnation`` recorded by ``record_incarnation``."""
    out: dict[tuple[int, int], int] = {}
    jobs = data_dir / "jobs"
    if not jobs.is_dir():
        return out
    for path in jobs.glob("*/incarnations"):
        if not path.parent.name.isdigit():
            continue
        job = int(path.parent.name)
        for line in path.read_text().splitlines():
            fields = line.split()
            # A torn last line (killed mid-write) is skipped: at worst that incarnation is
            # not fenced after a restart, as before this record existed.
            if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
                key = (job, int(fields[0]))
                out[key] = max(out.get(key, 0), int(fields[1]))
    return out


def delete_job(data_dir: Path, job: int) -> None:
    shutil.rmtree(job_dir(data_dir, job), ignore_errors=True)
