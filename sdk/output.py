"""Showing a job's output the way ``mpiexec`` does, and what ``vsdk`` exits with.

Output arrives as chunks cut anywhere (an agent posts what a pipe gave it);
``protocol.lines.LineAssembler`` (shared with the web portal) makes whole lines of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import BinaryIO

from vpool.protocol.api import JobInfo
from vpool.protocol.lines import Line, LineAssembler

__all__ = ["Line", "LineAssembler", "LineWriter", "job_exit_code"]

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
