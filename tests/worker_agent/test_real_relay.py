"""Two ranks on one agent talking through the real relay (``vpool.relay.server``)."""

from __future__ import annotations

import functools
from pathlib import Path

import msgspec
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from vpool.protocol import api

from .conftest import FakeCoordinator, Pki, RunningAgent, lease_for, lines

serve_relay = pytest.importorskip("vpool.relay.server").serve_relay
RelaySettings = pytest.importorskip("vpool.relay.settings").RelaySettings


@pytest.fixture
def coordinator() -> FakeCoordinator:
    return FakeCoordinator(signing_key=Ed25519PrivateKey.generate())


@pytest.fixture
async def real_relay(
    nursery: trio.Nursery, coordinator: FakeCoordinator, pool_pki: Pki, tmp_path: Path
) -> api.RelayInfo:
    assert coordinator.signing_key is not None
    settings = RelaySettings(
        name="relay-a",
        host="127.0.0.1",
        port=0,
        data_dir=str(tmp_path / "relay"),
        tls_cert=str(pool_pki.cert),
        tls_key=str(pool_pki.key),
    )
    host, port = await nursery.start(
        functools.partial(serve_relay, settings, signing_key=coordinator.signing_key.public_key())
    )
    return api.RelayInfo(name="relay-a", host=host, port=port)


def _add_pair(coordinator: FakeCoordinator, relay: api.RelayInfo, args: list[str]) -> None:
    for rank in (0, 1):
        lease = lease_for(coordinator, None, args=args, rank=rank)
        coordinator.add_lease(msgspec.structs.replace(lease, relays=[relay], homes=[0, 0]))


@pytest.mark.parametrize("n", [10, 300_000])
async def test_ping_pong_through_the_real_relay(
    agent: RunningAgent, coordinator: FakeCoordinator, real_relay: api.RelayInfo, n: int
) -> None:
    _add_pair(coordinator, real_relay, ["pingpong", str(n)])
    await coordinator.wait_for(lambda: len(coordinator.exits) == 2, seconds=30)
    assert coordinator.problems == []
    assert [(e.code, e.aborted) for e in coordinator.exits] == [(0, False), (0, False)]
    out0, out1 = (lines(coordinator.output_of(7, r)) for r in (0, 1))
    assert {"data": "pong", "n": 4 * n, "src": 1} in out0
    assert {"ack": [0, 1, 1]} in out0
    assert {"data": "ping", "n": 4 * n, "src": 0} in out1
    assert {"ack": [1, 0, 1]} in out1


async def test_stream_beyond_the_push_window(
    agent: RunningAgent, coordinator: FakeCoordinator, real_relay: api.RelayInfo
) -> None:
    # 3000 x 4 KiB = 12 MiB: three times the relay's push window, so it only gets through if
    # the agent credits what it delivers; thousands of small frames exercise the batching.
    _add_pair(coordinator, real_relay, ["stream", "3000", "4096"])
    await coordinator.wait_for(lambda: len(coordinator.exits) == 2, seconds=60)
    assert [(e.code, e.aborted) for e in coordinator.exits] == [(0, False), (0, False)]
    assert coordinator.problems == []
    assert "mb_per_s" in lines(coordinator.output_of(7, 0))[-1]


async def test_agent_shutdown_blames_itself_not_the_relay(
    agent: RunningAgent, coordinator: FakeCoordinator, real_relay: api.RelayInfo
) -> None:
    _add_pair(coordinator, real_relay, ["hang"])
    await coordinator.wait_for(lambda: all(b"pid" in coordinator.output_of(7, r) for r in (0, 1)))
    agent.cancel_scope.cancel()
    with trio.fail_after(10):
        await agent.finished.wait()
    assert sorted((p.rank, p.message) for p in coordinator.problems) == [
        (0, "agent test-agent is shutting down"),
        (1, "agent test-agent is shutting down"),
    ]


MPI_PROGRAM = """
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
if rank == 0:
    comm.send({"hello": list(range(5))}, dest=1, tag=3)
    print("rank 0 got", comm.recv(source=1, tag=4))
else:
    msg = comm.recv(source=0, tag=3)
    comm.send(sum(msg["hello"]), dest=0, tag=4)
total = comm.allreduce(rank + 1)
print(f"rank {rank} of {size} on {MPI.Get_processor_name()}: total {total}")
"""


async def test_real_mpi4py_program(
    agent: RunningAgent, coordinator: FakeCoordinator, real_relay: api.RelayInfo
) -> None:
    pytest.importorskip("vpool.sdk.mpi.MPI")
    for rank in (0, 1):
        lease = lease_for(coordinator, None, program=MPI_PROGRAM, rank=rank)
        coordinator.add_lease(msgspec.structs.replace(lease, relays=[real_relay], homes=[0, 0]))
    await coordinator.wait_for(lambda: len(coordinator.exits) == 2, seconds=30)
    errors = [coordinator.output_of(7, r, "stderr").decode() for r in (0, 1)]
    assert [e.code for e in coordinator.exits] == [0, 0], errors
    out0 = coordinator.output_of(7, 0).decode()
    assert "rank 0 got 10" in out0
    assert "rank 0 of 2 on " in out0 and "total 3" in out0
    assert "rank 1 of 2 on " in coordinator.output_of(7, 1).decode()
