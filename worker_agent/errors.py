"""Errors of the worker agent.

    AgentError
     +-- CoordinatorError        an HTTP call to the coordinator failed
     |    +-- CoordinatorUnreachable   no answer (connection refused, timeout, 5xx): retried
     |    |    +-- CoordinatorUntrusted  its TLS certificate is not signed by our CA: retried
     |    |                              once running, fatal when enrolling (nothing ran yet)
     |    +-- CoordinatorRejected      a 4xx answer with the API's ErrorBody: not retried
     +-- BundleError             a blob or bundle is unusable (hash mismatch, unsafe zip, too big)
     |    +-- BundleRejected       the bundle itself breaks a rule (unsafe member, a link, too
     |                             big, too many members): the job's error, on every agent
     +-- SandboxStartError       a rank's sandbox could not be started (sandboxed.py)
     +-- CgroupError             a rank's cgroup could not be made or ended (cgroups.py)
     +-- SeccompError            the seccomp filter could not be built (seccomp.py)
     +-- RelayLinkError          a relay connection could not be opened, refused us, or dropped
     +-- RankSocketError         the agent's unix socket cannot be set up

Each carries a message meant for people; the agent turns them into ``RankProblem`` reports or
log lines, never tracebacks on the wire.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base class of the worker agent's errors."""


class CoordinatorError(AgentError):
    pass


class CoordinatorUnreachable(CoordinatorError):
    pass


class CoordinatorUntrusted(CoordinatorUnreachable):
    pass


class CoordinatorRejected(CoordinatorError):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"coordinator refused ({status} {code}): {message}")
        self.status = status
        self.code = code
        self.message = message


class BundleError(AgentError):
    pass


class BundleRejected(BundleError):
    pass


class NoRoom(AgentError):
    """This agent cannot take the rank now (its volunteer's disk is too full for its
    bundle): the rank runs elsewhere, and the job is not at fault."""


class RelayLinkError(AgentError):
    """``relay``: the relay's name when the trouble is reaching it (no answer, a dropped
    connection that did not come back), which the coordinator treats as the relay's outage
    rather than the rank's fault; "" when the relay answered and refused."""

    def __init__(self, message: str, *, relay: str = "") -> None:
        super().__init__(message)
        self.relay = relay


class RankSocketError(AgentError):
    pass
