"""The agent's control socket: ``vpool-agent status``, ``pause`` and ``resume`` talk to the
running agent through it, without root and without the network.

A Unix socket (``AgentSettings.control_path``), one JSON request line and one JSON answer line
per connection:

    {"op": "status"}                      -> {"ok": true, "status": {...}}
    {"op": "pause", "seconds": 7200}      -> {"ok": true, "status": {...}}
    {"op": "pause"}                       -> the same, until resumed
    {"op": "resume"}                      -> {"ok": true, "status": {...}}
    {"op": "reload"}                      -> {"ok": true, "status": {...}, "later": [...]}
                                             (the preferences read again from the file)
    anything else                         -> {"ok": false, "error": "..."}

Anyone on the machine may read the status (the socket is mode 0666, its directory 0755: an
agent run as root serves its desktop's users too). Pausing and resuming are for the agent's
own user, root, and the users named in ``control_users``: the kernel says who is calling
(``SO_PEERCRED``). A request is at most 4 KiB and must come within 5 s; at most 8 connections
are served at once.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import pwd
import socket
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import trio

from vpool.config import SettingsError
from vpool.worker_agent.errors import AgentError
from vpool.worker_agent.proxy import choose_socket_path
from vpool.worker_agent.settings import SYSTEM_CONTROL_SOCKET, AgentSettings

if TYPE_CHECKING:
    from vpool.worker_agent.agent import Agent

log = logging.getLogger("vpool.agent")

MAX_REQUEST = 4096
REQUEST_TIMEOUT = 5.0
MAX_CONNECTIONS = 8
ACCEPT_RETRY = 1.0  # s before accepting again after an error
# Where an agent run as root (a system service) listens: what `vpool-agent status` tries when
# its own settings name no socket that exists.
SYSTEM_SOCKET = SYSTEM_CONTROL_SOCKET


class ControlRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op: Literal["status", "pause", "resume", "reload"]
    seconds: float | None = None  # pause: for how long (None: until resumed)


class ControlError(AgentError):
    """The control socket cannot be used (in use by another agent, unreachable...)."""


def socket_path(settings: AgentSettings) -> Path:
    """Where the agent of ``settings`` listens: its ``control_path``, or a short path named
    after its work directory when that is too long for a socket address (as ``agent.sock``)."""
    path = settings.control_path
    if path.parent == settings.work_path:
        return choose_socket_path(settings.work_path, path.name)
    return path


def _peer_uid(sock: trio.socket.SocketType) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _allowed_uids(names: list[str]) -> set[int]:
    uids = {0, os.getuid()}
    for name in names:
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            log.warning("control_users: no user %r on this machine", name)
    return uids


def _clear(path: Path) -> None:
    """Make ``path``'s directory; remove a socket file left by an agent that is gone. One
    that answers belongs to a running agent: ``ControlError``."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink(missing_ok=True)  # stale
        else:
            raise ControlError(f"another agent is running: {path} answers")
        finally:
            probe.close()
    path.with_name(f".{path.name}.{os.getpid()}").unlink(missing_ok=True)


