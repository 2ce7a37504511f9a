"""Two ranks on one agent talking through the real relay (``vpool.relay.server``)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

import msgspec
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from vpool.protocol import api
from vpool.relay.hub import Hub
from vpool.worker_agent.settings import AgentSettings

from .conftest import FakeCoordinator, Pki, RunningAgent, lease_for, lines
from .ft_programs import FT_PROGRAM

serve_relay = pytest.importorskip("vpool.relay.server").serve_relay
RelaySettings = pytest.importorskip("vpool.relay.settings").RelaySettings


@pytest.fixture
def coordinator() -> FakeCoordinator:
    return FakeCoordinator(signing_key=Ed25519PrivateKey.generate())


@pytest.fixture
async def real_relay(relay_and_hub: tuple[api.RelayInfo, Hub]) -> api.RelayInfo:
    return relay_and_hub[0]


@pytest.fixture
async def relay_and_hub(
    nursery: trio.Nursery, coordinator: FakeCoordinator, pool_pki: Pki, tmp_path: Path
) -> tuple[api.RelayInfo, Hub]:
    assert coordinator.signing_key is not None
    settings = RelaySettings(
        name="relay-a",
        host="127.0.0.1",
        port=0,
        data_dir=str(tmp_path / "relay"),
        tls_cert=str(pool_pki.cert),
        tls_key=str(pool_pki.key),
    )
    hubs_in, hubs_out = trio.open_memory_channel[Hub](1)
    host, port = await nursery.start(
        functools.partial(
            serve_relay,
            settings,
            signing_key=coordinator.signing_key.public_key(),
            hub_ready=hubs_in,
        )
    )
    return api.RelayInfo(name="relay-a", host=host, port=port), await hubs_out.receive()


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


@pytest.mark.parametrize(
    "settings", [{"local_delivery": False}, {}], indirect=True, ids=["via-relay", "local"]
)
async def test_stream_beyond_the_push_window(
    agent: RunningAgent,
    coordinator: FakeCoordinator,
    relay_and_hub: tuple[api.RelayInfo, Hub],
    settings: AgentSettings,
) -> None:
    # 3000 x 4 KiB = 12 MiB: three times the relay's push window, so through the relay it only
    # gets through if the agent credits what it delivers; thousands of small frames exercise
    # the batching. Delivered locally it is more than the receiver's backlog (8 MiB): the
    # sender waits for room. (Messages sent before the receiver attached take the relay's
    # way, and the channel goes local again once the relay caught up.)
    relay, hub = relay_and_hub
    _add_pair(coordinator, relay, ["stream", "3000", "4096"])
    await coordinator.wait_for(lambda: len(coordinator.exits) == 2, seconds=60)
    assert [(e.code, e.aborted) for e in coordinator.exits] == [(0, False), (0, False)]
    assert coordinator.problems == []
    assert "mb_per_s" in lines(coordinator.output_of(7, 0))[-1]
    assert hub.core.boxes[(7, 1)].mailbox.acked(0) == 3000  # all logged
    if settings.local_delivery:
        assert hub.pushed_to[7, 1] < 1000, hub.pushed_to
    else:
        assert hub.pushed_to[7, 1] == 3000


@pytest.mark.parametrize("settings", [{"local_delivery": False}, {}], indirect=True)
async def test_messages_between_ranks_of_one_agent_are_logged_but_not_pushed_back(
    agent: RunningAgent,
    coordinator: FakeCoordinator,
    relay_and_hub: tuple[api.RelayInfo, Hub],
    settings: AgentSettings,
) -> None:
    relay, hub = relay_and_hub
    _add_pair(coordinator, relay, ["pingpong", "10"])
    await coordinator.wait_for(lambda: len(coordinator.exits) == 2, seconds=30)
    assert [(e.code, e.aborted) for e in coordinator.exits] == [(0, False), (0, False)]
    assert {"data": "pong", "n": 40, "src": 1} in lines(coordinator.output_of(7, 0))
    # Both messages are in the receivers' logs at the relay, and acknowledged (the ranks
    # waited for their Acks) ...
    assert hub.core.boxes[(7, 1)].mailbox.acked(0) == 1
    assert hub.core.boxes[(7, 0)].mailbox.acked(1) == 1
    # ... and the relay pushed them only when the agent did not deliver them itself. (The
    # ping may leave before rank 1 is attached, and then takes the relay's way; the pong
    # cannot: rank 0 is running, so attached, when rank 1 answers.)
    if settings.local_delivery:
        assert hub.pushed_to[7, 0] == 0 and hub.pushed_to[7, 1] <= 1
    else:
        assert hub.pushed_to[7, 0] == hub.pushed_to[7, 1] == 1
    assert hub.memory_used == 0  # and keeps no copy of them in memory


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
    pytest.importorskip("vpool.mpi.MPI")
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


# Rank 0 sends 2K numbered messages to rank 1 in two halves; between them both wait for the
# file named by argv[1] (the test restarts the relay meanwhile). Rank 1 checks it got each
# message once, in order, then answers; each waits for its last deposit's Ack.
RESTART_PROGRAM = """
import json, os, socket, sys, time
from vpool.protocol import framing, messages as m

K = 20
sock = socket.socket(socket.AF_UNIX)
sock.connect(os.environ["VPOOL_AGENT_SOCKET"])
dec = framing.FrameDecoder()

def recv():
    while (f := dec.next_frame()) is None:
        data = sock.recv(1 << 20)
        if not data:
            sys.exit("agent closed the socket")
        dec.receive_data(data)
    return f

def send(msg, payload=b""):
    sock.sendall(framing.encode_frame(msg, payload))

