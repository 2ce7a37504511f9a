"""The restore path of a new incarnation, short of a real CRIU restore: which images are
tried and why not, fetching and unpacking from a store, the relay counters set before
attaching, the fallback to a start from the beginning, and the reports."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

from vpool.protocol import api
from vpool.protocol.ckptdigest import image_digest
from vpool.protocol.messages import CkptPut
from vpool.tls import client_context
from vpool.worker_agent import ckpt_image, restore
from vpool.worker_agent.checkpoints import Capability
from vpool.worker_agent.local_ranks import LocalRank, LocalRanks
from vpool.worker_agent.ranks import RankServices
from vpool.worker_agent.settings import AgentSettings

from .conftest import ENV_PROGRAM, FakeCoordinator, Pki, RunningAgent, lease_for
from .test_checkpoints import FakeStore, store  # noqa: F401 - the store fixture

KEY = os.urandom(32)
KEY_TEXT = __import__("base64").urlsafe_b64encode(KEY).decode().rstrip("=")


def _ref(ckpt: int, **kw: Any) -> api.CheckpointRef:
    base: dict[str, Any] = {
        "ckpt": ckpt,
        "incarnation": 1,
        "relay": 0,
        "size": 10,
        "digest": "00" * 32,
        "fingerprint": "fp",
        "received": {0: 4},
        "dets": 2,
        "meta": b"",
    }
    base.update(kw)
    return api.CheckpointRef(**base)


def test_manifest_paths_must_stay_under_rank_root(tmp_path: Path) -> None:
    root = tmp_path / "ranks"
    rank_dir = root / "uid-0-1-abcd"

    def meta(**kw: str) -> bytes:
        m = {
            "rank_dir": str(rank_dir),
            "work": str(rank_dir / "work"),
            "home": str(rank_dir / "home"),
        }
        m.update(kw)
        return msgspec.msgpack.encode(m)

    _, got, work, home = restore.manifest_paths(meta(), root)
    assert (got, work, home) == (rank_dir, rank_dir / "work", rank_dir / "home")
    for bad in (
        meta(rank_dir="/etc"),
        meta(rank_dir=str(root / ".." / "x")),
        meta(rank_dir=str(root / "a" / "b")),
        meta(work="/tmp/elsewhere"),
        b"\xc1",
        msgspec.msgpack.encode([1, 2]),
    ):
        with pytest.raises(restore.RestoreError):
            restore.manifest_paths(bad, root)


def test_snapshot_survives_an_image(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.txt").write_text("changed later")
    st = (tmp_path / "a.txt").stat()
    before = {"a.txt": (st.st_size, st.st_mtime_ns), "b.txt": (3, 5)}
    restore.save_snapshot(tmp_path / "snap.json", before)
    # The image kept mtimes to the microsecond only.
    os.utime(tmp_path / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns // 1000 * 1000 + 1))
    loaded = restore._load_snapshot(tmp_path / "snap.json", tmp_path)
    assert loaded["a.txt"] == (st.st_size, (tmp_path / "a.txt").stat().st_mtime_ns)
    assert loaded["b.txt"] == (3, 5)


def _services(settings: AgentSettings, cap: Capability, pki: Pki | None = None) -> RankServices:
    class Client:
        token = "agent"

    return RankServices(
        settings=settings,
        client=Client(),  # type: ignore[arg-type]
        links=None,  # type: ignore[arg-type]
        blobs=None,  # type: ignore[arg-type]
        ranks=LocalRanks(),
        socket_path=Path(settings.work_dir) / "agent.sock",
        report_problem=None,  # type: ignore[arg-type]
        capability=cap,
        ssl_context=client_context(pki.ca) if pki else None,
    )


def _lease(relays: list[api.RelayInfo], refs: list[api.CheckpointRef]) -> api.Lease:
    return api.Lease(
        job=4,
        rank=0,
        incarnation=3,
        size=1,
        token="rank-token",
        bundle="",
        entry="app.py",
        args=[],
        stdin=None,
        relays=relays,
        homes=[0] if relays else [],
        job_uid="uid",
        ckpt_key=KEY_TEXT,
        restore=refs,
        from_start=True,
    )


async def test_images_that_cannot_be_used_here_are_skipped(tmp_path: Path) -> None:
    settings = AgentSettings(work_dir=str(tmp_path), rank_root=str(tmp_path / "ranks"))
    info = api.RelayInfo(name="r", host="127.0.0.1", port=1)
    refs = [_ref(5, fingerprint="other"), _ref(9, relay=3)]
    rank = LocalRank(_lease([info], refs))

    async def attach(svc: RankServices, rank: LocalRank) -> None:
        raise AssertionError("nothing to attach")

    cap = Capability(criu="4.1.1", fingerprint="fp")
    cap.ready.set()
    got, tried = await restore.restore_rank(_services(settings, cap), rank, attach)
    assert got is None
    assert [t.ckpt for t in tried] == [9, 5]  # newest first
    assert "relay 3" in tried[0].reason and "another environment" in tried[1].reason
    no_criu = Capability()
    no_criu.ready.set()
    _, tried = await restore.restore_rank(_services(settings, no_criu), rank, attach)
    assert all("CRIU" in t.reason for t in tried)


@pytest.mark.large
async def test_fetch_unpack_then_a_failed_restore(
    store: tuple[FakeStore, api.RelayInfo],  # noqa: F811
    pool_pki: Pki,
    tmp_path: Path,
) -> None:
    """A good image is fetched and unpacked, the rank's counters are set for the attach, then
    CRIU fails (a CRIU that is not one): the attempt is reported, the rank reset. An image the
    coordinator knows by another digest (here the SHA-256 of images before BLAKE3) is not used."""
    fake, info = store
    root = tmp_path / "ranks"
    maker = tmp_path / "maker"
    (maker / "work").mkdir(parents=True)
    (maker / "home").mkdir()
    (maker / "work" / "state.txt").write_text("step 41")
    images = tmp_path / "images"
    images.mkdir()
    (images / "core.img").write_bytes(b"not really")
    rank_dir = root / "uid-0-1-abcd"
    writer = ckpt_image.ImageWriter(KEY, job=4, rank=0, ckpt=11)
    body = b"".join(writer.pack(images, maker))
    meta = msgspec.msgpack.encode(
        {
            "rank_dir": str(rank_dir),
            "work": str(rank_dir / "work"),
            "home": str(rank_dir / "home"),
            "out_offsets": {"stdout": 12, "stderr": 0},
        }
    )
    fake.images[11] = (CkptPut("t", 11, {0: 4}, 2, "fp", meta), body)
    # A stale directory where the image goes is replaced.
    (rank_dir / "work").mkdir(parents=True)
    (rank_dir / "work" / "stale.txt").write_text("old")
    ref = _ref(11, size=len(body), digest=image_digest(body).hex(), meta=meta, received={0: 4})
    settings = AgentSettings(
        work_dir=str(tmp_path / "w"),
        rank_root=str(root),
        criu="/bin/false",
        checkpoint_scratch=str(tmp_path / "scratch"),
    )
    (tmp_path / "w").mkdir()
    cap = Capability(criu="4.1.1", fingerprint="fp")
    cap.ready.set()
    fake.images[12] = (CkptPut("t", 12, {0: 4}, 2, "fp", meta), body)
    old = _ref(12, size=len(body), digest=hashlib.sha256(body).hexdigest(), meta=meta)
    refs = [old, ref, _ref(3, size=1, digest="ab" * 32, meta=meta)]
    rank = LocalRank(_lease([info], refs))
    seen: list[tuple[dict[int, int], int, int]] = []

    async def attach(svc: RankServices, rank: LocalRank) -> None:
        seen.append((dict(rank.delivery.received), rank.delivery.dets, rank.restored_from))
        restore_file = json.loads((rank_dir / restore.RESTORE_FILE).read_text())
        assert restore_file["checkpoint"] == 11 and restore_file["secret"] == rank.secret
        assert restore_file["incarnation"] == 3
        for name in ("stdout", "stderr"):
            assert os.path.exists(restore_file[name])  # noqa: ASYNC240
        # The image's rank directory is in place, the stale one gone.
        assert (rank_dir / "work" / "state.txt").read_text() == "step 41"
        assert not os.path.exists(rank_dir / "work" / "stale.txt")  # noqa: ASYNC240

    with trio.fail_after(60):
        got, tried = await restore.restore_rank(_services(settings, cap, pool_pki), rank, attach)
    assert got is None
    assert seen == [({0: 4}, 2, 11)]
    assert [t.ckpt for t in tried] == [12, 11, 3]
    assert "holds another image 12" in tried[0].reason
    assert "restore ended" in tried[1].reason
    assert "not_found" in tried[2].reason  # the store has no image 3
    # The rank is reset for a start from the beginning; nothing is left in the scratch.
    assert (rank.delivery.received, rank.delivery.dets, rank.restored_from) == ({}, 0, -1)
    assert not any((tmp_path / "scratch").iterdir())


# -- through the agent ------------------------------------------------------------------------


@dataclasses.dataclass
class CkptCoordinator(FakeCoordinator):
    restored: list[api.RestoreReport] = dataclasses.field(default_factory=list)

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/v1/agents/restored":
            self.restored.append(msgspec.json.decode(request.content, type=api.RestoreReport))
            return httpx.Response(200, content=b"{}")
        return await super()._handle(request)


@pytest.fixture
def coordinator() -> CkptCoordinator:
    return CkptCoordinator()


@pytest.fixture
def settings(settings: AgentSettings, tmp_path: Path) -> AgentSettings:
    return dataclasses.replace(
        settings, rank_root=str(tmp_path / "ranks"), criu=str(tmp_path / "no-criu")
    )


async def test_no_usable_image_starts_from_the_beginning(
    agent: RunningAgent, coordinator: CkptCoordinator, tmp_path: Path
) -> None:
    lease = lease_for(
        coordinator, None, program=ENV_PROGRAM, size=1, extra={"data/input.txt": "in"}
    )
    lease = api.Lease(
        **{
            **{f: getattr(lease, f) for f in lease.__struct_fields__},
            "incarnation": 2,
            "job_uid": "uid7",
            "ckpt_key": KEY_TEXT,
            "restore": [_ref(8)],
        }
    )
    coordinator.add_lease(lease)
    report = await coordinator.wait_for(lambda: coordinator.restored)
    [r] = report
    assert (r.job, r.rank, r.incarnation, r.ckpt) == (7, 0, 2, -1)
    assert [t.ckpt for t in r.tried] == [8] and "CRIU" in r.tried[0].reason
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert done.code == 0
    env = json.loads(coordinator.output_of(7, 0).splitlines()[0])
    # No CRIU: the rank gets no checkpoint variables; it started afresh in its sandbox.
    assert "VPOOL_CKPT_SIGNAL" not in env
    assert env["cwd"] == "/vpool/rank/work" and env["fresh"]
    # The heartbeats said so too.
    assert all(hb.criu == "" for hb in coordinator.heartbeats)


async def test_no_usable_image_and_no_start_is_a_problem(
    agent: RunningAgent, coordinator: CkptCoordinator
) -> None:
    lease = lease_for(coordinator, None, size=1)
    lease = api.Lease(
        **{
            **{f: getattr(lease, f) for f in lease.__struct_fields__},
            "incarnation": 2,
            "job_uid": "uid7",
            "ckpt_key": KEY_TEXT,
            "restore": [_ref(8)],
            "from_start": False,
        }
    )
    coordinator.add_lease(lease)
    [problem] = await coordinator.wait_for(lambda: coordinator.problems)
    assert "checkpoint 8" in problem.message and "no longer hold" in problem.message
    # The coordinator hears why each image was not used (restore_failed events), and no exit.
    [report] = coordinator.restored
    assert report.ckpt == -1 and [t.ckpt for t in report.tried] == [8], report
    assert report.message.startswith("not started"), report
    assert coordinator.exits == []
