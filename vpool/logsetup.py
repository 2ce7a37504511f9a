"""Logging set-up shared by the pool's long-running processes (agent, relay).

Routine requests are not news: httpx logs every request at INFO (``HTTP Request: POST
.../agents/heartbeat "HTTP/1.1 200 OK"``, some 8 MB a day per agent) and httpcore its
connection steps at DEBUG. A failed request reaches the log through its caller, which knows what
failed and says why (``vpool.reasons.describe``).
"""

from __future__ import annotations

import logging

CHATTY = ("httpx", "httpcore")


def quiet_routine_requests(*, verbose: bool = False) -> None:
    """Only warnings from the HTTP client libraries; ``verbose`` (debugging) brings back all."""
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)
