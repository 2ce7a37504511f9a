"""``Client``: the coordinator's user API (``protocol/api.py``) from Python, synchronous.

    from vpool.sdk import Client

    with Client.from_config() as c:
        job = c.submit("pi.py", ranks=8, args=["1000000"])
        for rec in c.follow_output(job.id):
            print(rec.rank, rec.stream, rec.data)
        print(c.wait(job.id).state)

Every call goes through ``_request``, the one place where httpx errors and the API's error bodies
become ``vpool.sdk.errors`` exceptions.
"""

from __future__ import annotations

import hashlib
import io
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec

from vpool import tls
from vpool.protocol.api import (
    TERMINAL_STATES,
    AgentInfo,
    BlobInfo,
    CheckpointAsk,
    CheckpointAsked,
    ErrorBody,
    FailureMode,
    JobDetail,
    JobInfo,
    JobSubmit,
    OutputPage,
    OutputRecord,
    PoolInfo,
    UserInfo,
)
from vpool.reasons import describe, untrusted
from vpool.sdk import bundle as bundle_mod
from vpool.sdk import clientconfig
from vpool.sdk.errors import (
    ApiError,
    BundleError,
    ConnectionError,
    VsdkError,
    WaitTimeout,
    api_error,
)

T = TypeVar("T")
API = "/api/v1"

#: Seconds a single long-poll asks the coordinator to hold the request.
POLL_WAIT = 20.0


