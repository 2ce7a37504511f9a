"""What a job may store at this relay, and what happens to one that stores too much.

Two limits guard the disk of ``data_dir``:

- ``job_log_quota``: the bytes of message and determinant logs and checkpoint images one job
  may hold here (what its receivers' logs hold now: a checkpoint's trim gives room back; an
  image counts once committed, less the older images its retention deletes);
- ``disk_reserve``: the bytes kept free on the disk, whoever else fills it. The free space is
  read (``statvfs``) at most once a second, and in between estimated from what was written, so
  the check costs a subtraction per deposit.

A deposit past either is refused, and so is every later deposit of its job: the job is done
for. Its sending ranks get a rank-scoped ``Error`` (``quota_exceeded`` or ``disk_full``; the
connection and every other rank on it go on), and the coordinator one ``RelayRefused``, which
fails the job with the limit named; its logs are then deleted like any finished job's. Jobs
within their quota do not notice, and the relay never exits for a full disk: it keeps serving
what it has.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path

import trio

from vpool.protocol.api import RelayRefused
from vpool.protocol.errors import ErrorCode
from vpool.sizes import format_size

DISK_CHECK_EVERY = 1.0  # s between statvfs calls while the estimate says there is room


class Quotas:
    """Per-job accounting of the logs and the refusals, with the reports for the coordinator."""

    def __init__(self, name: str, data_dir: Path, job_log_quota: int, disk_reserve: int) -> None:
        self.name = name
        self.data_dir = data_dir
        self.job_log_quota = job_log_quota
        self.disk_reserve = disk_reserve
        self.job_bytes: Counter[int] = Counter()
        self.refused: dict[int, tuple[ErrorCode, str]] = {}  # job -> (code, message)
        self.reports: list[RelayRefused] = []
        self.ready = trio.Event()
        self._free = 0
        self._free_at = -DISK_CHECK_EVERY  # monotonic time of the last statvfs

    def admit(self, job: int, nbytes: int, images: int = 0) -> tuple[ErrorCode, str] | None:
        """Why ``job`` may not log ``nbytes`` more here (its checkpoint images take
        ``images``; it is then refused for good), or None: the bytes are counted as the
        job's."""
        if job in self.refused:
            return self.refused[job]
        held = self.job_bytes[job] + nbytes
        if held + images > self.job_log_quota:
            return self._refuse(
                job,
                ErrorCode.QUOTA_EXCEEDED,
                f"job {job} exceeded job_log_quota ({format_size(self.job_log_quota)}) at "
                f"relay {self.name}: its logs and checkpoint images there would hold "
                f"{format_size(held + images)}",
            )
        if self._free - nbytes < self.disk_reserve or self._stale():
            self._free = disk_free(self.data_dir)
            self._free_at = time.monotonic()
            if self._free - nbytes < self.disk_reserve:
                return self._refuse(
                    job,
                    ErrorCode.DISK_FULL,
                    f"relay {self.name}'s disk is full: {format_size(self._free)} free, "
                    f"disk_reserve is {format_size(self.disk_reserve)}; job {job} may log "
                    "nothing more there",
                )
        self._free -= nbytes
        self.job_bytes[job] = held
        return None

    def admit_image(self, job: int, growth: int, images: int) -> tuple[ErrorCode, str] | None:
        """Why the job may not commit an image that grows what it holds here by ``growth``
        bytes (its images take ``images`` now; it is then refused for good), or None."""
        if job in self.refused:
            return self.refused[job]
        held = self.job_bytes[job] + images + growth
        if held > self.job_log_quota:
            return self._refuse(
                job,
                ErrorCode.QUOTA_EXCEEDED,
                f"job {job} exceeded job_log_quota ({format_size(self.job_log_quota)}) at "
                f"relay {self.name}: its logs and checkpoint images there would hold "
                f"{format_size(held)}",
            )
        return None

    def freed(self, job: int, nbytes: int) -> None:
        """``nbytes`` of the job's logs are gone (a checkpoint's trim)."""
        if job in self.job_bytes:
            self.job_bytes[job] = max(0, self.job_bytes[job] - nbytes)
        self._free += nbytes

    def loaded(self, job: int, nbytes: int) -> None:
        """Logs found on disk at start."""
        self.job_bytes[job] += nbytes

    def forget(self, job: int) -> None:
        """The job is over and its logs deleted."""
        self._free += self.job_bytes.pop(job, 0)
        self.refused.pop(job, None)

    def take(self) -> list[RelayRefused]:
        out, self.reports = self.reports, []
        self.ready = trio.Event()
        return out

    def _stale(self) -> bool:
        return time.monotonic() - self._free_at >= DISK_CHECK_EVERY

    def _refuse(self, job: int, code: ErrorCode, message: str) -> tuple[ErrorCode, str]:
        self.refused[job] = (code, message)
        self.reports.append(RelayRefused(name=self.name, job=job, code=code, message=message))
        self.ready.set()
        return code, message


def disk_free(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0
