"""The agent's link to systemd-logind over D-Bus (issue 22, "suspend, don't kill").

The agent runs ranks only while the machine's owner is away, and checkpoints every rank before
the machine sleeps or shuts down. logind knows both: its ``IdleHint`` says whether every session
is idle, and it announces a sleep or a shutdown with the signals ``PrepareForSleep(true)`` and
``PrepareForShutdown(true)`` (and a resume with ``PrepareForSleep(false)``). It then waits, at
most ``InhibitDelayMaxUSec`` (5 s by default), until every "delay" inhibitor lock taken *before*
the signal is released: a lock taken on hearing the signal comes too late. So the agent holds a
lock all the time, checkpoints on ``("sleep", True)``, closes the lock, and takes a new one on
``("sleep", False)``::

    async with Logind.connect() as logind:
        events = logind.sleep_events()
        lock = await logind.inhibit("checkpointing the ranks")
        async for what, starting in events:
            if starting:
                ...  # checkpoint, within logind.inhibit_delay_max() seconds
                os.close(lock)  # lets the machine go
            else:  # resumed (or the shutdown was called off)
                lock = await logind.inhibit("checkpointing the ranks")

Errors (all with a message for people, none a raw jeepney one)::

    AgentError
     +-- LogindUnavailable        no system bus, no org.freedesktop.login1 on it, or an answer
          |                       that is not logind's
          +-- LogindTimeout       a call (or connecting) got no answer within its deadline
          +-- LogindRefused       logind (or the bus) answered a call with a D-Bus error, e.g.
          |                       AccessDenied for Inhibit
          +-- LogindDisconnected  the bus connection broke after connecting

Using a :class:`Logind` after its ``connect`` block has ended raises
``trio.ClosedResourceError`` (closed by us, not broken by the peer).

The D-Bus client is jeepney's: its authentication (with unix fd passing) and message codec, and
its ``DBusConnection`` as a channel of messages. The routing of replies is ours (one receiver task
per connection, :meth:`Logind._receive`) because jeepney's ``DBusRouter`` drops file descriptors
of replies that come after their caller gave up (a ResourceWarning, and a lock held until the
garbage collector runs) and ends the whole ``connect`` block with its own exception when the bus
goes away; here a lost bus closes the event channel and fails the calls with
:class:`LogindDisconnected`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from jeepney import (  # type: ignore[import-untyped]
    AuthenticationError,
    DBusAddress,
    FileDescriptor,
    HeaderFields,
    MatchRule,
    MessageType,
    Properties,
    message_bus,
    new_method_call,
)
from jeepney.auth import BEGIN, Authenticator  # type: ignore[import-untyped]
from jeepney.bus import get_connectable_addresses  # type: ignore[import-untyped]
from jeepney.io.trio import DBusConnection  # type: ignore[import-untyped]

from .errors import AgentError

log = logging.getLogger("vpool.agent")

SYSTEM_BUS_ADDRESS = "unix:path=/run/dbus/system_bus_socket"
# Each call, and connecting, ends within this many seconds unless told otherwise. logind answers
# in milliseconds; an Inhibit may wait for polkit.
DEFAULT_TIMEOUT = 5.0
# Sleep events queued for a reader that is slow to take them; more are dropped (with a warning).
# logind sends two per sleep, so this only fills if nobody reads the channel at all.
EVENTS_BUFFER = 16

LOGIND = "org.freedesktop.login1"
LOGIND_PATH = "/org/freedesktop/login1"
MANAGER_INTERFACE = "org.freedesktop.login1.Manager"
_MANAGER = DBusAddress(LOGIND_PATH, bus_name=LOGIND, interface=MANAGER_INTERFACE)
_PEER = DBusAddress(LOGIND_PATH, bus_name=LOGIND, interface="org.freedesktop.DBus.Peer")
_BUS = "org.freedesktop.DBus"
_SIGNALS = {"PrepareForSleep": "sleep", "PrepareForShutdown": "shutdown"}
# Errors of the bus meaning there is no logind to talk to.
_NO_LOGIND = {
    "org.freedesktop.DBus.Error.ServiceUnknown",
    "org.freedesktop.DBus.Error.NameHasNoOwner",
}


class LogindUnavailable(AgentError):
    """logind cannot be used: no system bus, no logind on it, or an answer that is not logind's."""


