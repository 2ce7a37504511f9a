"""Bad input gets a typed Error and closes that connection only: a healthy connection on the
same relay keeps working throughout."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from relay_fakes import FakeAgent, Pool, RunningRelay

from vpool.protocol.framing import PREFIX, encode_frame
from vpool.protocol.messages import PROTOCOL_VERSION, Attach, Credit, Data, Hello

Case = Callable[[Pool, RunningRelay], Awaitable[FakeAgent]]


async def garbage_bytes(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr)
    await agent.send_raw(PREFIX.pack(6, 0) + b"\xc1\xc1\xc1\xc1\xc1\xc1")
    return agent


async def garbage_before_hello(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr, hello=False)
    await agent.send_raw(b"GET / HTTP/1.1\r\nHost: relay\r\n\r\n")
    return agent


async def payload_before_hello(pool: Pool, relay: RunningRelay) -> FakeAgent:
    # Within the limit after Hello, but a stranger gets no buffer allocated at all.
    agent = await FakeAgent.connect(pool, relay.addr, hello=False)
    await agent.send_raw(PREFIX.pack(20, 1 << 20))
    return agent


async def oversized_payload(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr)
    # Only the prefix is sent: the relay must refuse before waiting for the body.
    await agent.send_raw(PREFIX.pack(20, relay.settings.max_payload + 1))
    return agent


async def oversized_header(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr)
    await agent.send_raw(PREFIX.pack(1 << 30, 0))
    return agent


async def payload_on_a_control_message(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr)
    head = encode_frame(Credit(job=1, rank=0, nbytes=1))
    await agent.send_raw(PREFIX.pack(len(head) - PREFIX.size, 3) + head[PREFIX.size :] + b"abc")
    return agent


async def missing_token(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr, hello=False)
    await agent.send(Hello(version=PROTOCOL_VERSION, role="agent", token=""))
    return agent


async def forged_token(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr, hello=False)
    token = pool.agent_token("agent-1", key=Ed25519PrivateKey.generate())
    await agent.send(Hello(version=PROTOCOL_VERSION, role="agent", token=token))
    return agent


async def expired_token(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr, hello=False)
    token = pool.agent_token("agent-1", expires=time.time() - 1)
    await agent.send(Hello(version=PROTOCOL_VERSION, role="agent", token=token))
    return agent


async def rank_token_as_agent_token(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr, hello=False)
    token = pool.rank_token(1, 0, agent="agent-1", size=2)
    await agent.send(Hello(version=PROTOCOL_VERSION, role="agent", token=token))
    return agent


async def wrong_version(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr, hello=False)
    await agent.send(Hello(version=99, role="agent", token=pool.agent_token("agent-1")))
    return agent


async def attach_before_hello(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr, hello=False)
    await agent.send(Attach(token=pool.rank_token(1, 0, agent="agent-1", size=2)))
    return agent


async def rank_token_of_another_agent(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr, "agent-1")
    await agent.send(Attach(token=pool.rank_token(1, 0, agent="agent-2", size=2)))
    return agent


async def forged_rank_token(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr, "agent-1")
    token = pool.rank_token(1, 0, agent="agent-1", size=2, key=Ed25519PrivateKey.generate())
    await agent.send(Attach(token=token))
    return agent


async def expired_rank_token(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr, "agent-1")
    token = pool.rank_token(1, 0, agent="agent-1", size=2, expires=time.time() - 1)
    await agent.send(Attach(token=token))
    return agent


async def data_for_a_job_not_attached(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr, "agent-1")
    await agent.attach(pool, 1, 0, size=2)
    await agent.send(Data(job=2, src=0, dst=1, seq=1, ctx=0, tag=0), b"sneaky")
    return agent


async def data_outside_the_job(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr, "agent-1")
    await agent.attach(pool, 1, 0, size=2)
    await agent.send(Data(job=1, src=0, dst=2, seq=1, ctx=0, tag=0), b"nowhere")
    return agent


async def seq_zero(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr, "agent-1")
    await agent.attach(pool, 1, 0, size=2)
    await agent.send(Data(job=1, src=0, dst=1, seq=0, ctx=0, tag=0), b"zero")
    return agent


async def second_hello(pool: Pool, relay: RunningRelay) -> FakeAgent:
    agent = await FakeAgent.connect(pool, relay.addr, "agent-1")
    await agent.send(
        Hello(version=PROTOCOL_VERSION, role="agent", token=pool.agent_token("agent-1"))
    )
    return agent


CASES: list[tuple[Case, str]] = [
    (garbage_bytes, "bad_frame"),
    (garbage_before_hello, "frame_too_large"),
    (payload_before_hello, "frame_too_large"),
    (oversized_payload, "frame_too_large"),
    (oversized_header, "frame_too_large"),
    (payload_on_a_control_message, "bad_frame"),
    (missing_token, "missing_token"),
    (forged_token, "forged_token"),
    (expired_token, "expired_token"),
    (rank_token_as_agent_token, "wrong_token"),
    (wrong_version, "bad_version"),
    (attach_before_hello, "bad_frame"),
    (rank_token_of_another_agent, "wrong_token"),
    (forged_rank_token, "forged_token"),
    (expired_rank_token, "expired_token"),
    (data_for_a_job_not_attached, "not_attached"),
    (data_outside_the_job, "bad_dst"),
    (seq_zero, "seq_gap"),
    (second_hello, "bad_frame"),
]


@pytest.mark.parametrize(("case", "code"), CASES, ids=[c.__name__ for c, _ in CASES])
async def test_bad_input_closes_only_that_connection(
    pool: Pool, relay: RunningRelay, case: Case, code: str
) -> None:
    healthy = await FakeAgent.connect(pool, relay.addr, "agent-h")
    receiver = await FakeAgent.connect(pool, relay.addr, "agent-r")
    await healthy.attach(pool, 7, 0, size=2)
    await receiver.attach(pool, 7, 1, size=2, home=True)
    await healthy.deposit(7, 0, 1, 1, b"before")

    bad = await case(pool, relay)
    err = await bad.expect_error(code)
    assert err.message

    await healthy.deposit(7, 0, 1, 2, b"after")
    await healthy.acks_until(7, 0, 1, 2)
    got = [await receiver.next_data() for _ in range(2)]
    assert [p for _, p in got] == [b"before", b"after"]


async def test_plain_tcp_to_a_tls_relay_is_just_closed(pool: Pool, relay: RunningRelay) -> None:
    import trio

    stream = await trio.open_tcp_stream(*relay.addr)
    try:
        await stream.send_all(b"\x16\x03\x01\x00\x05hello" * 10)
        with trio.fail_after(10):
            try:
                while await stream.receive_some(1024):
                    pass
            except trio.BrokenResourceError:
                pass
    finally:
        await stream.aclose()
    healthy = await FakeAgent.connect(pool, relay.addr, "agent-h")
    await healthy.attach(pool, 1, 0, size=1)
