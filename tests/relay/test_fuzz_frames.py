"""Every frame type of the protocol, mutated, sent to a real relay in every state of a
connection, each case on a connection of its own (issue 20, hardening).

For each state (nothing sent yet; after the agent's Hello; with a rank attached; after its
Detach; a store connection before and after its Hello) and each of the protocol's message
types (read off the ``Message`` union), four cases: the message with plausible fields (the
connection's own job and rank, valid tokens); with a field made hostile (the 64-bit limits, a
wrong type, a huge string, list or map); amid other frames, plausible or hostile, in one
write; and mutated at random (fields missing or extra, an unknown tag, not an array, a header
cut short or a prefix that lies about it, a payload where none belongs, a payload length of
4 GiB, random bytes after the frame, a MessagePack count of 2**32). Then a probe that the
relay answers on a healthy connection (an Attach of another job; a store's CkptGet of an
image it does not have). The relay must either serve the probe or send an Error that ends the
connection and close it, within the deadline: never hang, never log an error (a crash of a
connection's task). A message the state does not admit, or bytes that are no frame, must end
the connection. Meanwhile a well-behaved agent deposits and receives messages on the same
relay without a pause, and once more at the end.

Cases are drawn from a fixed seed; a failure names its case (state, type, mutation, bytes).
``tests/relay/test_bad_input.py`` has the hand-written cases with their exact error codes.
"""

from __future__ import annotations

import logging
import random
import zlib
from dataclasses import dataclass
from typing import Any, get_args

import msgspec
import pytest
import trio
from relay_fakes import DEADLINE, FakeAgent, Pool, RunningRelay

from vpool.protocol.errors import ends_connection
from vpool.protocol.framing import PREFIX, encode_frame
from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    Attach,
    Attached,
    CkptChunk,
    CkptEnd,
    CkptGet,
    CkptPut,
    Credit,
    Data,
    Delivered,
    Det,
    Detach,
    Error,
    Hello,
    Message,
    Ping,
    Pong,
    Welcome,
)
from vpool.relay.ckptstore import STORE_PREAMBLE

SEED = 20  # issue 20
CONCURRENT = 8  # fuzzed connections open at once
MESSAGE_TYPES: list[type[Any]] = list(get_args(Message))
# What an agent may send on each kind of connection once it said Hello.
AGENT_SENDS = {Attach, Data, Det, Credit, Delivered, Detach, Ping, Pong}
STORE_SENDS = {CkptPut, CkptChunk, CkptEnd, CkptGet}
STATES = ["fresh", "welcomed", "attached", "detached", "store-fresh", "store-welcomed"]
INTS = [-1, 0, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63), 2**64 - 1, 10**18]
WRONG = ["x", 1.5, None, [], {}, b"\xff", True, [1, 2], {"a": 1}]
MUTATIONS = [
    "missing_fields",
    "extra_fields",
    "bad_tag",
    "not_an_array",
    "short_header",
    "prefix_too_short",
    "prefix_too_long",
    "payload",
    "payload_4gib",
    "random_after",
    "huge_count",
    "garbage_header",
]
# Mutations after which the bytes are no frame the relay may take (trailing fields are
# allowed: a newer peer's; a payload is, on Data and CkptChunk).
BROKEN = set(MUTATIONS) - {"extra_fields", "payload"}


@dataclass
class Case:
    state: str
    type: type[Any]
    mutation: str  # "plausible", "hostile_field", "sequence" or one of MUTATIONS
    job: int  # the connection's own job (its rank 0 is attached in "attached")
    seed: int

    def __str__(self) -> str:
        return f"{self.state}/{self.type.__name__}/{self.mutation}/job {self.job}"


# -- frames ---------------------------------------------------------------------------------


def fields_of(t: type[Any]) -> list[tuple[str, msgspec.inspect.Type, bool]]:
    info = msgspec.inspect.type_info(t)
    assert isinstance(info, msgspec.inspect.StructType)
    return [(f.encode_name, f.type, f.required) for f in info.fields]