class LogindTimeout(LogindUnavailable):
    """A call to logind (or connecting to the bus) got no answer within its deadline."""


class LogindRefused(LogindUnavailable):
    """logind, or the bus, answered a call with a D-Bus error."""

    def __init__(self, message: str, error_name: str) -> None:
        super().__init__(message)
        self.error_name = error_name


class LogindDisconnected(LogindUnavailable):
    """The connection to the bus broke after it was made."""


@dataclass(frozen=True)
class Idle:
    idle: bool  # logind's IdleHint: every session is idle
    since: float  # seconds since the hint last changed; 0 if logind does not know


def system_bus_address() -> str:
    """The system bus's D-Bus address: ``$DBUS_SYSTEM_BUS_ADDRESS``, else the standard socket."""
    return os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or SYSTEM_BUS_ADDRESS


@dataclass
class _Waiter:
    """A call waiting for its reply (``reply`` stays None if the connection is lost)."""

    done: trio.Event = field(default_factory=trio.Event)
    reply: Any = None


class Logind:
    """A connection to logind on the system bus; made by :meth:`connect`, not directly.

    ``call_timeout`` is the deadline of each call in seconds (from ``connect``; may be
    changed)."""

    def __init__(self, conn: Any, address: str, call_timeout: float) -> None:
        self.call_timeout = call_timeout
        self._conn = conn
        self._address = address
        self._pending: dict[int, _Waiter] = {}
        self._events_send, self._events = trio.open_memory_channel[tuple[str, bool]](EVENTS_BUFFER)
        self._owner: str | None = None  # logind's unique name on the bus: only it sends signals
        self._owner_changed = False
        self._lost: str | None = None
        self._closed = False

    @classmethod
    @asynccontextmanager
    async def connect(
        cls, bus_address: str | None = None, *, call_timeout: float = DEFAULT_TIMEOUT
    ) -> AsyncIterator[Logind]:
        """Connect to logind on the bus at ``bus_address`` (None: :func:`system_bus_address`),
        subscribed to its sleep and shutdown signals. Raises :class:`LogindUnavailable` when
        there is no bus there or no logind on it, :class:`LogindTimeout` when either does not
        answer within ``call_timeout`` seconds (the deadline of connecting, then of each call)."""
        address = bus_address or system_bus_address()
        with _deadline(
            call_timeout, f"the D-Bus bus at {address} did not answer within {call_timeout:g} s"
        ):
            stream = await _open_bus(address)
        # An exception of the block comes out of the nursery in a group of one (there is no
        # other: the receiver task turns every failure into an answer to the callers); give it
        # back as itself, so that callers can catch LogindUnavailable.
        single: BaseException | None = None
        try:
            async with trio.open_nursery() as nursery:
                logind = cls(DBusConnection(stream.socket, enable_fds=True), address, call_timeout)
                nursery.start_soon(logind._receive)
                try:
                    await logind._start()
                    yield logind
                finally:
                    logind._closed = True
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if len(group.exceptions) != 1:
                raise
            single = group.exceptions[0]
        finally:
            stream.socket.close()
        if single is not None:
            raise single

    async def idle(self) -> Idle:
        """logind's idle hint, and how long ago it last changed."""
        # The hint first: if it changes between the two calls, ``since`` is then close to 0
        # ("just changed"), never the long age of the state before.
        hint = await self._get("IdleHint", "b")
        since_usec = await self._get("IdleSinceHintMonotonic", "t")
        since = 0.0
        if since_usec:
            since = max(0.0, time.clock_gettime(time.CLOCK_MONOTONIC) - since_usec / 1e6)
        return Idle(idle=bool(hint), since=since)

    async def inhibit(
        self, why: str, what: str = "sleep:shutdown", *, who: str = "vpool agent"
    ) -> int:
        """Take a "delay" inhibitor lock on ``what`` (colon-separated: sleep, shutdown); its
        file descriptor, not inherited by child processes. Close it to release the lock. Raises
        :class:`LogindRefused` if logind says no (e.g. polkit denies it)."""
        reply = await self._call(
            new_method_call(_MANAGER, "Inhibit", "ssss", (what, who, why, "delay")),
            f"Inhibit({what!r}, 'delay')",
        )
        body = reply.body
        if _signature(reply) != "h" or not isinstance(body[0], FileDescriptor):
            _close_fds(body)
            raise LogindUnavailable(
                f"logind answered Inhibit with {_signature(reply)!r}, not a file descriptor"
            )
        fd: int = body[0].to_raw_fd()
        # Received fds are inheritable: a rank started later would hold the lock too, and
        # closing ours would not release it.
        os.set_inheritable(fd, False)
        return fd

    def sleep_events(self) -> trio.MemoryReceiveChannel[tuple[str, bool]]:
        """logind's announcements, in order: ``("sleep", True)`` before the machine sleeps,
        ``("sleep", False)`` after it resumes (or the sleep failed), ``("shutdown", True)``
        before it shuts down (``("shutdown", False)``: the shutdown was called off). The same
        channel on every call, for one reader; it ends (``EndOfChannel``) when the connection
        is closed or lost."""
        return self._events

    async def inhibit_delay_max(self) -> float:
        """How long logind waits for delay locks before sleeping anyway, in seconds."""
        usec = await self._get("InhibitDelayMaxUSec", "t")
        return float(usec) / 1e6

    # -- calls --------------------------------------------------------------------------------

    async def _start(self) -> None:
        reply = await self._call(message_bus.Hello(), "Hello")
        self._conn.unique_name = reply.body[0]
        # Signals count only from the current owner of logind's name (another client may send
        # us a look-alike directly): followed from before it is asked, and the sleep signals
        # subscribed to only once it is known, before connect returns.
        owner_rule = MatchRule(
            type="signal",
            sender=_BUS,
            interface=_BUS,
            member="NameOwnerChanged",
            path="/org/freedesktop/DBus",
        )
        owner_rule.add_arg_condition(0, LOGIND)
        await self._call(message_bus.AddMatch(owner_rule), "AddMatch")
        # Ping starts logind if the bus can (D-Bus activation), and fails if there is none.
        await self._call(new_method_call(_PEER, "Ping"), "Ping")
        reply = await self._call(message_bus.GetNameOwner(LOGIND), "GetNameOwner")
        if not self._owner_changed:  # else NameOwnerChanged since told who owns it now
            self._owner = str(reply.body[0])
        for member in _SIGNALS:
            rule = MatchRule(
                type="signal",
                sender=LOGIND,
                interface=MANAGER_INTERFACE,
                member=member,
                path=LOGIND_PATH,
            )
            await self._call(message_bus.AddMatch(rule), "AddMatch")

    async def _get(self, name: str, signature: str) -> Any:
        reply = await self._call(Properties(_MANAGER).get(name), f"Get({name})")
        if _signature(reply) != "v" or reply.body[0][0] != signature:
            _close_fds(reply.body)
            raise LogindUnavailable(f"logind's {name} is not of D-Bus type {signature!r}")
        return reply.body[0][1]

    async def _call(self, message: Any, what: str) -> Any:
        """Send a method call; its reply (a jeepney Message), within ``self.call_timeout``."""
        if self._closed:
            raise trio.ClosedResourceError("this logind connection is closed")
        if self._lost is not None:
            raise LogindDisconnected(self._lost)
        serial = next(self._conn.outgoing_serial)
        waiter = _Waiter()
        self._pending[serial] = waiter
        try:
            with trio.move_on_after(self.call_timeout) as scope:
                try:
                    await self._conn.send(message, serial=serial)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    raise LogindDisconnected(
                        f"lost the D-Bus connection to {self._address}: {exc}"
                    ) from exc
                await waiter.done.wait()
        except BaseException:
            if waiter.reply is not None:  # came, but the caller is gone (cancelled)
                _close_fds(waiter.reply.body)
            raise
        finally:
            del self._pending[serial]
        reply = waiter.reply
        if reply is None:
            if scope.cancelled_caught:
                who = message.header.fields.get(HeaderFields.destination)
                raise LogindTimeout(
                    f"{'the bus' if who == _BUS else who} did not answer {what} within"
                    f" {self.call_timeout:g} s (on the D-Bus bus at {self._address})"
                )
            raise LogindDisconnected(self._lost or "lost the D-Bus connection")
        if reply.header.message_type is MessageType.error:
            _close_fds(reply.body)
            name = str(reply.header.fields.get(HeaderFields.error_name, "?"))
            text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
            if name in _NO_LOGIND:
                raise LogindUnavailable(
                    f"no {LOGIND} on the D-Bus bus at {self._address}"
                    f" (is systemd-logind running?): {text or name}"
                )
            raise LogindRefused(f"{what} refused: {name}: {text}", name)
        return reply

    # -- the receiver task --------------------------------------------------------------------

    async def _receive(self) -> None:
        try:
            while True:
                self._dispatch(await self._conn.receive())
        except trio.EndOfChannel:
            self._lost = f"lost the D-Bus connection to {self._address}: the bus closed it"
        except Exception as exc:  # a broken socket, or bytes that are not D-Bus
            self._lost = f"lost the D-Bus connection to {self._address}: {exc!r}"
        finally:
            if self._lost is not None and not self._closed:
                log.warning("logind: %s", self._lost)
            for waiter in self._pending.values():
                waiter.done.set()
            self._events_send.close()

    def _dispatch(self, message: Any) -> None:
        header = message.header
        fields = header.fields
        if header.message_type in (MessageType.method_return, MessageType.error):
            waiter = self._pending.get(fields.get(HeaderFields.reply_serial))
            if waiter is not None and waiter.reply is None:
                waiter.reply = message
                waiter.done.set()
                return
        elif header.message_type is MessageType.signal:
            self._signal(message)
        # Whatever nobody takes (a reply that came after its deadline, a stray message): its
        # file descriptors are closed now, not by the garbage collector.
        _close_fds(message.body)

    def _signal(self, message: Any) -> None:
        fields = message.header.fields
        sender = fields.get(HeaderFields.sender)
        member = fields.get(HeaderFields.member)
        interface = fields.get(HeaderFields.interface)
        if sender == _BUS and interface == _BUS and member == "NameOwnerChanged":
            name, _old, new = message.body
            if name == LOGIND:
                self._owner = new or None
                self._owner_changed = True
            return
        what = _SIGNALS.get(member)
        if (
            what is None
            or sender is None
            or sender != self._owner
            or interface != MANAGER_INTERFACE
            or fields.get(HeaderFields.path) != LOGIND_PATH
            or _signature(message) != "b"
        ):
            return
        try:
            self._events_send.send_nowait((what, bool(message.body[0])))
        except trio.WouldBlock:
            log.warning(
                "logind: nobody reads the sleep events; dropped %s(%s)", member, message.body[0]
            )
        except trio.BrokenResourceError:
            pass  # the reader closed its end: it wants no more


