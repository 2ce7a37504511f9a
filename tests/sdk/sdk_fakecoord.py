"""An in-memory coordinator speaking the user API of ``protocol/api.py`` over
``httpx.MockTransport``: enough to drive ``Client`` and ``vsdk`` without processes.

A test scripts each job's fate with ``coord.script(...)``: its final state, exit code, reason
and output chunks. Output is served a few records per page so following takes several calls.
"""

from __future__ import annotations

import hashlib
import io
import re
import zipfile
from dataclasses import dataclass, field

import httpx
import msgspec

from vpool.protocol.api import (
    AgentInfo,
    ErrorBody,
    ErrorDetail,
    JobDetail,
    JobEvent,
    JobInfo,
    JobSubmit,
    OutputPage,
    OutputRecord,
    PoolInfo,
    RankInfo,
    UserInfo,
)
from vpool.sdk.client import Client

TOKEN = "secret-token"
URL = "http://coord.test"


@dataclass
class Script:
    state: str = "succeeded"
    exit_code: int | None = 0
    reason: str = ""
    chunks: list[tuple[int, str, bytes]] = field(default_factory=list)
    events: list[JobEvent] = field(default_factory=list)  # between "submitted" and the end
    restored_from: dict[int, int] = field(default_factory=dict)  # rank -> checkpoint id
    suspended: dict[int, float] = field(default_factory=dict)  # rank -> frozen since (running)
    # (state, waiting, never_fits, restarts, running) of empty output pages served before the
    # records,
    # as the coordinator's long-poll returns them when the job's progress changes
    progress: list[tuple[str, str, bool, int, int]] = field(default_factory=list)
    # ``OutputPage.validation`` of each of those pages ("" when shorter)
    validation: list[str] = field(default_factory=list)


@dataclass
class Job:
    info: JobInfo
    submit: JobSubmit
    script: Script
    records: list[OutputRecord] = field(default_factory=list)
    served: int = 0  # how many records were handed out so far


