"""``vsdk local``: a whole pool on this machine, as background processes, without root.

Everything lives in ``vpool.paths.local_pool_dir()``::

    ca.pem ca.key                     the pool's own CA (clients and agents trust only it)
    coordinator/ config.toml cert.pem key.pem state/
    relay-<i>/   config.toml cert.pem key.pem data/
    agent-<i>/   config.toml identity/ work/
    run/<name>.ready.json             ready files written by the components
    logs/<name>.log                   each component's stdout and stderr
    pids.json                         [{name, pid, cmdline}] of what ``up`` started
    pool.json                         url and shape of the running pool

``up`` writes the client config so the next ``vsdk submit`` targets the local pool. ``down``
signals exactly the recorded pids, and only those whose ``/proc/<pid>/cmdline`` still matches the
recorded one: a pid reused by another program is never touched.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vpool import paths
from vpool.sdk import clientconfig, toml
from vpool.sdk.errors import LocalPoolError, VsdkError
from vpool.sdk.localpool_files import (  # noqa: F401  re-exported for callers
    DEFAULT_SLOTS,
    HOST,
    LOCAL_USER,
    TIMERS,
    Layout,
    Secrets,
    _quiet,
    _write_private,
    agent_argv,
    agent_settings,
    component_command,
    coordinator_argv,
    coordinator_settings,
    issue_secrets,
    layout,
    make_ca,
    make_server_cert,
    relay_argv,
    relay_settings,
    user_add_argv,
    write_config,
)

Progress = Callable[[str], None]

READY_TIMEOUT = 30.0
ENDED_WAIT = 2.0  # s from a closed ready pipe to the exit status
SELFTEST_CACHE = "local-pool-selftest.json"  # the agents' shared selftest_cache, in cache_dir()
STOP_TIMEOUT = 10.0
DEFAULT_AGENTS = 2
DEFAULT_RELAYS = 1

# Environment variables that would override the generated config files in the children.
_SETTING_PREFIXES = ("VPOOL_COORDINATOR_", "VPOOL_RELAY_", "VPOOL_AGENT_")


@dataclass(frozen=True)
class Recorded:
    """One process started by ``up``, as kept in pids.json."""

    name: str
    pid: int
    cmdline: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "pid": self.pid, "cmdline": self.cmdline}


def read_cmdline(pid: int) -> list[str] | None:
    """The argv of a live process, or None if there is no such process (or it is a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    if stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] in ("Z", "X"):
        return None
    return [part.decode(errors="surrogateescape") for part in raw.split(b"\0")[:-1]]


def status_of(rec: Recorded) -> str:
    """``running`` (same pid, same cmdline), ``gone``, or ``replaced`` (pid reused)."""
    cmd = read_cmdline(rec.pid)
    if cmd is None:
        return "gone"
    return "running" if cmd == rec.cmdline else "replaced"


def read_pids(lay: Layout) -> list[Recorded]:
    try:
        data = json.loads(lay.pids_file.read_text())
        return [
            Recorded(str(d["name"]), int(d["pid"]), [str(a) for a in d["cmdline"]]) for d in data
        ]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LocalPoolError(f"{lay.pids_file} is unreadable: {exc}") from exc


def write_pids(lay: Layout, recs: Sequence[Recorded]) -> None:
    tmp = lay.pids_file.with_suffix(".tmp")
    tmp.write_text(json.dumps([r.to_json() for r in recs], indent=1) + "\n")
    os.replace(tmp, lay.pids_file)


def running(lay: Layout) -> list[Recorded]:
    """The recorded processes that still run what was recorded."""
    return [r for r in read_pids(lay) if status_of(r) == "running"]


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: init reaps it


