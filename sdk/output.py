"""Showing a job's output the way ``mpiexec`` does, and what ``vsdk`` exits with.

Output arrives as chunks cut anywhere (an agent posts what a pipe gave it). ``LineAssembler``
keeps one partial line per (rank, stream) and hands out only whole lines, so two ranks never
share a line; at the end, ``flush`` gives the partial lines that never got their newline.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import BinaryIO

from vpool.protocol.api import JobInfo, OutputRecord

# Exit codes of vsdk (besides a job's own exit code).
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_LOST = 3  # the job failed without an exit code (a rank was lost)
EXIT_CANCELLED = 4
EXIT_UNREACHABLE = 5  # cannot reach the coordinator, or authentication failed


def job_exit_code(job: JobInfo) -> int:
    """What ``vsdk submit --wait`` / ``vsdk wait`` exit with for an ended job."""
    if job.state == "succeeded":
        return EXIT_OK
    if job.state == "cancelled":
        return EXIT_CANCELLED
    if job.state == "failed":
        code = job.exit_code
        if code is None:
            return EXIT_LOST
        if code < 0:  # killed by signal -code, as a shell reports it
            return min(128 - code, 255)
        if code == 0:
            return EXIT_ERROR
        return code if code <= 255 else EXIT_ERROR
    return EXIT_ERROR  # not ended


Line = tuple[int, str, bytes]  # (rank, stream, bytes of whole lines incl. the newline)


class LineAssembler:
    """Turns output chunks into whole lines, per rank and stream.

    ``label`` prefixes each line with ``[rank] `` like ``mpiexec -l``.
    """

    def __init__(self, *, label: bool = False) -> None:
        self._label = label
        self._partial: dict[tuple[int, str], bytes] = {}

    def _tag(self, rank: int, data: bytes) -> bytes:
        if not self._label:
            return data
        prefix = f"[{rank}] ".encode()
        lines = data.splitlines(keepends=True)
        return b"".join(prefix + line for line in lines)

    def feed(self, rank: int, stream: str, data: bytes) -> list[Line]:
        """Take one chunk; return the lines it completed (one item, possibly several lines)."""
        key = (rank, stream)
        buf = self._partial.pop(key, b"") + data
        cut = buf.rfind(b"\n") + 1
        if cut < len(buf):
            self._partial[key] = buf[cut:]
        if not cut:
            return []
        return [(rank, stream, self._tag(rank, buf[:cut]))]

    def feed_records(self, records: Iterable[OutputRecord]) -> list[Line]:
        out: list[Line] = []
        for rec in records:
            out += self.feed(rec.rank, rec.stream, rec.data)
        return out

    def flush(self) -> list[Line]:
        """The partial lines left at the end, by rank. Each stream's output stays as the
        program wrote it, except that a partial line followed by another rank's partial line
        gets a newline, so the two never share a line."""
        keys = sorted(self._partial)
        out: list[Line] = []
        for i, (rank, stream) in enumerate(keys):
            data = self._partial[(rank, stream)]
            if any(s == stream for _, s in keys[i + 1 :]):
                data += b"\n"
            out.append((rank, stream, self._tag(rank, data)))
        self._partial.clear()
        return out


class LineWriter:
    """Writes assembled lines: stdout lines to ``stdout``, stderr lines to ``stderr``."""

    def __init__(self, stdout: BinaryIO, stderr: BinaryIO) -> None:
        self._out = {"stdout": stdout, "stderr": stderr}

    def write(self, lines: Iterable[Line]) -> None:
        touched = set()
        for _rank, stream, data in lines:
            f = self._out.get(stream, self._out["stdout"])
            f.write(data)
            touched.add(id(f))
        for f in self._out.values():
            if id(f) in touched:
                f.flush()