async def _open_bus(address: str) -> trio.SocketStream:
    """A unix socket to the bus at ``address``, authenticated (with fd passing)."""
    try:
        path = next(get_connectable_addresses(address))
    except (RuntimeError, ValueError) as exc:
        raise LogindUnavailable(f"cannot use the D-Bus address {address!r}: {exc}") from exc
    try:
        stream = await trio.open_unix_socket(path)
    except OSError as exc:
        raise LogindUnavailable(f"no D-Bus bus at {address}: {exc.strerror or exc}") from exc
    try:
        auth = Authenticator(enable_fds=True, inc_null_byte=False)
        await stream.send_all(b"\0")  # Linux: the bus reads our credentials off the socket
        for data in auth:
            await stream.send_all(data)
            received = await stream.receive_some()
            if not received:
                raise LogindUnavailable(
                    f"the D-Bus bus at {address} closed the connection while authenticating"
                )
            auth.feed(received)
        await stream.send_all(BEGIN)
    except AuthenticationError as exc:
        stream.socket.close()
        raise LogindUnavailable(f"the D-Bus bus at {address} refused us: {exc}") from exc
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        stream.socket.close()
        raise LogindUnavailable(
            f"the D-Bus bus at {address} dropped the connection: {exc}"
        ) from exc
    except BaseException:
        stream.socket.close()
        raise
    return stream


@contextmanager
def _deadline(seconds: float, message: str) -> Iterator[None]:
    with trio.move_on_after(seconds) as scope:
        yield
    if scope.cancelled_caught:
        raise LogindTimeout(message)


def _signature(message: Any) -> str:
    return str(message.header.fields.get(HeaderFields.signature, ""))


def _close_fds(value: Any) -> None:
    """Close every file descriptor received in a message body (nested anywhere in it)."""
    if isinstance(value, FileDescriptor):
        value.close()
    elif isinstance(value, tuple | list):
        for item in value:
            _close_fds(item)
    elif isinstance(value, dict):
        for item in value.values():
            _close_fds(item)
