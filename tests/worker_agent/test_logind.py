"""The agent's link to logind (worker_agent/logind.py) against a real dbus-daemon with a fake
logind on it (fake_logind.py), and against places where there is no bus at all."""

# ruff: noqa: F811 (the fixtures imported from fake_logind.py are the tests' arguments)

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import trio
from jeepney import (  # type: ignore[import-untyped]
    DBusAddress,
    HeaderFields,
    message_bus,
    new_signal,
)
from jeepney.io.trio import open_dbus_connection  # type: ignore[import-untyped]

from vpool.worker_agent.logind import (
    Idle,
    Logind,
    LogindDisconnected,
    LogindRefused,
    LogindTimeout,
    LogindUnavailable,
    system_bus_address,
)

from .fake_logind import (  # noqa: F401 (fixtures: dbus_daemon, fake_logind)
    MANAGER,
    PATH,
    DBusDaemon,
    FakeLogind,
    dbus_daemon,
    fake_logind,
)

DEADLINE = 10.0  # for what should take milliseconds


# -- no bus, no logind ---------------------------------------------------------------------


@pytest.mark.medium
async def test_no_bus_at_the_address(tmp_path: Path) -> None:
    address = f"unix:path={tmp_path}/no-bus-here"
    with pytest.raises(LogindUnavailable, match=f"no D-Bus bus at {address}: No such file"):
        async with Logind.connect(address):
            pytest.fail("connected to nothing")


async def test_an_address_jeepney_cannot_use() -> None:
    with pytest.raises(LogindUnavailable, match="cannot use the D-Bus address 'tcp:host=x,port=1'"):
        async with Logind.connect("tcp:host=x,port=1"):
            pytest.fail("connected to nothing")


def test_the_system_bus_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DBUS_SYSTEM_BUS_ADDRESS", raising=False)
    assert system_bus_address() == "unix:path=/run/dbus/system_bus_socket"
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/elsewhere")
    assert system_bus_address() == "unix:path=/elsewhere"


@pytest.mark.medium
async def test_a_socket_that_never_answers_times_out(tmp_path: Path) -> None:
    # A listening socket nobody accepts on: connecting works (the backlog), authenticating
    # waits for ever.
    path = tmp_path / "silent"
    with trio.socket.socket(trio.socket.AF_UNIX) as listener:
        await listener.bind(str(path))
        listener.listen()
        start = trio.current_time()
        with pytest.raises(LogindTimeout, match=f"at unix:path={path} did not answer within 0.3 s"):
            async with Logind.connect(f"unix:path={path}", call_timeout=0.3):
                pytest.fail("connected to a socket that says nothing")
        assert trio.current_time() - start < 0.3 + DEADLINE


@pytest.mark.medium
async def test_a_socket_that_hangs_up_is_not_a_bus(tmp_path: Path) -> None:
    path = tmp_path / "rude"
    with trio.socket.socket(trio.socket.AF_UNIX) as listener:
        await listener.bind(str(path))
        listener.listen()

        async def hang_up() -> None:
            conn, _ = await listener.accept()
            conn.close()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hang_up)
            with pytest.raises(LogindUnavailable, match=f"the D-Bus bus at unix:path={path}"):
                async with Logind.connect(f"unix:path={path}"):
                    pytest.fail("connected to a socket that hung up")


async def test_a_bus_without_logind(dbus_daemon: DBusDaemon) -> None:
    with pytest.raises(
        LogindUnavailable, match=r"no org\.freedesktop\.login1 on the D-Bus bus at"
    ) as e:
        async with Logind.connect(dbus_daemon.address):
            pytest.fail("found a logind that is not there")
    assert type(e.value) is LogindUnavailable


# -- with the fake logind ----------------------------------------------------------------------


async def test_idle_reads_the_hint_and_since(fake_logind: FakeLogind) -> None:
    async with Logind.connect(fake_logind.address) as logind:
        assert await logind.idle() == Idle(idle=False, since=0.0)  # logind never saw a change

        fake_logind.set_idle(True, since=600.0)
        before = time.monotonic()
        idle = await logind.idle()
        assert idle.idle
        assert 600.0 <= idle.since < 600.0 + (time.monotonic() - before) + 1.0

        fake_logind.set_idle(False, since=2.5)
        idle = await logind.idle()
        assert not idle.idle
        assert 2.5 <= idle.since < 2.5 + DEADLINE


async def test_inhibit_delay_max(fake_logind: FakeLogind) -> None:
    fake_logind.inhibit_delay_max_usec = 7_500_000
    async with Logind.connect(fake_logind.address) as logind:
        assert await logind.inhibit_delay_max() == 7.5


async def test_sleep_events(fake_logind: FakeLogind) -> None:
    async with Logind.connect(fake_logind.address) as logind:
        events = logind.sleep_events()
        assert logind.sleep_events() is events
        with trio.fail_after(DEADLINE):
            await fake_logind.prepare_for_sleep(True)
            assert await events.receive() == ("sleep", True)
            await fake_logind.prepare_for_sleep(False)
            assert await events.receive() == ("sleep", False)
            await fake_logind.prepare_for_shutdown(True)
            assert await events.receive() == ("shutdown", True)
    # Closed with the connection.
    with pytest.raises(trio.EndOfChannel):
        await events.receive()


