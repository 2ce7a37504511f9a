"""Suspend, don't kill: the agent's ranks yield to the owner of the machine.

Every ``manners_interval`` (and at once on a pause, a resume or a sleep signal) the agent looks
at its machine (``desktop.py``, ``logind.py``), asks ``manners.decide`` what to do and does it:

- **available**: every frozen rank is thawed; the agent asks for work.
- **suspended**: every running rank is frozen (its cgroup's freezer, else SIGSTOP: it takes no
  CPU and does not know it was frozen); the agent asks for no work and its heartbeats say
  "suspended" and why, so the coordinator counts the ranks as suspended, not lost. A rank
  frozen for longer than the pool's ``suspend_limit`` is handed back (below).
- **handed back** (``evacuate``: the machine is about to sleep or shut down, the battery is
  nearly empty, a rank was suspended too long): the rank is thawed, checkpointed, and stopped
  as lost, so the coordinator restarts it elsewhere from the image taken moments before
  (seed 001's proactive evacuation). Before a sleep the agent holds a logind "delay"
  inhibitor lock, and releases it once every rank's image is committed at its relay.

A rank with a checkpoint under way is frozen once it ends (the clone being dumped is in the
rank's group). Ranks told to stop are left alone: ``ranks.py`` thaws them so they end as asked.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from vpool.reasons import describe
from vpool.sizes import format_duration
from vpool.worker_agent import desktop
from vpool.worker_agent.local_ranks import LocalRank, LocalRanks
from vpool.worker_agent.manners import Activity, Seen, Verdict, decide
from vpool.worker_agent.settings import AgentSettings

if TYPE_CHECKING:
    from vpool.worker_agent.logind import Logind

log = logging.getLogger("vpool.agent")

DEFAULT_SUSPEND_LIMIT = 600.0  # s, when neither the pool nor the volunteer says
SLEEP_DELAY_ADVISED = 30.0  # s of InhibitDelayMaxSec below which the agent says it is short
INHIBIT_WHY = "vpool checkpoints the MPI ranks it runs, to move them to another machine"


class Suspender:
    """The owner's preferences, applied to the ranks of one agent."""

    def __init__(
        self, settings: AgentSettings, ranks: LocalRanks, changed: Callable[[], None]
    ) -> None:
        self.settings = settings
        self.prefs = settings.preferences()
        self.ranks = ranks
        self.changed = changed  # the activity changed: a heartbeat now, a lease loop awake
        self.verdict = Verdict("available")
        self.stopping = False  # the agent is leaving (``Agent.leave``)
        self.paused_until = 0.0  # trio clock; math.inf: until resumed
        self.pool_limit = 0.0  # the pool's suspend_limit (0: not told)
        self.going_to_sleep = False
        self.idle_source = ""  # where idleness comes from now ("logind", "terminals", "")
        self.sleep_lock = False  # holding logind's delay inhibitor lock
        self.sleep_delay_max = 0.0  # s logind waits for it (InhibitDelayMaxSec)
        self.last_seen: Seen | None = None
        self._bus_failing = False  # logind's last answer was an error (said once)
        self._wake = trio.Event()
        # Passes of the loop begun and ended, and an event set at the end of each (a pause
        # answers once a pass begun after it has frozen the ranks: ``next_pass``).
        self._begun = 0
        self._ended = 0
        self._pass_ended = trio.Event()
        self._evacuations: set[LocalRank] = set()
        # Totals for ``vpool-agent status``: ranks that ended here, and their CPU seconds.
        self.started_at = time.time()
        self.ranks_done = 0
        self.cpu_done = 0.0

    def configure(self, settings: AgentSettings) -> None:
        """New preferences (``vpool-agent prefs``): applied from the next pass, at once."""
        self.settings = settings
        self.prefs = settings.preferences()
        self.wake()

    # -- what the agent and the owner see ---------------------------------------------------

    @property
    def activity(self) -> Activity:
        return "leaving" if self.stopping else self.verdict.activity

    @property
    def reason(self) -> str:
        return "it is stopping" if self.stopping else self.verdict.reason

    @property
    def available(self) -> bool:
        return self.activity == "available"

    @property
    def suspend_limit(self) -> float:
        """Seconds a rank may stay frozen (0: for ever)."""
        if self.settings.suspend_limit > 0:
            return self.settings.suspend_limit
        return self.pool_limit or DEFAULT_SUSPEND_LIMIT

    def pause(self, seconds: float = math.inf) -> None:
        """The owner pauses the agent (``vpool-agent pause [--for]``)."""
        self.paused_until = trio.current_time() + seconds
        self.wake()

    def resume(self) -> None:
        self.paused_until = 0.0
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    async def next_pass(self, *, wake: bool = True) -> None:
        """Until a pass of the loop begun from now on has applied its verdict; ``wake``: one
        begins now (else at the next interval, or the next event that wakes the loop)."""
        target = self._begun + 1
        if wake:
            self.wake()
        while self._ended < target:
            await self._pass_ended.wait()

    def rank_ended(self, rank: LocalRank) -> None:
        """Its process ended and the coordinator was told (the slot is free)."""
        self.ranks_done += 1
        self.cpu_done += rank.cpu_seconds
        self._evacuations.discard(rank)
        self.wake()  # a sleep may be waiting for it (``handed_back``)

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        async with self._logind() as bus, trio.open_nursery() as nursery:
            if bus is not None:
                nursery.start_soon(self._watch_sleep, bus)
            while True:
                self._wake = trio.Event()
                self._begun += 1
                begun = self._begun
                seen = await self.look(bus)
                await self.apply(decide(self.prefs, seen), nursery)
                self._ended = begun
                self._pass_ended.set()
                self._pass_ended = trio.Event()
                with trio.move_on_after(self.settings.manners_interval):
                    await self._wake.wait()

    @contextlib.asynccontextmanager
    async def _logind(self) -> AsyncIterator[Logind | None]:
        """logind's bus, where it is there and idleness or sleep may come from it."""
        if self.settings.idle_source == "terminals":
            yield None
            return
        try:
            from vpool.worker_agent.logind import Logind, LogindUnavailable
        except ImportError as exc:  # jeepney is missing: installed without the agent extra
            log.info("no logind (%s): idle from terminals, no warning before sleep", exc)
            yield None
            return
        async with contextlib.AsyncExitStack() as stack:
            bus: Logind | None = None
            try:  # only connecting: what the loop raises inside is not logind's
                bus = await stack.enter_async_context(
                    Logind.connect(self.settings.logind_bus or None)
                )
            except LogindUnavailable as exc:
                if self.settings.idle_source == "logind":
                    log.warning("idle_source is 'logind' but %s: the ranks wait for it", exc)
                else:
                    log.info("%s: idle from terminals, no warning before sleep", exc)
            else:
                log.info("logind: idle from the session's idle hint, checkpoints before sleep")
            yield bus

    async def look(self, bus: Logind | None) -> Seen:
        """What the machine looks like now."""
        idle: float | None = None
        source = ""
        if bus is not None:
            try:
                hint = await bus.idle()
            except Exception as exc:  # a bus gone mid-run: the terminals still say something
                if not self._bus_failing:
                    log.warning("logind: %s (idle from terminals meanwhile)", describe(exc))
                self._bus_failing = True
            else:
                if self._bus_failing:
                    log.info("logind answers again")
                self._bus_failing = False
                idle, source = (hint.since if hint.idle else 0.0), "logind"
        if source == "" and self.settings.idle_source != "logind":
            idle = await trio.to_thread.run_sync(desktop.terminal_idle, time.time())
            source = "terminals" if idle is not None else ""
        self.idle_source = source
        battery = await trio.to_thread.run_sync(
            desktop.read_battery, Path(self.settings.power_supply_dir)
        )
        programs = frozenset()
        if self.prefs.pause_while:
            programs = await trio.to_thread.run_sync(
                desktop.running_programs, self.prefs.pause_while
            )
        seen = Seen(
            now=dt.datetime.now(),
            idle=idle,
            idle_source=source,
            battery=battery,
            programs=programs,
            paused_for=max(0.0, self.paused_until - trio.current_time()),
            going_to_sleep=self.going_to_sleep,
        )
        self.last_seen = seen
        return seen

    async def apply(self, verdict: Verdict, nursery: trio.Nursery) -> None:
        """Freeze, thaw or hand back the ranks as ``verdict`` says."""
        before = (self.verdict.activity, self.verdict.reason)
        self.verdict = verdict
        if before != (verdict.activity, verdict.reason):
            log.info("%s%s", verdict.activity, f": {verdict.reason}" if verdict.reason else "")
            self.changed()
        now = trio.current_time()
        limit = self.suspend_limit
        for rank in self.ranks:
            await trio.to_thread.run_sync(self._sample, rank)
            if rank.stop_requested.is_set() or rank.process is None or rank.evacuating:
                continue
            if verdict.evacuate:
                self._evacuate(rank, verdict.evacuate, nursery)
            elif verdict.runs or self.stopping:
                # A stopping agent checkpoints its ranks first (``Agent.leave``): thawed.
                await self._thaw(rank)
            elif rank.suspended_since is None:
                await self._freeze(rank)
            elif limit > 0 and now - rank.suspended_since >= limit:
                self._evacuate(rank, f"suspended for more than {format_duration(limit)}", nursery)

    async def _freeze(self, rank: LocalRank) -> None:
        ckpt = rank.checkpointer
        if ckpt is not None and ckpt.taking is not None:
            return  # its clone is being dumped: frozen on a later pass
        process = rank.process
        assert process is not None
        rank.unfrozen = trio.Event()
        rank.suspended_since = trio.current_time()
        how = await trio.to_thread.run_sync(process.freeze, True)
        log.info("suspended %s (%s): %s", rank.label, how, self.reason)
        self.changed()

    async def _thaw(self, rank: LocalRank) -> None:
        if rank.suspended_since is None:
            return
        process = rank.process
        if process is not None:
            await trio.to_thread.run_sync(process.freeze, False)
        frozen_for = trio.current_time() - rank.suspended_since
        rank.suspended_since = None
        rank.unfrozen.set()
        log.info("resumed %s after %s", rank.label, format_duration(frozen_for))
        self.changed()

    def _evacuate(self, rank: LocalRank, why: str, nursery: trio.Nursery) -> None:
        rank.evacuating = why
        self._evacuations.add(rank)
        nursery.start_soon(self._hand_back, rank, why)

    async def _hand_back(self, rank: LocalRank, why: str) -> None:
        """Thaw ``rank``, checkpoint it and stop it as lost: it restarts elsewhere from that
        image (or, where it cannot take one, from its last image or its start)."""
        try:
            await self._thaw(rank)
            ckpt = rank.checkpointer
            cannot = ckpt.unable() if ckpt is not None else "its process is not running"
            stored = False
            if not cannot and ckpt is not None:
                log.info("%s: checkpointing %s to move it elsewhere", why, rank.label)
                stored = await ckpt.checkpoint_now()
            if stored:
                how = "moved to another machine from a checkpoint taken now"
            else:
                how = f"moved to another machine (no checkpoint now: {cannot or 'it failed'})"
            log.info("%s: %s %s", why, rank.label, how)
            rank.request_stop(f"{why}: {how}", lost=True)
        finally:
            self._evacuations.discard(rank)
            self.wake()

    def handed_back(self) -> bool:
        """No hand-back is under way, and every rank that ran here has ended and the
        coordinator was told (its slot is free), so that it restarts elsewhere while this
        machine sleeps. Ranks still starting (no process yet) do not count."""
        if self._evacuations:
            return False
        return all(
            r.slot_released or (r.process is None and not r.stop_requested.is_set())
            for r in self.ranks
        )

    def _sample(self, rank: LocalRank) -> None:
        process = rank.process
        if process is not None:
            rank.cpu_seconds, rank.rss = desktop.usage(process.pids())

    # -- sleep ------------------------------------------------------------------------------

    async def _watch_sleep(self, bus: Logind) -> None:
        """Hold a delay inhibitor lock while awake; on PrepareForSleep (or ForShutdown) hand
        every rank back and release the lock once their images are committed."""
        from vpool.worker_agent.logind import LogindUnavailable

        lock = -1
        try:
            try:
                lock = await bus.inhibit(INHIBIT_WHY)
                self.sleep_lock = True
                self.sleep_delay_max = await bus.inhibit_delay_max()
            except LogindUnavailable as exc:
                log.warning("no inhibitor lock (%s): ranks may sleep unsaved", exc)
            else:
                if self.sleep_delay_max < SLEEP_DELAY_ADVISED:
                    log.info(
                        "logind waits at most %g s for the checkpoints before sleep "
                        "(InhibitDelayMaxSec); large ranks may need more",
                        self.sleep_delay_max,
                    )
            async for kind, coming in bus.sleep_events():
                if coming:
                    log.info("%s coming: handing every rank back first", kind)
                    self.going_to_sleep = True
                    # logind goes on after InhibitDelayMaxSec whatever the lock: holding it
                    # longer only keeps this loop from hearing of the wake-up.
                    limit = self.sleep_delay_max or SLEEP_DELAY_ADVISED
                    with trio.move_on_after(limit):
                        await self.next_pass()  # one that knows: every rank being handed back
                        while not self.handed_back():
                            # Woken by each hand-back and each rank's end, not spinning.
                            await self.next_pass(wake=False)
                    if lock >= 0:
                        os.close(lock)
                        lock = -1
                        self.sleep_lock = False
                        if self.handed_back():
                            log.info("every rank handed back: the %s may go on", kind)
                        else:
                            log.warning(
                                "not every rank handed back within logind's %g s: the %s "
                                "goes on (they restart elsewhere from older images)",
                                limit,
                                kind,
                            )
                elif kind == "sleep":
                    log.info("woke up")
                    self.going_to_sleep = False
                    self.wake()
                    if lock < 0:
                        with contextlib.suppress(LogindUnavailable):
                            lock = await bus.inhibit(INHIBIT_WHY)
                            self.sleep_lock = True
        finally:
            if lock >= 0:
                os.close(lock)
            self.sleep_lock = False

    # -- status -----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The part of ``vpool-agent status`` that is about the owner's preferences."""
        seen = self.last_seen
        now = trio.current_time()
        paused = max(0.0, self.paused_until - now)
        prefs = self.prefs
        return {
            "activity": self.activity,
            "reason": self.reason,
            "paused_for": None if math.isinf(paused) else paused,
            "paused": paused > 0,
            "idle": seen.idle if seen is not None else None,
            "idle_source": self.idle_source,
            "battery": (
                {"discharging": seen.battery.discharging, "percent": seen.battery.percent}
                if seen is not None and seen.battery is not None
                else None
            ),
            "sleep_lock": self.sleep_lock,
            "sleep_delay_max": self.sleep_delay_max,
            "suspend_limit": self.suspend_limit,
            "preferences": {
                "run_when": prefs.run_when,
                "idle_after": prefs.idle_after,
                "pause_on_battery": prefs.pause_on_battery,
                "evacuate_battery_below": prefs.evacuate_battery_below,
                "pause_while": sorted(prefs.pause_while),
                "run_hours": ", ".join(str(w) for w in prefs.hours),
            },
            "ranks": [
                {
                    "job": r.lease.job,
                    "rank": r.lease.rank,
                    "incarnation": r.lease.incarnation,
                    "user": r.lease.user,
                    "state": "suspended" if r.suspended_since is not None else r.state,
                    "suspended_for": (now - r.suspended_since)
                    if r.suspended_since is not None
                    else 0.0,
                    "since": r.started_at,
                    "cpu_seconds": r.cpu_seconds,
                    "memory": r.rss,
                    "evacuating": r.evacuating,
                }
                for r in self.ranks
            ],
            "totals": {
                "since": self.started_at,
                "ranks_done": self.ranks_done,
                "cpu_seconds": self.cpu_done + sum(r.cpu_seconds for r in self.ranks),
            },
        }