class FakeCoordinator:
    def __init__(self, page_size: int = 2) -> None:
        self.blobs: dict[str, bytes] = {}
        self.jobs: dict[int, Job] = {}
        self.requests: list[tuple[str, str]] = []
        self.next_script = Script()
        self.page_size = page_size
        self.next_record = 1
        self.results_zip = b""
        self.agents: list[AgentInfo] = []  # what ``GET /pool/agents`` lists

    def client(self, token: str = TOKEN) -> Client:
        return Client(URL, token, transport=httpx.MockTransport(self.handle))

    def script(self, **kwargs: object) -> None:
        self.next_script = Script(**kwargs)  # type: ignore[arg-type]

    # -- HTTP ---------------------------------------------------------------------------------

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.requests.append((request.method, path))
        if path == "/api/v1/pool":
            return self._json(PoolInfo(name="fake", version="0.1.0", signing_key="k"))
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return self._error(401, "bad_token", "unknown API token")
        for pattern, method, fn in self._routes():
            m = re.fullmatch(pattern, path)
            if m and request.method == method:
                return fn(request, *m.groups())
        return self._error(404, "not_found", f"no route {request.method} {path}")

    def _routes(self):  # type: ignore[no-untyped-def]
        return [
            (r"/api/v1/whoami", "GET", lambda r: self._json(UserInfo(name="alice"))),
            (r"/api/v1/pool/agents", "GET", lambda r: self._json(self.agents)),
            (r"/api/v1/blobs/([0-9a-f]{64})", "HEAD", self._head_blob),
            (r"/api/v1/blobs/([0-9a-f]{64})", "PUT", self._put_blob),
            (r"/api/v1/jobs", "POST", self._submit),
            (r"/api/v1/jobs", "GET", lambda r: self._json([j.info for j in self.jobs.values()])),
            (r"/api/v1/jobs/(\d+)", "GET", self._detail),
            (r"/api/v1/jobs/(\d+)/output", "GET", self._output),
            (r"/api/v1/jobs/(\d+)/cancel", "POST", self._cancel),
            (r"/api/v1/jobs/(\d+)/results", "GET", self._results),
        ]

    def _json(self, value: object, status: int = 200) -> httpx.Response:
        return httpx.Response(
            status, content=msgspec.json.encode(value), headers={"content-type": "application/json"}
        )

    def _error(self, status: int, code: str, message: str) -> httpx.Response:
        return self._json(ErrorBody(ErrorDetail(code, message)), status)

    def _head_blob(self, request: httpx.Request, sha: str) -> httpx.Response:
        return httpx.Response(200 if sha in self.blobs else 404)

    def _put_blob(self, request: httpx.Request, sha: str) -> httpx.Response:
        data = request.read()
        if hashlib.sha256(data).hexdigest() != sha:
            return self._error(400, "hash_mismatch", "the blob's sha256 is not its name")
        self.blobs[sha] = data
        return self._json({"sha256": sha, "size": len(data)}, 201)

    def _job(self, job_id: str) -> Job | None:
        return self.jobs.get(int(job_id))

    def _submit(self, request: httpx.Request) -> httpx.Response:
        body = msgspec.json.decode(request.read(), type=JobSubmit)
        if body.bundle not in self.blobs:
            return self._error(400, "unknown_blob", "upload the bundle first")
        job_id = len(self.jobs) + 1
        info = JobInfo(
            id=job_id,
            name=body.name,
            user="alice",
            state="queued",
            ranks=body.ranks,
            exit_code=None,
            reason="",
            created=1000.0,
            started=None,
            finished=None,
            fault_tolerance=body.fault_tolerance,
            checkpoint_every=body.checkpoint_every,
            memory=body.memory,
            unsandboxed=body.unsandboxed,
            validate=body.validate,
        )
        job = Job(info, body, self.next_script)
        for rank, stream, data in job.script.chunks:
            job.records.append(OutputRecord(self.next_record, rank, stream, data))  # type: ignore[arg-type]
            self.next_record += 1
        self.jobs[job_id] = job
        return self._json(info, 201)

    def _finish(self, job: Job) -> None:
        s = job.script
        job.info = msgspec.structs.replace(
            job.info,
            state=s.state,
            exit_code=s.exit_code,
            reason=s.reason,
            started=1001.0,
            finished=1003.5,
        )

    def _detail(self, request: httpx.Request, job_id: str) -> httpx.Response:
        job = self._job(job_id)
        if job is None:
            return self._error(404, "no_such_job", f"job {job_id} does not exist")
        self._finish(job)
        ranks = [
            RankInfo(
                rank=r,
                incarnation=1,
                agent=f"a-{r % 2}",
                agent_name=f"laptop-{r % 2}",
                relay="relay-0",
                state="running" if r in job.script.suspended else "exited",
                exit_code=None if r in job.script.suspended else 0,
                restored_from=job.script.restored_from.get(r, -1),
                suspended_since=job.script.suspended.get(r),
            )
            for r in range(job.info.ranks)
        ]
        events = [
            JobEvent(time=1000.0, kind="submitted", message="by alice"),
            *job.script.events,
            JobEvent(time=1003.5, kind=job.info.state, message=job.info.reason, rank=None),
        ]
        return self._json(JobDetail(job=job.info, ranks=ranks, events=events))

    def _output(self, request: httpx.Request, job_id: str) -> httpx.Response:
        job = self._job(job_id)
        if job is None:
            return self._error(404, "no_such_job", f"job {job_id} does not exist")
        after = int(request.url.params.get("after", "0"))
        if job.script.progress:
            state, waiting, never, restarts, running = job.script.progress.pop(0)
            validation = job.script.validation.pop(0) if job.script.validation else ""
            job.info = msgspec.structs.replace(
                job.info, state=state, waiting=waiting, never_fits=never, restarts=restarts
            )
            return self._json(
                OutputPage(
                    records=[],
                    next=after,
                    complete=False,
                    state=job.info.state,
                    waiting=waiting,
                    never_fits=never,
                    restarts=restarts,
                    running=running,
                    ranks=job.info.ranks,
                    mark=f"{state}/{waiting}/{restarts}/{running}/{validation}",
                    validation=validation,
                )
            )
        rank = request.url.params.get("rank")
        wanted = [r for r in job.records if r.id > after and (rank is None or r.rank == int(rank))]
        page = wanted[: self.page_size]
        job.served += len(page)
        done = len(page) == len(wanted)
        if done:
            self._finish(job)
        else:
            job.info = msgspec.structs.replace(job.info, state="running", started=1001.0)
        nxt = page[-1].id if page else after
        return self._json(OutputPage(records=page, next=nxt, complete=done, state=job.info.state))

    def _cancel(self, request: httpx.Request, job_id: str) -> httpx.Response:
        job = self._job(job_id)
        if job is None:
            return self._error(404, "no_such_job", f"job {job_id} does not exist")
        if job.info.state in ("succeeded", "failed", "cancelled"):
            return self._error(
                409,
                "job_ended",
                f"job {job_id} already ended ({job.info.state}); there is nothing to cancel",
            )
        job.script = Script(
            state="cancelled", exit_code=None, reason="cancelled by alice", chunks=job.script.chunks
        )
        self._finish(job)
        return self._json(job.info)

    def _results(self, request: httpx.Request, job_id: str) -> httpx.Response:
        if self._job(job_id) is None:
            return self._error(404, "no_such_job", f"job {job_id} does not exist")
        return httpx.Response(
            200, content=self.results_zip, headers={"content-type": "application/zip"}
        )


def zip_of(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()
