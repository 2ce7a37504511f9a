"""The agent's relay links, one per relay address, opened on first use."""

from __future__ import annotations

import ssl
from collections.abc import Callable

import trio

from vpool.protocol.api import RelayInfo
from vpool.worker_agent.errors import RelayLinkError
from vpool.worker_agent.relay_link import ProblemCallback, RelayLink


class RelayLinks:
    """The agent's relay links, keyed by address and opened on first use."""

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        ssl_context: ssl.SSLContext,
        token: Callable[[], str],
        on_problem: ProblemCallback,
        max_payload: int,
        reconnect: float = 30.0,
        ping_interval: float = 5.0,
        dead_after: float = 12.0,
    ) -> None:
        self.nursery = nursery
        self.ssl_context = ssl_context
        self.token = token
        self.on_problem = on_problem
        self.max_payload = max_payload
        self.reconnect = reconnect
        # Liveness of each connection (``protocol.liveness``; the agent's relay_ping_interval
        # and relay_dead_after): a Ping after ping_interval s of silence, given up for dead
        # after dead_after s. 0: no pings, and TCP keepalive alone notices a dead peer.
        self.ping_interval = ping_interval
        self.dead_after = dead_after if ping_interval > 0 else 0.0
        self._links: dict[tuple[str, int], RelayLink] = {}

    async def get(self, info: RelayInfo) -> RelayLink:
        key = (info.host, info.port)
        link = self._links.get(key)
        if link is None or link.broken is not None:
            link = self._links[key] = RelayLink(info, owner=self)
        try:
            await link.ensure_open()
        except RelayLinkError:
            self.forget(link)
            raise
        return link

    def forget(self, link: RelayLink) -> None:
        key = (link.info.host, link.info.port)
        if self._links.get(key) is link:
            del self._links[key]

    def __len__(self) -> int:
        return len(self._links)
