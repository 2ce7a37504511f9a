"""A sealed message that does not open at the receiving agent (issue 34) is reported as what it
is: an integrity failure naming the relay that pushed it (``RankProblem.unopened_from``), with
the failure in words every agent would use (``RankProblem.failure``, compared by the
coordinator across agents), never handed to the rank; one that opens, large or small, is."""

from __future__ import annotations

import base64
import hashlib

import msgspec
import pytest

from vpool.protocol.framing import encode_frame, frames_in
from vpool.protocol.messages import Ack, Data, Stop
from vpool.protocol.sealing import Sealer, message_key

from .conftest import FakeCoordinator, FakeRelay, RunningAgent, lease_for
from .conftest import lines as json_lines
from .test_proxy import _attach, _open_relay

JOB_KEY = base64.urlsafe_b64encode(b"k" * 32).rstrip(b"=").decode()
OTHER_KEY = base64.urlsafe_b64encode(b"x" * 32).rstrip(b"=").decode()


def _sealed(key: str, payload: bytes, job: int) -> tuple[Data, bytes]:
    """The sealed frame of a message from rank 1 to rank 0 of ``job``, as a relay pushes it."""
    msg = Data(job=job, src=1, dst=0, seq=1, ctx=0, tag=9, kind=1, parts=[len(payload)])
    frame = encode_frame(msg, payload)
    [(_, header_len, _)] = list(frames_in(frame))
    sealed = bytes(Sealer(message_key(key)).seal(msg, frame, header_len))
    return msgspec.structs.replace(msg, sealed=True), sealed


# Each case a job of its own: a rank's cgroup is named after its agent's pid and its job.
SIZES = [(100, 11), (70_000, 12), (5 << 20, 13)]


@pytest.mark.parametrize(("size", "job"), SIZES)
async def test_a_message_sealed_with_another_key_is_an_integrity_failure(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay, size: int, job: int
) -> None:
    lease = lease_for(coordinator, relay, args=["wait"], job=job)
    coordinator.add_lease(msgspec.structs.replace(lease, ckpt_key=JOB_KEY))
    conn = await _open_relay(relay)
    await _attach(conn, job)
    _, sealed = _sealed(OTHER_KEY, bytes(range(256)) * (size // 256), job)
    await conn.stream.send_all(sealed)
    problem = await coordinator.wait_for(lambda: coordinator.problems and coordinator.problems[0])
    expected = (
        f"message 1 from rank 1 to rank 0 of job {job} does not open with the job's key: "
        "it was changed on its way"
    )
    assert (problem.job, problem.rank, problem.incarnation) == (job, 0, 1)
    assert (problem.failure, problem.unopened_from, problem.relay) == (expected, "relay-0", "")
    assert problem.message == f"relay relay-0 ({relay.host}:{relay.port}): {expected}"
    # The rank never saw it (the coordinator, which would stop it, is a fake here).
    await conn.send(Stop(job=job, rank=0, incarnation=1, reason="the test is over"))
    await coordinator.wait_for(lambda: coordinator.exit_of(job, 0))
    assert b'"got": "Data"' not in coordinator.output_of(job, 0)


@pytest.mark.parametrize(("size", "job"), [(s, j + 10) for s, j in SIZES])
async def test_a_message_sealed_with_the_job_key_reaches_the_rank_as_it_was_sent(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay, size: int, job: int
) -> None:
    lease = lease_for(coordinator, relay, args=["proxy", "0"], job=job)
    coordinator.add_lease(msgspec.structs.replace(lease, ckpt_key=JOB_KEY))
    conn = await _open_relay(relay)
    await _attach(conn, job)
    await conn.receive()  # the rank's own message, sealed on its way out
    payload = bytes(range(256)) * (size // 256)
    msg, sealed = _sealed(JOB_KEY, payload, job)
    await conn.stream.send_all(sealed)
    await conn.send(Ack(job=job, src=0, dst=1, seq=1))
    plain = encode_frame(msgspec.structs.replace(msg, sealed=False), payload)
    done = await coordinator.wait_for(lambda: coordinator.exit_of(job, 0))
    assert done.code == 0, coordinator.output_of(job, 0)
    out = json_lines(coordinator.output_of(job, 0))
    assert {"data": len(payload), "sha": hashlib.sha256(plain).hexdigest()} in out
    assert coordinator.problems == []
