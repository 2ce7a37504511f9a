"""Every route of the coordinator, fuzzed: hostile path parameters, query strings, headers and
bodies, with and without each kind of credential. No request may get a 5xx, raise or hang,
every 4xx of the JSON API has the one error shape, and a well-behaved client (whose
credentials the fuzzer never has) is served between the routes and after them (issue 20,
hardening).

The routes are read off the app (``iter_route_contexts``), so a new route is fuzzed without
touching this file; what a route reads is found in its endpoint's source: the msgspec type it
decodes (``decode(request, api.X)``), a form (``request.form``) or a raw upload
(``chunks(request)``). Values are drawn per request at a level of hostility from none (every
field plausible: an id that exists, a blob that was uploaded, the session's CSRF secret, so
the request gets past the lookups to the code behind them) to all (every field hostile:
huge, negative, of the wrong type, unicode, ``..``, lone surrogates). The generator is
seeded per route: a failure prints its request, and a run gives the same requests again.
"""

from __future__ import annotations

import base64
import gc
import hashlib
import inspect
import json
import math
import random
import re
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import httpx
import msgspec
import pytest
import trio
from coord_helpers import HELLO, Agent, Pool, make_zip, open_pool, relay_headers
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.routing import iter_route_contexts
from starlette.routing import Mount

from vpool.coordinator.app import create_app
from vpool.coordinator.errors import CoordinatorError
from vpool.protocol import api
from vpool.protocol.tokens import sign_possession
from vpool.web import portal, session, submit

SEED = 20  # issue 20
PER_ROUTE = 60  # random requests per route, after the systematic ones
REQUEST_DEADLINE = 10.0  # seconds; every long-poll is capped far below (max_wait)
MAX_URL_PART = 20_000  # characters of one encoded parameter or header (far past servers' limits)
HOSTILITY = [0.2, 0.5, 1.0]  # the chance of a value of a hostile aspect being hostile
INTS = [
    0, 1, 2, 3, -1, -2, 7, 255, 65535, 65536, 2**31 - 1, 2**31, -(2**31), 2**53 + 1, 2**62,
    2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 2**64 - 1, 2**70, -(2**70), 10**30,
]  # fmt: skip
NOT_INTS = ["", "abc", "1.5", "1e3", "0x10", " 1", "+1", "-", "٣", "\uff11", "²", "NaN", "∞"]
FLOATS = [0.0, -1.0, 0.5, 1e-300, 1e308, -1e308, math.inf, -math.inf, math.nan, 2.0**64]
STRINGS = [
    "", "a", ".", "..", "../..", "../../etc/passwd", "/", "//", "\\", "%00", "\x00", "%", "%zz",
    "\u202e", "\ufeff", "\U0001f600", "é", "\ud800", "<script>alert(1)</script>", "{{ 7*7 }}",
    "'; DROP TABLE jobs; --", "\r\nX-Injected: 1", "null", "true", "[]", "{}", "0" * 64, "f" * 64,
    "F" * 64, "g" * 64,
]  # fmt: skip
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
CONTENT_TYPES = [
    "application/json", "application/json; charset=latin-1", "text/plain",
    "application/x-www-form-urlencoded", "multipart/form-data", "multipart/form-data; boundary=",
    "multipart/form-data; boundary=zz", "application/octet-stream", "application/zip", "*/*",
    ";;;", "\xff",
]  # fmt: skip
CREDENTIALS = [
    "none", "garbage", "user", "operator", "agent", "relay", "session", "operator-session",
]  # fmt: skip
FILE_FIELDS = {"program", "inputs", "project", "stdin"}


# -- the routes ---------------------------------------------------------------------------------


@dataclass
class Route:
    method: str
    path: str  # with {name} placeholders
    path_params: dict[str, Any]  # name -> annotation
    query_params: dict[str, Any]
    body_type: type[msgspec.Struct] | None  # the msgspec type the endpoint decodes
    form: bool  # the endpoint reads a form
    upload: bool  # the endpoint reads the raw body

    @property
    def api(self) -> bool:
        """A route of the JSON API (or the event stream), whose errors are JSON."""
        return self.path.startswith("/api/") or self.path.endswith("/live")

    @property
    def own_credentials(self) -> list[str]:
        """The kinds of credential this route is for (the first: a user's own)."""
        if self.path.startswith("/api/v1/agents/"):
            return ["agent"]
        if self.path.startswith("/api/v1/relays/"):
            return ["relay"]
        if self.path.startswith("/api/"):
            return ["user", "operator"]
        return ["session", "operator-session", "none"]

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


