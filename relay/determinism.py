"""Reports of the determinism check, on their way to the coordinator.

The check itself is ``protocol.relay_core`` (a re-sent message's digest against the logged
one's). When it fails for an ordinary incarnation, the rank gets ``Error(not_deterministic)``
and the coordinator one ``RelayDiverged`` per incarnation, which fails the job. A validating
incarnation (a rank re-executed from its log to check the original run) gets one verdict,
``RelayValidated``: it disagreed at its first difference, or agreed when it detached having
re-sent all the original sent. ``registry`` takes both kinds from here, in the order they came.
"""

from __future__ import annotations

import trio

from vpool.protocol.api import RelayDiverged, RelayValidated

Report = RelayDiverged | RelayValidated


class Determinism:
    def __init__(self) -> None:
        self.reports: list[Report] = []
        self.ready = trio.Event()

    def add(self, report: Report) -> None:
        self.reports.append(report)
        self.ready.set()

    def take(self) -> list[Report]:
        """The reports not yet handed to the coordinator client."""
        out, self.reports = self.reports, []
        self.ready = trio.Event()
        return out
