"""``vpool-agent join`` and ``leave``: put this machine into a pool as a service, and take it out.

``join URL TOKEN`` does, saying each step as it goes:

1. the pool CA: ``--ca FILE``; or ``--ca-sha256 HEX``, fetched from the coordinator's public
   ``GET /api/v1/pool/ca`` over a connection nothing checks yet and trusted only if its SHA-256
   is HEX (what ``vpool-coordinator join-token create`` prints); or neither: the system's CAs;
2. enrolls with the join token (the agent's own enrollment, ``agent.enroll``). From then on
   the identity key is the agent's credential, so the token is written nowhere;
3. writes the settings (with the CA next to them) and makes the work directory;
4. writes a systemd unit whose ``ExecStart`` is this installation's ``vpool-agent`` and, where
   systemd runs, enables and starts it (a user unit; a system unit when run as root);
5. writes what it made into a record (``agent-join.json``), which is what ``leave`` undoes.

A failed join removes what it had made. ``leave`` stops, disables and removes the unit, then
removes the settings, the CA, the identity key and the work directory, but only those join
made (a key or a work directory that was there before stays), and finally the record: run
again, it finishes what an interrupted run left. The coordinator hears of it from the agent
itself: its clean stop (SIGTERM, the unit's) checkpoints its ranks, hands them back and says
it is leaving, and the pool lists it as gone once it is silent. There is no "left for good"
call: with its key removed, that agent never comes back.

Where things go (``Layout``):

    a user          settings, ca.pem, record   <config dir>/               (~/.config/vpool)
                    identity key               <config dir>/agent/identity.key
                    work directory             <state dir>/agent           (~/.local/state/vpool)
                    unit                       $XDG_CONFIG_HOME/systemd/user/vpool-agent.service
    root (system)   settings, ca.pem, record   /etc/vpool/
                    identity key               /var/lib/vpool-agent/identity/identity.key
                    work directory             /var/lib/vpool-agent/work
                    unit                       /etc/systemd/system/vpool-agent.service

The system unit runs the agent as root, like the agent a root user starts by hand: the
sandbox makes the ranks' namespaces and cgroups as root, and CRIU checkpoints need root (a
sandbox made through an unprivileged user namespace cannot be dumped, docs/internals.md). Each
rank still runs with no capabilities, no network and a read-only system.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import click
import httpx
import msgspec
import tomli_w
import trio

from vpool import __version__, paths
from vpool.protocol import pki
from vpool.protocol.api import EnrollResponse
from vpool.reasons import describe
from vpool.worker_agent import identity
from vpool.worker_agent.agent import SOCKET_NAME, enroll
from vpool.worker_agent.coordinator import CoordinatorClient
from vpool.worker_agent.errors import AgentError, CoordinatorUntrusted
from vpool.worker_agent.proxy import choose_socket_path
from vpool.worker_agent.settings import SYSTEM_CONTROL_SOCKET, AgentSettings

Say = Callable[[str], None]

UNIT_NAME = "vpool-agent.service"
RECORD_NAME = "agent-join.json"
SETTINGS_NAME = "agent.toml"
CA_NAME = "ca.pem"
# Seconds join waits for the coordinator to answer (enrolling, fetching the CA).
CONNECT_WAIT = 30.0
# Seconds a systemctl call may take (stopping the agent: its unit's TimeoutStopSec is 45).
SYSTEMCTL_TIMEOUT = 90.0
SYSTEM_CONFIG = Path("/etc/vpool")
SYSTEM_STATE = Path("/var/lib/vpool-agent")

log = logging.getLogger("vpool.agent")


class InstallError(AgentError):
    """join or leave cannot go on; the message says why and what to do."""


# -- where things go --------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    system: bool
    config_dir: Path  # the settings, the pool CA, the record of what join made
    identity_dir: Path
    work_dir: Path
    unit_dir: Path

    @property
    def settings_file(self) -> Path:
        return self.config_dir / SETTINGS_NAME

    @property
    def ca_file(self) -> Path:
        return self.config_dir / CA_NAME

    @property
    def record_file(self) -> Path:
        return self.config_dir / RECORD_NAME

    @property
    def unit_file(self) -> Path:
        return self.unit_dir / UNIT_NAME


def user_layout() -> Layout:
    """This user's: the agent's own default directories (``vpool.paths``, platformdirs), and
    the user unit directory systemd reads first."""
    defaults = AgentSettings()
    xdg = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Layout(
        system=False,
        config_dir=paths.config_dir(),
        identity_dir=defaults.identity_path,
        work_dir=defaults.work_path,
        unit_dir=Path(xdg) / "systemd" / "user",
    )


SYSTEM_LAYOUT = Layout(
    system=True,
    config_dir=SYSTEM_CONFIG,
    identity_dir=SYSTEM_STATE / "identity",
    work_dir=SYSTEM_STATE / "work",
    unit_dir=Path("/etc/systemd/system"),
)


def layout_for(system: bool | None) -> Layout:
    """The system layout for root (or ``system``), else this user's."""
    if system is None:
        system = os.geteuid() == 0
    if system and os.geteuid() != 0:
        raise InstallError("--system installs a system service: run it as root (sudo)")
    return SYSTEM_LAYOUT if system else user_layout()


