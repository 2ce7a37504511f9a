"""Liveness of one connection: when to ping a quiet peer, and when to give it up for dead.

A connection through a middlebox can die without a FIN or a reset: a NAT or firewall that
forgets an idle flow silently drops every later packet, and an end that only waits for the next
frame waits for ever, while what it sends vanishes. TCP keepalive (``vpool.sockopts``) notices
only once the kernel's probes go unanswered, and not at all while something between the ends
still acknowledges them. So each end of an agent <-> relay connection also watches what it
receives, as aioquic's idle timeout does, with time an input:

- ``heard(at)``: bytes of the peer arrived at ``at`` (the shell passes the time of its latest
  read: any frame, even part of one, shows the peer alive);
- ``next_timer()``: when ``handle_timer`` is next due;
- ``handle_timer(now)``: a ``Ping`` to send (nothing arrived for ``ping_interval`` since the
  later of the last bytes and the last ``Ping``), ``Silent`` (nothing arrived for
  ``dead_after``: close the connection and never write to it again) or None.

The agent pings (``relay_ping_interval``, 5 s) and gives a connection up after
``relay_dead_after`` (12 s) of silence; the relay only listens (``ping_interval`` 0) and closes a
connection silent for ``agent_idle_timeout`` (30 s), which an agent that pings never is while
alive. A ``Ping`` is answered ``Pong`` at once by either side (``session``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vpool.protocol.messages import Ping


@dataclass(frozen=True)
class Silent:
    """The peer sent nothing for ``seconds``: the connection is dead."""

    seconds: float


class Liveness:
    """One connection's liveness watch from one end. A ``ping_interval`` or ``dead_after`` of 0
    turns that part off."""

    def __init__(self, *, ping_interval: float, dead_after: float, now: float) -> None:
        if ping_interval > 0 and 0 < dead_after <= ping_interval:
            raise ValueError(
                f"a connection declared dead after {dead_after:g} s of silence must be pinged "
                f"sooner than that, not every {ping_interval:g} s"
            )
        self.ping_interval = ping_interval
        self.dead_after = dead_after
        self.heard_at = now
        self._pinged_at = -math.inf
        self._nonce = 0

    def heard(self, at: float) -> None:
        """Something of the peer arrived at ``at`` (an earlier time than known is ignored)."""
        if at > self.heard_at:
            self.heard_at = at

    def next_timer(self) -> float:
        due = self.heard_at + self.dead_after if self.dead_after > 0 else math.inf
        if self.ping_interval > 0:
            due = min(due, max(self.heard_at, self._pinged_at) + self.ping_interval)
        return due

    def handle_timer(self, now: float) -> Ping | Silent | None:
        quiet = now - self.heard_at
        if self.dead_after > 0 and quiet >= self.dead_after:
            return Silent(quiet)
        if self.ping_interval > 0 and now - max(self.heard_at, self._pinged_at) >= (
            self.ping_interval
        ):
            self._pinged_at = now
            self._nonce += 1
            return Ping(nonce=self._nonce)
        return None