def tag_of(t: type[Any]) -> str:
    info = msgspec.inspect.type_info(t)
    assert isinstance(info, msgspec.inspect.StructType) and isinstance(info.tag, str)
    return info.tag


class Frames:
    """The values of one case's frames: plausible for its connection, or hostile."""

    def __init__(self, pool: Pool, case: Case, agent: str) -> None:
        self.rng = random.Random(case.seed)
        self.case = case
        job = case.job
        self.agent_token = pool.agent_token(agent)
        self.counters = {"seq": 1, "index": 0}  # a sequence of Data (Det) frames counts up
        self.plausible: dict[str, Any] = {
            "version": PROTOCOL_VERSION,
            "role": "store" if case.state.startswith("store") else "agent",
            "token": pool.rank_token(job, 0, agent=agent, size=2),
            "job": job,
            "rank": 0,
            "src": 0,
            "dst": 1,
            "incarnation": 1,
            "home": True,
            "size": 0,
            "digest": bytes(32),
            "mac_key": bytes(32),
            "code": "bad_frame",
        }

    def plausible_value(self, t: type[Any], name: str, ft: msgspec.inspect.Type) -> Any:
        if name == "token" and t is Hello:
            return self.agent_token
        if name in self.counters:
            self.counters[name] += 1
            return self.counters[name] - 1
        if name in self.plausible:
            return self.plausible[name]
        mi = msgspec.inspect
        if isinstance(ft, mi.IntType):
            return 0
        if isinstance(ft, mi.StrType):
            return "x"
        if isinstance(ft, mi.BytesType):
            return b""
        if isinstance(ft, mi.BoolType):
            return False
        if isinstance(ft, mi.ListType):
            return []
        if isinstance(ft, mi.DictType):
            return {}
        return None

    def hostile_value(self, t: msgspec.inspect.Type) -> Any:
        mi, rng = msgspec.inspect, self.rng
        r = rng.random()
        if r < 0.3:
            return rng.choice(WRONG)
        if isinstance(t, mi.IntType):
            return rng.choice(INTS)
        if isinstance(t, mi.StrType):
            return rng.choice(["", "\x00", "\ud7ff" * 3, "é" * 20_000, "a.b.c", "x" * 70_000])
        if isinstance(t, mi.BytesType):
            return rng.choice([b"", rng.randbytes(1000), bytes(70_000)])
        if isinstance(t, mi.ListType):
            return [rng.choice(INTS) for _ in range(rng.choice([1, 100, 10_000]))]
        if isinstance(t, mi.DictType):
            n = rng.choice([1, 100, 5000])
            return {rng.choice(INTS) ^ i: rng.choice(INTS) for i in range(n)}
        return rng.choice(INTS)

    def header(self, t: type[Any], *, hostile: bool) -> bytes:
        """A message's MessagePack header: ``[tag, field, ...]`` (``array_like``)."""
        fields = fields_of(t)
        values = [self.plausible_value(t, name, ft) for name, ft, _ in fields]
        if hostile and fields:
            i = self.rng.randrange(len(fields))
            values[i] = self.hostile_value(fields[i][1])
        return msgspec.msgpack.encode([tag_of(t), *values])

    def whole(self, t: type[Any], *, hostile: bool) -> bytes:
        head = self.header(t, hostile=hostile)
        payload = b"x" * 10 if t in (Data, CkptChunk) else b""
        return PREFIX.pack(len(head), len(payload)) + head + payload

    def frame(self) -> tuple[bytes, bool]:
        """The case's bytes, and whether they end in the middle of a frame."""
        case, rng = self.case, self.rng
        mutation = case.mutation
        if mutation in ("plausible", "hostile_field"):
            return self.whole(case.type, hostile=mutation == "hostile_field"), False
        if mutation == "sequence":
            # Frames the state admits around the case's, in one write: how one frame's
            # effects meet the next's.
            kinds = admits(case.state)
            around = [
                rng.choice(kinds if rng.random() < 0.8 else MESSAGE_TYPES)
                for _ in range(rng.randint(2, 6))
            ]
            around.insert(rng.randrange(len(around) + 1), case.type)
            frames = [self.whole(t, hostile=rng.random() < 0.3) for t in around]
            return b"".join(frames), False
        head = self.header(case.type, hostile=False)
        fields = fields_of(case.type)
        required = sum(1 for _, _, req in fields if req)
        if mutation == "missing_fields":
            values = msgspec.msgpack.decode(head)
            head = msgspec.msgpack.encode(values[: rng.randint(0, max(0, required))])
        elif mutation == "extra_fields":
            values = msgspec.msgpack.decode(head)
            head = msgspec.msgpack.encode([*values, *([0] * len(fields)), "extra", [1], {}])
        elif mutation == "bad_tag":
            values = msgspec.msgpack.decode(head)
            values[0] = rng.choice(["nope", "", 7, None, "HELLO", tag_of(case.type) + "\x00"])
            head = msgspec.msgpack.encode(values)
        elif mutation == "not_an_array":
            head = msgspec.msgpack.encode(
                rng.choice([{"type": tag_of(case.type)}, tag_of(case.type), 5, None, b"x"])
            )
        elif mutation == "short_header":
            cut = rng.randint(1, max(1, len(head) - 1))
            return PREFIX.pack(len(head), 0) + head[:cut], True
        elif mutation == "prefix_too_short":
            return PREFIX.pack(max(1, len(head) - rng.randint(1, 4)), 0) + head, False
        elif mutation == "prefix_too_long":
            return PREFIX.pack(len(head) + rng.randint(1, 64), 0) + head, True
        elif mutation == "payload":
            payload = rng.randbytes(rng.choice([1, 100, 70_000]))
            return PREFIX.pack(len(head), len(payload)) + head + payload, False
        elif mutation == "payload_4gib":
            return PREFIX.pack(len(head), 2**32 - 1) + head, True
        elif mutation == "random_after":
            tail = rng.randbytes(rng.choice([1, 8, 100, 5000]))
            return PREFIX.pack(len(head), 0) + head + tail, True
        elif mutation == "huge_count":
            # An array (or map) that says it has 2**32 - 1 elements, then a few.
            head = rng.choice([b"\xdd", b"\xdf"]) + b"\xff\xff\xff\xff" + head[1:]
        elif mutation == "garbage_header":
            head = rng.randbytes(rng.choice([1, 10, 1000]))
        else:
            raise AssertionError(mutation)
        return PREFIX.pack(len(head), 0) + head, False