# -- the unit ---------------------------------------------------------------------------------

_UNIT_BODY = """\
[Unit]
Description=vpool worker agent (runs MPI ranks for a vpool volunteer pool)
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
ExecStart={exec_start}
# SIGTERM goes to the agent alone: it checkpoints its ranks (leave_checkpoint_grace, 20 s),
# stops them itself and exits 0. Anything still alive after TimeoutStopSec is SIGKILLed with
# the whole unit (KillMode=mixed): keep it above the grace.
KillMode=mixed
KillSignal=SIGTERM
TimeoutStopSec=45
Restart=on-failure
RestartSec=10
# A volunteer's desktop comes first: ranks inherit a low CPU and I/O priority.
Nice=10
IOSchedulingClass=idle
Environment=PYTHONUNBUFFERED=1
NoNewPrivileges=yes
# Every rank gets a cgroup of its own (memory, processes, the lowest CPU weight) inside the
# agent's: systemd must hand the agent that subtree.
Delegate=yes

[Install]
WantedBy={wanted_by}
"""

# What packaging/vpool-agent.service starts (pipx's or pip --user's place for the command);
# that file is ``render_unit`` of these, which tests/worker_agent/test_install.py checks.
PACKAGED_EXEC_START = "%h/.local/bin/vpool-agent --config %E/vpool/agent.toml"
PACKAGED_HEADER = """\
# systemd *user* unit for the vpool worker agent. `vpool-agent join URL TOKEN` writes one
# like it, for the installation it runs from, and starts it (packaging/README.md); by hand:
# copy to ~/.config/systemd/user/, then
#   systemctl --user daemon-reload && systemctl --user enable --now vpool-agent
# pipx / pip --user put the command in ~/.local/bin; adjust ExecStart if it is elsewhere.
"""

_PLAIN_ARG = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")


def unit_arg(arg: str) -> str:
    """``arg`` as one word of a unit's ``ExecStart=``: specifiers (%) and variables ($)
    escaped, quoted if it has anything but plain characters."""
    if any(not c.isprintable() for c in arg):
        raise InstallError(f"{arg!r} cannot be written into a systemd unit")
    escaped = arg.replace("%", "%%").replace("$", "$$")
    if _PLAIN_ARG.fullmatch(arg):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_unit(exec_start: str, *, system: bool, header: str) -> str:
    """The agent's unit, ``exec_start`` already in unit syntax (``unit_arg``)."""
    wanted_by = "multi-user.target" if system else "default.target"
    return header + _UNIT_BODY.format(exec_start=exec_start, wanted_by=wanted_by)


def agent_command() -> list[str]:
    """This installation's ``vpool-agent`` (the console script next to this interpreter,
    as pip and pipx install it), else this interpreter running its module."""
    python = Path(sys.executable).absolute()
    script = python.parent / "vpool-agent"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [str(python), "-m", "vpool.worker_agent.cli"]


def agent_argv(layout: Layout) -> list[str]:
    """What the unit starts: this installation's agent with the settings join wrote."""
    return [*agent_command(), "--config", str(layout.settings_file)]


