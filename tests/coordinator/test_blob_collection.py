"""Uploads nobody uses are not kept for ever (issue 20): a blob no job (bundle, stdin) and no
result names is deleted once it is ``blob_keep`` seconds old; uploading it again keeps it
anew, and blobs in use stay."""

from __future__ import annotations

from pathlib import Path

import pytest
from coord_helpers import FakeClock, open_pool

from vpool.coordinator.access import Principal
from vpool.coordinator.errors import BadRequest
from vpool.protocol import api

KEEP = 3600.0
ALICE = Principal("alice", "user", 0)


async def test_unused_uploads_go_after_blob_keep(tmp_path: Path) -> None:
    clock = FakeClock()
    async with open_pool(tmp_path, clock, blob_keep=KEEP) as pool:
        core = pool.core
        orphan = await pool.upload(b"never submitted")
        again = await pool.upload(b"uploaded twice")
        job = await pool.submit(1, stdin=b"42\n")  # its bundle and stdin are in use
        row = core.store.job_row(job.id)
        assert row is not None
        used = [row["bundle"], row["stdin"]]
        assert await core.collect_blobs() == 0  # nothing old enough yet
        clock.advance(KEEP * 0.9)
        await pool.upload(b"uploaded twice")  # new again
        clock.advance(KEEP * 0.2)
        assert await core.collect_blobs() == 1
        assert not await core.has_blob(ALICE, orphan) and not core.blobs.path(orphan).exists()
        assert all([await core.has_blob(ALICE, s) for s in [*used, again]])
        r = await pool.client.head(f"/api/v1/blobs/{orphan}", headers=pool.user())
        assert r.status_code == 404
        # A submission that checked the blob before it went is refused in its transaction.
        with pytest.raises(BadRequest, match="was not uploaded"):
            core.store.create_job("alice", api.JobSubmit(1, orphan, "app.py"), clock())
        clock.advance(KEEP)
        late = await pool.upload(b"uploaded just now")
        assert await core.collect_blobs() == 1  # the re-uploaded one, unused in the end
        assert await core.has_blob(ALICE, late)
        clock.advance(KEEP + 1)
        assert await core.collect_blobs() == 1 and not await core.has_blob(ALICE, late)
        assert all([await core.has_blob(ALICE, s) for s in used])
