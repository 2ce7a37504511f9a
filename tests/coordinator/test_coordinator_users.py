"""``vpool-coordinator user ...``: users, their roles and tokens, as an operator makes them."""

from __future__ import annotations

from pathlib import Path

import tomli_w
from click.testing import CliRunner, Result

from vpool.coordinator import keys
from vpool.coordinator.cli import main
from vpool.coordinator.sqlite_store import SqliteStore


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "pool.toml"
    path.write_text(tomli_w.dumps({"state_dir": str(tmp_path / "state")}))
    return path


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def test_users_roles_and_tokens(tmp_path: Path) -> None:
    config = str(_config(tmp_path))
    alice = run("user", "add", "alice", "--config", config)
    assert alice.exit_code == 0, alice.output
    alice_token = alice.output.strip()
    ops = run("user", "add", "ops", "--operator", "--config", config)
    assert ops.exit_code == 0
    again = run("user", "add", "alice", "--config", config)
    assert again.exit_code == 1 and "already exists" in again.output
    bad = run("user", "add", "../x", "--config", config)
    assert bad.exit_code == 1 and "is not a user name" in bad.output

    second = run("user", "token", "alice", "--label", "laptop", "--config", config)
    assert second.exit_code == 0
    second_token = second.output.strip()
    missing = run("user", "token", "nobody", "--config", config)
    assert missing.exit_code == 1 and "no user 'nobody'" in missing.output

    promoted = run("user", "role", "alice", "operator", "--config", config)
    assert promoted.output.strip() == "alice is now an operator"
    listed = run("user", "list", "--config", config).output
    assert listed.splitlines() == ["alice\toperator\t2 token(s)", "ops\toperator\t1 token(s)"]

    store = SqliteStore(tmp_path / "state" / "vpool.db")
    try:
        for token in (alice_token, second_token):
            who = store.principal_by_token_hash(keys.hash_token(token), 1.0)
            assert who is not None and (who.name, who.role) == ("alice", "operator")
        labels = [t.label for t in store.list_tokens("alice")]
        assert labels == ["first token", "laptop"]
    finally:
        store.close()


def test_user_add_waits_for_a_busy_coordinator(tmp_path: Path) -> None:
    """``user add`` while the coordinator is in a write transaction waits for it instead of
    failing with "database is locked" (and the coordinator's next call is not a 500)."""
    import threading

    db = tmp_path / "state" / "vpool.db"
    db.parent.mkdir()
    coordinator = SqliteStore(db)
    coordinator.db.execute("BEGIN IMMEDIATE")  # a write transaction in progress
    release = threading.Timer(0.3, lambda: coordinator.db.execute("COMMIT"))
    release.start()
    try:
        added = run("user", "add", "carol", "--config", str(_config(tmp_path)))
    finally:
        release.join()
    assert added.exit_code == 0, added.output
    assert [u["name"] for u in coordinator.list_users()] == ["carol"]
    coordinator.close()
