"""Trust between parties on a real local pool (issue 20): a stranger's agent cannot enroll
without a join token, a relay cannot report on a job it does not serve, and a banned agent's
ranks move to other agents while the job still finishes."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.integration.conftest import alive
from vpool import tls
from vpool.protocol import api
from vpool.protocol.tokens import sign_possession

if TYPE_CHECKING:
    from conftest import Pool

PROGRAMS = Path(__file__).parent / "programs"
BIN = Path(sys.executable).parent


def _dir(pool: Pool) -> Path:
    return pool.home / "state" / "local-pool"


def _config(pool: Pool, name: str) -> dict:
    return tomllib.loads((_dir(pool) / name / "config.toml").read_text())


def _client(pool: Pool) -> httpx.Client:
    info = json.loads((_dir(pool) / "pool.json").read_text())
    return httpx.Client(
        base_url=info["url"], verify=tls.client_context(Path(info["ca"])), timeout=10.0
    )


def _detail(pool: Pool, job: int) -> dict:
    return pool.detail(job)


def _wait(pool: Pool, job: int, cond, what: str, timeout: float = 120) -> dict:
    return pool.wait(job, cond, what, timeout)


def _submit(pool: Pool, ranks: int, seconds: str) -> int:
    program = str(PROGRAMS / "keeper.py")
    res = pool.vsdk("submit", program, "--ranks", str(ranks), "--json", "--", seconds)
    assert res.returncode == 0, res.stderr.decode()
    return int(json.loads(res.stdout)["id"])


def _running(d: dict) -> bool:
    return d["job"]["state"] == "running" and all(r["state"] == "running" for r in d["ranks"])


def test_a_stranger_agent_cannot_enroll_without_a_join_token(pool: Pool) -> None:
    key = Ed25519PrivateKey.generate()

    def enroll(token: str) -> httpx.Response:
        now = time.time()
        pub, sig = sign_possession(key, now)
        req = api.EnrollRequest(pub, now, sig, "stranger", 4096, join_token=token)
        with _client(pool) as c:
            return c.post("/api/v1/agents/enroll", json=msgspec.to_builtins(req))

    r = enroll("")
    assert r.status_code == 403 and r.json()["error"]["code"] == "join_token_required"
    # agent-0's token admitted agent-0 and no more.
    r = enroll(_config(pool, "agent-0")["join_token"])
    assert r.status_code == 403 and r.json()["error"]["code"] == "bad_join_token"
    assert "used up" in r.json()["error"]["message"]
    assert "stranger" not in pool.vsdk("status", timeout=30).stdout.decode()


def test_a_relay_cannot_report_on_a_job_it_does_not_serve(pool: Pool) -> None:
    job = _submit(pool, 1, "60")
    d = _wait(pool, job, _running, "the rank runs")
    home = d["ranks"][0]["relay"]
    other = next(n for n in ("relay-0", "relay-1") if n != home)
    forged = {
        "name": other,
        "lost": [{"job": job, "rank": 0, "incarnation": 1, "reason": "forged"}],
    }
    key = {"Authorization": f"Bearer {_config(pool, other)['relay_key']}"}
    with _client(pool) as c:
        r = c.post("/api/v1/relays/lost", json=forged, headers=key)
        assert r.status_code == 403 and r.json()["error"]["code"] == "not_your_job"
        r = c.post("/api/v1/relays/lost", json={**forged, "name": home}, headers=key)
        assert r.status_code == 403 and r.json()["error"]["code"] == "not_your_name"
        diverged = {"name": other, "job": job, "rank": 0, "incarnation": 1, "message": "forged"}
        r = c.post("/api/v1/relays/diverged", json=diverged, headers=key)
        assert r.status_code == 403 and r.json()["error"]["code"] == "not_your_job"
    d = _detail(pool, job)
    assert d["job"]["state"] == "running" and d["job"]["restarts"] == 0, d
    assert pool.vsdk("cancel", str(job), timeout=30).returncode == 0


def test_a_marker_sent_by_a_program_is_nowhere_on_the_relays(pool: Pool) -> None:
    marker = f"MARKER-{secrets.token_hex(12)}"
    program = str(PROGRAMS / "marker.py")
    res = pool.vsdk("submit", program, "--ranks", "4", "--json", "--", marker, "3")
    assert res.returncode == 0, res.stderr.decode()
    job = int(json.loads(res.stdout)["id"])
    relays = [_dir(pool) / name / "data" for name in ("relay-0", "relay-1")]

    def logged() -> int:
        return sum(
            f.stat().st_size for d in relays for f in d.glob(f"jobs/{job}/*/*.seg") if f.exists()
        )

    # Every rank received both messages (with the marker) into its home relay's log.
    deadline = time.monotonic() + 60
    while logged() < 4 * 2 * len(marker):
        assert time.monotonic() < deadline, f"messages not logged\n{pool.logs()}"
        time.sleep(0.05)
    found = [
        f for d in relays for f in d.rglob("*") if f.is_file() and marker.encode() in f.read_bytes()
    ]
    assert found == [], found
    d = _wait(pool, job, lambda d: d["job"]["state"] in ("succeeded", "failed"), "the job ends")
    assert d["job"]["state"] == "succeeded", d
    out = pool.vsdk("logs", str(job), timeout=60).stdout.decode()
    assert out.count(marker) == 8, out  # the marker reached every rank, twice


def test_a_flood_on_a_small_disk_fails_alone_and_the_relay_stays_up(
    pool_1relay: Pool, tmp_path: Path
) -> None:
    """relay-0's logs on a 96 MiB tmpfs, job_log_quota 16 MiB: a job sending 64 MiB nobody
    receives fails, naming the quota; a job beside it finishes with its output."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=96m,mode=0700", "tmpfs", str(disk)],
        capture_output=True,
        check=False,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mount.stderr.decode().strip()}")
    pool = pool_1relay
    try:
        relay = _dir(pool) / "relay-0"
        os.kill(pool.pid_of("relay-0"), signal.SIGTERM)
        _wait_gone(pool.pid_of("relay-0"))
        config = relay / "config.toml"
        text = "".join(
            line + "\n"
            for line in config.read_text().splitlines()
            if not line.startswith("data_dir")
        )
        config.write_text(
            text + f'data_dir = "{disk}"\njob_log_quota = {16 << 20}\ndisk_reserve = {4 << 20}\n'
        )
        res = pool.vsdk("local", "restart", "relay-0")
        assert res.returncode == 0, res.stderr.decode()
        flood = _submit_program(pool, "flood.py", 2, "64")
        marker = f"MARKER-{secrets.token_hex(6)}"
        calm = _submit_program(pool, "marker.py", 2, marker, "2")
        d = _wait(pool, flood, lambda d: d["job"]["state"] in ("succeeded", "failed"), "flood")
        assert d["job"]["state"] == "failed", d
        assert "job_log_quota (16 MiB)" in d["job"]["reason"], d["job"]
        d = _wait(pool, calm, lambda d: d["job"]["state"] in ("succeeded", "failed"), "calm")
        assert d["job"]["state"] == "succeeded", (d, pool.logs())
        out = pool.vsdk("logs", str(calm), timeout=60).stdout.decode()
        assert out.count(marker) == 4, out
        assert alive(pool.pid_of("relay-0")), pool.logs()
    finally:
        pool.vsdk("local", "down", timeout=60)  # before the unmount: the relay holds files
        subprocess.run(["umount", str(disk)], check=False)


