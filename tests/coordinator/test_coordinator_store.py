"""The SQLite store's migrations and the pure scheduling rules."""

from __future__ import annotations

from pathlib import Path

import sqlite_utils
from coord_helpers import FakeClock, test_settings

from vpool.coordinator import migrations, scheduler
from vpool.coordinator.service import Coordinator
from vpool.coordinator.sqlite_store import SqliteStore
from vpool.protocol import api


def test_migrations_from_empty_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "vpool.db"
    store = SqliteStore(path)
    assert store.schema_version == len(migrations.MIGRATIONS)
    store.add_user("alice", "h" * 64, 1.0)
    store.close()

    again = SqliteStore(path)  # re-open: nothing re-applied, data kept
    assert again.schema_version == len(migrations.MIGRATIONS)
    assert again.user_by_token_hash("h" * 64) == "alice"
    again.close()

    db = sqlite_utils.Database(path)
    assert migrations.current_version(db) == len(migrations.MIGRATIONS)
    tables = set(db.table_names())
    assert {
        "users",
        "jobs",
        "ranks",
        "incarnations",
        "agents",
        "relays",
        "blobs",
        "events",
        "output",
        "results",
        "schema_version",
    } <= tables
    db.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "vpool.db"
    SqliteStore(path).close()
    db = sqlite_utils.Database(path)
    db.execute("UPDATE schema_version SET version = 999")
    db.close()
    try:
        SqliteStore(path)
    except RuntimeError as exc:
        assert "newer" in str(exc)
    else:
        raise AssertionError("opened a db from the future")


async def test_state_survives_restart(tmp_path: Path) -> None:
    settings = test_settings(tmp_path)
    core = Coordinator(settings, clock=FakeClock())
    key = core.signing_key
    await core.db.call(core.store.add_user, "alice", "x" * 64, 1.0)
    core.close()
    core = Coordinator(settings, clock=FakeClock())
    assert core.signing_key == key  # same signing key: issued tokens stay valid
    assert await core.db.call(core.store.user_by_token_hash, "x" * 64) == "alice"
    core.close()
    assert (settings.state_path() / "signing.key").stat().st_mode & 0o777 == 0o600


def test_plan_gang() -> None:
    assert scheduler.plan_gang(3, [("a", 1), ("b", 1)]) is None
    assert scheduler.plan_gang(3, [("a", 2), ("b", 1)]) == ["a", "b", "a"]
    assert scheduler.plan_gang(4, [("a", 1), ("b", 3), ("c", 0)]) == ["b", "a", "b", "b"]
    assert scheduler.plan_gang(0, []) == []


def test_pick_relays_and_homes() -> None:
    assert scheduler.pick_relays([], 2, 1) == []
    assert scheduler.pick_relays(["r1", "r0", "r2"], 2, 0) == ["r0", "r1"]
    assert scheduler.pick_relays(["r1", "r0", "r2"], 5, 1) == ["r1", "r2", "r0"]
    assert scheduler.homes(5, 2) == [0, 1, 0, 1, 0]


def test_free_slots() -> None:
    assert scheduler.free_slots(4, 4, 0) == 4
    assert scheduler.free_slots(4, 4, 2) == 2  # placed but not yet seen by the agent
    assert scheduler.free_slots(4, 1, 0) == 1  # a killed rank still running there
    assert scheduler.free_slots(4, 0, 5) == 0


def test_output_overlap_is_reassembled(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "vpool.db")
    store.db.execute(
        "INSERT INTO output (job, rank, stream, offset, data) VALUES "
        "(1, 0, 'stdout', 0, ?), (1, 0, 'stdout', 3, ?), (1, 0, 'stdout', 6, ?)",
        [b"abcd", b"defg", b"ghi"],
    )
    assert store.output_streams(1) == {(0, "stdout"): b"abcdefghi"}
    records, more = store.output_page(1, 0, None, 2)
    assert more and [r.data for r in records] == [b"abcd", b"defg"]
    assert isinstance(records[0], api.OutputRecord)
    store.close()