# -- connections ----------------------------------------------------------------------------


async def connect(pool: Pool, relay: RunningRelay, case: Case, agent: str) -> FakeAgent:
    """A connection of ``agent`` in the case's state."""
    if case.state.startswith("store"):
        tcp = await trio.open_tcp_stream(*relay.addr)
        await tcp.send_all(STORE_PREAMBLE)
        stream = trio.SSLStream(tcp, pool.client_ssl, server_hostname=relay.addr[0])
        conn = FakeAgent(stream, agent)
        FakeAgent.opened.append(conn)
        if case.state == "store-welcomed":
            await conn.send(
                Hello(version=PROTOCOL_VERSION, role="store", token=pool.agent_token(agent))
            )
            await conn.expect(Welcome)
        return conn
    conn = await FakeAgent.connect(pool, relay.addr, agent, hello=case.state != "fresh")
    if case.state in ("attached", "detached"):
        await conn.attach(pool, case.job, 0, size=2, home=True)
    if case.state == "detached":
        await conn.send(Detach(job=case.job, rank=0))
    return conn


def probe(pool: Pool, case: Case, agent: str) -> bytes:
    """A frame about another job (``case.job + 1``) that the relay answers on a healthy
    connection of the case's kind: ``Attached``; a store's ``Error(not_found)`` (an image
    it does not have)."""
    token = pool.rank_token(case.job + 1, 0, agent=agent, size=1)
    if case.state.startswith("store"):
        return encode_frame(CkptGet(token=token, ckpt=99))
    return encode_frame(Attach(token=token))


