"""``vpool-agent join`` and ``leave`` (worker_agent/install.py) with no process: a coordinator
answering through ``httpx.MockTransport`` and a systemd that records what it is told. Join
writes where the layout says, the unit starts this installation's agent with those settings,
and leave removes exactly what join wrote (and what it found there stays)."""

from __future__ import annotations

import datetime as dt
import os
import shlex
import socket
import tomllib
from pathlib import Path

import httpx
import msgspec
import pytest

from vpool.protocol import api, pki
from vpool.worker_agent import identity, install
from vpool.worker_agent.errors import CoordinatorRejected
from vpool.worker_agent.install import InstallError, JoinRequest
from vpool.worker_agent.proxy import choose_socket_path

REPO = Path(__file__).resolve().parents[2]
URL = "https://pool.example.org:8443"
TOKEN = "vpj_good"


class FakeSystemd(install.Systemd):
    def __init__(self, system: bool = False, *, running: bool = True) -> None:
        super().__init__(system)
        self.up = running
        self.calls: list[tuple[str, ...]] = []

    def running(self) -> bool:
        return self.up

    def run(self, *args: str) -> tuple[int, str]:
        self.calls.append(args)
        return 0, "active" if args[0] == "is-active" else ""


class FakeCoordinator:
    """Enrolls agents presenting ``TOKEN`` (or a key it knows) and serves a pool CA."""

    def __init__(self, ca_pem: bytes) -> None:
        self.ca_pem = ca_pem
        self.keys: set[str] = set()
        self.enrolled: list[api.EnrollRequest] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/v1/pool/ca":
            return httpx.Response(200, content=self.ca_pem)
        assert request.url.path == "/api/v1/agents/enroll"
        req = msgspec.json.decode(request.content, type=api.EnrollRequest)
        if req.public_key not in self.keys and req.join_token != TOKEN:
            body = api.ErrorBody(api.ErrorDetail("bad_join_token", "the join token is unknown"))
            return httpx.Response(403, content=msgspec.json.encode(body))
        self.keys.add(req.public_key)
        self.enrolled.append(req)
        resp = api.EnrollResponse(
            agent_id="agent-0123456789abcdef",
            agent_token="t",
            signing_key="k",
            heartbeat_interval=2.0,
        )
        return httpx.Response(200, content=msgspec.json.encode(resp))

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's home with the XDG directories in it, and no VPOOL_ variable."""
    for var in [v for v in os.environ if v.startswith(("VPOOL_", "XDG_"))]:
        monkeypatch.delenv(var)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(home / ".local" / "state"))
    return home


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    cert, _key = pki.make_ca("physics", now=dt.datetime.now(dt.UTC))
    path = tmp_path / "given-ca.pem"
    path.write_bytes(cert)
    return path


def tree(root: Path) -> dict[str, str]:
    """Every file and directory under ``root``, with its mode."""
    found = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(top, name)
            found[str(path.relative_to(root))] = oct(path.lstat().st_mode)
    return found


def run_join(
    coordinator: FakeCoordinator, systemd: FakeSystemd, **request: object
) -> tuple[install.JoinRecord, list[str]]:
    said: list[str] = []
    req = JoinRequest(**{"url": URL, "token": TOKEN, **request})  # type: ignore[arg-type]
    record = install.join(
        req, install.user_layout(), systemd, said.append, transport=coordinator.transport()
    )
    return record, said


def run_leave(systemd: FakeSystemd) -> tuple[install.JoinRecord | None, list[str], list[str]]:
    said: list[str] = []
    plans: list[str] = []

    def confirm(plan: list[str]) -> bool:
        plans.extend(plan)
        return True

    return install.leave(install.user_layout(), systemd, said.append, confirm), said, plans


# -- the unit ---------------------------------------------------------------------------------


def test_the_packaged_unit_is_the_one_join_writes() -> None:
    packaged = (REPO / "packaging" / "vpool-agent.service").read_text()
    assert packaged == install.render_unit(
        install.PACKAGED_EXEC_START, system=False, header=install.PACKAGED_HEADER
    )


@pytest.mark.parametrize("system", [False, True])
def test_the_unit_starts_this_installation_with_the_settings(home: Path, system: bool) -> None:
    layout = install.SYSTEM_LAYOUT if system else install.user_layout()
    text = install.unit_text(layout, URL)
    [line] = [ln for ln in text.splitlines() if ln.startswith("ExecStart=")]
    argv = shlex.split(line.removeprefix("ExecStart=").replace("%%", "%").replace("$$", "$"))
    assert argv == install.agent_argv(layout)
    assert argv[-2:] == ["--config", str(layout.settings_file)]
    assert Path(argv[0]).is_absolute() and os.access(argv[0], os.X_OK)
    wanted = "multi-user.target" if system else "default.target"
    assert f"\n[Install]\nWantedBy={wanted}\n" in text
    assert "Delegate=yes" in text and "KillMode=mixed" in text
    assert "User=" not in text  # a system unit runs the agent as root (install.py says why)