async def test_sleep_events_come_only_from_logind(fake_logind: FakeLogind) -> None:
    """Another client's look-alike PrepareForSleep, sent straight to the agent's connection,
    is not an event."""
    async with Logind.connect(fake_logind.address) as logind:
        events = logind.sleep_events()
        ours = fake_logind.calls[-1][0]  # the unique name our connection called from
        impostor = await open_dbus_connection(fake_logind.address)
        async with impostor, impostor.router() as router:
            look_alike = new_signal(
                DBusAddress(PATH, interface=MANAGER), "PrepareForSleep", "b", (True,)
            )
            look_alike.header.fields[HeaderFields.destination] = ours
            with trio.fail_after(DEADLINE):
                await router.send(look_alike)
                # The bus has passed the look-alike on once it answers the impostor's next
                # call; logind's signal, sent after that, comes to us after it.
                await router.send_and_get_reply(message_bus.GetId())
                await fake_logind.prepare_for_sleep(False)
                assert await events.receive() == ("sleep", False)


async def test_inhibit_hands_out_a_lock_released_when_closed(fake_logind: FakeLogind) -> None:
    async with Logind.connect(fake_logind.address) as logind:
        fd = await logind.inhibit("checkpointing 2 ranks")
        assert not os.get_inheritable(fd)  # a rank started later does not hold it
        [lock] = fake_logind.inhibitors
        assert (lock.what, lock.who, lock.why, lock.mode) == (
            "sleep:shutdown",
            "vpool agent",
            "checkpointing 2 ranks",
            "delay",
        )
        assert lock.held
        assert fake_logind.held("delay", "sleep") == fake_logind.held("delay", "shutdown") == [lock]
        os.close(fd)
        await fake_logind.wait_released(lock, DEADLINE)
        assert fake_logind.held("delay", "sleep") == []


async def test_inhibit_refused(fake_logind: FakeLogind) -> None:
    fake_logind.refuse_inhibit = ("org.freedesktop.DBus.Error.AccessDenied", "Permission denied")
    async with Logind.connect(fake_logind.address) as logind:
        with pytest.raises(LogindRefused, match=r"Inhibit.*AccessDenied: Permission denied") as e:
            await logind.inhibit("checkpointing")
        assert e.value.error_name == "org.freedesktop.DBus.Error.AccessDenied"
        # logind's own rule: delay locks are for sleep and shutdown only.
        fake_logind.refuse_inhibit = None
        with pytest.raises(LogindRefused, match="InvalidArgs"):
            await logind.inhibit("checkpointing", what="idle")
    assert fake_logind.inhibitors == []


@pytest.mark.parametrize("call", ["idle", "inhibit", "inhibit_delay_max"])
async def test_a_logind_that_never_answers(fake_logind: FakeLogind, call: str) -> None:
    async with Logind.connect(fake_logind.address) as logind:
        fake_logind.answering = False
        logind.call_timeout = 0.3
        start = trio.current_time()
        with pytest.raises(LogindTimeout, match=r"org.freedesktop.login1 did not answer .* 0.3 s"):
            if call == "inhibit":
                await logind.inhibit("checkpointing")
            elif call == "idle":
                await logind.idle()
            else:
                await logind.inhibit_delay_max()
        assert trio.current_time() - start < 0.3 + DEADLINE
        assert fake_logind.unanswered


async def test_a_late_lock_is_released_not_leaked(fake_logind: FakeLogind) -> None:
    """An Inhibit answered after its deadline: the lock that comes late is closed at once."""
    async with Logind.connect(fake_logind.address) as logind:
        fake_logind.answering = False
        logind.call_timeout = 0.2
        with pytest.raises(LogindTimeout):
            await logind.inhibit("checkpointing")
        await fake_logind.answer_now()
        [lock] = fake_logind.inhibitors
        await fake_logind.wait_released(lock, DEADLINE)
        # And the connection still works.
        logind.call_timeout = DEADLINE
        assert not (await logind.idle()).idle


async def test_connecting_to_a_logind_that_never_answers(fake_logind: FakeLogind) -> None:
    fake_logind.answering = False
    with pytest.raises(
        LogindTimeout, match=r"org\.freedesktop\.login1 did not answer Ping within 1 s"
    ):
        async with Logind.connect(fake_logind.address, call_timeout=1.0):
            pytest.fail("connected to a logind that says nothing")


async def test_losing_the_bus(fake_logind: FakeLogind, dbus_daemon: DBusDaemon) -> None:
    async with Logind.connect(fake_logind.address) as logind:
        events = logind.sleep_events()
        await dbus_daemon.stop()
        with trio.fail_after(DEADLINE):
            with pytest.raises(trio.EndOfChannel):
                await events.receive()
        with pytest.raises(LogindDisconnected, match="lost the D-Bus connection"):
            await logind.idle()


async def test_a_closed_logind(fake_logind: FakeLogind) -> None:
    async with Logind.connect(fake_logind.address) as logind:
        pass
    with pytest.raises(trio.ClosedResourceError):
        await logind.idle()


async def test_errors_of_the_block_come_out_as_themselves(fake_logind: FakeLogind) -> None:
    """An exception raised in the ``connect`` block is not wrapped in an exception group."""
    cause = ValueError("cause")
    with pytest.raises(KeyError) as e:
        async with Logind.connect(fake_logind.address):
            raise KeyError("mine") from cause
    assert e.value.__cause__ is cause
