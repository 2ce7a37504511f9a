"""Trimming a rank's log behind its checkpoint images: disk and memory stay bounded while
messages flow, the trim point survives a SIGKILL of the relay, and an Attach asking for what
was dropped gets ``trimmed``. The relays here have no coordinator, so a commit counts as
accepted at once (``ckptstore``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from relay_fakes import DEADLINE, FakeAgent, Pool, start_relay
from store_fakes import MAC_KEY, put, store_conn, until

from vpool.protocol.messages import Attach, CkptChunk, CkptPut, CkptStored

BIN = Path(sys.executable).parent
KiB = 1024


pytestmark = pytest.mark.large


def log_bytes(rank_dir: Path) -> int:
    return sum(p.stat().st_size for p in rank_dir.iterdir() if p.suffix in (".seg", ".log"))


async def test_trimming_keeps_the_log_bounded(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    settings = pool.settings(tmp_path / "relay", segment_size=32 * KiB, checkpoint_keep=2)
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    b = await FakeAgent.connect(pool, relay.addr, "agent-b")
    store = await store_conn(pool, relay.addr, "agent-b")
    await a.attach(pool, 9, 0, size=2)
    await b.attach_home(pool, 9, 1, size=2)
    rank_dir = tmp_path / "relay" / "jobs" / "9" / "1"
    seq = dets = 0
    biggest = 0
    for ckpt in range(1, 41):
        await b.det(9, 1, dets, b"det-%d" % dets)
        dets += 1
        assert (await b.det_ack()).count == dets
        for _ in range(20):
            seq += 1
            await a.deposit(9, 0, 1, seq, b"%06d" % seq * 340)
        for s in range(seq - 19, seq + 1):
            msg, _ = await b.next_data()
            assert msg.seq == s
        await a.acks_until(9, 0, 1, seq)
        stored = await put(
            store, pool, 9, 1, ckpt, b"image %d" % ckpt, received={0: seq}, dets=dets
        )
        assert stored == CkptStored(ckpt=ckpt, retained=[ckpt, ckpt - 1][: min(ckpt, 2)])
        biggest = max(biggest, log_bytes(rank_dir))
    # 40 rounds wrote 40 * 20 * ~2 KiB; the log keeps the last two images' worth, in
    # segments of 32 KiB.
    assert seq * 2 * KiB > 1500 * KiB
    assert biggest < 200 * KiB, biggest
    box = relay.hub.boxes[(9, 1)]
    assert box.trim.received == {0: seq - 20} and box.trim.dets == dets - 1
    assert len(box.mailbox) == 20 and len(box.dets) == dets and box.dets.first == dets - 1
    assert relay.hub.messages_stored == 20
    # A restarted incarnation asking for trimmed messages or determinants is refused; the
    # connection stays up and serves one that starts at the trim point.
    c = await FakeAgent.connect(pool, relay.addr, "agent-c")
    token: dict[str, Any] = {"size": 2, "home": True, "incarnation": 2}
    await c.send(_attach(pool, c, 9, 1, received={0: seq - 21}, dets_from=dets - 1, **token))
    err = await c.expect_rank_error("trimmed")
    assert f"no longer holds messages <= {seq - 20} from rank 0" in err.message
    await c.send(_attach(pool, c, 9, 1, received={0: seq - 20}, dets_from=0, **token))
    err = await c.expect_rank_error("trimmed")
    assert "determinants below" in err.message
    att, replayed = await c.attach_home(
        pool, 9, 1, size=2, incarnation=2, received={0: seq - 20}, dets_from=dets - 1
    )
    assert att.dets == dets and [d.index for d in replayed] == [dets - 1]
    got = [(await c.next_data())[0].seq for _ in range(20)]
    assert got == list(range(seq - 19, seq + 1))


def _attach(pool: Pool, agent: FakeAgent, job: int, rank: int, **kw: Any) -> Any:
    token = pool.rank_token(
        job, rank, agent=agent.agent, size=kw.pop("size"), incarnation=kw.pop("incarnation")
    )
    return Attach(token=token, **kw)


class RelayProcess:
    """A standalone ``vpool-relay`` process on one data dir, started again after a kill."""

    def __init__(self, pool: Pool, tmp_path: Path) -> None:
        self.data_dir = tmp_path / "relay"
        self.ready = tmp_path / "ready.json"
        self.env = {
            **os.environ,
            "VPOOL_RELAY_TLS_CERT": str(pool.cert),
            "VPOOL_RELAY_TLS_KEY": str(pool.cert_key),
            "VPOOL_RELAY_SIGNING_KEY": pool.public_key_text,
            "VPOOL_RELAY_LOST_GRACE": "30",
            "VPOOL_RELAY_SEGMENT_SIZE": str(16 * KiB),
        }
        self.cmd = [
            str(BIN / "vpool-relay"),
            *("--host", "127.0.0.1", "--port", "0", "--name", "r-trim"),
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
        return info["host"], info["port"]

    async def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        with trio.fail_after(DEADLINE):
            await self.proc.wait()

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(DEADLINE):
            await proc.wait()
        output = await proc.stdout.receive_some(1 << 20) if proc.stdout else b""
        assert proc.returncode == 0, output.decode(errors="replace")


async def test_trim_point_and_uploads_survive_sigkill(
    pool: Pool, tmp_path: Path, agents: object
) -> None:
    relay = RelayProcess(pool, tmp_path)
    addr = await relay.start()
    rank_dir = relay.data_dir / "jobs" / "5" / "1"
    try:
        a = await FakeAgent.connect(pool, addr, "agent-a")
        b = await FakeAgent.connect(pool, addr, "agent-b")
        await a.attach(pool, 5, 0, size=2)
        await b.attach_home(pool, 5, 1, size=2)
        for index in range(5):
            await b.det(5, 1, index, b"det-%d" % index)
            assert (await b.det_ack()).count == index + 1
        for seq in range(1, 31):
            await a.deposit(5, 0, 1, seq, b"%04d" % seq * 1000)
        await a.acks_until(5, 0, 1, 30)
        for seq in range(1, 31):
            assert (await b.next_data())[0].seq == seq
        store = await store_conn(pool, addr, "agent-b")
        stored = await put(store, pool, 5, 1, 1, b"image-1", received={0: 20}, dets=3)
        assert stored == CkptStored(ckpt=1, retained=[1])
        assert json.loads((rank_dir / "trim.json").read_text()) == {
            "received": {"0": 20},
            "dets": 3,
        }
        # A second image is being uploaded when the relay is killed.
        token = pool.rank_token(5, 1, agent="agent-b", size=2)
        await store.send(
            CkptPut(
                token=token, ckpt=2, received={0: 30}, dets=5, fingerprint="fp", mac_key=MAC_KEY
            )
        )
        await store.send(CkptChunk(ckpt=2), b"p" * 100_000)
        ckpt = rank_dir / "ckpt"
        await until(lambda: any(p.suffix == ".part" for p in ckpt.iterdir()))
        await relay.kill()
        for agent in (a, b, store):
            await agent.aclose()

        addr = await relay.start()
        assert sorted(p.name for p in ckpt.iterdir()) == ["1.img", "1.json"]
        # Segments of trimmed frames only are gone; the kept tail is rebuilt after the trim
        # point, and the channel goes on from it.
        a = await FakeAgent.connect(pool, addr, "agent-a")
        att = await a.attach(pool, 5, 0, size=2)
        assert att.stored == {1: 30}
        c = await FakeAgent.connect(pool, addr, "agent-c")
        await c.send(
            _attach(pool, c, 5, 1, size=2, incarnation=2, home=True, received={0: 19}, dets_from=3)
        )
        err = await c.expect_rank_error("trimmed")
        assert "no longer holds messages <= 20" in err.message
        att, replayed = await c.attach_home(
            pool, 5, 1, size=2, incarnation=2, received={0: 20}, dets_from=3
        )
        assert att.dets == 5 and [d.data for d in replayed] == [b"det-3", b"det-4"]
        assert [(await c.next_data())[0].seq for _ in range(10)] == list(range(21, 31))
        await a.deposit(5, 0, 1, 12, b"%04d" % 12 * 1000)  # trimmed: a duplicate, acked
        await a.deposit(5, 0, 1, 31, b"after the restart")
        await a.acks_until(5, 0, 1, 31)
        msg, data = await c.next_data()
        assert (msg.seq, data) == (31, b"after the restart")
        store = await store_conn(pool, addr, "agent-c")
        stored = await put(
            store, pool, 5, 1, 2, b"image-2", received={0: 31}, dets=5, incarnation=2
        )
        assert stored == CkptStored(ckpt=2, retained=[2, 1])
    finally:
        await relay.stop()