async def outcome(conn: FakeAgent, case: Case) -> str:
    """ "served" (the probe was answered) or "refused <code>" (an Error that ends the
    connection, and the connection closed)."""
    while True:
        try:
            msg, _ = await conn.recv()
        except EOFError:
            return "closed without an Error"
        if isinstance(msg, Attached) and msg.job == case.job + 1:
            return "served"
        if isinstance(msg, Error):
            if msg.code == "not_found" and msg.job == case.job + 1:
                return "served"
            if ends_connection(msg.code, msg.rank):
                try:
                    while True:
                        await conn.recv()
                except EOFError:
                    return f"refused {msg.code}"


def admits(state: str) -> list[type[Any]]:
    """The message types a state admits (a message of them may still be refused)."""
    if state in ("fresh", "store-fresh"):
        return [Hello]
    if state == "store-welcomed":
        return sorted(STORE_SENDS, key=lambda t: t.__name__)
    return sorted(AGENT_SENDS, key=lambda t: t.__name__)


def must_refuse(case: Case) -> bool:
    """Whether the case's bytes must end the connection."""
    if case.mutation == "sequence":  # its frames move the state: a type no state admits
        kind = STORE_SENDS if case.state.startswith("store") else AGENT_SENDS
        return case.type not in kind | {Hello}
    if case.type not in admits(case.state):
        return True
    if case.mutation == "payload":
        return case.type not in (Data, CkptChunk)
    return case.mutation in BROKEN


async def run_case(pool: Pool, relay: RunningRelay, case: Case, failures: list[str]) -> None:
    agent = f"fuzz-{case.job}"
    frames = Frames(pool, case, agent)
    data, partial = frames.frame()
    try:
        with trio.fail_after(DEADLINE):
            conn = await connect(pool, relay, case, agent)
            try:
                # After bytes that end inside a frame, zeros: they complete it, and make an
                # empty header of what follows.
                tail = bytes(70_000) if partial else probe(pool, case, agent)
                await conn.send_raw(data + tail)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the relay closed first; what it said is still to be read
            got = await outcome(conn, case)
            await conn.aclose()
    except trio.TooSlowError:
        failures.append(f"{case}: neither served nor closed in {DEADLINE} s: {data[:200]!r}")
        return
    if got == "closed without an Error":
        failures.append(f"{case}: {got}: {data[:200]!r}")
    elif got == "served" and must_refuse(case):
        failures.append(f"{case}: served after a frame it must refuse: {data[:200]!r}")


def cases() -> list[Case]:
    """For each state and message type: one plausible frame, one with a hostile field, one
    among others in a sequence, and one mutation."""
    found: list[Case] = []
    job = 1000
    for state in STATES:
        for t in MESSAGE_TYPES:
            rng = random.Random(SEED ^ zlib.crc32(f"{state}/{t.__name__}".encode()))
            for mutation in ("plausible", "hostile_field", "sequence", rng.choice(MUTATIONS)):
                job += 2  # the case's job and the probe's
                found.append(Case(state, t, mutation, job, rng.randrange(2**32)))
    return found


