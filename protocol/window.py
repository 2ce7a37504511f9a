"""The push window of one receiving rank, grown to the bandwidth-delay product of its link.

Sans-IO: time is an argument (``now``, seconds on any one monotonic clock), never read here, as
in aioquic's congestion controller. The relay pushes a rank's logged frames to the rank's agent
while fewer than ``size`` bytes are un-credited (``protocol.mailbox``). A fixed window caps a
stream at window / round trip: 4 MiB over a 40 ms round trip is 100 MiB/s at best, whatever the
link carries. So the window starts at ``initial`` and grows while it is what limits the stream:

- **Samples** (BBR's delivery-rate estimation, draft-cheng-iccrg-delivery-rate-estimation):
  every push is recorded with the time it went out and how much had been credited by then;
  when credit covers a pushed frame, the frame gives a round-trip sample (push to credit) and
  a delivery-rate sample (bytes credited since the frame went out, over the longer of the
  credit interval and the send interval, so that credit arriving in a burst does not count as
  a fast link). ``min_rtt`` is the smallest round trip seen (so queueing in the agent, which
  lengthens round trips, does not count as distance), replaced by the newest sample once it is
  ``MIN_RTT_EXPIRY`` seconds old (a path that got longer is noticed); ``max_rate`` is the
  largest delivery rate since the reset.
- **Growth**: on credit, if the window held the stream back since the last credit
  (``limited``: frames were waiting while ``in_flight >= size``), the window becomes
  ``GAIN * max_rate * min_rtt + max_frame`` when that is larger, within ``maximum``: twice the
  bandwidth-delay product, the rule of Linux's receive-window autotuning, plus the largest
  frame pushed since the reset. That last term is there because credit comes per whole frame
  (the agent credits a frame once the rank has all of it): a frame's own crossing time adds
  to its round trip, and a window of twice the bandwidth-delay product alone could keep a
  single big frame in flight at a time, the link idle while each one's credit travels back.
  While the window limits a stream that has no other bottleneck, a round trip delivers about
  one window, so the window doubles each round trip; once something else (the link, the
  agent, the rank) sets the pace, the delivery rate stops rising and so does the window. A
  slow receiver grows it little: its round trips are long but ``min_rtt`` is not, and its
  rate is low.
- **Never shrinks** while the receiver stays attached: everything in flight stays allowed, and
  a window larger than needed costs nothing on the relay (pushed frames leave its memory; the
  log keeps them), only buffer room in the receiving agent, which ``maximum`` bounds. ``reset``
  (a new attachment) returns to ``initial``.

Credit is counted per byte and may cover part of a frame; a frame gives samples only once
credit covers all of it, and credit that completes several gives them for the newest. Credit
beyond what was pushed (late credit of an earlier attachment) is ignored. Pushes or credits
without a time (``now`` None) count bytes and give no samples.
"""

from __future__ import annotations

from collections import deque

GAIN = 2.0
MIN_RTT_EXPIRY = 10.0  # seconds a round-trip minimum stands before a newer sample replaces it


class _Sent:
    """One push: where it ends in the byte count, when it went out, and the credit state then."""

    __slots__ = ("delivered", "delivered_time", "end", "first_sent_time", "sent_time")

    def __init__(
        self,
        end: int,
        sent_time: float | None,
        delivered: int,
        delivered_time: float | None,
        first_sent_time: float | None,
    ) -> None:
        self.end = end
        self.sent_time = sent_time
        self.delivered = delivered
        self.delivered_time = delivered_time
        self.first_sent_time = first_sent_time


class PushWindow:
    """How many pushed bytes may be un-credited (``size``), between ``initial`` and
    ``maximum`` (see the module docstring)."""

    def __init__(self, initial: int, maximum: int | None = None) -> None:
        if initial <= 0:
            raise ValueError("window must be positive")
        self.initial = initial
        self.maximum = max(initial, maximum if maximum is not None else initial)
        self.size = initial
        self.min_rtt: float | None = None
        self.max_rate = 0.0  # bytes per second
        self.max_frame = 0
        self._min_rtt_at = 0.0
        self._records: deque[_Sent] = deque()
        self._sent = 0  # bytes pushed since the reset
        self._delivered = 0  # of those, bytes credited
        self._delivered_time: float | None = None
        self._first_sent_time: float | None = None
        self._limited = False

    @property
    def growing(self) -> bool:
        """False when the window is fixed (``maximum == initial``)."""
        return self.maximum > self.initial

    @property
    def in_flight(self) -> int:
        """Bytes pushed and not credited, as this window counts them."""
        return self._sent - self._delivered

    def reset(self) -> None:
        """A new receiver: the initial window, no samples, nothing in flight."""
        self.size = self.initial
        self.min_rtt = None
        self.max_rate = 0.0
        self.max_frame = 0
        self._records.clear()
        self._sent = self._delivered = 0
        self._delivered_time = self._first_sent_time = None
        self._limited = False

    def limited(self) -> None:
        """Frames were waiting and the window held them back."""
        self._limited = True

    def pushed(self, nbytes: int, now: float | None) -> None:
        """A frame of ``nbytes`` went out at ``now``."""
        if not self.growing:
            return
        if self._sent == self._delivered and now is not None:
            # Nothing in flight: intervals start here, not at the last credit before an idle.
            self._first_sent_time = self._delivered_time = now
        self._sent += nbytes
        if nbytes > self.max_frame:
            self.max_frame = nbytes
        self._records.append(
            _Sent(self._sent, now, self._delivered, self._delivered_time, self._first_sent_time)
        )

    def credited(self, nbytes: int, now: float | None) -> None:
        """The receiver credited ``nbytes`` at ``now``: samples, then perhaps growth."""
        if not self.growing:
            return
        nbytes = min(nbytes, self._sent - self._delivered)
        if nbytes <= 0:
            return
        self._delivered += nbytes
        records = self._records
        newest: _Sent | None = None
        while records and records[0].end <= self._delivered:
            newest = records.popleft()
        if now is None:
            return
        self._delivered_time = now
        if newest is None or newest.sent_time is None:
            return
        self._first_sent_time = newest.sent_time
        rtt = now - newest.sent_time
        if self.min_rtt is None or rtt <= self.min_rtt or now - self._min_rtt_at > MIN_RTT_EXPIRY:
            self.min_rtt = rtt
            self._min_rtt_at = now
        if newest.delivered_time is not None and newest.first_sent_time is not None:
            interval = max(newest.sent_time - newest.first_sent_time, now - newest.delivered_time)
            if interval > 0 and interval >= self.min_rtt:
                rate = (self._delivered - newest.delivered) / interval
                if rate > self.max_rate:
                    self.max_rate = rate
        if self._limited:
            self._limited = False
            target = GAIN * self.max_rate * self.min_rtt + self.max_frame
            if target > self.size:
                self.size = min(self.maximum, int(target))