def wait_for_go():
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.02)

with open(os.environ["VPOOL_RANK_SECRET_FILE"]) as _f:  # the agent writes it
    SECRET = _f.read()
send(m.RankHello(version=m.PROTOCOL_VERSION, secret=SECRET))
w = recv().message
if w.rank == 0:
    def deposit(seq):
        send(m.Data(job=w.job, src=0, dst=1, seq=seq, ctx=0, tag=0), b"m%d" % seq)
    for seq in range(1, K + 1):
        deposit(seq)
    print("sent", flush=True)
    wait_for_go()
    for seq in range(K + 1, 2 * K + 1):
        deposit(seq)
    answer = acked = None
    while answer is None or acked != 2 * K:
        msg = recv()
        if isinstance(msg.message, m.Data):
            answer = msg.payload.decode()
        elif isinstance(msg.message, m.Ack):
            acked = msg.message.seq
    print(json.dumps({"answer": answer, "acked": acked}), flush=True)
else:
    got = []
    def take(n):
        while len(got) < n:
            f = recv()
            if isinstance(f.message, m.Data):
                got.append((f.message.seq, f.payload.decode()))
    take(K)
    print("half", flush=True)
    wait_for_go()
    take(2 * K)
    ok = got == [(s, "m%d" % s) for s in range(1, 2 * K + 1)]
    send(m.Data(job=w.job, src=1, dst=0, seq=1, ctx=0, tag=0), b"ok" if ok else repr(got).encode())
    while not isinstance(recv().message, m.Ack):
        pass
send(m.Finalize())
"""


async def test_relay_restart_on_the_same_disk(
    nursery: trio.Nursery,
    agent: RunningAgent,
    coordinator: FakeCoordinator,
    pool_pki: Pki,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    settings: AgentSettings,
) -> None:
    caplog.set_level(logging.INFO, "vpool.agent")
    agent_settings = settings
    assert coordinator.signing_key is not None
    key = coordinator.signing_key.public_key()
    settings = RelaySettings(
        name="relay-a",
        host="127.0.0.1",
        port=0,
        data_dir=str(tmp_path / "relay"),
        tls_cert=str(pool_pki.cert),
        tls_key=str(pool_pki.key),
    )

    async def run_relay(
        scope: trio.CancelScope, ended: trio.Event, task_status: trio.TaskStatus[int]
    ) -> None:
        try:
            with scope:
                await serve_relay(settings, signing_key=key, task_status=task_status)
        finally:
            ended.set()

    first, first_ended = trio.CancelScope(), trio.Event()
    host, port = await nursery.start(run_relay, first, first_ended)
    info = api.RelayInfo(name="relay-a", host=host, port=port)
    for rank in (0, 1):
        lease = lease_for(coordinator, None, program=RESTART_PROGRAM, args=["go"], rank=rank)
        coordinator.add_lease(msgspec.structs.replace(lease, relays=[info], homes=[0, 0]))
    await coordinator.wait_for(
        lambda: b"sent" in coordinator.output_of(7, 0) and b"half" in coordinator.output_of(7, 1)
    )

    first.cancel()  # the relay goes away with both ranks attached...
    with trio.fail_after(10):
        await first_ended.wait()
    settings = dataclasses.replace(settings, port=port)
    # ...and comes back on the same disk and port
    await nursery.start(run_relay, trio.CancelScope(), trio.Event())
    # Each rank sees only its own directory: the cue goes into both.
    for rank_dir in (agent_settings.work_path / "ranks").iterdir():
        (rank_dir / "work" / "go").touch()

    await coordinator.wait_for(lambda: len(coordinator.exits) == 2, seconds=30)
    errors = [coordinator.output_of(7, r, "stderr").decode() for r in (0, 1)]
    assert [(e.code, e.lost) for e in coordinator.exits] == [(0, False), (0, False)], errors
    assert lines(coordinator.output_of(7, 0)) == [{"answer": "ok", "acked": 40}]
    assert coordinator.problems == []
    assert "reconnected to relay relay-a" in caplog.text


async def test_determinants_are_logged_and_replayed_to_the_next_incarnation(
    agent: RunningAgent, coordinator: FakeCoordinator, real_relay: api.RelayInfo
) -> None:
    lease = lease_for(coordinator, None, program=FT_PROGRAM, args=["det"])
    first = msgspec.structs.replace(lease, relays=[real_relay], homes=[0, 0])
    coordinator.add_lease(first)
    await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    second = msgspec.structs.replace(
        first, incarnation=2, token=coordinator.rank_token(7, 0, 2, incarnation=2)
    )
    coordinator.add_lease(second)
    await coordinator.wait_for(lambda: len(coordinator.exits) == 2)
    assert [(e.incarnation, e.code) for e in coordinator.exits] == [(1, 0), (2, 0)]
    out1, out2 = (lines(coordinator.output_of(7, 0, incarnation=i)) for i in (1, 2))
    assert out1[:3] == [
        {"welcome": [1, 0], "replay_sent": {}},
        {"got": ["DetAck", 7, 0, 1]},
        {"got": ["Ack", 7, 0, 1, 1]},
    ]
    # The second incarnation is told of the logged determinant and gets it first; its own
    # next one is index 1, and its re-sent message (same bytes) is acknowledged again; the
    # relay's log holds its predecessor's message to rank 1 (replay_sent).
    assert out2[:4] == [
        {"welcome": [2, 1], "replay_sent": {"1": 1}},
        {"got": ["Det", 7, 0, 0, "live"]},
        {"got": ["DetAck", 7, 0, 2]},
        {"got": ["Ack", 7, 0, 1, 1]},
    ]
    assert coordinator.problems == []
