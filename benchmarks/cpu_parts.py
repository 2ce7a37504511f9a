"""CPU seconds of a local pool's parts over a stretch of time, from ``/proc``.

``CpuParts`` reads every process's user and system time (``/proc/PID/stat``, its own time
only, never its reaped children's: those were sampled themselves) every ``interval`` seconds (1)
in a thread, and keeps per process the first and the last reading; a process that started
meanwhile counts from zero, one that ended counts up to its last reading (so at most
``interval`` of its time is missed). Processes are sorted into parts by their command line
(``PARTS``); kernel threads (no command line) make one part.

    with CpuParts() as cpu:
        ...
    cpu.parts()  # {"ranks": (user, system), ...}
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from types import TracebackType

# (part, what its command line contains), first match wins.
PARTS = (
    ("checkpoint workers", "vpool.worker_agent.ckpt_worker"),
    ("store process", "vpool.relay.storeworker"),
    ("criu", "criu"),
    ("relay", "vpool-relay"),
    ("agents", "vpool-agent"),
    ("coordinator", "vpool-coordinator"),
    ("ranks", "vpool-ranks"),
)
TICK = os.sysconf("SC_CLK_TCK")


def _read(pid: str) -> tuple[str, int, int] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[1].split()
    part = "kernel" if not cmdline else "other"
    for name, needle in PARTS:
        if needle in cmdline:
            part = name
            break
    return part, int(fields[11]), int(fields[12])


class CpuParts:
    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.first: dict[tuple[str, str], tuple[int, int]] = {}
        self.last: dict[tuple[str, str], tuple[str, int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._own = str(os.getpid())

    def _sample(self, first: bool) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid == self._own:
                continue
            got = _read(pid)
            if got is None:
                continue
            # A pid reused by another part is another process.
            key = (pid, got[0])
            if first:
                self.first[key] = (got[1], got[2])
            self.last[key] = got

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample(first=False)

    def __enter__(self) -> CpuParts:
        self._sample(first=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(first=False)

    def parts(self) -> dict[str, tuple[float, float]]:
        """(user, system) CPU seconds per part over the stretch."""
        out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for key, (part, user, system) in self.last.items():
            u0, s0 = self.first.get(key, (0, 0))
            out[part][0] += (user - u0) / TICK
            out[part][1] += (system - s0) / TICK
        return {part: (u, s) for part, (u, s) in sorted(out.items())}