def stop(
    recs: Sequence[Recorded], *, timeout: float = STOP_TIMEOUT, progress: Progress = _quiet
) -> list[str]:
    """SIGTERM each recorded process that still matches its cmdline, wait up to ``timeout``,
    then SIGKILL the ones left. Returns warnings about processes that were not touched."""
    warnings: list[str] = []
    signalled: list[Recorded] = []
    for rec in reversed(recs):
        state = status_of(rec)
        if state == "gone":
            continue
        if state == "replaced":
            warnings.append(f"pid {rec.pid} ({rec.name}) now runs something else; not signalled")
            continue
        try:
            os.kill(rec.pid, signal.SIGTERM)
            signalled.append(rec)
            progress(f"stopping {rec.name} (pid {rec.pid})")
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while signalled and time.monotonic() < deadline:
        for rec in signalled:
            _reap(rec.pid)
        signalled = [r for r in signalled if status_of(r) == "running"]
        if signalled:
            time.sleep(0.05)
    for rec in signalled:
        if status_of(rec) == "running":
            warnings.append(f"{rec.name} (pid {rec.pid}) ignored SIGTERM; killed")
            try:
                os.kill(rec.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _reap(rec.pid)
    return warnings


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    tail = text.splitlines()[-lines:]
    return "\n".join("    " + line for line in tail) if tail else "    (log is empty)"


def _without_ready_fd(argv: Sequence[str]) -> list[str]:
    """A recorded command line without the ``--ready-fd N`` of the start it was read from."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--ready-fd":
            skip = True
        elif not arg.startswith("--ready-fd="):
            out.append(arg)
    return out


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(_SETTING_PREFIXES)}


class _Starter:
    """Starts components and remembers them, so a failed ``up`` stops what it started."""

    def __init__(self, lay: Layout, progress: Progress) -> None:
        self.lay = lay
        self.progress = progress
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.ready_pipes: dict[str, int] = {}  # name -> read end, until it said it is ready
        self.env = _child_env()

    def start(self, name: str, argv: list[str], *, again: bool = False) -> subprocess.Popen[bytes]:
        """Start component ``name``; ``again`` (a restart) appends to its log, which holds
        why it ended the first time, after a line that says when it restarted. It says it is
        ready over a pipe (``--ready-fd``, ``vpool.readyfile``), which ``wait_ready`` reads."""
        log = self.lay.log_file(name)
        log.parent.mkdir(parents=True, exist_ok=True)
        self.lay.ready_file(name).parent.mkdir(parents=True, exist_ok=True)
        self.lay.ready_file(name).unlink(missing_ok=True)
        read_end, write_end = os.pipe()
        try:
            with open(log, "ab" if again else "wb") as out:
                if again:
                    when = time.strftime("%Y-%m-%d %H:%M:%S %z")
                    out.write(f"\n--- vsdk local restart {name} at {when} ---\n".encode())
                    out.flush()
                try:
                    proc = subprocess.Popen(
                        [*_without_ready_fd(argv), "--ready-fd", str(write_end)],
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        cwd=self.lay.root,
                        env=self.env,
                        pass_fds=(write_end,),
                        # Out of the terminal's foreground group (its Ctrl-C and hangup), but
                        # in this session: one scheduler autogroup for the whole pool and its
                        # ranks, where the niceness of the checkpoint chores counts
                        # (docs/internals.md).
                        process_group=0,
                    )
                except OSError as exc:
                    raise LocalPoolError(f"cannot start {name} ({argv[0]}): {exc}") from exc
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)  # the child's copy is the only one: its exit closes the pipe
        self.procs.append((name, proc))
        self.ready_pipes[name] = read_end
        return proc

    def wait_ready(self, names: Sequence[str], timeout: float = READY_TIMEOUT) -> dict[str, Any]:
        """What each of ``names`` said when it was ready (the JSON of its ready file), read
        from its pipe as it says it; fails at once if one of them ends before (its end of the
        pipe closes with nothing said), or when ``timeout`` passes."""
        procs = dict(self.procs)
        deadline = time.monotonic() + timeout
        waiting = {self.ready_pipes[name]: name for name in names}
        said: dict[str, bytes] = {name: b"" for name in names}
        found: dict[str, Any] = {}
        try:
            while waiting:
                left = deadline - time.monotonic()
                readable = select.select(list(waiting), [], [], max(left, 0))[0]
                if not readable:
                    late = next(iter(waiting.values()))
                    raise LocalPoolError(
                        f"{late} was not ready after {timeout:g} s; the end of "
                        f"{self.lay.log_file(late)}:\n{_tail(self.lay.log_file(late))}"
                    )
                for fd in readable:
                    name = waiting[fd]
                    chunk = os.read(fd, 65536)
                    said[name] += chunk
                    if chunk and not said[name].endswith(b"\n"):
                        continue  # the rest of the line is on its way
                    del waiting[fd]
                    self._close_pipe(name)
                    try:
                        found[name] = json.loads(said[name])
                    except ValueError:
                        raise self._ended(name, procs[name], said[name]) from None
        finally:
            for name in names:
                self._close_pipe(name)
        return found

    def _close_pipe(self, name: str) -> None:
        fd = self.ready_pipes.pop(name, None)
        if fd is not None:
            os.close(fd)

    def _ended(self, name: str, proc: subprocess.Popen[bytes], said: bytes) -> LocalPoolError:
        """The error for a component whose pipe closed without a ready line."""
        try:
            # Its end of the pipe closes as it exits: the exit status follows at once.
            code: int | None = proc.wait(timeout=ENDED_WAIT)
        except subprocess.TimeoutExpired:
            code = None
        how = f"exited with code {code}" if code is not None else "closed its ready pipe"
        if said.strip():
            how += f" (it said {said[:200]!r}, not a ready line)"
        return LocalPoolError(
            f"{name} {how} before it was ready; the end of "
            f"{self.lay.log_file(name)}:\n{_tail(self.lay.log_file(name))}"
        )

    def recorded(self) -> list[Recorded]:
        out = []
        for name, proc in self.procs:
            cmd = read_cmdline(proc.pid)
            deadline = time.monotonic() + 2.0
            while cmd == [] and time.monotonic() < deadline:  # empty for a moment after exec
                time.sleep(0.01)
                cmd = read_cmdline(proc.pid)
            if not cmd:
                raise LocalPoolError(
                    f"{name} exited right after start; the end of its log:\n"
                    f"{_tail(self.lay.log_file(name))}"
                )
            out.append(Recorded(name, proc.pid, cmd))
        return out

    def abort(self) -> None:
        for name in list(self.ready_pipes):
            self._close_pipe(name)
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for _name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass(frozen=True)
class PoolStarted:
    url: str
    token: str
    ca: Path
    processes: list[Recorded]
    root: Path


def _coordinator_cli(lay: Layout, *args: str) -> subprocess.CompletedProcess[bytes]:
    """``vpool-coordinator ARGS --config`` the local pool's coordinator settings."""
    base = user_add_argv(lay)
    argv = [*base[: base.index("user")], *args, *base[base.index("--config") :]]
    try:
        return subprocess.run(argv, capture_output=True, env=_child_env(), timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LocalPoolError(f"`vpool-coordinator {' '.join(args)}` failed: {exc}") from exc


def _make_user(lay: Layout, *, exists: bool) -> str:
    """The local user's API token: a new user (an operator: who runs a local pool operates
    it), or (``exists``: a kept database) a new token of the user it already has, made an
    operator if a database from before roles made it a plain user."""
    args: tuple[str, ...] = ("user", "add", LOCAL_USER, "--operator")
    if exists and _coordinator_cli(lay, "user", "role", LOCAL_USER, "operator").returncode == 0:
        args = ("user", "token", LOCAL_USER, "--label", "vsdk local up")
    res = _coordinator_cli(lay, *args)
    out = res.stdout.decode(errors="replace").split()
    if res.returncode != 0 or not out:
        err = res.stderr.decode(errors="replace").strip()
        raise LocalPoolError(
            f"`vpool-coordinator {' '.join(args)}` exited with {res.returncode}: {err}"
        )
    return out[-1]  # the token is the last word printed


def _reset_root(lay: Layout, *, keep_jobs: bool, progress: Progress) -> bool:
    """Empty the pool directory for a new pool; with ``keep_jobs``, the coordinator's state
    (database, blobs, signing key) of the previous one stays. True if some was kept."""
    state = Path(coordinator_settings(lay, Secrets())["state_dir"])
    kept = None
    if lay.root.exists():
        if keep_jobs and (state / "vpool.db").exists():
            kept = Path(tempfile.mkdtemp(prefix=".kept-", dir=lay.root.parent))
            shutil.move(state, kept / "state")
        shutil.rmtree(lay.root)
    lay.root.mkdir(parents=True, mode=0o700)
    if kept is None:
        return False
    state.parent.mkdir(parents=True, mode=0o700)
    shutil.move(kept / "state", state)
    kept.rmdir()
    _retire_components(state / "vpool.db")
    progress("keeping the jobs of the previous local pool (`vsdk local up --fresh` starts anew)")
    return True


def _retire_components(db: Path) -> None:
    """The previous pool's agents and relays are gone for good (the new ones enroll and
    register afresh): mark them lost before the coordinator starts, or it would count them
    alive for a while and place ranks on them."""
    from vpool.coordinator.sqlite_store import SqliteStore

    store = SqliteStore(db)
    try:
        now = time.time()
        store.expire_agents(math.inf, now)
        store.expire_relays(math.inf, -math.inf, now)
    finally:
        store.close()


def _cancel_leftovers(url: str, token: str, ca: Path, progress: Progress) -> None:
    """Jobs the previous pool left unfinished cannot go on: their relays' logs are gone."""
    from vpool.sdk.client import Client

    with Client(url, token, ca=ca, timeout=10.0) as client:
        left = [
            job
            for state in ("queued", "running")
            for job in client.jobs(state=state, everyone=True)
        ]
        for job in left:
            client.cancel(job.id)
    if left:
        ids = ", ".join(str(j.id) for j in left)
        progress(f"cancelled job(s) {ids}: the previous local pool stopped while they ran")


def _wait_registered(
    url: str, token: str, ca: Path, *, agents: int, relays: int, timeout: float, progress: Progress
) -> None:
    """Wait until the coordinator answers with our token and, if its pool info counts live
    agents and relays, until it counts ours."""
    from vpool.sdk.client import Client

    deadline = time.monotonic() + timeout
    with Client(url, token, ca=ca, timeout=5.0) as client:
        client.whoami()
        while True:
            resp = client._request("GET", "/pool")
            info = json.loads(resp.content)
            have_a, have_r = info.get("agents"), info.get("relays")
            if not isinstance(have_a, int) or not isinstance(have_r, int):
                return  # the coordinator does not report them; the ready files must do
            if have_a >= agents and have_r >= relays:
                return
            if time.monotonic() >= deadline:
                raise LocalPoolError(
                    f"the coordinator sees {have_a} agent(s) and {have_r} relay(s) after "
                    f"{timeout:g} s, expected {agents} and {relays}"
                )
            time.sleep(0.1)


def up(
    *,
    agents: int = DEFAULT_AGENTS,
    relays: int = DEFAULT_RELAYS,
    slots: int = DEFAULT_SLOTS,
    force: bool = False,
    fresh: bool = False,
    package_index: str = "",
    timeout: float = READY_TIMEOUT,
    progress: Progress = _quiet,
    config_path: Path | None = None,
    relay_options: Mapping[str, Any] | None = None,
    timers: str = "production",
    selftest_cache: str | None = None,
) -> PoolStarted:
    """Start a coordinator, ``relays`` relays and ``agents`` agents on 127.0.0.1 and point the
    client config at them. The coordinator keeps the jobs of the previous local pool (its
    database and files) unless ``fresh``; everything else starts anew. ``relay_options``:
    settings written into every relay's config over the pool's own (benchmarks: a relay on
    another loopback address behind a delay line, a push window). ``timers``: a profile of
    ``TIMERS`` ("test": faults detected and recovered from in seconds). ``selftest_cache``:
    the agents' shared ``selftest_cache`` (None: ``SELFTEST_CACHE`` in vpool's cache directory,
    kept from one ``up`` to the next; "": none, each agent probes its sandbox)."""
    if agents < 1 or relays < 1 or slots < 1:
        raise LocalPoolError("a local pool needs at least one agent, one relay and one slot")
    if timers not in TIMERS:
        raise LocalPoolError(f"no timer profile {timers!r}; there are {', '.join(TIMERS)}")
    timed = TIMERS[timers]
    if selftest_cache is None:
        selftest_cache = str(paths.cache_dir() / SELFTEST_CACHE)
    lay = layout()
    live = running(lay)
    if live:
        if not force:
            raise LocalPoolError(
                f"a local pool is already running ({len(live)} processes, see "
                "`vsdk local status`); stop it with `vsdk local down` or use --force"
            )
        progress("stopping the running local pool (--force)")
        for warning in stop(read_pids(lay), progress=progress):
            progress(warning)
    kept = _reset_root(lay, keep_jobs=not fresh, progress=progress)

    now = dt.datetime.now(dt.UTC)
    relay_names = [f"relay-{i}" for i in range(relays)]
    agent_names = [f"agent-{i}" for i in range(agents)]
    sec = issue_secrets(lay, relay_names, agent_names)
    make_ca(lay, now=now)
    make_server_cert(lay, "coordinator", now=now)
    write_config(lay, "coordinator", {**coordinator_settings(lay, sec), **timed["coordinator"]})

    starter = _Starter(lay, progress)
    try:
        progress("starting the coordinator")
        starter.start("coordinator", coordinator_argv(lay))
        ready = starter.wait_ready(["coordinator"], timeout)["coordinator"]
        _pin_port(lay, "coordinator")
        url = f"https://{HOST}:{int(ready['port'])}"
        progress(f"coordinator ready at {url}")
        token = _make_user(lay, exists=kept)
        if kept:
            _cancel_leftovers(url, token, lay.ca_cert, progress)

        for name in relay_names:
            make_server_cert(lay, name, now=now)
            write_config(
                lay,
                name,
                {**relay_settings(lay, name, sec, url), **timed["relay"], **(relay_options or {})},
            )
            starter.start(name, relay_argv(lay, name))
        # The agents with the relays: an agent enrols with the coordinator, which tells it
        # where the relays are only when it leases a rank.
        for name in agent_names:
            write_config(
                lay,
                name,
                {
                    **agent_settings(lay, name, sec, url, slots, package_index),
                    "selftest_cache": selftest_cache,
                    **timed["agent"],
                },
            )
            starter.start(name, agent_argv(lay, name))
        progress(f"starting {relays} relay(s) and {agents} agent(s) with {slots} slots each")
        starter.wait_ready([*relay_names, *agent_names], timeout)
        for name in relay_names:
            _pin_port(lay, name)
        _wait_registered(
            url,
            token,
            lay.ca_cert,
            agents=agents,
            relays=relays,
            timeout=timeout,
            progress=progress,
        )
        recs = starter.recorded()
        write_pids(lay, recs)
    except (VsdkError, KeyboardInterrupt):
        starter.abort()
        raise

    lay.pool_file.write_text(
        json.dumps(
            {
                "url": url,
                "ca": str(lay.ca_cert),
                "agents": agents,
                "relays": relays,
                "slots": slots,
                "timers": timers,
                "started": time.time(),
            },
            indent=1,
        )
        + "\n"
    )
    cfg_path = clientconfig.save(
        clientconfig.ClientConfig(url=url, token=token, ca=lay.ca_cert), config_path
    )
    progress(f"client config written to {cfg_path}")
    return PoolStarted(url=url, token=token, ca=lay.ca_cert, processes=recs, root=lay.root)


def down(*, timeout: float = STOP_TIMEOUT, progress: Progress = _quiet) -> tuple[int, list[str]]:
    """Stop the recorded processes; returns (how many were running, warnings)."""
    lay = layout()
    recs = read_pids(lay)
    if not recs:
        return 0, []
    alive = len([r for r in recs if status_of(r) == "running"])
    warnings = stop(recs, timeout=timeout, progress=progress)
    lay.pids_file.unlink(missing_ok=True)
    return alive, warnings


def restart(name: str, *, timeout: float = READY_TIMEOUT, progress: Progress = _quiet) -> Recorded:
    """Start the recorded component ``name`` again, with the same command line, config and
    data directory, if its process is gone (killed, crashed). Waits until it is ready.

    A relay keeps its logs and a coordinator its database across this: it is how a local pool
    shows that they are durable."""
    lay = layout()
    recs = read_pids(lay)
    rec = next((r for r in recs if r.name == name), None)
    if rec is None:
        known = ", ".join(r.name for r in recs) or "none"
        raise LocalPoolError(f"no component {name!r} in the local pool (components: {known})")
    state = status_of(rec)
    if state == "running":
        raise LocalPoolError(f"{name} is still running (pid {rec.pid}); nothing to restart")
    _reap(rec.pid)
    _pin_port(lay, name)
    starter = _Starter(lay, progress)
    progress(f"restarting {name}")
    starter.start(name, rec.cmdline, again=True)
    try:
        starter.wait_ready([name], timeout)
        (fresh,) = starter.recorded()
    except (VsdkError, KeyboardInterrupt):
        starter.abort()
        raise
    # Re-read: another restart may have updated the file meanwhile.
    write_pids(lay, [fresh if r.name == name else r for r in read_pids(lay)])
    return fresh


def _pin_port(lay: Layout, name: str) -> None:
    """Make a server component listen where it did before (its config says port 0 on the first
    start): agents reconnect to the relay address in their leases, and clients to the
    coordinator URL in their config. Done as soon as it is first ready, while its ready file
    says the port: one that stops cleanly removes that file, and a restart must not pick a
    new port then."""
    try:
        port = int(json.loads(lay.ready_file(name).read_text())["port"])
        config = lay.config(name)
        with open(config, "rb") as f:
            settings = tomllib.load(f)
    except (OSError, ValueError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return  # no port to keep (an agent), or nothing readable: start as configured
    if settings.get("port") == 0 and port > 0:
        settings["port"] = port
        toml.write(config, settings, private=True)


def status() -> dict[str, Any]:
    """What ``vsdk local status`` shows."""
    lay = layout()
    recs = read_pids(lay)
    try:
        pool = json.loads(lay.pool_file.read_text())
    except (OSError, ValueError):
        pool = {}
    procs = [{**r.to_json(), "state": status_of(r)} for r in recs]
    n_running = sum(p["state"] == "running" for p in procs)
    return {
        "dir": str(lay.root),
        "url": pool.get("url") if recs else None,
        "running": bool(procs) and n_running == len(procs),
        "processes": procs,
    }
