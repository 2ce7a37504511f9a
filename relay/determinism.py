"""Reports of programs that are not deterministic, on their way to the coordinator.

The check itself is ``protocol.relay_core`` (a re-sent message's digest against the logged
one's); when it fails, the rank gets ``Error(not_deterministic)`` and the coordinator one
``RelayDiverged`` per (job, rank), which fails the job. ``registry`` takes them from here.
"""

from __future__ import annotations

import trio

from vpool.protocol.api import RelayDiverged


class Determinism:
    def __init__(self) -> None:
        self.reports: list[RelayDiverged] = []
        self.ready = trio.Event()

    def add(self, report: RelayDiverged) -> None:
        self.reports.append(report)
        self.ready.set()

    def take(self) -> list[RelayDiverged]:
        """The reports not yet handed to the coordinator client."""
        out, self.reports = self.reports, []
        self.ready = trio.Event()
        return out
