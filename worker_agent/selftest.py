"""``vpool-agent selftest``: what a rank can and cannot do here, found by trying.

A test rank runs ``selftest_probe`` in a sandbox made exactly as a real rank's is
(``sandboxed.start``, the agent's own settings and limits) and tries the hostile acts a
stranger's program would: read the agent's identity key and files, see or signal other
processes, find a secret in an environment, reach the coordinator or any other host, write to
the system, make namespaces, ptrace, mount, use the kernel keyring or netlink. Each act has
the outcome a sandbox must give (``EXPECTED``); the report says what each probe saw and
whether it matched. Limits are read back from the rank's cgroup. With CRIU, a checkpoint of a
sandboxed process is made and restored into a new sandbox, and the restored process is asked
what it can do: a restore must give back the same confinement.

The level: "sandbox" when every probe matched and the cgroup set the memory and process
limits; "sandbox-rlimits" when the probes matched but no cgroup could be had; "none" when no
sandbox could be made, or a probe did not match (the agent then treats itself as unsandboxed).
The agent runs this at start and reports the result to the coordinator.

With ``selftest_cache`` set, the agent keeps what it found in that file and, at its next start,
reuses it instead of probing again when nothing the outcome depends on changed: the machine's
boot, the user, vpool's own code, the interpreter, bwrap and CRIU (by their files), the seccomp
filter, the cgroups, the view and the settings (``cache_key``). Only a clean result is kept (a
sandbox whose every probe matched, checkpoints that worked or no CRIU to try). A local pool's
agents share one (`vsdk local up --selftest-cache`): three agents on one machine would find the
same thing three times, every time the pool starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import trio

from vpool import __version__, paths
from vpool.protocol.api import IsolationReport
from vpool.sizes import format_size
from vpool.worker_agent import cgroups, criu, sandbox, sandboxed
from vpool.worker_agent.proxy import choose_socket_path
from vpool.worker_agent.settings import AgentSettings

log = logging.getLogger("vpool.agent")

PROBE_SCRIPT = Path(__file__).with_name("selftest_probe.py")
_TIMEOUT = 60.0
CACHE_ENTRIES = 8  # keys one cache file keeps (the newest)
# Settings that differ between agents of one machine and change nothing a probe can see from
# inside the sandbox: every other setting is part of the cache key (a new one too, so that
# forgetting it here costs a probe, never a wrong reuse).
NOT_KEYED = frozenset(
    {
        "name",
        "coordinator_url",
        "coordinator_ca",
        "join_token",
        "identity_dir",
        "work_dir",
        "control_socket",
        "fingerprint_salt",
        "selftest_cache",
    }
)
_REFUSED_FILE = frozenset({"FileNotFoundError", "PermissionError"})

# probe -> (what it tries, the outcome a sandbox gives: a test of what the probe saw)
EXPECTED: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "read_identity_key": ("read the agent's identity key", lambda v: v in _REFUSED_FILE),
    "read_agent_files": ("read the agent's work directory", lambda v: v in _REFUSED_FILE),
    "read_shadow": ("read /etc/shadow", lambda v: v in _REFUSED_FILE),
    "other_processes": ("see processes outside its sandbox", lambda v: v == []),
    "signal_agent": ("signal the agent", lambda v: v == "ProcessLookupError"),
    "secret_in_environ": ("find a rank secret in an environment", lambda v: v is False),
    "connect_coordinator": (
        "connect to the coordinator",
        # No listener on the sandbox's own loopback, no route out, or no name service.
        lambda v: v in ("ECONNREFUSED", "ENETUNREACH", "gaierror"),
    ),
    "connect_outside": ("connect to another host", lambda v: v == "ENETUNREACH"),
    "write_system": ("write to /usr", lambda v: v in ("EROFS", "EACCES")),
    "write_work": ("write to its own work directory", lambda v: v == "ok"),
    "write_root": ("plant /etc/ld.so.preload", lambda v: v in ("EROFS", "EACCES")),
    "write_kernel_settings": ("write /proc/sys (core_pattern)", lambda v: v in ("EROFS", "EACCES")),
    "write_sysrq": ("write /proc/sysrq-trigger", lambda v: v in ("EROFS", "EACCES", "ENOENT")),
    "host_boot_id": ("read the machine's boot_id", lambda v: v is False),
    "new_user_namespace": ("make a user namespace", lambda v: v == "EPERM"),
    "ptrace": ("use ptrace", lambda v: v == "EPERM"),
    "mount": ("mount a file system", lambda v: v == "EPERM"),
    "keyctl": ("use the kernel keyring", lambda v: v == "EPERM"),
    "netlink_socket": ("open a netlink socket", lambda v: v == "EAFNOSUPPORT"),
    "capabilities": ("hold capabilities", lambda v: v == "0000000000000000"),
    # Run as root, the bounding set is the host's to empty; an unprivileged agent's ranks are
    # in a user namespace of their own, whose capabilities mean nothing outside it.
    "bounding_set": (
        "keep a capability bounding set",
        lambda v: v == "0000000000000000" or os.getuid() != 0,
    ),
    "no_new_privs": ("gain privileges (no_new_privs)", lambda v: v == "1"),
    "seccomp": ("run without the seccomp filter", lambda v: v == "2"),
}


@dataclass
class SelfTest:
    """What the selftest found."""

    level: str
    detail: str = ""
    probes: dict[str, Any] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)  # probes that did not give the outcome
    limits: dict[str, int | None] = field(default_factory=dict)  # read back from the cgroup
    checkpoints: str = ""  # "ok", or why sandboxed ranks cannot be checkpointed here
    restored: dict[str, str] = field(default_factory=dict)  # the restored process's probes

    def report(self, limits: sandboxed.RankLimits) -> IsolationReport:
        return IsolationReport(
            level=self.level,
            detail=self.detail,
            rank_memory=limits.memory if self.level == "sandbox" else 0,
            rank_processes=limits.processes if self.level == "sandbox" else 0,
            rank_disk=limits.disk if self.level != "none" else 0,
            checkpoints=self.checkpoints == "ok",
            probes={k: str(v) for k, v in self.probes.items()},
        )

    def lines(self) -> list[str]:
        out = [f"isolation level: {self.level}" + (f" ({self.detail})" if self.detail else "")]
        for name, (what, ok) in EXPECTED.items():
            if name in self.probes:
                verdict = "refused" if ok(self.probes[name]) else "NOT REFUSED"
                if name == "write_work":
                    verdict = "allowed" if ok(self.probes[name]) else "NOT ALLOWED"
                out.append(f"  {what:<40} {verdict:<12} ({self.probes[name]})")
        for name, value in self.limits.items():
            shown = "NOT SET" if value is None else str(value)
            if name == "memory" and value is not None:
                shown = format_size(value)
            elif name == "cpu" and value is not None:
                shown = f"weight {value} (the lowest)"
            out.append(f"  limit {name:<34} {shown}")
        if "tmp_bytes" in self.probes:
            out.append(f"  {'private /tmp of':<40} {format_size(self.probes['tmp_bytes'])}")
        out.append(f"  checkpoints of sandboxed ranks: {self.checkpoints or 'not tried'}")
        for name, value in self.restored.items():
            out.append(f"    after a restore, {name}: {value}")
        return out


async def run_selftest(
    settings: AgentSettings,
    iso: sandboxed.Isolation,
    limits: sandboxed.RankLimits,
    *,
    criu_ok: bool,
) -> SelfTest:
    """Probe the sandbox ``iso`` makes (and its checkpoints, with ``criu_ok``)."""
    if not iso.on:
        return SelfTest(level="none", detail=iso.reason)
    root = await trio.to_thread.run_sync(paths.private_dir, settings.work_path / "selftest")
    tmp = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    server = socket.socket(socket.AF_UNIX)
    # A stand-in for the agent's socket (the test rank does not use it), at a path short
    # enough for a socket address.
    sock_path = choose_socket_path(tmp)
    try:
        server.bind(str(sock_path))
        server.listen()
        rank_dir = tmp / "rank"
        (rank_dir / "work").mkdir(parents=True)
        (rank_dir / "home").mkdir()
        shutil.copy(PROBE_SCRIPT, rank_dir / "work" / "probe.py")
        result = await _probe(settings, iso, limits, sock_path, rank_dir)
        if criu_ok and not result.failed:
            try:
                result.restored = await _checkpoint(settings, iso, limits, sock_path, tmp, rank_dir)
                bad = [k for k, v in result.restored.items() if not EXPECTED[k][1](v)]
                result.checkpoints = (
                    "ok" if not bad else f"a restored rank is less confined ({', '.join(bad)})"
                )
            except (sandboxed.SandboxStartError, criu.CriuError, OSError, ValueError) as exc:
                result.checkpoints = f"failed: {exc}"
        elif not criu_ok:
            result.checkpoints = "no usable CRIU"
        return result
    finally:
        server.close()
        sock_path.unlink(missing_ok=True)
        await trio.to_thread.run_sync(lambda: shutil.rmtree(tmp, ignore_errors=True))


async def run_cached(
    settings: AgentSettings,
    iso: sandboxed.Isolation,
    limits: sandboxed.RankLimits,
    *,
    criu_ok: bool,
) -> SelfTest:
    """``run_selftest``, or what it found before in ``settings.selftest_cache`` under the same
    key (module docstring)."""
    if not settings.selftest_cache or not iso.on:
        return await run_selftest(settings, iso, limits, criu_ok=criu_ok)
    path = Path(settings.selftest_cache)
    key = await trio.to_thread.run_sync(cache_key, settings, iso, limits, criu_ok)
    found = await trio.to_thread.run_sync(load_cached, path, key)
    if found is not None:
        log.info("selftest: the findings kept in %s (nothing they depend on changed)", path)
        return found
    result = await run_selftest(settings, iso, limits, criu_ok=criu_ok)
    if result.level != "none" and result.checkpoints in ("ok", "no usable CRIU"):
        try:
            await trio.to_thread.run_sync(store_cached, path, key, result)
        except OSError as exc:
            log.warning("cannot keep the selftest's findings in %s: %s", path, exc)
    return result


def cache_key(
    settings: AgentSettings, iso: sandboxed.Isolation, limits: sandboxed.RankLimits, criu_ok: bool
) -> str:
    """A digest of everything the selftest's outcome depends on (blocking: stats files)."""

    def stat(path: str | Path) -> list[object]:
        try:
            st = os.stat(path)
        except OSError as exc:
            return [str(path), type(exc).__name__]
        return [str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]

    code = Path(__file__).parent
    material = {
        "vpool": __version__,
        "code": [stat(f) for f in sorted(code.glob("*.py"))],
        "boot": _host_boot_id(),
        "kernel": os.uname().release,
        "uid": os.getuid(),
        "settings": {
            f.name: str(getattr(settings, f.name))
            for f in dataclasses.fields(settings)
            if f.name not in NOT_KEYED
        },
        "python": stat(os.path.realpath(settings.python_path)),
        "bwrap": stat(iso.bwrap),
        "criu": [criu_ok, stat(os.path.realpath(shutil.which(settings.criu) or settings.criu))],
        "seccomp": hashlib.sha256(iso.seccomp).hexdigest(),
        "cgroup": None
        if iso.cgroup is None
        else [iso.cgroup.version, sorted(iso.cgroup.controllers), iso.cgroup.reason],
        "view": [list(iso.view.ro), [list(x) for x in iso.view.links]] if iso.view else None,
        "limits": repr(limits),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def load_cached(path: Path, key: str) -> SelfTest | None:
    """The findings kept under ``key``, or None. A file this user does not own, or that others
    may write, is not read: findings that say a sandbox holds are trusted only from the agent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            log.warning("selftest cache %s is not this user's alone: not used", path)
            return None
        try:
            entry = json.loads(f.read(1 << 20)).get(key)
            return SelfTest(**entry) if isinstance(entry, dict) else None
        except (ValueError, TypeError, AttributeError):
            return None  # damaged or from another version: probe again


def store_cached(path: Path, key: str, result: SelfTest) -> None:
    """Keep ``result`` under ``key`` (with the newest others), replacing the file atomically."""
    try:
        with open(path, "rb") as f:
            kept = json.loads(f.read(1 << 20))
        kept = kept if isinstance(kept, dict) else {}
    except (OSError, ValueError):
        kept = {}
    kept.pop(key, None)
    kept[key] = dataclasses.asdict(result)
    kept = dict(list(kept.items())[-CACHE_ENTRIES:])
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".selftest-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:  # mkstemp: mode 0600
            json.dump(kept, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _targets(settings: AgentSettings) -> dict[str, Any]:
    url = urlsplit(settings.coordinator_url)
    return {
        "private": {
            "identity_key": str(settings.identity_path / "identity.key"),
            "agent_files": str(settings.work_path / "agent.sock"),
        },
        "agent_pid": os.getpid(),
        "boot_id": _host_boot_id(),
        "coordinator_host": url.hostname or "127.0.0.1",
        "coordinator_port": url.port or 443,
    }


def _host_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


async def _probe(
    settings: AgentSettings,
    iso: sandboxed.Isolation,
    limits: sandboxed.RankLimits,
    sock_path: Path,
    rank_dir: Path,
) -> SelfTest:
    python = settings.python_path
    program = [python, "-I", "-S", f"{sandbox.RANK_DIR}/work/probe.py"]
    out = await _run_boxed(
        iso, limits, sock_path, rank_dir, [*program, json.dumps(_targets(settings))], python
    )
    probes = json.loads(out.decode().strip().splitlines()[-1])
    applied = probes.pop("_limits", {})
    level, detail, failed = judge(probes, iso.cgroup)
    return SelfTest(level=level, detail=detail, probes=probes, failed=failed, limits=applied)


def judge(probes: dict[str, Any], cg: cgroups.Support | None) -> tuple[str, str, list[str]]:
    """The level, why it is not stronger, and the probes that were not refused."""
    failed = [k for k, (_, ok) in EXPECTED.items() if k in probes and not ok(probes[k])]
    missing = [k for k in EXPECTED if k not in probes and k != "keyctl"]
    if failed or missing:
        parts = []
        if failed:
            parts.append("probes not refused: " + ", ".join(failed))
        if missing:
            parts.append("probes that did not run: " + ", ".join(missing))
        return "none", "; ".join(parts), failed + missing
    if cg is None or not cg.version:
        return "sandbox-rlimits", f"no cgroup: {cg.reason if cg is not None else 'not probed'}", []
    if not {"memory", "pids"} <= cg.controllers:
        return "sandbox-rlimits", f"cgroup without memory or pids limits: {cg.reason}", []
    return "sandbox", "", []


async def _start(
    iso: sandboxed.Isolation,
    limits: sandboxed.RankLimits,
    sock_path: Path,
    rank_dir: Path,
    program: list[str],
    python: str,
    name: str,
) -> sandboxed.Sandboxed:
    """``program`` in a sandbox made as a rank's is, its stdout and stderr on one pipe."""
    return await sandboxed.start(
        iso,
        sandbox.Mounts(rank_dir, sock_path),
        lambda status_fd: sandbox.init_argv(
            python,
            program,
            status_fd=status_fd,
            linger=0,
            stdin=False,
            nofile=limits.open_files,
            fsize=limits.disk,
            sched_idle=limits.sched_idle,
        ),
        name=f"{name}-{os.getpid()}",
        limits=limits,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": f"{sandbox.RANK_DIR}/home"},
        cwd=rank_dir / "work",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


async def _run_boxed(
    iso: sandboxed.Isolation,
    limits: sandboxed.RankLimits,
    sock_path: Path,
    rank_dir: Path,
    program: list[str],
    python: str,
) -> bytes:
    """Run ``program`` as a rank would run, to its end; its stdout, with the cgroup's limits
    as read back added as ``_limits`` to the last JSON line."""
    box = await _start(iso, limits, sock_path, rank_dir, program, python, "selftest")
    try:
        applied = box.cgroup.limits_applied() if box.cgroup is not None else {}
        assert box.process.stdout is not None
        data = b""
        with trio.fail_after(_TIMEOUT):
            while chunk := await box.process.stdout.receive_some(65536):
                data += chunk
            await box.wait_ended()
    finally:
        await box.aclose()
    lines = data.decode(errors="replace").strip().splitlines()
    try:
        last = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise ValueError(f"the probe printed no result: {data[-500:]!r}") from None
    last["_limits"] = applied
    return (json.dumps(last) + "\n").encode()


async def _checkpoint(
    settings: AgentSettings,
    iso: sandboxed.Isolation,
    limits: sandboxed.RankLimits,
    sock_path: Path,
    tmp: Path,
    rank_dir: Path,
) -> dict[str, str]:
    """Dump a sandboxed process's clone, restore it in a new sandbox; what it holds then."""
    python = settings.python_path
    program = [python, "-I", "-S", f"{sandbox.RANK_DIR}/work/probe.py", "--clone"]
    box = await _start(iso, limits, sock_path, rank_dir, program, python, "selftest-dump")
    scratch = tmp / "ckpt"
    (scratch / "images").mkdir(parents=True)
    try:
        assert box.process.stdout is not None
        with trio.fail_after(_TIMEOUT):
            line = b""
            while b"\n" not in line:
                chunk = await box.process.stdout.receive_some(4096)
                if not chunk:
                    raise ValueError(f"the probe said nothing: {line!r}")
                line += chunk
        clone = int(json.loads(line.split(b"\n")[0])["clone"])
        await criu.dump(
            clone, scratch / "images", criu=settings.criu, log_dir=scratch, enter=box.init_pid
        )
    finally:
        await box.aclose()
    with open(scratch / "restore.log", "wb") as restore_log:  # noqa: ASYNC230 - an fd
        restored = await sandboxed.start_restore(
            iso,
            sandbox.Mounts(rank_dir, sock_path),
            scratch,
            python=python,
            criu=settings.criu,
            name=f"selftest-restore-{os.getpid()}",
            limits=limits,
            log=restore_log.fileno(),
        )
    try:
        with trio.fail_after(_TIMEOUT):
            await restored.process.wait()
    finally:
        await restored.aclose()
    status = criu.read_status(scratch / "status")
    if status != 0:
        tail = (scratch / "restore.log").read_text(errors="replace")[-500:]
        raise ValueError(f"the restored process ended with {status}: {tail}")
    seen = json.loads((rank_dir / "restored.json").read_text())
    return {k: str(v) for k, v in seen.items()}
