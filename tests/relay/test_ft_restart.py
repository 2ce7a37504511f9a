"""A real ``vpool-relay`` killed with SIGKILL and restarted on its data dir keeps every message,
digest and determinant: agents re-attach with their counters and go on, and a restarted
incarnation replays from the start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from relay_fakes import DEADLINE, FakeAgent, Pool

from vpool.protocol.framing import PREFIX, encode_frame
from vpool.protocol.messages import Ack, Credit, Data
from vpool.relay.hub import DIGEST_INLINE_MAX

BIN = Path(sys.executable).parent


pytestmark = pytest.mark.large


class RelayProcess:
    """A ``vpool-relay`` process on one data dir, started again after a kill."""

    def __init__(self, pool: Pool, tmp_path: Path) -> None:
        self.data_dir = tmp_path / "relay"
        self.ready = tmp_path / "ready.json"
        self.env = {
            **os.environ,
            "VPOOL_RELAY_TLS_CERT": str(pool.cert),
            "VPOOL_RELAY_TLS_KEY": str(pool.cert_key),
            "VPOOL_RELAY_SIGNING_KEY": pool.public_key_text,
            "VPOOL_RELAY_LOST_GRACE": "30",
        }
        self.cmd = [
            str(BIN / "vpool-relay"),
            *("--host", "127.0.0.1", "--port", "0", "--name", "r-ft"),
            *("--data-dir", str(self.data_dir), "--ready-file", str(self.ready)),
        ]
        self.proc: trio.Process | None = None

    async def start(self) -> tuple[str, int]:
        self.ready.unlink(missing_ok=True)
        proc = self.proc = await trio.lowlevel.open_process(
            self.cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        with trio.fail_after(DEADLINE):
            while not self.ready.exists():
                if proc.poll() is not None:
                    out = await proc.stdout.receive_some(1 << 20) if proc.stdout else b""
                    raise AssertionError(f"relay exited: {out.decode(errors='replace')}")
                await trio.sleep(0.02)
        info = json.loads(self.ready.read_text())
        assert info["pid"] == proc.pid
        return info["host"], info["port"]

    async def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        with trio.fail_after(DEADLINE):
            await self.proc.wait()
        assert self.proc.returncode == -signal.SIGKILL

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(DEADLINE):
            await proc.wait()
        output = await proc.stdout.receive_some(1 << 20) if proc.stdout else b""
        assert proc.returncode == 0, output.decode(errors="replace")


async def drain(agent: FakeAgent, ack: tuple[int, int, int, int], ndata: int = 0) -> list[bytes]:
    """Read until ``ack`` (job, src, dst, seq) came and ``ndata`` pushes (credited)."""
    got: list[bytes] = []
    acked = False
    while not acked or len(got) < ndata:
        msg, data = await agent.recv()
        if isinstance(msg, Data):
            await agent.send(Credit(job=msg.job, rank=msg.dst, nbytes=len(encode_frame(msg, data))))
            got.append(data)
        elif isinstance(msg, Ack):
            acked = acked or ((msg.job, msg.src, msg.dst) == ack[:3] and msg.seq >= ack[3])
        else:
            raise AssertionError(msg)
    return got


def payload(seq: int) -> bytes:
    size = DIGEST_INLINE_MAX + 5000 if seq == 7 else 50 + 13 * seq
    return (b"%d:" % seq) * (size // 3)


async def test_sigkilled_relay_keeps_messages_digests_and_determinants(
    pool: Pool, tmp_path: Path, agents: object
) -> None:
    relay = RelayProcess(pool, tmp_path)
    addr = await relay.start()
    try:
        # Job 7: rank 0 on agent a, rank 1 on agent b, both homed at this relay.
        a = await FakeAgent.connect(pool, addr, "agent-a")
        b = await FakeAgent.connect(pool, addr, "agent-b")
        await a.attach_home(pool, 7, 0, size=2)
        await b.attach_home(pool, 7, 1, size=2)
        for index in range(5):
            await a.det(7, 0, index, b"det-%d" % index)
            assert (await a.det_ack()).count == index + 1
        for seq in range(1, 21):
            await a.deposit(7, 0, 1, seq, payload(seq))
        for seq in range(1, 6):
            await b.deposit(7, 1, 0, seq, b"back-%d" % seq)
        back = await drain(a, (7, 0, 1, 20), 5)
        assert back == [b"back-%d" % s for s in range(1, 6)]
        got = await drain(b, (7, 1, 0, 5), 10)
        assert got[:10] == [payload(s) for s in range(1, 11)]

        await relay.kill()
        await a.aclose()
        await b.aclose()
        # A determinant record torn by the kill.
        dets = relay.data_dir / "jobs" / "7" / "0" / "dets.log"
        good = dets.stat().st_size
        with dets.open("ab") as f:
            f.write(PREFIX.pack(25, 0) + b"\x94\xa3det")

        addr = await relay.start()
        assert dets.stat().st_size == good
        # The agents reconnect and re-attach with their counters.
        a = await FakeAgent.connect(pool, addr, "agent-a")
        b = await FakeAgent.connect(pool, addr, "agent-b")
        att_a, replayed = await a.attach_home(pool, 7, 0, size=2, received={1: 5}, dets_from=5)
        assert (att_a.dets, att_a.stored, replayed) == (5, {1: 20}, [])
        att_b, replayed = await b.attach_home(pool, 7, 1, size=2, received={0: 10})
        assert (att_b.dets, att_b.stored, replayed) == (0, {0: 5}, [])
        assert [(await b.next_data())[1] for _ in range(10)] == [payload(s) for s in range(11, 21)]
        # Re-sent copies (the big one too) match the digests rebuilt from disk.
        await a.deposit(7, 0, 1, 7, payload(7))
        await a.deposit(7, 0, 1, 20, payload(20))
        await a.acks_until(7, 0, 1, 20)
        await a.deposit(7, 0, 1, 21, b"after the restart")
        msg, data = await b.next_data()
        assert (msg.seq, data) == (21, b"after the restart")
        await a.det(7, 0, 5, b"det-5")
        assert (await a.det_ack()).count == 6

        # Rank 0 is restarted (incarnation 2, on agent c): every determinant, then every
        # message from the start; its re-sent messages are checked against the log.
        c = await FakeAgent.connect(pool, addr, "agent-c")
        att_c, replayed = await c.attach_home(pool, 7, 0, size=2, incarnation=2)
        assert att_c.dets == 6
        assert [d.data for d in replayed] == [b"det-%d" % i for i in range(6)]
        assert [(await c.next_data())[1] for _ in range(5)] == [b"back-%d" % s for s in range(1, 6)]
        for seq in range(1, 8):
            await c.deposit(7, 0, 1, seq, payload(seq))
        assert await drain(c, (7, 0, 1, 7)) == []
        await c.deposit(7, 0, 1, 8, b"not what it sent before")
        err = await c.expect_rank_error("not_deterministic")
        assert "rank 0 re-sent message 8 to rank 1" in err.message
        # The rest of the job goes on.
        await b.deposit(7, 1, 0, 6, b"back-6")
        msg, data = await c.next_data()
        assert (msg.seq, data) == (6, b"back-6")
    finally:
        await relay.stop()
