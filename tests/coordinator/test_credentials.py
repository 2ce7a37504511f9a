"""Trust between parties on the coordinator: join tokens (closed enrollment), bans, and relay
keys that let a relay speak for itself and for the jobs it serves only (issue 20)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from coord_helpers import SANDBOX, Pool, open_pool, relay_headers
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from vpool.coordinator import cli, keys
from vpool.coordinator.settings import CoordinatorSettings
from vpool.coordinator.sqlite_store import SqliteStore
from vpool.protocol import api


def _code(r: object) -> tuple[int, str]:
    import httpx

    assert isinstance(r, httpx.Response)
    return r.status_code, (r.json()["error"]["code"] if r.status_code >= 400 else "")


def _join_token(pool: Pool, *, uses: int | None = None, expires: float | None = None) -> str:
    token, token_hash = keys.new_api_token(keys.JOIN_PREFIX)
    pool.core.store.create_join_token(token_hash, "test", pool.clock(), uses=uses, expires=expires)
    return token


def test_enrollment_is_closed_unless_the_operator_opens_it() -> None:
    assert CoordinatorSettings().open_enrollment is False


async def test_a_new_agent_needs_a_live_join_token(tmp_path: Path) -> None:
    async with open_pool(tmp_path, open_enrollment=False) as pool:
        once = _join_token(pool, uses=1)
        first, second = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
        assert _code(await pool.enroll_request(first)) == (403, "join_token_required")
        assert _code(await pool.enroll_request(first, join_token="vpj_nope")) == (
            403,
            "bad_join_token",
        )
        assert _code(await pool.enroll_request(first, join_token=once)) == (200, "")
        # Used up: a second machine cannot come in with it ...
        r = await pool.enroll_request(second, join_token=once)
        assert _code(r) == (403, "bad_join_token") and "used up" in r.text
        # ... but the first one enrolls again on its key alone (a restart, a lost token).
        assert _code(await pool.enroll_request(first)) == (200, "")
        [info] = pool.core.store.list_join_tokens(pool.clock())
        assert (info.used, info.uses_left, info.usable) == (1, 0, False)

        expiring = _join_token(pool, expires=pool.clock() + 60)
        pool.clock.advance(61)
        r = await pool.enroll_request(second, join_token=expiring)
        assert _code(r) == (403, "bad_join_token") and "expired" in r.text

        revoked = _join_token(pool)
        [*_, last] = pool.core.store.list_join_tokens(pool.clock())
        pool.core.store.revoke_join_token(last.id, pool.clock())
        r = await pool.enroll_request(second, join_token=revoked)
        assert _code(r) == (403, "bad_join_token") and "revoked" in r.text

        many = _join_token(pool)  # no limit
        assert _code(await pool.enroll_request(second, join_token=many)) == (200, "")
        rows = {r["name"]: r for r in pool.core.store.list_agents()}
        assert rows["agent-1"]["join_token"] is not None


async def test_a_banned_agent_loses_its_ranks_and_cannot_come_back(pool: Pool) -> None:
    await pool.register_relay("relay-0")
    job = await pool.submit(2)
    bad = await pool.enroll("bad", slots=2)
    leases = await pool.lease(bad)
    assert len(leases) == 2
    await pool.heartbeat(bad, leases)
    await pool.exit(bad, leases[1], code=0)  # rank 1 already ended there
    good = await pool.enroll("good", slots=2)
    store = pool.core.store
    store.db.execute("UPDATE agents SET agreed = 50, agreed_streak = 50")  # type: ignore[attr-defined]

    row = store.ban_agent("bad", "forged output", pool.clock())
    assert (row["lost"], row["affected"]) == (1, [job.id])
    # Its record of agreeing is gone: validation re-executes its ranks always from now on.
    streaks = store.db.query("SELECT name, agreed, agreed_streak FROM agents ORDER BY name")  # type: ignore[attr-defined]
    assert [tuple(r.values()) for r in streaks] == [("bad", 50, 0), ("good", 50, 50)]

    # Its credentials are dead: heartbeats are refused and its key cannot enroll again.
    hb = api.AgentHeartbeat(ranks=[], free_slots=2, isolation=SANDBOX)
    r = await pool.post("/api/v1/agents/heartbeat", hb, bad.headers)
    assert _code(r) == (401, "unknown_agent")
    r = await pool.enroll_request(bad.key, "bad")
    assert _code(r) == (403, "agent_banned") and "forged output" in r.text

    # Rank 0 moves to the good agent; the job says what the banned agent ran.
    await pool.core.schedule()
    [moved] = await pool.lease(good)
    assert (moved.rank, moved.incarnation) == (0, 2)
    detail = await pool.job(job.id)
    kinds = {e.kind: e.message for e in detail.events}
    assert "was banned (forged output)" in kinds["rank_lost"]
    assert kinds["agent_banned"] == (
        "agent bad was banned (forged output): what it ran of rank(s) 0, 1 is not trusted"
    )
    r = await pool.client.get("/api/v1/pool/agents", headers=pool.add_user("ops", "operator"))
    listed = msgspec.json.decode(r.content, type=list[api.AgentInfo])
    assert {a.name: a.state for a in listed} == {"bad": "banned", "good": "alive"}

    pool.core.store.unban_agent("bad")
    assert _code(await pool.enroll_request(bad.key, "bad")) == (200, "")


async def test_a_relay_speaks_for_itself_and_its_jobs_only(pool: Pool) -> None:
    await pool.register_relay("relay-0")
    job = await pool.submit(2)
    agent = await pool.enroll("agent-1", slots=2)
    leases = await pool.lease(agent)
    await pool.heartbeat(agent, leases)
    await pool.register_relay("relay-1", port=7001)  # a relay of the pool, not of this job

    lost = api.RelayLost(
        name="relay-1",
        lost=[api.RankLost(job=job.id, rank=0, incarnation=1, reason="forged")],
    )
    r = await pool.post("/api/v1/relays/lost", lost, relay_headers("relay-1"))
    assert _code(r) == (403, "not_your_job")
    posing = msgspec.structs.replace(lost, name="relay-0")
    r = await pool.post("/api/v1/relays/lost", posing, relay_headers("relay-1"))
    assert _code(r) == (403, "not_your_name")
    assert (await pool.job(job.id)).job.restarts == 0  # nothing was lost

    ghost = {"Authorization": "Bearer vpr_not-a-key-of-this-pool"}
    reg = api.RelayRegister(name="relay-0", host="127.0.0.1", port=7000)
    assert _code(await pool.post("/api/v1/relays/register", reg, ghost)) == (401, "bad_token")

    pool.core.store.revoke_relay_key("relay-1", pool.clock())
    r = await pool.post(
        "/api/v1/relays/heartbeat",
        api.RelayHeartbeat(name="relay-1", load=api.RelayLoad()),
        relay_headers("relay-1"),
    )
    assert _code(r) == (401, "bad_token")

    # The job's own relay is heard.
    real = msgspec.structs.replace(lost, name="relay-0")
    r = await pool.post("/api/v1/relays/lost", real, relay_headers("relay-0"))
    assert _code(r) == (200, "")
    assert (await pool.job(job.id)).job.restarts == 1


def _config(tmp_path: Path) -> Path:
    config = tmp_path / "pool.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\ninsecure_http = true\n')
    return config


def _run(*args: str) -> str:
    res = CliRunner().invoke(cli.main, list(args))
    assert res.exit_code == 0, res.output
    return res.stdout


def test_operator_cli_manages_join_tokens_relays_and_agents(tmp_path: Path) -> None:
    config = str(_config(tmp_path))
    token = _run("join-token", "create", "--uses", "2", "--expires", "7d", "--label", "lab",
                 "--config", config).strip()  # fmt: skip
    assert token.startswith(keys.JOIN_PREFIX)
    listed = _run("join-token", "list", "--config", config)
    assert "\n1\tusable\t2\t0\t" in listed and listed.rstrip().endswith("lab")
    key = _run("relay", "add", "relay-eu", "--config", config).strip()
    assert key.startswith(keys.RELAY_PREFIX)
    again = CliRunner().invoke(cli.main, ["relay", "add", "relay-eu", "--config", config])
    assert again.exit_code == 1 and "--rotate" in again.output
    rotated = _run("relay", "add", "relay-eu", "--rotate", "--config", config).strip()
    assert "relay-eu\tlive\tnever registered" in _run("relay", "list", "--config", config)

    store = SqliteStore(tmp_path / "state" / "vpool.db")
    try:
        assert store.relay_by_key_hash(keys.hash_token(key)) is None  # rotated away
        assert store.relay_by_key_hash(keys.hash_token(rotated)) == "relay-eu"
        agent = store.enroll_agent("pk", "desk", 2, "", 1.0, join_token_hash=keys.hash_token(token))
    finally:
        store.close()

    listed = _run("agent", "list", "--config", config)
    assert "\tagreed\tin a row\twrong\n" in listed
    assert f"{agent}\tdesk\talive\tavailable\t2\t0\t" in listed and listed.endswith(
        "\t1\t0\t0\t0\n"
    )
    out = _run("agent", "ban", "desk", "--reason", "cheated", "--config", config)
    assert out.startswith(f"agent {agent} (desk) banned; 0 rank(s) moved")
    assert "banned (cheated)" in _run("agent", "list", "--config", config)
    _run("join-token", "revoke", "1", "--config", config)
    assert "\n1\trevoked\t1\t1\t" in _run("join-token", "list", "--config", config)
    _run("relay", "revoke", "relay-eu", "--config", config)
    assert "relay-eu\trevoked" in _run("relay", "list", "--config", config)
    unknown = CliRunner().invoke(cli.main, ["agent", "ban", "nobody", "--config", config])
    assert unknown.exit_code == 1 and "no agent 'nobody'" in unknown.output


@pytest.mark.parametrize("text", ["0", "-1", "7x", "", "d"])
def test_durations_are_checked(text: str) -> None:
    import click

    with pytest.raises(click.BadParameter):
        cli.parse_duration(text)
    assert cli.parse_duration("90") == 90 and cli.parse_duration("2w") == 14 * 86400