class Client:
    """A user's session with one coordinator."""

    def __init__(
        self,
        url: str,
        token: str = "",
        *,
        ca: Path | str | None = None,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.ca = Path(ca) if ca else None
        self._timeout = timeout
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        verify: Any = True
        if self.url.startswith("https://"):
            if self.ca is not None and not self.ca.is_file():
                raise VsdkError(f"CA file {self.ca} does not exist")
            verify = tls.client_context(self.ca)
        self._http = httpx.Client(
            base_url=self.url + API,
            headers=headers,
            verify=verify,
            timeout=httpx.Timeout(timeout),
            transport=transport,
        )

    @classmethod
    def from_config(
        cls,
        path: Path | None = None,
        *,
        url: str | None = None,
        token: str | None = None,
        ca: Path | str | None = None,
        **kwargs: Any,
    ) -> Client:
        """A client from the config file (``vpool.paths.client_config_file()``); explicit
        ``url``/``token``/``ca`` win over the file, and with ``url`` no file is needed."""
        if url is None:
            cfg = clientconfig.load(path)
            url, token, ca = cfg.url, token if token is not None else cfg.token, ca or cfg.ca
        return cls(url, token or "", ca=ca, **kwargs)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the one place where transport and API errors are translated --------------------------

    def _request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        content: bytes | None = None,
        json_body: msgspec.Struct | None = None,
        timeout: float | None = None,
        ok: Sequence[int] = (200, 201),
    ) -> httpx.Response:
        headers = {}
        if json_body is not None:
            content = msgspec.json.encode(json_body)
            headers["Content-Type"] = "application/json"
        elif content is not None:
            headers["Content-Type"] = "application/octet-stream"
        try:
            resp = self._http.request(
                method,
                path,
                params={k: v for k, v in (params or {}).items() if v is not None},
                content=content,
                headers=headers,
                timeout=httpx.Timeout(timeout) if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.TimeoutException as exc:
            raise ConnectionError(
                f"the coordinator at {self.url} did not answer in time: {describe(exc)}"
            ) from exc
        except httpx.TransportError as exc:
            raise ConnectionError(
                f"cannot reach the coordinator at {self.url}: {_why(exc)}"
            ) from exc
        except httpx.HTTPError as exc:  # e.g. a bad URL
            raise VsdkError(f"bad request to {self.url}: {describe(exc)}") from exc
        if resp.status_code in ok:
            return resp
        raise _error_from(resp)

    def _get(self, path: str, type: type[T], **kwargs: Any) -> T:
        return _decode(self._request("GET", path, **kwargs), type)

    # -- pool ---------------------------------------------------------------------------------

    def pool_info(self) -> PoolInfo:
        return self._get("/pool", PoolInfo)

    def agents(self) -> list[AgentInfo]:
        """The pool's agents: state, slots, how they isolate ranks and the memory a rank may
        use on each."""
        return self._get("/pool/agents", list[AgentInfo])

    def whoami(self) -> UserInfo:
        return self._get("/whoami", UserInfo)

    # -- blobs and submission -----------------------------------------------------------------

    def upload_blob(self, data: bytes) -> BlobInfo:
        """Upload ``data`` unless the coordinator already has it; blobs are named by sha256."""
        digest = hashlib.sha256(data).hexdigest()
        resp = self._request("HEAD", f"/blobs/{digest}", ok=(200, 404))
        if resp.status_code == 200:
            return BlobInfo(sha256=digest, size=len(data))
        return _decode(
            self._request("PUT", f"/blobs/{digest}", content=data, ok=(200, 201)), BlobInfo
        )

    def submit(
        self,
        program_path: Path | str,
        ranks: int,
        *,
        inputs: Sequence[Path | str] = (),
        stdin: Path | str | bytes | None = None,
        args: Sequence[str] = (),
        name: str | None = None,
        entry: str | None = None,
        fault_tolerance: bool = True,
        on_failure: FailureMode = "transparent",
        universe: int = 0,
        module: str = "",
        checkpoint_every: float = 0.0,
        memory: int = 0,
        unsandboxed: bool = False,
        validate: bool = False,
        built: bundle_mod.Bundle | None = None,
        requirements: Sequence[str] = (),
    ) -> JobInfo:
        """Bundle ``program_path`` (``.py``, ``.zip`` or a project directory; ``built``: the
        bundle already made of it, see ``sdk.bundle``) with ``inputs``, upload and submit it
        to run on ``ranks`` ranks as ``python entry *args``; ``stdin`` (a file or bytes) is fed
        to rank 0. With ``fault_tolerance=False`` nothing is logged and a lost rank fails the
        job instead of being restarted; ``on_failure`` is what a lost rank means
        (``protocol.api.FailureMode``). ``checkpoint_every`` > 0: every rank is checkpointed
        that often (seconds), so a lost rank restarts from its last image instead of from the
        beginning. ``memory`` > 0: bytes each rank needs (agents that let a rank use less get
        none; the others hold each rank to it). ``unsandboxed=True`` lets ranks run on agents
        whose volunteers allowed ranks without a sandbox. ``validate=True``: once every rank
        exited, ranks are re-executed from their logs on other volunteers and compared before
        the job ends (``JobSubmit.validate``)."""
        if ranks < 1:
            raise VsdkError("a job needs at least one rank")
        program = Path(program_path)
        if built is None:
            built = bundle_mod.build(program, [Path(p) for p in inputs], entry=entry)
        stdin_sha = None
        if stdin is not None:
            if isinstance(stdin, bytes):
                stdin_data = stdin
            else:
                try:
                    stdin_data = Path(stdin).read_bytes()
                except OSError as exc:
                    raise BundleError(f"cannot read stdin file {stdin}: {exc.strerror}") from exc
            stdin_sha = self.upload_blob(stdin_data).sha256
        bundle_sha = self.upload_blob(built.data).sha256
        body = JobSubmit(
            ranks=ranks,
            bundle=bundle_sha,
            entry=built.entry,
            args=list(args),
            stdin=stdin_sha,
            name=name if name is not None else program.name,
            fault_tolerance=fault_tolerance,
            on_failure=on_failure,
            universe=universe,
            module=module,
            checkpoint_every=checkpoint_every,
            memory=memory,
            unsandboxed=unsandboxed,
            requirements=list(requirements),
            validate=validate,
        )
        return _decode(self._request("POST", "/jobs", json_body=body), JobInfo)

    # -- jobs ---------------------------------------------------------------------------------

    def jobs(self, *, state: str | None = None, everyone: bool = False) -> list[JobInfo]:
        """Your jobs, newest first (``state``: only those in it; ``everyone``: every user's,
        for operators)."""
        params = {"state": state, "all": "true" if everyone else None}
        return self._get("/jobs", list[JobInfo], params=params)

    def status(self, job: int, *, wait: float = 0.0, seen: str = "") -> JobDetail:
        """The job, its ranks and events. With ``wait`` > 0 and ``seen`` (the ``mark`` of the
        last detail) the coordinator holds the call until the detail differs from that one, or
        ``wait`` seconds passed."""
        params = {"wait": wait or None, "seen": seen or None}
        return self._get(
            f"/jobs/{int(job)}", JobDetail, params=params, timeout=self._timeout + wait
        )

    def cancel(self, job: int) -> JobInfo:
        return _decode(self._request("POST", f"/jobs/{int(job)}/cancel"), JobInfo)

    def checkpoint(self, job: int, rank: int | None = None) -> CheckpointAsked:
        """Ask for a checkpoint of every running rank of a job (or of one rank) now; returns
        the ranks whose agents were asked."""
        resp = self._request(
            "POST", f"/jobs/{int(job)}/checkpoint", json_body=CheckpointAsk(rank=rank), ok=(202,)
        )
        return _decode(resp, CheckpointAsked)

    def output(
        self,
        job: int,
        after: int = 0,
        rank: int | None = None,
        wait: float = 0.0,
        seen: str = "",
    ) -> OutputPage:
        """Output records with id > ``after``; with ``wait`` > 0 the coordinator holds the call
        until there are some, the job has ended, or (``seen``: the ``mark`` of the last page)
        its state, queue reason or restarts changed."""
        return self._get(
            f"/jobs/{int(job)}/output",
            OutputPage,
            params={"after": after, "rank": rank, "wait": wait or None, "seen": seen or None},
            timeout=self._timeout + wait,
        )

    def follow_pages(
        self,
        job: int,
        rank: int | None = None,
        *,
        after: int = 0,
        wait: float = POLL_WAIT,
        retries: int = 5,
    ) -> Iterator[OutputPage]:
        """Every output page of a job until its output is complete (the job ended and every
        record was returned). Pages may be empty: each shows the job's current state. Up to
        ``retries`` consecutive connection failures are retried (with growing pauses), so a
        long stream survives a coordinator restart; the cursor makes retries exact."""
        failures, seen = 0, ""
        while True:
            try:
                page = self.output(job, after=after, rank=rank, wait=wait, seen=seen)
            except ConnectionError:
                failures += 1
                if failures > retries:
                    raise
                time.sleep(min(0.5 * 2**failures, 10.0))
                continue
            failures = 0
            after, seen = page.next, page.mark
            yield page
            if page.complete:
                return

    def follow_output(
        self, job: int, rank: int | None = None, *, after: int = 0
    ) -> Iterator[OutputRecord]:
        """Every output record of a job (or one rank), as it arrives, until the job ended."""
        for page in self.follow_pages(job, rank, after=after):
            yield from page.records

    def wait(
        self,
        job: int,
        *,
        timeout: float | None = None,
        on_change: Callable[[JobDetail], None] | None = None,
    ) -> JobInfo:
        """Block until the job ends and return it; ``on_change`` sees each new job detail whose
        state or rank states differ from the last one (for progress displays). Follows the job
        by long-polls (``status`` with ``seen``): it hears of the end as it happens."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last, seen = None, ""
        while True:
            left = POLL_WAIT if deadline is None else deadline - time.monotonic()
            detail = self.status(job, wait=max(0.0, min(left, POLL_WAIT)), seen=seen)
            seen = detail.mark
            key = (detail.job.state, tuple(r.state for r in detail.ranks))
            if key != last:
                last = key
                if on_change is not None:
                    on_change(detail)
            if detail.job.state in TERMINAL_STATES:
                return detail.job
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"job {job} did not end within {timeout:g} s", detail.job)
            if not seen:  # a coordinator from before long-polls answers at once: poll gently
                time.sleep(1.0)

    def results(self, job: int, dest_dir: Path | str) -> list[Path]:
        """Download the job's results zip and extract it into ``dest_dir``; returns the files."""
        resp = self._request("GET", f"/jobs/{int(job)}/results", timeout=max(self._timeout, 300))
        return extract_zip(resp.content, Path(dest_dir))


def extract_zip(data: bytes, dest: Path) -> list[Path]:
    """Extract a zip into ``dest``, refusing members that would land outside it."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise VsdkError(f"the results are not a valid zip file: {exc}") from exc
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    out = []
    with zf:
        for info in zf.infolist():
            target = (root / info.filename).resolve()
            if not target.is_relative_to(root):
                raise VsdkError(f"the results zip holds an unsafe path {info.filename!r}")
            zf.extract(info, root)
            if not info.is_dir():
                out.append(target)
    return out


def _decode(resp: httpx.Response, type: type[T]) -> T:
    try:
        return msgspec.json.decode(resp.content, type=type)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ApiError(resp.status_code, "bad_response", f"unexpected answer: {exc}") from exc


def _error_from(resp: httpx.Response) -> ApiError:
    try:
        body = msgspec.json.decode(resp.content, type=ErrorBody)
        code, message = body.error.code, body.error.message
    except (msgspec.DecodeError, msgspec.ValidationError):
        code = f"http_{resp.status_code}"
        message = resp.text.strip()[:200] or resp.reason_phrase or "no message"
    return api_error(resp.status_code, code, message)


def _why(exc: httpx.TransportError) -> str:
    """The innermost useful reason of a transport error (e.g. a certificate failure)."""
    text = describe(exc)
    if untrusted(exc):
        return f"{text}; check the `ca` of your client config"
    return text
