"""Request and response plumbing shared by the API routers and the portal: msgspec JSON in and
out, bounded bodies and forms that time out when they stall, bearer credentials."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import aclosing, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import trio
from fastapi import Request, Response
from starlette.datastructures import FormData
from starlette.formparsers import FormParser, MultiPartException, MultiPartParser

from vpool.coordinator.errors import BadRequest, Forbidden, Stalled, TooLarge, Unauthorized

if TYPE_CHECKING:
    from vpool.coordinator.access import Principal
    from vpool.coordinator.service import Coordinator

T = TypeVar("T")
JSON = "application/json"
EMPTY = b"{}"


def coordinator(request: Request) -> Coordinator:
    c: Coordinator = request.app.state.coordinator
    return c


def reply(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type=JSON)


def empty() -> Response:
    return Response(EMPTY, media_type=JSON)


def declared_length(request: Request, limit: int) -> None:
    raw = request.headers.get("content-length")
    # isascii: str.isdigit() holds for '²', which int() refuses.
    if raw is not None and raw.isascii() and raw.isdigit() and int(raw) > limit:
        raise TooLarge(f"the body is larger than {limit} bytes")


async def chunks(request: Request) -> AsyncGenerator[bytes, None]:
    """The request's body as it comes; a client that sends nothing for
    ``upload_idle_timeout`` seconds gets ``Stalled`` (408), and what it sent is dropped.

    A reader that may stop early (a body too large, a hash that does not match) takes it
    under ``aclosing``: an async generator left unfinished would be closed by the garbage
    collector only, with the request's stream it holds open (trio warns of each)."""
    idle = coordinator(request).settings.upload_idle_timeout
    async with aclosing(request.stream()) as stream:
        while True:
            try:
                with trio.fail_after(idle):
                    chunk = await anext(stream)
            except StopAsyncIteration:
                return
            except trio.TooSlowError:
                raise Stalled(f"the request body stalled: nothing came for {idle:g} s") from None
            yield chunk


async def form(request: Request, *, max_files: int, max_fields: int) -> FormData:
    """The request's form (multipart or urlencoded), read through ``chunks``: a form upload
    that stalls is refused like any other (408 upload_stalled). A malformed one is 400
    bad_form. The caller closes it (``FormData.close``: the uploaded files' temporaries)."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    async with aclosing(chunks(request)) as stream:
        try:
            if kind == "multipart/form-data":
                parser = MultiPartParser(
                    request.headers, stream, max_files=max_files, max_fields=max_fields
                )
                return await parser.parse()
            if kind == "application/x-www-form-urlencoded":
                return await FormParser(request.headers, stream, max_fields=max_fields).parse()
        except MultiPartException as exc:
            raise BadRequest(f"the form cannot be read: {exc.message}", code="bad_form") from exc
    return FormData()


async def body(request: Request, limit: int) -> bytes:
    declared_length(request, limit)
    data = bytearray()
    async with aclosing(chunks(request)) as stream:
        async for chunk in stream:
            data += chunk
            if len(data) > limit:
                raise TooLarge(f"the body is larger than {limit} bytes")
    return bytes(data)


async def decode(request: Request, type_: type[T]) -> T:
    raw = await body(request, coordinator(request).settings.max_request_bytes)
    try:
        return msgspec.json.decode(raw, type=type_)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid {type_.__name__}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        # msgspec's error for bytes that are not UTF-8 inside a string ('{"name": "\xff"}').
        raise BadRequest(
            f"the body is not valid JSON: {exc.reason} (not UTF-8) at byte {exc.start}"
        ) from exc


async def principal(request: Request) -> Principal:
    """The user a JSON API request is made by (its bearer token)."""
    core, token = coordinator(request), bearer(request)  # none presented: not a guess
    return await presented(request, lambda: core.principal(token))


def client_address(request: Request) -> str:
    return request.client.host if request.client is not None else ""


async def presented(request: Request, check: Callable[[], Awaitable[T]]) -> T:
    """``check()`` of a credential the request presents, counted against its address's
    wrong guesses (``guesses``): refused with 429 while the address has used them up."""
    with _guessing(request):
        return await check()


def presented_now(request: Request, check: Callable[[], T]) -> T:
    """``presented`` for a check that needs no waiting (a signature)."""
    with _guessing(request):
        return check()


@contextmanager
def _guessing(request: Request) -> Iterator[None]:
    core = coordinator(request)
    address, now = client_address(request), core.clock()
    core.guesses.check(address, now)
    try:
        yield
    except Unauthorized:
        core.guesses.failed(address, now)
        raise
    except Forbidden as exc:
        if exc.code == "bad_join_token":
            core.guesses.failed(address, now)
        raise


def bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise Unauthorized(
            "an Authorization: Bearer <token> header is required", code="missing_token"
        )
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized(
            "the Authorization header must be 'Bearer <token>'", code="malformed_token"
        )
    return token.strip()
