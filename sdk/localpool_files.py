"""Files of the local pool started by ``vsdk local up``: where everything lives (``Layout``), the
pool's CA and server certificates, the components' settings files, and their command lines.

Process management (start, wait, record, stop) is in ``vpool.sdk.localpool``.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vpool import paths
from vpool.protocol import pki
from vpool.sdk import toml

Progress = Callable[[str], None]

DEFAULT_SLOTS = 8  # a trial pool oversubscribes so 8 ranks fit on a small machine
HOST = "127.0.0.1"
LOCAL_USER = "local"


def _quiet(_msg: str) -> None:
    pass


# -- layout and config generation (no processes) --------------------------------------------


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def pids_file(self) -> Path:
        return self.root / "pids.json"

    @property
    def pool_file(self) -> Path:
        return self.root / "pool.json"

    def dir(self, name: str) -> Path:
        return self.root / name

    def config(self, name: str) -> Path:
        return self.root / name / "config.toml"

    def ready_file(self, name: str) -> Path:
        return self.root / "run" / f"{name}.ready.json"

    def log_file(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"


def layout() -> Layout:
    return Layout(paths.local_pool_dir())


@dataclass(frozen=True)
class Secrets:
    """What the local pool's relays and agents present: a key per relay, a join token per
    agent (each agent stands for a volunteer of its own: validation by replay re-executes a
    rank only on an agent admitted by another token than the one that ran it)."""

    relay_keys: dict[str, str] = field(default_factory=dict)
    join_tokens: dict[str, str] = field(default_factory=dict)


def issue_secrets(lay: Layout, relays: Sequence[str], agents: Sequence[str]) -> Secrets:
    """Register ``relays`` and make a join token for each of ``agents`` in the coordinator's
    database (created if new), as `vpool-coordinator relay add` and `join-token create`
    would; the coordinator need not run."""
    from vpool.coordinator import keys
    from vpool.coordinator.sqlite_store import SqliteStore

    state = Path(coordinator_settings(lay, Secrets())["state_dir"])
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    store = SqliteStore(state / "vpool.db")
    try:
        now = time.time()
        relay_keys = {}
        for name in relays:
            key, key_hash = keys.new_api_token(keys.RELAY_PREFIX)
            store.add_relay_key(name, key_hash, now, replace=True)
            relay_keys[name] = key
        tokens = {}
        for name in agents:
            token, token_hash = keys.new_api_token(keys.JOIN_PREFIX)
            label = f"vsdk local up: {name}"
            store.create_join_token(token_hash, label, now, uses=1, expires=None)
            tokens[name] = token
    finally:
        store.close()
    return Secrets(relay_keys=relay_keys, join_tokens=tokens)


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_ca(lay: Layout, *, now: dt.datetime) -> None:
    cert, key = pki.make_ca("local", now=now)
    lay.ca_cert.parent.mkdir(parents=True, exist_ok=True)
    lay.ca_cert.write_bytes(cert)
    _write_private(lay.ca_key, key)


def make_server_cert(lay: Layout, name: str, *, now: dt.datetime) -> tuple[Path, Path]:
    """A server certificate for ``name`` valid for 127.0.0.1 and localhost."""
    cert, key = pki.issue_server_cert(
        lay.ca_cert.read_bytes(),
        lay.ca_key.read_bytes(),
        common_name=name,
        dns_names=["localhost"],
        ip_addresses=["127.0.0.1"],
        now=now,
    )
    d = lay.dir(name)
    d.mkdir(parents=True, exist_ok=True)
    (d / "cert.pem").write_bytes(cert)
    _write_private(d / "key.pem", key)
    return d / "cert.pem", d / "key.pem"


# Timer profiles of a local pool (``vsdk local up --timers``). "production": every component's
# defaults, what a real pool runs with. "test": heartbeats, failure detection, reconnects and
# grace periods a few times shorter, so that a fault (a frozen or killed agent, a relay down
# past the agents' reconnect) plays out in seconds: for tests and for watching vpool recover.
# Still long enough for a machine whose every core runs ranks: agents and relays run at normal
# priority, ranks at the idle one, so a heartbeat is late by milliseconds, not seconds.
TIMERS: dict[str, dict[str, dict[str, float]]] = {
    "production": {"coordinator": {}, "relay": {}, "agent": {}},
    "test": {
        "coordinator": {"heartbeat_interval": 1.0, "agent_timeout": 4.0, "relay_timeout": 4.0},
        "relay": {"lost_grace": 1.0, "agent_idle_timeout": 10.0},
        "agent": {
            "relay_reconnect": 8.0,
            "relay_ping_interval": 1.0,
            "relay_dead_after": 4.0,
            "stop_grace": 1.0,
        },
    },
}


def coordinator_settings(lay: Layout, sec: Secrets) -> dict[str, Any]:
    d = lay.dir("coordinator")
    return {
        "pool_name": "local",
        "host": HOST,
        "port": 0,
        "state_dir": str(d / "state"),
        "tls_cert": str(d / "cert.pem"),
        "tls_key": str(d / "key.pem"),
    }


def relay_settings(lay: Layout, name: str, sec: Secrets, coordinator_url: str) -> dict[str, Any]:
    d = lay.dir(name)
    return {
        "name": name,
        "host": HOST,
        "port": 0,
        "advertise_host": HOST,
        "data_dir": str(d / "data"),
        "tls_cert": str(d / "cert.pem"),
        "tls_key": str(d / "key.pem"),
        "coordinator_url": coordinator_url,
        "coordinator_ca": str(lay.ca_cert),
        "relay_key": sec.relay_keys.get(name, ""),
    }


def agent_settings(
    lay: Layout,
    name: str,
    sec: Secrets,
    coordinator_url: str,
    slots: int,
    package_index: str = "",
) -> dict[str, Any]:
    d = lay.dir(name)
    extra = {"package_index": package_index} if package_index else {}
    return {
        **extra,
        "name": name,
        "coordinator_url": coordinator_url,
        "coordinator_ca": str(lay.ca_cert),
        "join_token": sec.join_tokens.get(name, ""),
        "identity_dir": str(d / "identity"),
        "work_dir": str(d / "work"),
        "slots": slots,
        # `vsdk local down` stops the whole pool at once: a stopping agent has no relay or
        # coordinator left to checkpoint its ranks to (a volunteer's agent leaves alone).
        "leave_checkpoint_grace": 0.0,
    }


def write_config(lay: Layout, name: str, settings: dict[str, Any]) -> Path:
    path = lay.config(name)
    toml.write(path, settings, private=True)  # holds secrets
    for key in ("state_dir", "data_dir", "identity_dir", "work_dir"):
        if key in settings:
            Path(settings[key]).mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def component_command(script: str, module: str) -> list[str]:
    """The console script next to this interpreter, else ``python -m module``."""
    exe = Path(sys.executable).parent / script
    if exe.is_file() and os.access(exe, os.X_OK):
        return [str(exe)]
    return [sys.executable, "-m", module]


def coordinator_argv(lay: Layout) -> list[str]:
    return [
        *component_command("vpool-coordinator", "vpool.coordinator.cli"),
        "serve",
        "--config",
        str(lay.config("coordinator")),
        "--ready-file",
        str(lay.ready_file("coordinator")),
    ]


def user_add_argv(lay: Layout) -> list[str]:
    """Who runs a local pool operates it: its user sees the whole pool."""
    return [
        *component_command("vpool-coordinator", "vpool.coordinator.cli"),
        "user",
        "add",
        LOCAL_USER,
        "--operator",
        "--config",
        str(lay.config("coordinator")),
    ]


def relay_argv(lay: Layout, name: str) -> list[str]:
    return [
        *component_command("vpool-relay", "vpool.relay.cli"),
        "--config",
        str(lay.config(name)),
        "--ready-file",
        str(lay.ready_file(name)),
    ]


def agent_argv(lay: Layout, name: str) -> list[str]:
    return [
        *component_command("vpool-agent", "vpool.worker_agent.cli"),
        "--config",
        str(lay.config(name)),
        "--ready-file",
        str(lay.ready_file(name)),
    ]


# -- processes ------------------------------------------------------------------------------