def relay_bugs(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the relay logged as errors during the test (``no_relay_bugs`` sees only what it
    logs during teardown: ``caplog.records`` holds the current phase's)."""
    return [
        r.getMessage() + "\n" + (r.exc_text or "")
        for r in caplog.records
        if r.name.startswith("vpool.relay") and r.levelno >= logging.ERROR
    ]


@pytest.mark.large
async def test_every_frame_type_in_every_state(
    pool: Pool, relay: RunningRelay, caplog: pytest.LogCaptureFixture
) -> None:
    sender = await FakeAgent.connect(pool, relay.addr, "agent-h")
    receiver = await FakeAgent.connect(pool, relay.addr, "agent-r")
    await sender.attach(pool, 7, 0, size=2)
    await receiver.attach(pool, 7, 1, size=2, home=True)
    seq = 0

    async def round_trip() -> None:
        nonlocal seq
        seq += 1
        payload = f"message {seq}".encode()
        with trio.fail_after(DEADLINE):
            await sender.deposit(7, 0, 1, seq, payload)
            data, got = await receiver.next_data()
            assert (data.seq, got) == (seq, payload)
            await sender.acks_until(7, 0, 1, seq)

    fuzzed = trio.Event()
    during = 0

    async def healthy() -> None:
        nonlocal during
        while not fuzzed.is_set():
            await round_trip()
            during += 1

    all_cases = cases()
    assert {c.type for c in all_cases} == set(MESSAGE_TYPES)
    failures: list[str] = []
    limit = trio.CapacityLimiter(CONCURRENT)

    async def limited(case: Case) -> None:
        async with limit:
            await run_case(pool, relay, case, failures)

    async with trio.open_nursery() as both:
        both.start_soon(healthy)  # its last round trip ends once the fuzz did
        async with trio.open_nursery() as fuzz:
            for case in all_cases:
                fuzz.start_soon(limited, case)
        fuzzed.set()
    assert not relay.done.is_set(), "the relay stopped"
    assert not relay_bugs(caplog), "\n".join(relay_bugs(caplog))
    assert not failures, f"{len(failures)} of {len(all_cases)} cases:\n" + "\n".join(failures)
    assert during > 0
    await round_trip()  # and after


# -- what the fuzzer found ----------------------------------------------------------------------


async def test_an_error_from_an_agent_is_refused(
    pool: Pool, relay: RunningRelay, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent sends a relay no Error. The session table took one as the end of the
    session with the connection left open: as the first frame it failed the handshake's
    assertion (a crash, no answer); after a deposit the Ack then due could not be sent
    (LocalProtocolError in the writer, or in the reader of another agent pushing to this
    one); after a determinant its DetAck was dropped and the connection hung. Now it is
    refused (unexpected_message) and the connection closed."""
    healthy = await FakeAgent.connect(pool, relay.addr, "agent-h")
    receiver = await FakeAgent.connect(pool, relay.addr, "agent-r")
    await healthy.attach(pool, 7, 0, size=2)
    await receiver.attach(pool, 7, 1, size=2, home=True)
    bye = encode_frame(Error(code="bad_frame", message="bye"))
    rank_bye = encode_frame(Error(code="fenced", message="bye", job=5, rank=0))

    first = await FakeAgent.connect(pool, relay.addr, "agent-1", hello=False)
    await first.send_raw(bye)
    await first.expect_error("unexpected_message")

    depositor = await FakeAgent.connect(pool, relay.addr, "agent-2")
    await depositor.attach(pool, 5, 0, size=2)
    data = encode_frame(Data(job=5, src=0, dst=1, seq=1, ctx=0, tag=0), b"p")
    await depositor.send_raw(data + rank_bye + bye)
    await depositor.expect_error("unexpected_message")

    logger = await FakeAgent.connect(pool, relay.addr, "agent-3")
    await logger.attach(pool, 6, 0, size=2, home=True)
    await logger.send_raw(encode_frame(Det(job=6, rank=0, index=0, data=b"d")) + bye)
    await logger.expect_error("unexpected_message")

    for seq in (1, 2):
        await healthy.deposit(7, 0, 1, seq, b"still here")
        await healthy.acks_until(7, 0, 1, seq)
        assert (await receiver.next_data())[1] == b"still here"
    assert not relay_bugs(caplog), "\n".join(relay_bugs(caplog))


@pytest.mark.large
async def test_a_store_chunk_of_image_minus_one_is_refused(pool: Pool, relay: RunningRelay) -> None:
    """An image id is never negative: a chunk of image -1 (the store's "no image") is a bad
    frame, refused at once, not taken for the bulk put's and its payload read beneath TLS."""
    tcp = await trio.open_tcp_stream(*relay.addr)
    await tcp.send_all(STORE_PREAMBLE)
    conn = FakeAgent(trio.SSLStream(tcp, pool.client_ssl, server_hostname=relay.addr[0]), "a")
    FakeAgent.opened.append(conn)
    await conn.send(Hello(version=PROTOCOL_VERSION, role="store", token=pool.agent_token("a")))
    await conn.expect(Welcome)
    await conn.send(CkptChunk(ckpt=-1), b"x" * 10)
    with trio.fail_after(2):  # answered at once when right; no answer for 60 s when not
        await conn.expect_error("bad_frame")
