"""Credential guesses, rate-limited per client address.

Every secret a client presents (an API token, a portal session cookie, a join token, the
token pasted on the sign-in page) is checked here first: an address whose presentations
failed ``limit`` times within ``window`` seconds gets ``TooManyGuesses`` (429, with
``Retry-After``) for every presentation, right or wrong, until its oldest failure in the
window is older than ``window``. A success does not clear the count (a guesser holding one
valid token could reset it). Tokens have 256 bits: the limit is not what makes them
unguessable; it keeps a guesser from costing the coordinator a database lookup per try and
from filling its logs.

The table is bounded (``max_addresses``): past it, the addresses whose last failure is
oldest are forgotten first. State lives in the process: each coordinator replica counts its
own (a guesser spread over N replicas gets N times the limit).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

from vpool.coordinator.errors import CoordinatorError


class TooManyGuesses(CoordinatorError):
    status = 429
    code = "too_many_guesses"

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class GuessLimiter:
    def __init__(self, limit: int, window: float, *, max_addresses: int = 100_000) -> None:
        self.limit = limit
        self.window = window
        self.max_addresses = max_addresses
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def check(self, address: str, now: float) -> None:
        """Raise ``TooManyGuesses`` while ``address`` has used up its failures."""
        if self.limit <= 0:
            return
        failures = self._recent(address, now)
        if failures is not None and len(failures) >= self.limit:
            wait = max(1, math.ceil(failures[0] + self.window - now))
            raise TooManyGuesses(
                f"{len(failures)} credentials from this address were wrong in the last "
                f"{self.window:g} s: try again in {wait} s",
                retry_after=wait,
            )

    def failed(self, address: str, now: float) -> None:
        """Count one wrong credential from ``address``."""
        if self.limit <= 0:
            return
        failures = self._recent(address, now)
        if failures is None:
            failures = self._failures[address] = deque(maxlen=self.limit)
            while len(self._failures) > self.max_addresses:
                self._failures.popitem(last=False)
        failures.append(now)
        self._failures.move_to_end(address)

    def _recent(self, address: str, now: float) -> deque[float] | None:
        failures = self._failures.get(address)
        if failures is None:
            return None
        while failures and failures[0] <= now - self.window:
            failures.popleft()
        if not failures:
            del self._failures[address]
            return None
        return failures