def routes_of(app: Any) -> list[Route]:
    """Every route of ``app``, one per method; the static files' mount as GET."""
    found: list[Route] = []
    for ctx in iter_route_contexts(app.routes):
        if isinstance(ctx.original_route, Mount):
            found.append(Route("GET", ctx.path + "/{path}", {"path": str}, {}, None, False, False))
            continue
        source = inspect.getsource(ctx.endpoint)
        decoded = re.findall(r"decode\(request, api\.(\w+)\)", source)
        body_type = getattr(api, decoded[0]) if decoded else None
        paths = {p.name: p.field_info.annotation for p in ctx.dependant.path_params}
        queries = {p.name: p.field_info.annotation for p in ctx.dependant.query_params}
        for method in sorted(ctx.methods):
            form, upload = "request.form(" in source, "chunks(request)" in source
            found.append(Route(method, ctx.path, paths, queries, body_type, form, upload))
    return found


def form_fields() -> list[str]:
    """The names of the form fields the portal reads."""
    pattern = r'(?:form\.get(?:list)?\(|_text\(form, |_files\(form, )"(\w+)"'
    names: set[str] = set()
    for module in (portal, submit, session):
        names |= set(re.findall(pattern, inspect.getsource(module)))
    assert {"csrf", "token", "program"} <= names
    return sorted(names)


# -- values ----------------------------------------------------------------------------------


def q(text: str) -> str:
    """``text`` percent-encoded as UTF-8 (lone surrogates too: bytes a client may send)."""
    return quote(text.encode("utf-8", "surrogatepass"), safe="")[:MAX_URL_PART]


def latin1(text: str) -> str:
    """``text``'s UTF-8 bytes as a header value (headers travel as bytes, read as Latin-1),
    without the line breaks and NULs no HTTP parser lets through."""
    raw = text.encode("utf-8", "surrogatepass").decode("latin-1")
    return re.sub("[\r\n\0]", "", raw)[:MAX_URL_PART]


@dataclass
class Known:
    """Values that exist in the pool, by the name of the field, parameter or form field that
    takes them: a request made of them gets past the lookups."""

    by_name: dict[str, list[Any]] = field(default_factory=dict)
    ints: list[int] = field(default_factory=list)
    strings: list[str] = field(default_factory=list)


