"""A fake systemd-logind on a private D-Bus bus, for the tests of ``worker_agent/logind.py`` and
of what uses it (issue 22).

Only logind is fake: the bus is a real ``dbus-daemon`` (a session-like configuration written to
the test's tmp_path, listening on a unix socket there), and :class:`FakeLogind` is a task of the
test's trio run that connects to it with jeepney, owns ``org.freedesktop.login1`` and serves
``/org/freedesktop/login1``: ``org.freedesktop.DBus.Properties`` Get/GetAll (IdleHint,
IdleSinceHint, IdleSinceHintMonotonic, InhibitDelayMaxUSec, BlockInhibited, DelayInhibited),
``org.freedesktop.DBus.Peer.Ping``, and ``Manager.Inhibit``, which answers with a real file
descriptor: the write end of a pipe whose read end the fake watches, so that it sees the lock
released when every copy is closed, as logind does with its FIFOs. The test drives it:
:meth:`FakeLogind.set_idle`, :meth:`~FakeLogind.prepare_for_sleep`,
:meth:`~FakeLogind.prepare_for_shutdown`, :meth:`~FakeLogind.wait_for`; ``answering = False``
makes it a logind that takes calls and never answers.

Fixtures (import them into a test module; the ``nursery`` is pytest-trio's)::

    from .fake_logind import FakeLogind, dbus_daemon, fake_logind  # noqa: F401

    async def test_x(fake_logind: FakeLogind) -> None:
        async with Logind.connect(fake_logind.address) as logind:
            fake_logind.set_idle(True, since=600)
            ...

``dbus_daemon``: a bus with nothing on it (a :class:`DBusDaemon`); ``fake_logind``: the fake
on that bus. Both start a process, so under ``pytest --quick`` the tests using them are skipped;
without ``dbus-daemon`` (Debian package ``dbus-daemon``) they are skipped with that reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from jeepney import (  # type: ignore[import-untyped]
    DBusAddress,
    HeaderFields,
    MessageType,
    message_bus,
    new_error,
    new_method_return,
    new_signal,
)
from jeepney.bus_messages import DBusNameFlags  # type: ignore[import-untyped]
from jeepney.io.trio import open_dbus_connection  # type: ignore[import-untyped]

LOGIND = "org.freedesktop.login1"
PATH = "/org/freedesktop/login1"
MANAGER = "org.freedesktop.login1.Manager"
PROPERTIES = "org.freedesktop.DBus.Properties"
PEER = "org.freedesktop.DBus.Peer"
INVALID_ARGS = "org.freedesktop.DBus.Error.InvalidArgs"
_INHIBIT_WHATS = {
    "shutdown",
    "sleep",
    "idle",
    "handle-power-key",
    "handle-suspend-key",
    "handle-hibernate-key",
    "handle-lid-switch",
    "handle-reboot-key",
}

BUS_CONFIG = """\
<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>{listen}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""
START_TIMEOUT = 10.0


def _now_usec(clock: int) -> int:
    return time.clock_gettime_ns(clock) // 1000


def escape_address_value(value: str) -> str:
    """A value for a D-Bus address (``unix:path=...``): bytes other than the safe ones as %XX."""
    safe = b"-_/.\\*" + bytes(range(ord("0"), ord("9") + 1))
    safe += bytes(range(ord("A"), ord("Z") + 1)) + bytes(range(ord("a"), ord("z") + 1))
    return "".join(chr(b) if b in safe else f"%{b:02x}" for b in os.fsencode(value))


# -- the bus ---------------------------------------------------------------------------------


@dataclass
class DBusDaemon:
    """A running ``dbus-daemon``: its address (as it printed it), process and log file."""

    address: str
    process: trio.Process
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def stop(self) -> None:
        """End the daemon (every connection to it breaks) and wait for it, with a deadline."""
        self.process.terminate()
        with trio.fail_after(START_TIMEOUT):
            await self.process.wait()


async def start_dbus_daemon(directory: Path, nursery: trio.Nursery) -> DBusDaemon:
    """Start a dbus-daemon listening on ``directory/bus``, run by ``nursery`` (cancelling it
    ends the daemon). Raises RuntimeError, with the daemon's output, if it does not come up."""
    program = shutil.which("dbus-daemon")
    if program is None:
        raise RuntimeError("dbus-daemon is not installed (Debian package dbus-daemon)")
    socket_path = directory / "bus"
    if len(os.fsencode(socket_path)) > 107:
        raise RuntimeError(f"{socket_path} is too long for a unix socket's path")
    config = directory / "bus.conf"
    config.write_text(
        BUS_CONFIG.format(listen=f"unix:path={escape_address_value(str(socket_path))}")
    )
    log = directory / "dbus-daemon.log"
    with log.open("wb") as log_file:  # the child has its own copy
        command = [program, f"--config-file={config}", "--print-address", "--nofork", "--nosyslog"]
        process: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE, stderr=log_file, check=False)
        )
    assert process.stdout is not None
    printed = b""
    with trio.move_on_after(START_TIMEOUT):
        while not printed.endswith(b"\n"):
            chunk = await process.stdout.receive_some()
            if not chunk:
                break
            printed += chunk
    if not printed.endswith(b"\n"):
        process.kill()
        raise RuntimeError(
            f"dbus-daemon printed no address within {START_TIMEOUT:g} s"
            f" (exit status {process.poll()}); its output:\n{log.read_text(errors='replace')}"
        )
    return DBusDaemon(address=printed.decode().strip(), process=process, log=log)