async def bind(path: Path) -> trio.socket.SocketType:
    """A listening socket at ``path`` (see ``_clear``)."""
    await trio.to_thread.run_sync(_clear, path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Bound under a private name, opened up, then moved into place: nobody can connect
        # while it is more closed than it should be, or find one half made.
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        await sock.bind(str(tmp))
        os.chmod(tmp, 0o666)
        os.replace(tmp, path)
        sock.listen(16)
    except OSError as exc:
        sock.close()
        raise ControlError(f"cannot listen on {path}: {exc.strerror or exc}") from exc
    return sock


async def serve(
    agent: Agent, path: Path, *, task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED
) -> None:
    listener = await bind(path)
    allowed = _allowed_uids(agent.settings.control_users)
    limiter = trio.CapacityLimiter(MAX_CONNECTIONS)
    try:
        async with trio.open_nursery() as nursery:
            task_status.started(path)
            with listener:
                while True:
                    try:
                        conn, _ = await listener.accept()
                    except OSError as exc:  # out of descriptors, say: not worth the agent
                        log.warning("control socket: %s", exc.strerror or exc)
                        await trio.sleep(ACCEPT_RETRY)
                        continue
                    if limiter.available_tokens == 0:
                        conn.close()  # too many at once: the client says the agent is busy
                        continue
                    nursery.start_soon(_serve_one, agent, conn, allowed, limiter)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


async def _serve_one(
    agent: Agent, conn: trio.socket.SocketType, allowed: set[int], limiter: trio.CapacityLimiter
) -> None:
    async with limiter, trio.SocketStream(conn) as stream:
        try:
            await _answer(agent, stream, allowed)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the client went away
        except Exception:
            # The owner's command must never take the agent (and its ranks) down.
            log.exception("control socket: answering a request failed")


async def _answer(agent: Agent, stream: trio.SocketStream, allowed: set[int]) -> None:
    answer: dict[str, Any]
    try:
        with trio.fail_after(REQUEST_TIMEOUT):
            data = b""
            while b"\n" not in data and len(data) <= MAX_REQUEST:
                chunk = await stream.receive_some(MAX_REQUEST + 1)
                if not chunk:
                    break
                data += chunk
        if len(data) > MAX_REQUEST:
            raise ValueError(f"request longer than {MAX_REQUEST} bytes")
        req = msgspec.json.decode(data.split(b"\n", 1)[0], type=ControlRequest)
        answer = await handle(agent, req, _peer_uid(stream.socket), allowed)
    except trio.TooSlowError:
        return
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        answer = {"ok": False, "error": f"bad request: {exc}"}
    with trio.move_on_after(REQUEST_TIMEOUT):
        await stream.send_all(msgspec.json.encode(answer) + b"\n")


async def handle(agent: Agent, req: ControlRequest, uid: int, allowed: set[int]) -> dict[str, Any]:
    if req.op != "status" and uid not in allowed:
        return {
            "ok": False,
            "error": f"only the agent's user, root and control_users may {req.op} it "
            f"(you are uid {uid})",
        }
    if req.op == "pause":
        seconds = math.inf if req.seconds is None else req.seconds
        if not seconds > 0:
            return {"ok": False, "error": f"cannot pause for {req.seconds} s"}
        agent.manners.pause(seconds)
        log.info(
            "paused by uid %d %s",
            uid,
            "until resumed" if math.isinf(seconds) else f"for {seconds:g} s",
        )
    elif req.op == "resume":
        agent.manners.resume()
        log.info("resumed by uid %d", uid)
    later: list[str] = []
    if req.op == "reload":
        try:
            later = agent.reload_preferences()
        except (SettingsError, ControlError) as exc:
            return {"ok": False, "error": str(exc)}
        log.info("preferences read again by uid %d", uid)
    if req.op != "status":
        # Answered once the ranks are frozen (or thawed): the status says what is.
        with trio.move_on_after(REQUEST_TIMEOUT / 2):
            await agent.manners.next_pass()
    return {"ok": True, "status": status(agent), "later": later}


def status(agent: Agent) -> dict[str, Any]:
    settings = agent.settings
    iso = agent.isolation
    manners = agent.manners.status()
    return {
        "name": settings.agent_name,
        "agent_id": agent.enrolled.agent_id,
        "coordinator": settings.coordinator_url,
        "pid": os.getpid(),
        "now": time.time(),
        **manners,
        "isolation": iso.level if iso is not None else "unknown (probing)",
        "isolation_detail": iso.detail if iso is not None else "",
        "limits": {
            "slots": agent.slots,
            "busy": agent.busy,
            "memory": settings.memory_offered,
            "rank_memory": settings.rank_memory_bytes,
            "rank_processes": settings.rank_processes,
            "rank_disk": settings.rank_disk,
        },
    }


def request(path: Path, op: str, seconds: float | None = None, timeout: float = 10.0) -> Any:
    """Ask the agent listening at ``path`` (blocking; for the command line); its answer.
    Raises
    ``ControlError`` with a message for people."""
    body: dict[str, Any] = {"op": op}
    if seconds is not None:
        body["seconds"] = seconds
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
                raise ControlError(f"no agent is running here (nothing answers at {path})") from exc
            raise ControlError(f"cannot reach the agent at {path}: {exc.strerror or exc}") from exc
        sock.sendall(msgspec.json.encode(body) + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except TimeoutError as exc:
        raise ControlError(f"the agent at {path} did not answer within {timeout:g} s") from exc
    finally:
        sock.close()
    if not data:
        raise ControlError(f"the agent at {path} closed the connection (busy?)")
    answer = msgspec.json.decode(data)
    if not answer.get("ok"):
        raise ControlError(str(answer.get("error", "refused")))
    return answer  # {"ok": true, "status": {...}, "later": [...]}