def test_unit_words_are_escaped() -> None:
    assert install.unit_arg("/opt/vpool/bin/vpool-agent") == "/opt/vpool/bin/vpool-agent"
    assert install.unit_arg("/home/a b/100%/$x") == '"/home/a b/100%%/$$x"'
    assert install.unit_arg('/q"\\') == '"/q\\"\\\\"'
    with pytest.raises(InstallError):
        install.unit_arg("/new\nline")


def test_layouts(home: Path) -> None:
    user = install.user_layout()
    assert user.settings_file == home / ".config" / "vpool" / "agent.toml"
    assert user.identity_dir == home / ".config" / "vpool" / "agent"
    assert user.work_dir == home / ".local" / "state" / "vpool" / "agent"
    assert user.unit_file == home / ".config" / "systemd" / "user" / "vpool-agent.service"
    system = install.SYSTEM_LAYOUT
    assert system.settings_file == Path("/etc/vpool/agent.toml")
    assert system.ca_file == Path("/etc/vpool/ca.pem")
    assert system.identity_dir == Path("/var/lib/vpool-agent/identity")
    assert system.work_dir == Path("/var/lib/vpool-agent/work")
    assert system.unit_file == Path("/etc/systemd/system/vpool-agent.service")


def test_layout_by_user(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert install.layout_for(None) is install.SYSTEM_LAYOUT
    assert not install.layout_for(False).system  # root may ask for a user unit
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert install.layout_for(None) == install.user_layout()
    with pytest.raises(InstallError, match="run it as root"):
        install.layout_for(True)


# -- join and leave ---------------------------------------------------------------------------


def test_leave_removes_exactly_what_join_wrote(home: Path, ca: Path) -> None:
    before = tree(home)
    coordinator = FakeCoordinator(ca.read_bytes())
    systemd = FakeSystemd()
    record, said = run_join(coordinator, systemd, ca_file=ca, slots=3, name="desk")
    layout = install.user_layout()

    settings = tomllib.loads(layout.settings_file.read_text())
    assert settings == {
        "coordinator_url": URL,
        "coordinator_ca": str(layout.ca_file),
        "name": "desk",
        "slots": 3,
        "identity_dir": str(layout.identity_dir),
        "work_dir": str(layout.work_dir),
    }  # no join_token: the key is the credential now
    assert TOKEN not in "".join(
        p.read_text(errors="replace") for p in home.rglob("*") if p.is_file()
    )
    assert layout.ca_file.read_bytes() == ca.read_bytes()
    assert (layout.identity_dir / "identity.key").stat().st_mode & 0o077 == 0
    assert layout.settings_file.stat().st_mode & 0o077 == 0
    assert layout.work_dir.is_dir()
    assert layout.unit_file.read_text() == install.unit_text(layout, URL)
    [enrolled] = coordinator.enrolled
    assert (enrolled.name, enrolled.slots, enrolled.join_token) == ("desk", 3, TOKEN)
    assert systemd.calls == [
        ("daemon-reload",),
        ("enable", "--now", "vpool-agent.service"),
        ("is-active", "vpool-agent.service"),
    ]
    assert record.agent_id == "agent-0123456789abcdef" and record.name == "desk"
    text = "\n".join(said)
    for expected in (
        f"pool CA: {layout.ca_file}",
        "enrolled in https://pool.example.org:8443 as agent-0123456789abcdef (name desk, 3 slots)",
        f"identity key: {layout.identity_dir / 'identity.key'} (new)",
        f"settings: {layout.settings_file}",
        f"work directory: {layout.work_dir}",
        f"systemd user unit: {layout.unit_file}",
        "service: enabled and started (active)",
    ):
        assert expected in text
    assert install.read_record(layout) == record

    systemd.calls.clear()
    left, said, plan = run_leave(systemd)
    assert left == record
    assert tree(home) == before
    assert systemd.calls == [("disable", "--now", "vpool-agent.service"), ("daemon-reload",)]
    assert plan[0].startswith(f"the service {layout.unit_file}")
    assert str(layout.settings_file) in plan and str(layout.ca_file) in plan
    assert any(line.startswith(f"{layout.work_dir} and everything") for line in plan)
    assert f"removed {layout.settings_file}" in said and f"removed {layout.work_dir}" in said

    again, said, _plan = run_leave(systemd)
    assert again is None and said[0].startswith("nothing to undo")


def test_what_was_there_before_join_stays(home: Path, ca: Path) -> None:
    layout = install.user_layout()
    layout.work_dir.mkdir(parents=True)
    (layout.work_dir / "blobs").mkdir()
    layout.identity_dir.mkdir(parents=True)
    (layout.config_dir / "client.toml").write_text("# vsdk's\n")
    coordinator = FakeCoordinator(ca.read_bytes())
    key = identity.load_or_create_key(layout.identity_dir)
    coordinator.keys.add(identity.enroll_request(key, name="x", slots=1, join_token="").public_key)
    before = tree(home)
    systemd = FakeSystemd(running=False)
    _record, said = run_join(coordinator, systemd, token="vpj_spent", ca_file=ca)
    assert "(kept: it was there)" in "\n".join(said) and "(it was there)" in "\n".join(said)
    assert systemd.calls == []
    run_leave(systemd)
    assert tree(home) == before


def test_join_with_the_digest_fetches_the_ca(home: Path, ca: Path) -> None:
    digest = pki.fingerprint(ca.read_bytes())
    coordinator = FakeCoordinator(ca.read_bytes())
    colons = ":".join(digest[i : i + 2] for i in range(0, 64, 2)).upper()  # as openssl shows it
    _record, said = run_join(coordinator, FakeSystemd(), ca_sha256=colons)
    layout = install.user_layout()
    assert layout.ca_file.read_bytes() == ca.read_bytes()
    assert f"pool CA: {layout.ca_file} (SHA-256 {digest}, fetched from the coordinator" in said[0]


def test_a_ca_that_does_not_match_the_digest_is_refused(home: Path, ca: Path) -> None:
    before = tree(home)
    coordinator = FakeCoordinator(ca.read_bytes())
    with pytest.raises(InstallError, match="not trusted"):
        run_join(coordinator, FakeSystemd(), ca_sha256="ab" * 32)
    with pytest.raises(InstallError, match="not trusted"):
        run_join(coordinator, FakeSystemd(), ca_file=ca, ca_sha256="ab" * 32)
    with pytest.raises(InstallError, match="not a SHA-256 digest"):
        run_join(coordinator, FakeSystemd(), ca_sha256="abc")
    assert coordinator.enrolled == [] and tree(home) == before


def test_a_refused_join_leaves_nothing(home: Path, ca: Path) -> None:
    before = tree(home)
    coordinator = FakeCoordinator(ca.read_bytes())
    with pytest.raises(CoordinatorRejected, match="bad_join_token"):
        run_join(coordinator, FakeSystemd(), token="vpj_wrong", ca_file=ca)
    assert tree(home) == before


def test_join_twice_is_refused(home: Path, ca: Path) -> None:
    coordinator = FakeCoordinator(ca.read_bytes())
    run_join(coordinator, FakeSystemd(), ca_file=ca)
    with pytest.raises(InstallError, match="`vpool-agent leave` first"):
        run_join(coordinator, FakeSystemd(), ca_file=ca)


def test_without_systemd_it_says_how_to_run_the_agent(home: Path, ca: Path) -> None:
    systemd = FakeSystemd(running=False)
    _record, said = run_join(FakeCoordinator(ca.read_bytes()), systemd, ca_file=ca)
    layout = install.user_layout()
    assert layout.unit_file.exists() and systemd.calls == []
    [line] = [s for s in said if s.startswith("service:")]
    assert "systemd is not running here" in line
    assert line.endswith(shlex.join(install.agent_argv(layout)))


def test_no_service_writes_no_unit(home: Path, ca: Path) -> None:
    before = tree(home)
    systemd = FakeSystemd()
    record, said = run_join(FakeCoordinator(ca.read_bytes()), systemd, ca_file=ca, service=False)
    assert record.unit == "" and systemd.calls == []
    assert not install.user_layout().unit_file.exists()
    assert any(s.startswith("no service (--no-service): run the agent with") for s in said)
    run_leave(systemd)
    assert systemd.calls == [] and tree(home) == before


@pytest.mark.parametrize("deep", [False, True], ids=["short", "long-work-dir"])
@pytest.mark.medium
def test_leave_refuses_while_an_agent_runs(
    home: Path, ca: Path, monkeypatch: pytest.MonkeyPatch, deep: bool
) -> None:
    if deep:  # agent.sock's path in it is too long for a socket address: the agent's is short
        state = home / ("s" * 60) / ("t" * 60)
        monkeypatch.setenv("XDG_STATE_HOME", str(state))
        assert len(str(state / "vpool" / "agent" / "agent.sock")) > 107
    run_join(FakeCoordinator(ca.read_bytes()), FakeSystemd(running=False), ca_file=ca)
    layout = install.user_layout()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        # Where the agent listens: work_dir/agent.sock, or a short path if that is too long.
        listener.bind(str(choose_socket_path(layout.work_dir)))
        listener.listen()
        with pytest.raises(InstallError, match="an agent still runs"):
            run_leave(FakeSystemd(running=False))
    assert layout.settings_file.exists() and install.read_record(layout) is not None
    # Its socket left behind by an agent that ended does not count.
    run_leave(FakeSystemd(running=False))
    assert not layout.settings_file.exists()
