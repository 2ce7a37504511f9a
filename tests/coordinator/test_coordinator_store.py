"""The SQLite store's migrations and the pure scheduling rules."""

from __future__ import annotations

from pathlib import Path

import sqlite_utils
from coord_helpers import SANDBOX, FakeClock, test_settings

from vpool.coordinator import migrations, scheduler
from vpool.coordinator.access import Principal
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
    assert again.principal_by_token_hash("h" * 64, 2.0) == Principal("alice", "user", 1)
    again.close()

    db = sqlite_utils.Database(path)
    assert migrations.current_version(db) == len(migrations.MIGRATIONS)
    tables = set(db.table_names())
    assert {
        "accounts",
        "tokens",
        "sessions",
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
    who = await core.db.call(core.store.principal_by_token_hash, "x" * 64, 2.0)
    assert who is not None and who.name == "alice"
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


def _store_with_running_job(tmp_path: Path) -> tuple[SqliteStore, str]:
    """A store with job 1 (2 ranks) running on one agent, through the store's own calls."""
    store = SqliteStore(tmp_path / "vpool.db", restarts=scheduler.RestartPolicy(max_restarts=5))
    store.register_relay(api.RelayRegister(name="relay-0", host="127.0.0.1", port=1), 100.0)
    agent = store.enroll_agent("key-1", "agent-1", 4, "", 100.0, open_enrollment=True)
    hb = api.AgentHeartbeat(ranks=[], free_slots=4, isolation=SANDBOX)
    store.agent_heartbeat(agent, hb, 100.0, 10.0)
    sub = api.JobSubmit(ranks=2, bundle="b" * 64, entry="app.py")
    store.add_blob("b" * 64, 100, 100.0)
    store.create_job("alice", sub, 100.0)
    done = store.schedule(100.0, 90.0, 90.0, lambda claims: f"token-{claims.incarnation}")
    assert done.started == [1]
    assert len(store.take_leases(agent, 100.0)) == 2
    return store, agent


def test_store_dedups_output_by_end_offset_and_incarnation(tmp_path: Path) -> None:
    store, agent = _store_with_running_job(tmp_path)

    def chunk(incarnation: int, offset: int, data: bytes) -> api.OutputChunk:
        return api.OutputChunk(
            job=1, rank=0, incarnation=incarnation, stream="stdout", offset=offset, data=data
        )

    assert store.add_output(agent, [chunk(1, 0, b"abc"), chunk(1, 3, b"def")]).changed == {1}
    assert store.add_output(agent, [chunk(1, 0, b"abcdef")]).changed == set()
    ex = api.RankExit(job=1, rank=0, incarnation=1, code=-9, lost=True)
    assert store.rank_exit(agent, ex, 101.0)
    store.schedule(101.0, 90.0, 90.0, lambda claims: "t")
    assert store.take_leases(agent, 101.0)[0].incarnation == 2
    late = store.add_output(agent, [chunk(1, 6, b"late")])  # a replaced incarnation's
    assert late.changed == set()
    assert store.add_output(agent, [chunk(2, 0, b"abcdefgh")]).changed == {1}
    rows = list(store.db.query("SELECT offset, data FROM output ORDER BY id"))
    assert [(r["offset"], r["data"]) for r in rows] == [(0, b"abc"), (3, b"def"), (6, b"gh")]
    assert store.output_streams(1) == {(0, "stdout"): b"abcdefgh"}
    store.close()


def test_store_startup_counts_everyone_as_seen(tmp_path: Path) -> None:
    store, _agent = _store_with_running_job(tmp_path)
    store.startup(500.0)
    assert store.count_live(490.0, 490.0) == (1, 1)
    assert not store.expire_agents(490.0, 500.0)
    assert not store.expire_relays(490.0, 200.0, 500.0)
    assert store.job_info(1).state == "running"  # type: ignore[union-attr]
    store.startup(400.0)  # never moves last_seen back
    assert store.count_live(495.0, 495.0) == (1, 1)
    store.close()