def unit_text(layout: Layout, url: str) -> str:
    header = (
        f"# Written by `vpool-agent join` (vpool {__version__}) for the pool at {url};\n"
        "# `vpool-agent leave` stops and removes it. The system unit runs the agent as root\n"
        "# (its sandboxes and checkpoints need it; every rank runs without privileges).\n"
        if layout.system
        else f"# Written by `vpool-agent join` (vpool {__version__}) for the pool at {url};\n"
        "# `vpool-agent leave` stops and removes it.\n"
    )
    exec_start = " ".join(unit_arg(a) for a in agent_argv(layout))
    return render_unit(exec_start, system=layout.system, header=header)


# -- systemd ----------------------------------------------------------------------------------


class Systemd:
    """systemctl, for the user's manager or the system's. Tests replace it."""

    def __init__(self, system: bool) -> None:
        self.system = system

    def running(self) -> bool:
        """Whether systemd is this machine's init (what ``sd_booted()`` checks)."""
        return Path("/run/systemd/system").is_dir()

    def run(self, *args: str) -> tuple[int, str]:
        """``systemctl [--user] ARGS``: its exit status and what it said."""
        cmd = self.command(*args)
        try:
            res = subprocess.run(
                cmd, capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return 1, describe(exc)
        return res.returncode, (res.stderr.strip() or res.stdout.strip())

    def command(self, *args: str) -> list[str]:
        return ["systemctl", *([] if self.system else ["--user"]), *args]

    def show(self, *args: str) -> str:
        return shlex.join(self.command(*args))


# -- the record -------------------------------------------------------------------------------


class JoinRecord(msgspec.Struct, frozen=True):
    """What ``join`` made, so that ``leave`` removes exactly that."""

    coordinator_url: str
    agent_id: str
    name: str
    system: bool
    settings: str
    work_dir: str
    unit: str = ""  # "" with --no-service
    files: list[str] = []  # files join wrote (the settings, the CA, a new key, the unit)
    work_made: bool = False  # join made the work directory: leave removes it and what it holds
    dirs: list[str] = []  # directories join made, outermost first: removed once empty
    joined: float = 0.0


def read_record(layout: Layout) -> JoinRecord | None:
    try:
        data = layout.record_file.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return msgspec.json.decode(data, type=JoinRecord)
    except msgspec.DecodeError as exc:
        raise InstallError(f"{layout.record_file} is unreadable ({exc}): remove it") from exc


def _write(path: Path, data: bytes, mode: int) -> None:
    """``path`` with ``data`` and ``mode``, all at once (a temporary file renamed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)  # whatever the umask took away
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _make_dirs(path: Path) -> list[Path]:
    """Make ``path`` and its missing parents (0700); those made, outermost first."""
    missing: list[Path] = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(mode=0o700, exist_ok=True)
    return list(reversed(missing))


@dataclass
class _Made:
    """What a join has made so far: undone if it fails."""

    files: list[Path] = field(default_factory=list)
    dirs: list[Path] = field(default_factory=list)
    work_made: bool = False

    def dirs_for(self, path: Path) -> None:
        self.dirs += _make_dirs(path)

    def write(self, path: Path, data: bytes, mode: int) -> None:
        self.dirs_for(path.parent)
        existed = path.exists()
        _write(path, data, mode)
        if not existed:
            self.files.append(path)

    def undo(self, work_dir: Path) -> None:
        for f in reversed(self.files):
            f.unlink(missing_ok=True)
        if self.work_made:
            shutil.rmtree(work_dir, ignore_errors=True)
        for d in reversed(self.dirs):
            with contextlib.suppress(OSError):  # not empty: something else is in it
                d.rmdir()


# -- join -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JoinRequest:
    url: str
    token: str
    ca_file: Path | None = None
    ca_sha256: str = ""
    slots: int = 0
    name: str = ""
    service: bool = True


def parse_digest(text: str) -> str:
    """A SHA-256 digest as 64 lowercase hex digits: colons, spaces and case as openssl or a
    person wrote them are fine."""
    digest = re.sub(r"[\s:]", "", text).lower()
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise InstallError(f"{text!r} is not a SHA-256 digest (64 hex digits)")
    return digest


def check_ca(pem: bytes, where: str, digest: str = "") -> str:
    """The CA's SHA-256 after checking ``pem`` is one CA certificate (whose digest is
    ``digest``, if given)."""
    try:
        found = pki.fingerprint(pem)
        is_ca = pki.is_ca(pem)
    except ValueError as exc:
        raise InstallError(f"{where} is not a PEM certificate ({exc})") from exc
    if not is_ca:
        raise InstallError(f"{where} is not a CA certificate (the pool's ca.pem is)")
    if digest and found != digest:
        raise InstallError(
            f"{where} has the SHA-256 {found}, not the {digest} you were given: it is not "
            "trusted (check the digest with the pool's operator; someone between you and "
            "the pool could have swapped the certificate)"
        )
    return found


async def fetch_ca(url: str, transport: httpx.AsyncBaseTransport | None = None) -> bytes:
    """The coordinator's ``GET /api/v1/pool/ca``, over a connection that checks nothing:
    what it gives is trusted only once its digest is checked."""
    where = f"{url}/api/v1/pool/ca"
    try:
        async with httpx.AsyncClient(
            verify=False, transport=transport, timeout=httpx.Timeout(CONNECT_WAIT)
        ) as http:
            resp = await http.get(where)
    except (httpx.HTTPError, OSError) as exc:
        raise InstallError(f"cannot fetch the pool CA from {where}: {describe(exc)}") from exc
    if resp.status_code == 404:
        raise InstallError(
            f"{url} does not serve its CA (its operator has not set tls_ca): ask for the "
            "pool's ca.pem and give it as --ca FILE"
        )
    if resp.status_code != 200:
        raise InstallError(f"GET {where} answered {resp.status_code}: {resp.text[:200]}")
    return resp.content


def _agent_settings(req: JoinRequest, layout: Layout, ca: Path | None) -> dict[str, object]:
    """The settings join writes: the agent's directories named, so the unit needs no
    environment; no join token (the key is the credential once enrolled)."""
    values: dict[str, object] = {"coordinator_url": req.url}
    if ca is not None:
        values["coordinator_ca"] = str(ca)
    if req.name:
        values["name"] = req.name
    if req.slots:
        values["slots"] = req.slots
    values["identity_dir"] = str(layout.identity_dir)
    values["work_dir"] = str(layout.work_dir)
    if layout.system:
        # Not in the private work directory: the desktop's users ask a system agent too.
        values["control_socket"] = str(SYSTEM_CONTROL_SOCKET)
    return values


async def _enroll(
    settings: AgentSettings, transport: httpx.AsyncBaseTransport | None
) -> EnrollResponse:
    key = identity.load_or_create_key(settings.identity_path)
    async with CoordinatorClient.of(settings, transport) as client:
        try:
            with trio.fail_after(CONNECT_WAIT):
                return await enroll(settings, client, key)
        except trio.TooSlowError:
            raise InstallError(
                f"no answer from {settings.coordinator_url} within {CONNECT_WAIT:g} s"
            ) from None
        except CoordinatorUntrusted as exc:
            raise InstallError(
                f"{exc}. Give the pool's CA: --ca FILE, or --ca-sha256 HEX (what "
                "`vpool-coordinator join-token create` printed for you)"
            ) from exc


def join(
    req: JoinRequest,
    layout: Layout,
    systemd: Systemd,
    say: Say,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
) -> JoinRecord:
    """Enroll this machine in the pool at ``req.url`` and install the agent as a service.
    ``transport`` replaces the network to the coordinator (tests)."""
    url = req.url.rstrip("/")
    req = dataclasses.replace(req, url=url)
    if not url.startswith(("https://", "http://")):
        raise InstallError(f"{url!r} is not the coordinator's https:// URL")
    existing = read_record(layout)
    if existing is not None:
        raise InstallError(
            f"this {'machine' if layout.system else 'user'} joined {existing.coordinator_url} "
            f"already, as {existing.agent_id} ({layout.record_file}): `vpool-agent leave` first"
        )
    if layout.settings_file.exists():
        raise InstallError(
            f"{layout.settings_file} exists (settings made by hand?): move it away, then join"
        )
    made = _Made()
    try:
        return _join(req, layout, systemd, say, made, transport)
    except BaseException:
        made.undo(layout.work_dir)
        raise


def _join(
    req: JoinRequest,
    layout: Layout,
    systemd: Systemd,
    say: Say,
    made: _Made,
    transport: httpx.AsyncBaseTransport | None,
) -> JoinRecord:
    ca: Path | None = None
    if req.ca_file is not None or req.ca_sha256:
        digest = parse_digest(req.ca_sha256) if req.ca_sha256 else ""
        if req.ca_file is not None:
            try:
                pem = req.ca_file.read_bytes()
            except OSError as exc:
                raise InstallError(f"cannot read {req.ca_file}: {exc.strerror}") from exc
            found = check_ca(pem, str(req.ca_file), digest)
            how = "its digest checked" if digest else "as given"
        else:
            pem = trio.run(fetch_ca, req.url, transport)
            found = check_ca(pem, f"the CA {req.url} served", digest)
            how = "fetched from the coordinator, its digest checked"
        made.write(layout.ca_file, pem, 0o644)
        ca = layout.ca_file
        say(f"pool CA: {ca} (SHA-256 {found}, {how})")
    elif req.url.startswith("https://"):
        say("pool CA: none given, the coordinator is checked against this system's CAs")

    values = _agent_settings(req, layout, ca)
    settings = AgentSettings(
        coordinator_url=req.url,
        coordinator_ca=str(ca) if ca is not None else "",
        join_token=req.token,
        name=req.name,
        slots=req.slots,
        identity_dir=str(layout.identity_dir),
        work_dir=str(layout.work_dir),
    )
    key_file = layout.identity_dir / identity.KEY_FILE
    new_key = not key_file.exists()
    made.dirs_for(layout.identity_dir)
    if new_key:
        made.files.append(key_file)  # made by the enrollment below
    enrolled = trio.run(_enroll, settings, transport)
    say(
        f"enrolled in {req.url} as {enrolled.agent_id} (name {settings.agent_name}, "
        f"{settings.slot_count} slots)"
    )
    say(f"identity key: {key_file}{' (new)' if new_key else ' (kept: it was there)'}")

    header = (
        f"# Written by `vpool-agent join` on {dt.date.today()}: `vpool-agent leave` removes it.\n"
        "# The join token is not kept: the identity key is this agent's credential now.\n"
        "# Every setting: docs/configuration.md (or `vpool-agent --help`).\n"
    )
    made.write(layout.settings_file, (header + tomli_w.dumps(values)).encode(), 0o600)
    say(f"settings: {layout.settings_file}")
    made.dirs_for(layout.work_dir)
    made.work_made = layout.work_dir in made.dirs
    say(f"work directory: {layout.work_dir}{'' if made.work_made else ' (it was there)'}")

    unit = ""
    if req.service:
        made.write(layout.unit_file, unit_text(layout, req.url).encode(), 0o644)
        unit = str(layout.unit_file)
        kind = "system" if layout.system else "user"
        say(f"systemd {kind} unit: {layout.unit_file}")
    record = JoinRecord(
        coordinator_url=req.url,
        agent_id=enrolled.agent_id,
        name=settings.agent_name,
        system=layout.system,
        settings=str(layout.settings_file),
        work_dir=str(layout.work_dir),
        unit=unit,
        files=[str(f) for f in made.files],
        work_made=made.work_made,
        dirs=[str(d) for d in made.dirs],
        joined=dt.datetime.now(dt.UTC).timestamp(),
    )
    made.write(layout.record_file, msgspec.json.encode(record), 0o600)
    if req.service:
        _start(layout, systemd, say)
    else:
        say(f"no service (--no-service): run the agent with  {shlex.join(agent_argv(layout))}")
    if shutil.which(settings.bwrap) is None:
        say(
            "warning: bubblewrap (bwrap) is not installed: the agent takes no ranks without "
            "a sandbox (Debian, Ubuntu: sudo apt install bubblewrap; Fedora: sudo dnf "
            "install bubblewrap)"
        )
    say("`vpool-agent leave` undoes all of this; `vpool-agent selftest` shows what a rank can do")
    return record


def _start(layout: Layout, systemd: Systemd, say: Say) -> None:
    """Enable and start the unit; where systemd cannot, say how to run the agent by hand."""
    by_hand = shlex.join(agent_argv(layout))
    if not systemd.running():
        say(
            "service: not started, systemd is not running here (no /run/systemd/system); "
            f"run the agent by hand:  {by_hand}"
        )
        return
    for args in (("daemon-reload",), ("enable", "--now", UNIT_NAME)):
        code, said = systemd.run(*args)
        if code != 0:
            say(
                f"service: `{systemd.show(*args)}` failed ({said or f'exit {code}'}); "
                f"start it once that works, or run the agent by hand:  {by_hand}"
            )
            return
    _code, state = systemd.run("is-active", UNIT_NAME)
    journal = "journalctl -u" if layout.system else "journalctl --user -u"
    say(f"service: enabled and started ({state or 'unknown'}); its log: {journal} vpool-agent -f")
    if not layout.system:
        say(
            "a user service stops when you log out; to keep volunteering while logged out: "
            f"sudo loginctl enable-linger {_user()}"
        )


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return "$USER"


# -- leave ------------------------------------------------------------------------------------


def leave_plan(record: JoinRecord) -> list[str]:
    """What leave removes, one line each."""
    lines = []
    if record.unit:
        lines.append(f"the service {record.unit} (stopped and disabled first)")
    lines += [f for f in record.files if f != record.unit]
    if record.work_made:
        lines.append(f"{record.work_dir} and everything in it (the agent's work directory)")
    return lines


def agent_answers(work_dir: Path) -> Path | None:
    """The socket of the agent with ``work_dir`` if an agent listens on it (one runs with it):
    ``work_dir/agent.sock``, or where the agent put it when that path was too long."""
    try:
        path = choose_socket_path(work_dir, SOCKET_NAME, make=False)
    except AgentError:
        return None  # no agent could have run with it
    if not path.exists():
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(str(path))
        except OSError:
            return None  # a stale socket of an agent that died
    return path


def leave(
    layout: Layout, systemd: Systemd, say: Say, confirm: Callable[[list[str]], bool]
) -> JoinRecord | None:
    """Undo what join did (``read_record``); None if there is nothing to undo. ``confirm``
    sees the list of what would be removed and says whether to go on."""
    record = read_record(layout)
    if record is None:
        say(
            f"nothing to undo: no record of a join at {layout.record_file} (this "
            f"{'machine' if layout.system else 'user'} has not joined, or left already)"
        )
        if not layout.system and SYSTEM_LAYOUT.record_file.exists():
            say("this machine joined as a system service: sudo vpool-agent leave")
        return None
    if not confirm(leave_plan(record)):
        raise click.Abort()
    if record.unit:
        _stop(record, systemd, say)
    running = agent_answers(Path(record.work_dir))
    if running is not None:
        raise InstallError(
            f"an agent still runs with these settings (its socket {running} answers): stop "
            "it first (Ctrl-C, or kill its pid), then leave again"
        )
    for name in [f for f in record.files if f != str(layout.record_file)]:
        _remove(Path(name), say)
        if name == record.unit and systemd.running():
            systemd.run("daemon-reload")
    if record.work_made:
        _remove_tree(Path(record.work_dir), say)
    _remove(layout.record_file, say)
    for d in reversed(record.dirs):
        with contextlib.suppress(OSError):  # gone, or something else is in it: kept
            Path(d).rmdir()
    say(f"left {record.coordinator_url}: {record.agent_id} ({record.name}) runs here no more")
    return record


def _stop(record: JoinRecord, systemd: Systemd, say: Say) -> None:
    if not systemd.running():
        say("service: systemd is not running here, nothing to stop")
        return
    if not Path(record.unit).exists():
        return
    code, said = systemd.run("disable", "--now", UNIT_NAME)
    if code == 0:
        say("service: stopped (its ranks checkpointed and handed back) and disabled")
    else:
        say(f"service: `{systemd.show('disable', '--now', UNIT_NAME)}` failed: {said}")


def _remove(path: Path, say: Say) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        return
    say(f"removed {path}")


def _remove_tree(path: Path, say: Say) -> None:
    """``path`` and all in it, whatever modes a rank left on its directories."""
    if not path.is_dir() or path.is_symlink():
        return
    for top, dirs, _files in os.walk(path):
        for d in dirs:
            with contextlib.suppress(OSError):
                if not os.path.islink(os.path.join(top, d)):
                    os.chmod(os.path.join(top, d), 0o700)
    shutil.rmtree(path, ignore_errors=True)
    say(f"removed {path}" if not path.exists() else f"could not remove all of {path}")


# -- the commands -----------------------------------------------------------------------------

SCOPE_OPTION = click.option(
    "--system/--user",
    "system",
    default=None,
    help="A system service (the default as root: settings in /etc/vpool, the agent's files "
    "in /var/lib/vpool-agent) or this user's (otherwise).",
)

JOIN_EPILOG = """\b
Example (the command `vpool-coordinator join-token create` printed):
  vpool-agent join https://pool.example.org:8443 vpj_... --ca-sha256 3f1c...
  vpool-agent join https://pool.example.org:8443 vpj_... --ca ca.pem --slots 4