class Fuzzer:
    """Draws one request's values: each one hostile with the chance ``hostility`` (drawn per
    request), else plausible."""

    def __init__(self, rng: random.Random, known: Known) -> None:
        self.rng = rng
        self.known = known
        self.hostility = 1.0

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def hostile(self) -> bool:
        return self.chance(self.hostility)

    def known_value(self, name: str) -> tuple[bool, Any]:
        values = self.known.by_name.get(name)
        if values and not self.hostile():
            return True, self.rng.choice(values)
        return False, None

    # hostile values

    def int(self) -> int:
        if self.chance(0.2):
            return self.rng.randint(-1000, 1000)
        return self.rng.choice(INTS)

    def float(self) -> float:
        return self.rng.choice(FLOATS) if self.chance(0.7) else self.rng.uniform(-1e6, 1e6)

    def text(self) -> str:
        r = self.rng.random()
        if r < 0.5:
            return self.rng.choice(STRINGS)
        if r < 0.65:
            unit = self.rng.choice("x\u00e9\u4e2d\U0001f600/.%")
            return unit * self.rng.choice([64, 201, 5000, 70_000])
        chars = [
            chr(self.rng.randint(0, 0x7F) if self.chance(0.5) else self.rng.randint(0x80, 0x2FFFF))
            for _ in range(self.rng.randint(1, 40))
        ]
        return "".join(chars)

    def raw_bytes(self) -> bytes:
        return self.rng.randbytes(self.rng.choice([0, 1, 7, 100, 4096]))

    def json_value(self, depth: int = 0) -> Any:
        """Any JSON value (of the wrong type, mostly)."""
        kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] if depth < 3 else [])
        kind = self.rng.choice(kinds)
        if kind == "int":
            return self.int()
        if kind == "float":
            return self.float()
        if kind == "str":
            return self.text()
        if kind == "bool":
            return self.chance(0.5)
        if kind == "null":
            return None
        if kind == "list":
            return [self.json_value(depth + 1) for _ in range(self.rng.randint(0, 3))]
        return {self.text()[:20]: self.json_value(depth + 1) for _ in range(self.rng.randint(0, 3))}

    # values of a type

    def value_of(self, t: msgspec.inspect.Type, name: str = "", depth: int = 0) -> Any:
        """A JSON value for a field ``name`` of msgspec type ``t``."""
        mi = msgspec.inspect
        if isinstance(t, mi.Metadata):
            return self.value_of(t.type, name, depth)
        found, value = self.known_value(name)
        if found:
            return value
        hostile = self.hostile()
        if hostile and self.chance(0.1):
            return self.json_value(depth)
        if isinstance(t, mi.IntType):
            return self.int() if hostile else self.rng.choice([*self.known.ints, 0, 1])
        if isinstance(t, mi.FloatType):
            return self.float() if hostile else self.rng.choice([0.0, 0.01, 1.0])
        if isinstance(t, mi.StrType):
            return self.text() if hostile else self.rng.choice(["x", *self.known.strings])
        if isinstance(t, mi.BoolType):
            return self.chance(0.5)
        if isinstance(t, mi.NoneType):
            return None
        if isinstance(t, mi.BytesType):
            if hostile and self.chance(0.3):
                return self.rng.choice(["not base64!", "====", "\u00e9"])
            return base64.b64encode(self.raw_bytes() if hostile else b"x").decode()
        if isinstance(t, mi.LiteralType):
            return self.text() if hostile and self.chance(0.5) else self.rng.choice(t.values)
        if isinstance(t, mi.UnionType):
            return self.value_of(self.rng.choice(t.types), name, depth)
        if isinstance(t, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType):
            n = self.rng.choice([0, 1, 2, 3] if depth < 2 else [0, 1])
            if hostile and self.chance(0.05):
                n = 3000
            return [self.value_of(t.item_type, name, depth + 1) for _ in range(n)]
        if isinstance(t, mi.TupleType):
            return [self.value_of(item, name, depth + 1) for item in t.item_types]
        if isinstance(t, mi.DictType):
            return {
                str(self.value_of(t.key_type, "", depth + 1)): self.value_of(
                    t.value_type, "", depth + 1
                )
                for _ in range(self.rng.choice([0, 1, 2]))
            }
        if isinstance(t, mi.StructType):
            return {
                f.encode_name: self.value_of(f.type, f.encode_name, depth + 1)
                for f in t.fields
                if f.required or self.chance(0.5)
            }
        return self.json_value(depth)

    # bodies

    def json_body(self, body_type: type[msgspec.Struct] | None) -> bytes:
        """A body for a route that decodes ``body_type``: well-shaped, or mutated, truncated,
        of another type, or not JSON at all."""
        if self.hostile():
            r = self.rng.random()
            if r < 0.15:
                return self.raw_bytes()
            if r < 0.2:
                depth = self.rng.choice([100, 5000])
                return b"[" * depth + b"]" * depth
            if r < 0.25:
                return b""
            if r < 0.35 or body_type is None:
                return json.dumps(self.json_value()).encode("utf-8", "surrogatepass")
        obj: Any = self.value_of(msgspec.inspect.type_info(body_type or dict[str, Any]))
        if isinstance(obj, dict) and obj and self.hostile() and self.chance(0.3):
            key = self.rng.choice(sorted(obj))
            if self.chance(0.5):
                del obj[key]
            else:
                obj[key] = self.json_value()
        if isinstance(obj, dict) and self.hostile() and self.chance(0.1):
            obj[self.text()[:30]] = self.json_value()
        data = json.dumps(obj, ensure_ascii=self.chance(0.5)).encode("utf-8", "surrogatepass")
        if self.hostile() and self.chance(0.1):
            data = data[: self.rng.randint(0, len(data))]
        return data

    def form_body(self, fields: list[str]) -> tuple[bytes, str]:
        """A form (urlencoded or multipart) of the portal's fields."""
        values: list[tuple[str, str]] = []
        for name in fields:
            if name == "csrf" or self.chance(0.6):
                for _ in range(self.rng.choice([1, 1, 1, 2, 30]) if self.hostile() else 1):
                    found, value = self.known_value(name)
                    values.append((name, str(value) if found else self.text()))
        if self.chance(0.4) or not any(name in FILE_FIELDS for name, _ in values):
            body = "&".join(f"{q(k)}={q(v)}" for k, v in values).encode()
            return body, "application/x-www-form-urlencoded"
        boundary = f"fuzz{self.rng.randint(0, 10**6)}"
        parts: list[bytes] = []
        for name, value in values:
            head = f'form-data; name="{name}"'
            content = value.encode("utf-8", "surrogatepass")
            if name in FILE_FIELDS:
                filename = value if self.hostile() else "app.py"
                head += f'; filename="{filename}"'
                program = self.rng.choice(
                    [HELLO, b"def broken(:\n", make_zip({"app.py": HELLO}), self.raw_bytes()]
                )
                content = program if self.hostile() else HELLO
            parts.append(
                f"--{boundary}\r\nContent-Disposition: {head}\r\n\r\n".encode(
                    "utf-8", "surrogatepass"
                )
                + content
                + b"\r\n"
            )
        body = b"".join(parts) + f"--{boundary}--\r\n".encode()
        if self.hostile() and self.chance(0.1):
            body = body[: self.rng.randint(0, len(body))]
        return body, f"multipart/form-data; boundary={boundary}"

    def upload_body(self) -> bytes:
        if not self.hostile():
            return make_zip({"out.txt": b"1"})
        return self.rng.choice([b"", b"abc", self.raw_bytes(), b"PK\x03\x04" + bytes(40)])

    # the URL

    def param(self, name: str, annotation: Any) -> str:
        """A path segment: of the parameter's type, or not."""
        found, value = self.known_value(name)
        if found:
            return q(str(value))
        if annotation is int:
            return str(self.int()) if self.chance(0.75) else q(self.rng.choice(NOT_INTS))
        value = q(self.text())
        if self.chance(0.5):  # a dot segment as it is, or encoded: the server decodes it
            value = value.replace(".", "%2E")
        return value

    def query_value(self, annotation: Any) -> str:
        text = repr(annotation)
        choices = re.findall(r"'(\w+)'", text)
        if not self.hostile():
            if choices:
                return self.rng.choice(choices)
            if "int" in text:
                return str(self.rng.choice([*self.known.ints, 0, 1, 10]))
            if "float" in text:
                return self.rng.choice(["0", "0.01"])
            if "bool" in text:
                return self.rng.choice(["true", "false"])
            return self.rng.choice(["", "x"])
        if "int" in text and self.chance(0.6):
            return str(self.int())
        if "float" in text and self.chance(0.6):
            return str(self.float())
        if "bool" in text and self.chance(0.5):
            return self.rng.choice(["1", "0", "yes", "on", "maybe"])
        return self.text()

    def query(self, params: dict[str, Any]) -> str:
        if self.hostile() and self.chance(0.1):
            return self.rng.choice(["%ff%fe", "&&==&", "a=1&a=2&a=%00", "=" * 1000, "%"])
        pairs = [
            (name, self.query_value(annotation))
            for name, annotation in params.items()
            if self.chance(0.6)
        ]
        if self.hostile() and self.chance(0.2):
            pairs.append((self.text()[:20], self.text()))
        return "&".join(f"{q(k)}={q(v)}" for k, v in pairs)


