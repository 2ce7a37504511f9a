"""``vsdk local``: generated configs and certificates (no processes), and a ``down`` that
signals only what it started."""

from __future__ import annotations

import datetime as dt
import importlib
import json
import ssl
import stat
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from cryptography import x509

from vpool import paths
from vpool.config import load_settings
from vpool.coordinator import keys
from vpool.coordinator.sqlite_store import SqliteStore
from vpool.sdk import localpool
from vpool.sdk.cli import cli
from vpool.sdk.errors import LocalPoolError

URL = "https://127.0.0.1:4443"
NOW = dt.datetime.now(dt.UTC)


@pytest.fixture
def lay(home: Path) -> localpool.Layout:
    lay = localpool.layout()
    assert lay.root == paths.local_pool_dir()
    localpool.make_ca(lay, now=NOW)
    return lay


def test_ca_and_server_certs(lay: localpool.Layout) -> None:
    assert stat.S_IMODE(lay.ca_key.stat().st_mode) == 0o600
    cert_path, key_path = localpool.make_server_cert(lay, "relay-0", now=NOW)
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    # The chain verifies with the pool CA: what agents and vsdk will do.
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_path, key_path)
    client = ssl.create_default_context(cafile=str(lay.ca_cert))
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    cs = client.wrap_bio(c_in, c_out, server_hostname="127.0.0.1")
    ss = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side, src, dst in ((cs, c_out, s_in), (ss, s_out, c_in)):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
            dst.write(src.read())
    cs.do_handshake()  # raises if the certificate did not verify