\b
Exit status: 0 when enrolled and installed (the service may still not have started where
systemd does not run: it says so), 1 when nothing was installed.
"""


@click.command(epilog=JOIN_EPILOG)
@click.argument("url")
@click.argument("token")
@click.option(
    "--ca",
    "ca_file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="The pool's CA certificate (ca.pem from its operator).",
)
@click.option(
    "--ca-sha256",
    metavar="HEX",
    default="",
    help="Fetch the pool CA from the coordinator and trust it only if its SHA-256 is HEX.",
)
@click.option("--slots", type=click.IntRange(min=1), help="Ranks at once (default: every CPU).")
@click.option("--name", default="", help="Name shown in the pool (default: the hostname).")
@click.option("--no-service", is_flag=True, help="Write no systemd unit; run the agent yourself.")
@SCOPE_OPTION
def join_command(
    url: str,
    token: str,
    ca_file: Path | None,
    ca_sha256: str,
    slots: int | None,
    name: str,
    no_service: bool,
    system: bool | None,
) -> None:
    """Join the pool at URL with the join TOKEN its operator gave you: enroll this machine,
    write the agent's settings, and install and start the agent as a systemd service (a
    user service; a system service when run as root). Prints each thing it does.

    The token is needed once: the agent's identity key is its credential afterwards, so the
    settings do not keep it. `vpool-agent leave` undoes all of it.
    """
    logging.getLogger("vpool.agent").setLevel(logging.WARNING)  # join says what it does
    req = JoinRequest(
        url=url,
        token=token,
        ca_file=ca_file,
        ca_sha256=ca_sha256,
        slots=slots or 0,
        name=name,
        service=not no_service,
    )
    try:
        layout = layout_for(system)
        join(req, layout, Systemd(layout.system), click.echo)
    except (AgentError, OSError) as exc:
        click.echo(f"vpool-agent: {exc}", err=True)
        click.echo("vpool-agent: nothing was installed", err=True)
        sys.exit(1)


@click.command()
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@SCOPE_OPTION
def leave_command(yes: bool, system: bool | None) -> None:
    """Leave the pool: stop, disable and remove the service `vpool-agent join` installed, and
    remove the settings, the pool CA, the identity key and the work directory it made
    (asking first, unless --yes). Prints what it removed. Running it again is harmless.

    \b
    Example:
      vpool-agent leave
    """

    def confirm(plan: Sequence[str]) -> bool:
        click.echo("This removes:")
        for line in plan:
            click.echo(f"  {line}")
        return yes or click.confirm("Go on?", default=False)

    try:
        layout = layout_for(system)
        leave(layout, Systemd(layout.system), click.echo, confirm)
    except (AgentError, OSError) as exc:
        click.echo(f"vpool-agent: {exc}", err=True)
        sys.exit(1)