# -- the pool under fuzz -------------------------------------------------------------------------


@dataclass
class Credentials:
    """Valid credentials of each kind, made fresh for every route (the fuzzer may revoke a
    token or end a session it holds)."""

    user: str
    operator: str
    agent: Agent
    user_session: tuple[str, str]  # cookie, CSRF secret
    operator_session: tuple[str, str]


async def fresh_credentials(pool: Pool, n: int, agent: Agent, known: Known) -> Credentials:
    user = pool.add_user(f"user-{n}")["Authorization"].removeprefix("Bearer ")
    operator = pool.add_user(f"operator-{n}", role="operator")["Authorization"]
    operator = operator.removeprefix("Bearer ")
    job = await pool.submit(1, user=f"user-{n}")  # a job of its own to look at
    user_cookie, user_csrf, who = await pool.core.sign_in(user)
    op_cookie, op_csrf, _ = await pool.core.sign_in(operator)
    try:
        await pool.core.agent(agent.token)
    except CoordinatorError:
        agent = await pool.enroll(f"agent-{n}", slots=2)
    known.by_name["job_id"] = [job.id]  # others' jobs are among the hostile values
    known.by_name["token_id"] = [who.token]
    known.by_name["token"] = [user]
    return Credentials(user, operator, agent, (user_cookie, user_csrf), (op_cookie, op_csrf))


