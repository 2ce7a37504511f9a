"""Who may do what: the one place the portal and the JSON API decide it.

A request is made by a ``Principal`` (a user, by an API token or a portal session opened with
one). Users see and act on their own jobs only; other users' jobs do not exist for them (404,
never 403, so job numbers reveal nothing). Operators see the whole pool and may look at,
checkpoint and cancel any job, but submit as themselves. Every route asks here; the test of
every route is ``tests/web/test_access.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from vpool.coordinator.errors import Forbidden, NotFound
from vpool.protocol import api


class Action(Enum):
    READ = "read"  # the job, its ranks, events, timeline, output and results
    CONTROL = "control"  # cancel it, checkpoint it


@dataclass(frozen=True)
class Principal:
    name: str
    role: api.Role
    token: int  # the id of the API token it authenticated with (a session's token)

    @property
    def operator(self) -> bool:
        return self.role == "operator"

    def info(self) -> api.UserInfo:
        return api.UserInfo(name=self.name, role=self.role)


def check_job(who: Principal, job: api.JobInfo | None, job_id: int, action: Action) -> api.JobInfo:
    """``job`` if ``who`` may do ``action`` on it; a job they may not see does not exist."""
    if job is None or not (job.user == who.name or who.operator):
        raise NotFound(f"no job {job_id}", code="unknown_job")
    return job


def jobs_owner(who: Principal, everyone: bool) -> str | None:
    """Whose jobs a listing shows: the user's own, or (operators asking for it) everyone's."""
    if everyone:
        check_operator(who)
        return None
    return who.name


def check_operator(who: Principal) -> None:
    if not who.operator:
        raise Forbidden("only the pool's operators may see this", code="operators_only")
