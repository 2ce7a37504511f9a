"""``vpool.mpi.observe`` in process: a second thread's looks at its own state are logged
determinants (``K_VALUE``) live and the logged values on replay (what the ``mpi4py.futures``
manager's looks at its task queue and clock go through), and a marked thread refuses
checkpoints (the request is answered as failed at once)."""

from __future__ import annotations

import socket
import threading
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest

from tests.mpi.test_ft_unit import live_ft, records, replay_ft
from vpool.mpi import environment, observe
from vpool.mpi.checkpoint import Checkpointer
from vpool.mpi.transport import read_message
from vpool.protocol.messages import CkptForked
from vpool.protocol.rank_ft import K_TEST, K_VALUE, R_OUTCOME


def use(monkeypatch: Any, ft: Any, t: Any) -> None:
    monkeypatch.setattr(environment, "_engine", SimpleNamespace(ft=ft, transport=t))


def test_looks_are_logged_live_and_obeyed_on_replay(monkeypatch: Any) -> None:
    ft, t = live_ft()
    use(monkeypatch, ft, t)
    queue: deque[int] = deque()
    assert observe.value(lambda: 1 if queue else None) is None  # event 0: empty, lazy
    queue.append(5)
    assert observe.value(lambda: 1 if queue else None) == 1  # event 1: logged
    assert ft.decide(K_TEST, lambda: None) is None  # event 2: an MPI test between looks
    assert observe.value(lambda: 3) == 3  # event 3
    ft.before_data()
    # Events 0 and 2 were failed tests: the records of later events cover them.
    assert records(t) == [[R_OUTCOME, 1, K_VALUE, 1], [R_OUTCOME, 3, K_VALUE, 3]]

    ft2, t2 = replay_ft(t.written)
    use(monkeypatch, ft2, t2)
    assert observe.replaying()
    # The replay sees what the live run saw, whatever its own state says now.
    assert observe.value(lambda: 1) is None
    assert observe.value(lambda: None) == 1
    assert ft2.decide(K_TEST, lambda: True) is None
    assert observe.value(lambda: 0) == 3
    assert not observe.replaying()
    assert observe.value(lambda: 7) == 7  # past the horizon: live again, logged
    ft2.flush()
    assert records(t2) == [[R_OUTCOME, 4, K_VALUE, 7]]


def test_a_look_of_another_kind_on_replay_is_not_deterministic(monkeypatch: Any) -> None:
    ft, t = live_ft()
    use(monkeypatch, ft, t)
    observe.value(lambda: 1)
    ft.flush()
    ft2, _ = replay_ft(t.written)
    with pytest.raises(SystemExit, match="observed value when logged, a test now"):
        ft2.decide(K_TEST, lambda: True)


def test_without_an_agent_a_look_is_live_and_unlogged(monkeypatch: Any) -> None:
    monkeypatch.setattr(environment, "_engine", None)
    assert observe.value(lambda: 4) == 4
    assert not observe.replaying()


def test_until_waits_for_the_other_thread() -> None:
    queue: deque[int] = deque()
    putter = threading.Timer(0.05, queue.append, args=(1,))
    putter.start()
    try:
        assert observe.until(lambda: bool(queue), timeout=30)
    finally:
        putter.join()
    assert not observe.until(lambda: False, timeout=0.01)


def test_a_marked_thread_refuses_checkpoints() -> None:
    assert observe.blocking_checkpoints() is None
    inside: list[str | None] = []

    def run() -> None:
        with observe.thread("mpi4py.futures manager"):
            inside.append(observe.blocking_checkpoints())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert inside[0] is not None and "mpi4py.futures manager" in inside[0]
    assert "could not be restored" in inside[0]
    assert observe.blocking_checkpoints() is None


def test_a_checkpoint_request_is_answered_as_failed_while_a_manager_runs() -> None:
    ours, agents = socket.socketpair()
    t = SimpleNamespace(ckpt_request=7, closed=False)
    eng = SimpleNamespace(ft=SimpleNamespace(busy=lambda: False))
    ckpt = Checkpointer(eng, t, "", "", "", 0)
    ckpt.control = ours
    try:
        with observe.thread("mpi4py.futures manager"):
            ckpt.on_request()  # would fork without the mark
        msg = read_message(agents)
        assert isinstance(msg, CkptForked)
        assert (msg.ckpt, msg.pid) == (7, -1)
        assert "mpi4py.futures manager" in msg.message
        assert t.ckpt_request is None  # answered: not tried again
    finally:
        ours.close()
        agents.close()