def headers_for(kind: str, creds: Credentials, fuzz: Fuzzer) -> tuple[dict[str, str], str]:
    """The credential headers of ``kind``, and the CSRF secret its forms carry."""
    csrf = ""
    headers: dict[str, str] = {}
    if kind == "garbage":
        token = latin1(fuzz.text())
        scheme = fuzz.rng.choice(["Bearer ", "bearer ", "Basic ", "", "Bearer", "Bearer  "])
        headers["authorization"] = scheme + token
        headers["cookie"] = f"{session.SESSION_COOKIE}={q(token[:100])}"
    elif kind == "user":
        headers["authorization"] = f"Bearer {creds.user}"
    elif kind == "operator":
        headers["authorization"] = f"Bearer {creds.operator}"
    elif kind == "agent":
        headers["authorization"] = f"Bearer {creds.agent.token}"
    elif kind == "relay":
        headers["authorization"] = relay_headers()["Authorization"]
    elif kind in ("session", "operator-session"):
        cookie, csrf = creds.user_session if kind == "session" else creds.operator_session
        headers["cookie"] = f"{session.SESSION_COOKIE}={cookie}"
    elif kind == "none" and fuzz.chance(0.7):  # the sign-in form's pre-session cookie
        csrf = f"login-{fuzz.rng.randint(0, 9)}"
        headers["cookie"] = f"{session.LOGIN_COOKIE}={csrf}"
    return headers, csrf


@dataclass
class Sent:
    """One fuzzed request, as it can be replayed."""

    method: str
    url: str  # percent-encoded path and query
    headers: dict[str, str]  # values are Latin-1: one character per byte
    body: bytes

    def __str__(self) -> str:
        headers = {k: v[:100] for k, v in self.headers.items()}
        return f"{self.method} {self.url[:300]} headers={headers} body={self.body[:300]!r}"


@dataclass
class Answer:
    status_code: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


async def call(app: Any, sent: Sent) -> Answer:
    """``sent`` handed to the ASGI ``app`` as a server would hand it over: any bytes in the
    path, query and headers, which an HTTP client library would refuse or rewrite (httpx
    normalizes URLs, limits their length and follows what a redirect says; a hostile Host
    header makes the one of a trailing-slash redirect unparseable)."""
    raw_path, _, query = sent.url.partition("?")
    headers = {"host": "coordinator", "content-length": str(len(sent.body))}
    headers.update((k.lower(), v) for k, v in sent.headers.items())
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": sent.method,
        "scheme": "http",
        "path": unquote(raw_path),
        "raw_path": raw_path.encode("latin-1"),
        "query_string": query.encode("latin-1"),
        "root_path": "",
        "headers": [(k.encode(), v.encode("latin-1")) for k, v in headers.items()],
        "server": ("coordinator", 80),
        "client": ("127.0.0.1", 1),
    }
    body = [{"type": "http.request", "body": sent.body, "more_body": False}]
    status: list[int] = []
    chunks: list[bytes] = []
    done = trio.Event()

    async def receive() -> dict[str, Any]:
        if body:
            return body.pop()
        await done.wait()  # what a server says once the answer is out
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    try:
        await app(scope, receive, send)
    finally:
        done.set()
    assert len(status) == 1, status
    return Answer(status[0], b"".join(chunks))


# What a request is made of; a fuzzed request is hostile in some of them, plausible in the rest.
ASPECTS = ("method", "path", "query", "body", "headers")
# Headers the app reads, beyond the credentials, and hostile values of each. '²' is one byte
# (a server reads headers as Latin-1), '²٣' the UTF-8 of both: digits to str.isdigit only.
HEADERS = {
    "last-event-id": ["-1", "99999999999999999999", str(2**63), "²", latin1("²٣"), "1e3", "abc"],
    "origin": ["http://evil", "http://[::1", "http://[", "null", "", "//x:y@", latin1("http://é")],
    "sec-fetch-site": ["cross-site", "", "same-site", "\xff", latin1("\U0001f600")],
    "host": ["", "evil", "[::1", "coordinator:99999"],
    "content-length": ["²", latin1("٣"), "-1", "abc", "99999999999999999999", "0", " 1"],
    "content-type": CONTENT_TYPES,
}
Override = tuple[str, str]  # (aspect, name): a value set outright, the rest drawn