def _submit_program(pool: Pool, program: str, ranks: int, *args: str) -> int:
    path = str(PROGRAMS / program)
    res = pool.vsdk("submit", path, "--ranks", str(ranks), "--json", "--", *args)
    assert res.returncode == 0, res.stderr.decode()
    return int(json.loads(res.stdout)["id"])


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 30
    while alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(0.05)


def test_a_banned_agents_ranks_move_and_the_job_still_succeeds(pool: Pool) -> None:
    """Last in this module: it takes an agent away for good (the module's pool: 3 agents,
    2 relays)."""
    job = _submit(pool, 2, "4")
    d = _wait(pool, job, _running, "both ranks run")
    victim = d["ranks"][0]["agent_name"]
    pid = pool.pid_of(victim)
    coordinator = str(_dir(pool) / "coordinator" / "config.toml")
    ban = subprocess.run(
        [str(BIN / "vpool-coordinator"), "agent", "ban", victim, "--reason", "test ban",
         "--config", coordinator],
        capture_output=True, timeout=60, check=False, env={**os.environ, **pool.env},
    )  # fmt: skip
    assert ban.returncode == 0, ban.stderr.decode()
    assert f"({victim}) banned" in ban.stdout.decode()
    d = _wait(pool, job, lambda d: d["job"]["state"] in ("succeeded", "failed"), "the job ends")
    assert d["job"]["state"] == "succeeded", d
    events = [(e["kind"], e["message"]) for e in d["events"]]
    assert any(k == "agent_banned" and victim in m for k, m in events), events
    moved = [r for r in d["ranks"] if r["incarnation"] > 1]
    assert moved and all(r["agent_name"] != victim for r in moved), d["ranks"]
    # The banned agent hears it is banned at its next heartbeat, and leaves.
    deadline = time.monotonic() + 60
    while alive(pid):
        assert time.monotonic() < deadline, f"banned agent {victim} still runs\n{pool.logs()}"
        time.sleep(0.1)
    assert "banned" in (_dir(pool) / "logs" / f"{victim}.log").read_text()