# -- the fake logind -------------------------------------------------------------------------


@dataclass
class Inhibitor:
    """A lock handed out by the fake's Inhibit."""

    what: str
    who: str
    why: str
    mode: str
    released: trio.Event = field(default_factory=trio.Event)

    @property
    def held(self) -> bool:
        return not self.released.is_set()


@dataclass
class FakeLogind:
    """The fake logind's state, which tests read and set; :meth:`serve` puts it on a bus."""

    idle_hint: bool = False
    idle_since_usec: int = 0  # IdleSinceHint (CLOCK_REALTIME, µs)
    idle_since_monotonic_usec: int = 0  # IdleSinceHintMonotonic (CLOCK_MONOTONIC, µs)
    inhibit_delay_max_usec: int = 5_000_000
    answering: bool = True  # False: takes every call and never answers (a hung logind)
    refuse_inhibit: tuple[str, str] | None = None  # (D-Bus error name, message) for Inhibit
    inhibitors: list[Inhibitor] = field(default_factory=list)
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (sender, interface, member)
    unanswered: list[Any] = field(default_factory=list)  # calls held while not answering
    address: str = ""  # of the bus it serves on
    unique_name: str = ""  # its own name on that bus

    def __post_init__(self) -> None:
        self.changed = trio.Event()
        self._conn: Any = None
        self._nursery: trio.Nursery | None = None

    # -- for the tests ---------------------------------------------------------------------------

    def set_idle(self, idle: bool, since: float = 0.0) -> None:
        """Set IdleHint, and the hint's change to ``since`` seconds ago."""
        self.idle_hint = idle
        self.idle_since_usec = _now_usec(time.CLOCK_REALTIME) - round(since * 1e6)
        self.idle_since_monotonic_usec = _now_usec(time.CLOCK_MONOTONIC) - round(since * 1e6)

    async def prepare_for_sleep(self, start: bool) -> None:
        """Emit PrepareForSleep(start): True before sleeping, False on resuming."""
        await self._emit("PrepareForSleep", start)

    async def prepare_for_shutdown(self, start: bool = True) -> None:
        """Emit PrepareForShutdown(start)."""
        await self._emit("PrepareForShutdown", start)

    def held(self, mode: str = "delay", what: str = "sleep") -> list[Inhibitor]:
        """The locks of ``mode`` that cover ``what`` and are still held."""
        return [
            i for i in self.inhibitors if i.held and i.mode == mode and what in i.what.split(":")
        ]

    async def wait_for(self, predicate: Callable[[], Any], seconds: float = 10.0) -> Any:
        """Wait until ``predicate()`` is truthy (checked whenever the fake's state changes:
        a call, an Inhibit, a lock released); its value."""
        with trio.fail_after(seconds):
            while not (result := predicate()):
                await self.changed.wait()
        return result

    async def answer_now(self) -> None:
        """Answer, late, every call held while not ``answering``, and answer again from now."""
        self.answering = True
        held, self.unanswered = self.unanswered, []
        for message in held:
            await self._reply(message)

    async def wait_released(self, inhibitor: Inhibitor, seconds: float = 10.0) -> None:
        """Wait until every copy of ``inhibitor``'s file descriptor is closed."""
        with trio.fail_after(seconds):
            await inhibitor.released.wait()

    # -- the service -----------------------------------------------------------------------------

    async def serve(self, address: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Own org.freedesktop.login1 on the bus at ``address`` and answer calls until
        cancelled or the bus goes away; started (``nursery.start``) once the name is ours."""
        conn = await open_dbus_connection(address, enable_fds=True)
        async with conn:
            async with conn.router() as router:
                reply = await router.send_and_get_reply(
                    message_bus.RequestName(LOGIND, DBusNameFlags.do_not_queue)
                )
            if reply.body != (1,):  # DBUS_REQUEST_NAME_REPLY_PRIMARY_OWNER
                raise RuntimeError(f"the fake logind could not own {LOGIND}: {reply.body}")
            self._conn = conn
            self.address = address
            self.unique_name = conn.unique_name
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                try:
                    while True:
                        await self._handle(await conn.receive())
                except (trio.EndOfChannel, trio.BrokenResourceError):
                    pass  # the bus went away (a test stopped it)
                finally:
                    nursery.cancel_scope.cancel()

    def _touch(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def _emit(self, member: str, start: bool) -> None:
        assert self._conn is not None, "the fake logind is not serving"
        emitter = DBusAddress(PATH, interface=MANAGER)
        await self._conn.send(new_signal(emitter, member, "b", (start,)))

    def _properties(self) -> dict[str, tuple[str, Any]]:
        def inhibited(mode: str) -> str:
            whats = {
                w for i in self.inhibitors if i.held and i.mode == mode for w in i.what.split(":")
            }
            return ":".join(sorted(whats))

        return {
            "IdleHint": ("b", self.idle_hint),
            "IdleSinceHint": ("t", self.idle_since_usec),
            "IdleSinceHintMonotonic": ("t", self.idle_since_monotonic_usec),
            "InhibitDelayMaxUSec": ("t", self.inhibit_delay_max_usec),
            "BlockInhibited": ("s", inhibited("block")),
            "DelayInhibited": ("s", inhibited("delay")),
        }

    async def _handle(self, message: Any) -> None:
        header = message.header
        if header.message_type is not MessageType.method_call:
            return
        fields = header.fields
        interface = fields.get(HeaderFields.interface, "")
        member = fields.get(HeaderFields.member, "")
        self.calls.append((fields.get(HeaderFields.sender, ""), interface, member))
        self._touch()
        if not self.answering:
            self.unanswered.append(message)
        else:
            await self._reply(message)

    async def _reply(self, message: Any) -> None:
        fields = message.header.fields
        interface = fields.get(HeaderFields.interface, "")
        member = fields.get(HeaderFields.member, "")
        if (interface, member) == (MANAGER, "Inhibit"):
            await self._inhibit(message)
        else:
            await self._conn.send(self._answer(message, interface, member))

    def _answer(self, message: Any, interface: str, member: str) -> Any:
        if message.header.fields.get(HeaderFields.path) != PATH:
            return _error(message, "org.freedesktop.DBus.Error.UnknownObject", "no such object")
        properties = self._properties()
        if (interface, member) == (PEER, "Ping"):
            return new_method_return(message)
        if (interface, member) == (PROPERTIES, "Get"):
            asked_interface, name = message.body
            if asked_interface != MANAGER or name not in properties:
                return _error(message, INVALID_ARGS, f"no property {asked_interface}.{name}")
            return new_method_return(message, "v", (properties[name],))
        if (interface, member) == (PROPERTIES, "GetAll"):
            if message.body != (MANAGER,):
                return new_method_return(message, "a{sv}", ({},))
            return new_method_return(message, "a{sv}", (properties,))
        return _error(
            message, "org.freedesktop.DBus.Error.UnknownMethod", f"no {interface}.{member}"
        )

    async def _inhibit(self, message: Any) -> None:
        what, who, why, mode = message.body
        whats = set(what.split(":"))
        if self.refuse_inhibit is not None:
            name, text = self.refuse_inhibit
            await self._conn.send(_error(message, name, text))
        elif mode not in ("block", "delay") or not what or not whats <= _INHIBIT_WHATS:
            await self._conn.send(_error(message, INVALID_ARGS, "Invalid what specification"))
        elif mode == "delay" and not whats <= {"sleep", "shutdown"}:
            text = "Delay inhibitors only supported for shutdown and sleep"
            await self._conn.send(_error(message, INVALID_ARGS, text))
        else:
            # As logind's FIFO: the caller gets the write end; the read end sees EOF once every
            # copy of it is closed.
            inhibitor = Inhibitor(what=what, who=who, why=why, mode=mode)
            read_end, write_end = os.pipe()
            try:
                assert self._nursery is not None
                self._nursery.start_soon(self._watch, inhibitor, read_end)
                await self._conn.send(new_method_return(message, "h", (write_end,)))
            finally:
                os.close(write_end)  # the message carried a copy
            self.inhibitors.append(inhibitor)
            self._touch()

    async def _watch(self, inhibitor: Inhibitor, read_end: int) -> None:
        try:
            while True:
                await trio.lowlevel.wait_readable(read_end)
                if not os.read(read_end, 4096):  # EOF: no write end left anywhere
                    break
        finally:
            os.close(read_end)
        inhibitor.released.set()
        self._touch()


def _error(message: Any, name: str, text: str) -> Any:
    return new_error(message, name, "s", (text,))


# -- the fixtures ----------------------------------------------------------------------------


@pytest.fixture
async def dbus_daemon(tmp_path: Path, nursery: trio.Nursery) -> AsyncIterator[DBusDaemon]:
    """A private dbus-daemon with nothing on it, for the test's duration."""
    if shutil.which("dbus-daemon") is None:
        pytest.skip("dbus-daemon is not installed (Debian package dbus-daemon)")
    daemon = await start_dbus_daemon(tmp_path, nursery)
    yield daemon
    # Its output, for a failing test (pytest shows what a test printed only then).
    print(f"dbus-daemon output:\n{daemon.output()}")


@pytest.fixture
async def fake_logind(dbus_daemon: DBusDaemon, nursery: trio.Nursery) -> FakeLogind:
    """A :class:`FakeLogind` serving on :func:`dbus_daemon`'s bus (its ``address``)."""
    fake = FakeLogind()
    with trio.fail_after(START_TIMEOUT):
        await nursery.start(fake.serve, dbus_daemon.address)
    return fake