def systematic(route: Route) -> Iterator[tuple[Override, str]]:
    """Every hostile value of every path parameter and header, one at a time: a value whose
    trouble needs the rest of the request right is not left to chance."""
    for name, annotation in route.path_params.items():
        values = [str(i) for i in INTS] + NOT_INTS if annotation is int else STRINGS
        for value in values:
            yield ("path", name), value
    for name, values in HEADERS.items():
        for value in values:
            yield ("header", name), value


def requests_for(
    route: Route, creds: Credentials, fuzz: Fuzzer, fields: list[str]
) -> Iterator[Sent]:
    """The ``systematic`` requests (plausible but for one value, with the route's own kind of
    credential); one request with each kind of credential; then ``PER_ROUTE`` hostile in
    some aspects, with the route's own kind of credential (now and then another)."""
    plans: list[tuple[str, set[str], dict[Override, str]]] = []
    for override, value in systematic(route):
        plans.append((route.own_credentials[0], set(), {override: value}))
    for kind in CREDENTIALS:
        plans.append((kind, set(ASPECTS), {}))
    for _ in range(PER_ROUTE):
        kind = fuzz.rng.choice(route.own_credentials if fuzz.chance(0.9) else CREDENTIALS)
        n = fuzz.rng.choice([0, 1, 1, 2, len(ASPECTS)])
        plans.append((kind, set(fuzz.rng.sample(ASPECTS, n)), {}))
    for kind, hostile, overrides in plans:
        yield make_request(route, kind, hostile, overrides, creds, fuzz, fields)


def make_request(
    route: Route,
    kind: str,
    hostile: set[str],
    overrides: dict[Override, str],
    creds: Credentials,
    fuzz: Fuzzer,
    fields: list[str],
) -> Sent:
    """A request with credentials of ``kind``, hostile in the ``hostile`` aspects, with the
    ``overrides`` set outright."""
    level = fuzz.rng.choice(HOSTILITY)

    def aspect(name: str) -> None:
        fuzz.hostility = level if name in hostile else 0.0

    fuzz.hostility = 0.0
    headers, csrf = headers_for(kind, creds, fuzz)
    fuzz.known.by_name["csrf"] = [csrf]
    aspect("method")
    method = fuzz.rng.choice(METHODS) if fuzz.hostile() else route.method
    aspect("path")
    path = route.path
    for name, annotation in route.path_params.items():
        value = overrides.get(("path", name))
        path = path.replace(
            "{" + name + "}", fuzz.param(name, annotation) if value is None else q(value)
        )
    aspect("body")
    body = b""
    if route.body_type is not None:
        body = fuzz.json_body(route.body_type)
        headers["content-type"] = "application/json"
    elif route.form:
        body, headers["content-type"] = fuzz.form_body(fields)
    elif route.upload:
        body = fuzz.upload_body()
        plausible = "path" not in hostile and ("path", "sha256") not in overrides
        if "sha256" in route.path_params and plausible:  # the body's own: it is stored
            path = path.rsplit("/", 1)[0] + "/" + hashlib.sha256(body).hexdigest()
    elif fuzz.hostile() and fuzz.chance(0.3):
        body = fuzz.json_body(None)
    aspect("query")
    query = fuzz.query(route.query_params)
    url = path + (f"?{query}" if query else "")
    aspect("headers")
    if fuzz.hostile():
        for name in fuzz.rng.sample(sorted(HEADERS), fuzz.rng.choice([1, 2])):
            headers[name] = fuzz.rng.choice(HEADERS[name])
    for (where, name), value in overrides.items():
        if where == "header":
            headers[name] = value
    return Sent(method, url, headers, body)


def check_response(route: Route, sent: Sent, r: Answer) -> str | None:
    """What is wrong with the answer, or None."""
    if r.status_code >= 500:
        return f"{r.status_code}: {r.text[:300]}"
    path = sent.url.split("?")[0]
    api_path = path.startswith("/api/") or path.endswith("/live")
    if not route.api or not api_path or not 400 <= r.status_code < 500 or sent.method == "HEAD":
        return None
    try:
        body = r.json()
    except ValueError:
        return f"{r.status_code} without a JSON body: {r.text[:300]}"
    shaped = (
        isinstance(body, dict)
        and set(body) == {"error"}
        and isinstance(body["error"], dict)
        and set(body["error"]) == {"code", "message"}
        and all(isinstance(v, str) for v in body["error"].values())
        and "Traceback" not in body["error"]["message"]
    )
    return None if shaped else f"{r.status_code} not in the error shape: {body!r:.300}"