def _settings_class(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        pytest.skip(f"{module} is not written yet")


@pytest.mark.parametrize(
    ("component", "module", "cls", "prefix"),
    [
        ("coordinator", "vpool.coordinator.settings", "CoordinatorSettings", "VPOOL_COORDINATOR"),
        ("relay-1", "vpool.relay.settings", "RelaySettings", "VPOOL_RELAY"),
        ("agent-0", "vpool.worker_agent.settings", "AgentSettings", "VPOOL_AGENT"),
    ],
)
@pytest.mark.parametrize("timers", sorted(localpool.TIMERS))
def test_configs_load_as_the_components_settings(
    lay: localpool.Layout, component: str, module: str, cls: str, prefix: str, timers: str
) -> None:
    sec = localpool.issue_secrets(lay, ["relay-1"], ["agent-0"])
    kind = component.split("-")[0]
    if kind == "coordinator":
        data = localpool.coordinator_settings(lay, sec)
    elif kind == "relay":
        data = localpool.relay_settings(lay, component, sec, URL)
    else:
        data = localpool.agent_settings(lay, component, sec, URL, 8)
    data |= localpool.TIMERS[timers][kind]  # as `vsdk local up --timers` writes them
    path = localpool.write_config(lay, component, data)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # holds the secrets
    assert tomllib.loads(path.read_text()) == data
    for key in ("state_dir", "data_dir", "identity_dir", "work_dir"):
        if key in data:
            assert Path(data[key]).is_dir()
            assert Path(data[key]).is_relative_to(lay.root)
    settings = load_settings(_settings_class(module, cls), prefix=prefix, file=path, env={})
    for key, value in data.items():
        assert str(getattr(settings, key)) == str(value), key


@pytest.mark.parametrize(
    ("kind", "module", "cls"),
    [
        ("coordinator", "vpool.coordinator.settings", "CoordinatorSettings"),
        ("relay", "vpool.relay.settings", "RelaySettings"),
        ("agent", "vpool.worker_agent.settings", "AgentSettings"),
    ],
)
def test_the_test_timers_are_shorter_than_the_defaults(kind: str, module: str, cls: str) -> None:
    """``--timers test`` only shortens periods (a scenario takes seconds); production is the
    components' own defaults."""
    defaults = _settings_class(module, cls)()
    assert localpool.TIMERS["production"][kind] == {}
    shorter = localpool.TIMERS["test"][kind]
    assert shorter
    for key, value in shorter.items():
        assert 0 < value < getattr(defaults, key), key


def test_up_refuses_a_timer_profile_it_does_not_have(home: Path) -> None:
    with pytest.raises(LocalPoolError, match="no timer profile 'fast'; there are production, test"):
        localpool.up(timers="fast")
    assert not localpool.layout().pids_file.exists()  # nothing was started


def test_configs_carry_credentials_the_coordinator_knows(lay: localpool.Layout) -> None:
    """Each relay gets its own key and each agent a join token of its own (it stands for a
    volunteer), registered in the coordinator's database before it starts; nothing is shared
    between relays or agents."""
    sec = localpool.issue_secrets(lay, ["relay-0", "relay-1"], ["agent-0", "agent-1"])
    coord = localpool.coordinator_settings(lay, sec)
    relays = [localpool.relay_settings(lay, f"relay-{i}", sec, URL) for i in range(2)]
    agent = localpool.agent_settings(lay, "agent-0", sec, URL, 8)
    other = localpool.agent_settings(lay, "agent-1", sec, URL, 8)
    assert agent["join_token"] != other["join_token"]
    assert coord["host"] == relays[0]["host"] == relays[0]["advertise_host"] == "127.0.0.1"
    assert coord["port"] == relays[0]["port"] == 0
    assert "open_enrollment" not in coord  # closed, as every pool is by default
    assert relays[0]["relay_key"] != relays[1]["relay_key"]
    assert agent["join_token"].startswith("vpj_") and len(agent["join_token"]) >= 40
    assert relays[0]["coordinator_url"] == agent["coordinator_url"] == URL
    assert relays[0]["coordinator_ca"] == agent["coordinator_ca"] == str(lay.ca_cert)
    assert agent["slots"] == 8 == localpool.DEFAULT_SLOTS
    store = SqliteStore(Path(coord["state_dir"]) / "vpool.db")
    try:
        for i, relay in enumerate(relays):
            assert store.relay_by_key_hash(keys.hash_token(relay["relay_key"])) == f"relay-{i}"
        tokens = store.list_join_tokens(0.0)
        assert [(t.uses_left, t.usable) for t in tokens] == [(1, True), (1, True)]
    finally:
        store.close()


def test_command_lines(lay: localpool.Layout) -> None:
    argv = localpool.coordinator_argv(lay)
    assert argv[-5:] == [
        "serve",
        "--config",
        str(lay.config("coordinator")),
        "--ready-file",
        str(lay.ready_file("coordinator")),
    ]
    assert localpool.user_add_argv(lay)[-6:] == [
        "user",
        "add",
        "local",
        "--operator",  # who runs a local pool operates it
        "--config",
        str(lay.config("coordinator")),
    ]
    assert localpool.relay_argv(lay, "relay-0")[-4:] == [
        "--config",
        str(lay.config("relay-0")),
        "--ready-file",
        str(lay.ready_file("relay-0")),
    ]
    assert "--ready-file" in localpool.agent_argv(lay, "agent-2")
    exe = localpool.component_command("vpool-relay", "vpool.relay.cli")
    assert exe == [str(Path(sys.executable).parent / "vpool-relay")] or exe[1:] == [
        "-m",
        "vpool.relay.cli",
    ]
    assert localpool.component_command("no-such-script", "x.y") == [sys.executable, "-m", "x.y"]


# -- stopping exactly what was started --------------------------------------------------------


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _live_cmdline(proc: subprocess.Popen[bytes]) -> list[str]:
    # Right after exec the kernel may show an empty cmdline for a moment.
    deadline = time.monotonic() + 10
    while not (cmd := localpool.read_cmdline(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cmd
    return cmd


def test_cmdline_of_a_process(sleeper: subprocess.Popen[bytes]) -> None:
    assert _live_cmdline(sleeper)[-2:] == ["-c", "import time; time.sleep(60)"]
    rec = localpool.Recorded("x", sleeper.pid, _live_cmdline(sleeper))
    assert localpool.status_of(rec) == "running"
    sleeper.kill()
    sleeper.wait()
    assert localpool.status_of(rec) == "gone"


def test_stop_refuses_a_pid_whose_cmdline_changed(sleeper: subprocess.Popen[bytes]) -> None:
    rec = localpool.Recorded("agent-0", sleeper.pid, ["/usr/bin/vpool-agent", "--config", "x"])
    assert localpool.status_of(rec) == "replaced"
    warnings = localpool.stop([rec], timeout=0.5)
    assert sleeper.poll() is None, "a reused pid must never be signalled"
    assert warnings and "now runs something else" in warnings[0]


def test_stop_terminates_a_matching_pid(sleeper: subprocess.Popen[bytes]) -> None:
    rec = localpool.Recorded("agent-0", sleeper.pid, _live_cmdline(sleeper))
    assert localpool.stop([rec], timeout=10) == []
    sleeper.wait(5)  # stop() may have reaped it already (it is our child here)
    assert localpool.status_of(rec) == "gone"


@pytest.mark.large
def test_stop_kills_what_ignores_sigterm() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        rec = localpool.Recorded("stubborn", proc.pid, _live_cmdline(proc))
        warnings = localpool.stop([rec], timeout=0.3)
        assert warnings == [f"stubborn (pid {proc.pid}) ignored SIGTERM; killed"]
        proc.wait(5)
        assert localpool.status_of(rec) == "gone"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


def _record(lay: localpool.Layout, recs: list[localpool.Recorded]) -> None:
    lay.root.mkdir(parents=True, exist_ok=True)
    localpool.write_pids(lay, recs)
    (lay.pool_file).write_text(json.dumps({"url": URL}))


def test_local_down_via_cli(home: Path, sleeper: subprocess.Popen[bytes]) -> None:
    lay = localpool.layout()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _record(
            lay,
            [
                localpool.Recorded("coordinator", sleeper.pid, _live_cmdline(sleeper)),
                localpool.Recorded("relay-0", other.pid, ["something", "else"]),
                localpool.Recorded("agent-0", 999_999_999, ["gone"]),
            ],
        )
        res = CliRunner().invoke(cli, ["local", "status"])
        assert res.exit_code == 1  # not all of it runs
        assert "running" in res.stdout and "replaced" in res.stdout and "gone" in res.stdout
        res = CliRunner().invoke(cli, ["local", "down"])
        assert res.exit_code == 0, res.stderr
        assert "now runs something else" in res.stderr
        sleeper.wait(5)
        assert other.poll() is None
        assert not lay.pids_file.exists()
        res = CliRunner().invoke(cli, ["local", "down"])
        assert res.exit_code == 0 and "no local pool was running" in res.stderr
    finally:
        other.kill()
        other.wait()


def test_local_up_refuses_when_running(home: Path, sleeper: subprocess.Popen[bytes]) -> None:
    lay = localpool.layout()
    _record(lay, [localpool.Recorded("coordinator", sleeper.pid, _live_cmdline(sleeper))])
    res = CliRunner().invoke(cli, ["local", "status", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["running"] is True
    res = CliRunner().invoke(cli, ["local", "up"])
    assert res.exit_code == 1
    assert "already running" in res.stderr and "--force" in res.stderr
    assert sleeper.poll() is None
    with pytest.raises(LocalPoolError, match="already running"):
        localpool.up()


def test_unreadable_pids_file(home: Path) -> None:
    lay = localpool.layout()
    lay.root.mkdir(parents=True)
    lay.pids_file.write_text("{not json")
    with pytest.raises(LocalPoolError, match="unreadable"):
        localpool.read_pids(lay)


@pytest.mark.large
def test_up_reports_a_component_that_dies_with_its_log(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = "import sys; print('coordinator: cannot bind, port taken'); sys.exit(3)"
    monkeypatch.setattr(localpool, "coordinator_argv", lambda lay: [sys.executable, "-c", script])
    res = CliRunner().invoke(cli, ["local", "up", "--timeout", "20"])
    assert res.exit_code == 1
    assert "coordinator exited with code 3 before it was ready" in res.stderr
    assert "cannot bind, port taken" in res.stderr  # the tail of its log
    assert not localpool.layout().pids_file.exists()


def _say_ready(*pieces: bytes, code: int = 0) -> list[str]:
    """A component that writes ``pieces`` to its --ready-fd, one write each, and exits."""
    script = (
        "import os, sys\n"
        "fd = int(sys.argv[sys.argv.index('--ready-fd') + 1])\n"
        f"for piece in {list(pieces)!r}:\n"
        "    os.write(fd, piece)\n"
        f"sys.exit({code})\n"
    )
    return [sys.executable, "-c", script]


@pytest.mark.large
def test_a_component_says_it_is_ready_over_its_pipe(home: Path) -> None:
    starter = localpool._Starter(localpool.layout(), localpool._quiet)
    try:
        starter.start("relay-0", _say_ready(b'{"port": ', b"7700}\n"))
        starter.start("agent-0", _say_ready(b'{"name": "agent-0"}\n'))
        found = starter.wait_ready(["relay-0", "agent-0"], timeout=60)
    finally:
        starter.abort()
    assert found == {"relay-0": {"port": 7700}, "agent-0": {"name": "agent-0"}}
    assert starter.ready_pipes == {}  # every read end closed


@pytest.mark.large
def test_a_component_that_says_something_else_is_not_ready(home: Path) -> None:
    starter = localpool._Starter(localpool.layout(), localpool._quiet)
    try:
        starter.start("agent-0", _say_ready(b"starting up\n", code=4))
        with pytest.raises(LocalPoolError, match=r"agent-0 exited with code 4 .*starting up"):
            starter.wait_ready(["agent-0"], timeout=60)
    finally:
        starter.abort()


def test_a_restart_gets_a_ready_pipe_of_its_own() -> None:
    recorded = ["vpool-relay", "--config", "c.toml", "--ready-fd", "5", "--ready-fd=6", "-x"]
    assert localpool._without_ready_fd(recorded) == ["vpool-relay", "--config", "c.toml", "-x"]


@pytest.mark.large
def test_up_gives_up_at_the_deadline_and_stops_what_it_started(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = "import time; print('starting...', flush=True); time.sleep(60)"
    started: list[int] = []
    real_start = localpool._Starter.start

    def start(self: Any, name: str, argv: list[str]) -> Any:
        proc = real_start(self, name, argv)
        started.append(proc.pid)
        return proc

    monkeypatch.setattr(localpool._Starter, "start", start)
    monkeypatch.setattr(localpool, "coordinator_argv", lambda lay: [sys.executable, "-c", script])
    with pytest.raises(LocalPoolError, match=r"not ready after 0\.5 s") as info:
        localpool.up(timeout=0.5)
    assert "starting..." in str(info.value)
    assert started and all(localpool.read_cmdline(pid) is None for pid in started)