async def served(client: httpx.AsyncClient, witness: dict[str, str], job: int) -> None:
    """A well-behaved user is served: the pool, their jobs, their job's output."""
    with trio.fail_after(REQUEST_DEADLINE):
        r = await client.get("/api/v1/pool")
        assert r.status_code == 200, r.text
        assert msgspec.json.decode(r.content, type=api.PoolInfo).name == "test-pool"
        r = await client.get("/api/v1/jobs", headers=witness)
        assert r.status_code == 200, r.text
        assert job in [j.id for j in msgspec.json.decode(r.content, type=list[api.JobInfo])]
        r = await client.get(f"/api/v1/jobs/{job}/output", headers=witness)
        assert r.status_code == 200, r.text


async def known_values(pool: Pool, agent: Agent, witness_job: int) -> Known:
    """Plausible values: the jobs and ranks the agent leased, the uploaded bundle, a valid
    enrollment (key, time and signature go together), a relay's name."""
    leases = await pool.lease(agent)
    assert leases
    bundle = await pool.upload(make_zip({"app.py": HELLO, "input.txt": b"42\n"}))
    ts = pool.clock()
    public_key, signature = sign_possession(Ed25519PrivateKey.generate(), ts)
    jobs = sorted({witness_job, *(lease.job for lease in leases)})
    return Known(
        by_name={
            "job": jobs,
            "rank": [0],
            "incarnation": [1],
            "ranks": [1, 2],
            "bundle": [bundle],
            "sha256": [bundle],
            "entry": ["app.py"],
            "stdin": [None],
            "name": ["relay-0", "fuzz"],
            "host": ["127.0.0.1"],
            "port": [7000],
            "free_slots": [1],
            "slots": [1],
            "public_key": [public_key],
            "timestamp": [ts],
            "signature": [signature],
            "level": ["sandbox"],
            "offset": [0],
            "memory": [0],
            "path": ["portal.css", "portal.js"],
            "next": ["/jobs", "/pool"],
            "fault_tolerance": ["on"],
        },
        ints=jobs,
        strings=[bundle, "app.py"],
    )


async def test_every_route_survives_hostile_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An event stream lasts MAX_STREAM and a long-poll up to max_wait: both bounded here, so
    # that a request the fuzzer makes valid ends at once.
    monkeypatch.setattr(portal, "MAX_STREAM", 0.01)
    # Thousands of wrong credentials from one address: the guess limit would answer 429 to
    # all that follow (its own test: test_hostile_submissions.py).
    async with open_pool(tmp_path, max_wait=0.01, guess_limit=0) as pool:
        app = create_app(pool.core.settings, coordinator=pool.core)
        routes = routes_of(app)
        paths = {r.path for r in routes}
        assert {"/api/v1/jobs", "/api/v1/agents/enroll", "/jobs/{job_id}/live"} <= paths
        assert "/static/{path}" in paths
        fields = form_fields()

        await pool.register_relay()
        witness = pool.user("witness")
        witness_job = (await pool.submit(1, user="witness")).id
        agent = await pool.enroll("agent-0", slots=2)
        await pool.submit(1, user="alice")
        known = await known_values(pool, agent, witness_job)

        failures: list[str] = []  # every one, to see all the bugs of a run at once
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://coordinator"
        ) as client:
            await served(client, witness, witness_job)
            for n, route in enumerate(routes):
                creds = await fresh_credentials(pool, n, agent, known)
                agent = creds.agent
                rng = random.Random(SEED ^ zlib.crc32(str(route).encode()))
                for sent in requests_for(route, creds, Fuzzer(rng, known), fields):
                    try:
                        with trio.fail_after(REQUEST_DEADLINE):
                            r = await call(app, sent)
                    except trio.TooSlowError:
                        failures.append(f"{route}: hung: {sent}")
                        continue
                    except Exception as exc:  # the app raised: a 500 under a real server
                        failures.append(f"{route}: raised {exc!r}: {sent}")
                        continue
                    wrong = check_response(route, sent, r)
                    if wrong is not None:
                        failures.append(f"{route}: {wrong}: {sent}")
                await served(client, witness, witness_job)
        assert not failures, f"{len(failures)} bad answers:\n" + "\n".join(failures[:20])


# -- what the fuzzer found ----------------------------------------------------------------------


def assert_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.json() == {"error": {"code": code, "message": r.json()["error"]["message"]}}


async def test_json_with_bytes_that_are_not_utf8_is_refused_not_crashed(pool: Pool) -> None:
    """msgspec raises UnicodeDecodeError, not its DecodeError, for bytes that are not UTF-8
    inside a JSON string: 422, not 500."""
    for raw in (b"\xff", b"\xed\xa0\x80"):  # not UTF-8; a lone surrogate
        r = await pool.client.post("/api/v1/agents/enroll", content=b'{"name": "' + raw + b'"}')
        assert_error(r, 422, "bad_request")
        assert "UTF-8" in r.json()["error"]["message"]


async def test_an_origin_that_is_not_a_url_is_a_foreign_origin(pool: Pool) -> None:
    """A form POST whose Origin header does not parse as a URL (urlsplit raises on
    'http://[::1'): refused like any other foreign origin (403 bad_origin), not a 500."""
    token = pool.user()["Authorization"].removeprefix("Bearer ")
    cookie, csrf, _ = await pool.core.sign_in(token)
    for origin in ("http://[::1", "http://["):
        r = await pool.client.post(
            "/login",
            headers={"origin": origin, "cookie": f"{session.LOGIN_COOKIE}=s"},
            data={"csrf": "s", "token": token},
        )
        assert r.status_code == 403 and "bad_origin" in r.text, (r.status_code, r.text)
        r = await pool.client.post(
            "/account/tokens",
            headers={"origin": origin, "cookie": f"{session.SESSION_COOKIE}={cookie}"},
            data={"csrf": csrf, "label": "x"},
        )
        assert r.status_code == 403 and "bad_origin" in r.text, (r.status_code, r.text)


async def test_digits_that_are_not_ascii_are_no_number(pool: Pool) -> None:
    """str.isdigit() holds for '²' (one byte in a Latin-1 header), which int() refuses: a
    Last-Event-ID or Content-Length of it is ignored or refused, not a 500."""
    app = create_app(pool.core.settings, coordinator=pool.core)
    user = pool.user()
    job = await pool.submit(1)
    await pool.client.post(f"/api/v1/jobs/{job.id}/cancel", headers=user)  # its stream ends
    cookie, _, _ = await pool.core.sign_in(user["Authorization"].removeprefix("Bearer "))
    signed_in = {"cookie": f"{session.SESSION_COOKIE}={cookie}"}
    for digits in ("²", latin1("²٣")):
        r = await call(
            app, Sent("GET", f"/jobs/{job.id}/live", {**signed_in, "last-event-id": digits}, b"")
        )
        assert r.status_code == 200 and "event: end" in r.text, (r.status_code, r.text)
        url = f"/api/v1/blobs/{hashlib.sha256(b'abc').hexdigest()}"
        r = await call(app, Sent("PUT", url, {**user, "content-length": digits}, b"abc"))
        assert r.status_code == 200, r.text
        r = await call(app, Sent("POST", "/jobs/new", {**signed_in, "content-length": digits}, b""))
        assert r.status_code == 422 and "length_required" in r.text, (r.status_code, r.text)


async def test_a_body_refused_midway_leaves_no_reader_open(pool: Pool) -> None:
    """A body found too large as it is read (its Content-Length said less): the readers of
    the request's stream are closed, not left for the garbage collector (which trio warns of:
    ResourceWarning, an error under pytest)."""
    app = create_app(pool.core.settings, coordinator=pool.core)
    user = pool.user()
    big = b"x" * (pool.core.settings.max_request_bytes + 1)
    url = f"/api/v1/blobs/{hashlib.sha256(big * 5).hexdigest()}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = await call(app, Sent("POST", "/api/v1/tokens", {**user, "content-length": "0"}, big))
        assert_error(r, 413, "too_large")
        r = await call(app, Sent("PUT", url, {**user, "content-length": "0"}, big * 5))
        assert_error(r, 413, "too_large")
        del r
        gc.collect()
    assert [str(w.message) for w in caught] == []
