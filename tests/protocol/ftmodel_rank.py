"""A simulated rank of the fault-tolerance model: the program's runtime and its agent.

See ``ftmodel`` ("A rank") for what it does: numbering, determinants, the pessimistic rule,
lazy failed polls, resends, and replay of a restarted incarnation.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from .ftmodel_config import Divergence, ModelError
from .ftmodel_frames import Ack, Credit, Data, Det, DetAck, Link, Push
from .ftmodel_mpi import ANY, Env, Op, Poll, Recv, RecvAny, Send

if TYPE_CHECKING:
    from .ftmodel import World


class SimRank:
    def __init__(self, world: World, rank: int, inc: int, replay: list[tuple[int, str, Any]]):
        self.world, self.rank, self.inc = world, rank, inc
        self.home = world.home(rank)
        self.state = "running"  # running -> finalizing -> exited; or down (crashed)
        self.seq_out: dict[int, int] = {}
        self.arrived: dict[int, deque[tuple[int, Any]]] = {s: deque() for s in world.ranks}
        self.received: dict[int, int] = {}  # per source, the highest seq pushed to us
        self.consumed: list[tuple[int, int, Any]] = []  # (src, seq, payload), in program order
        self.decisions: list[tuple[str, Any]] = []  # every non-deterministic outcome
        self.clock = 0
        self.records = {rec[0]: rec for rec in replay}
        self.horizon = max(self.records, default=-1)
        self.dets = len(replay)  # index of the next determinant
        self.det_acked = len(replay)
        self.lazy: int | None = None  # clock of the last failed poll not logged yet
        self.unacked: dict[int, dict[int, Data]] = {}  # dst -> seq -> frame
        self.unacked_dets: dict[int, Det] = {}
        self.up: dict[int, Link] = {}  # relay -> our link to it
        self.output: Any = None
        self.gen = world.programs[rank](rank, world.size)
        self.op: Op | None = None
        self._advance(None)

    def __repr__(self) -> str:
        return f"rank {self.rank}.{self.inc}"

    # Which ways the current operation can complete now, as choices for the scheduler.
    def options(self) -> list[Any]:
        op = self.op
        if self.state != "running":
            return []
        if isinstance(op, Send):
            if self.lazy is not None and self.world.config.flush_lazy:
                return ["flush"]
            if self.world.config.pessimistic and self.det_acked < self.dets:
                return []  # the pessimistic rule: wait for DetAck
            return ["deposit"]
        if isinstance(op, Recv):
            return ["recv"] if self.arrived[op.src] else []
        if isinstance(op, Env):
            return ["env"]
        record = self.records.get(self.clock)
        if record is not None:  # replaying: reproduce the recorded outcome
            want = "any" if isinstance(op, RecvAny) else ("poll", "fail")
            if record[1] not in want:
                raise Divergence(
                    f"program is not deterministic: {self} event {self.clock} is {op}, "
                    f"the log says {record}"
                )
            src = record[2]
            return [record[1]] if src is None or self.arrived[src] else []
        if self.clock <= self.horizon:  # inside the horizon, no record: a failed poll
            if isinstance(op, RecvAny):
                raise Divergence(f"program is not deterministic: {self} {op} not in the log")
            return ["fail"]
        waiting = [s for s, q in self.arrived.items() if q]
        if isinstance(op, Poll) and op.src != ANY:
            waiting = [s for s in waiting if s == op.src]
        if isinstance(op, RecvAny):
            return [("any", s) for s in waiting]
        return [("poll", s) for s in waiting] or ["fail"]

    def take(self, choice: Any) -> str:
        op = self.op
        if choice == "flush":
            clock, self.lazy = self.lazy, None
            self._log_det("fail", None, clock=clock)
            return f"{self}: logs its lazy record: polls failed up to event {clock}"
        if choice == "deposit":
            assert isinstance(op, Send)
            seq = self.seq_out[op.dst] = self.seq_out.get(op.dst, 0) + 1
            frame = Data(self.rank, self.inc, op.dst, seq, op.payload)
            self.unacked.setdefault(op.dst, {})[seq] = frame
            self.world.send(self.up[self.world.home(op.dst)], frame)
            self._advance(None)
            return f"{self}: deposits {op.dst}#{seq}={op.payload!r}"
        if choice == "recv":
            assert isinstance(op, Recv)
            return self._consume(op.src, live=None)
        if choice == "env":
            self.decisions.append(("env", self.inc))
            self._advance(self.inc)
            return f"{self}: reads the environment (unlogged): {self.inc}"
        # A non-deterministic event: decided live past the horizon, else replayed.
        live = self.clock > self.horizon
        if isinstance(op, RecvAny):
            return self._consume(choice[1] if live else self.records[self.clock][2], live=live)
        if choice == "fail":
            src = None
            if live:
                self.lazy = self.clock  # logged only if a deposit follows
        else:
            src = choice[1] if live else self.records[self.clock][2]
            if live:
                self._log_det("poll", src)
        self.decisions.append(("poll", src))
        self.clock += 1
        self._advance(src)
        return f"{self}: {op} -> {src} ({'live' if live else 'replay'})"

    def _consume(self, src: int, live: bool | None) -> str:
        seq, payload = self.arrived[src].popleft()
        self.consumed.append((src, seq, payload))
        how = ""
        if live is not None:
            if live:
                self._log_det("any", src)
            self.decisions.append(("any", src))
            self.clock += 1
            how = " (live)" if live else " (replay)"
        self._advance(payload if live is None else (src, payload))
        return f"{self}: consumes {src}#{seq}={payload!r}{how}"

    def _log_det(self, kind: str, value: Any, clock: int | None = None) -> None:
        if kind != "fail":
            self.lazy = None  # a later record covers the failed polls before it
        det = Det(
            self.rank, self.inc, self.dets, (self.clock if clock is None else clock, kind, value)
        )
        self.dets += 1
        self.unacked_dets[det.index] = det
        self.world.send(self.up[self.home], det)

    def _advance(self, value: Any) -> None:
        try:
            self.op = self.gen.send(value)
        except StopIteration as stop:
            self.op, self.output, self.state = None, stop.value, "finalizing"
            self._maybe_exit()

    def _maybe_exit(self) -> None:
        # Finalize waits until every deposit is acknowledged, so no message dies with the process.
        if self.state == "finalizing" and not any(self.unacked.values()):
            self.state = "exited"

    # Frames from the relays.
    def receive(self, relay: int, frame: Any) -> None:
        if self.state == "exited":
            return
        if isinstance(frame, Push):
            if frame.seq != self.received.get(frame.src, 0) + 1:
                raise ModelError(f"{self} got {frame.src}#{frame.seq} after {self.received}")
            self.received[frame.src] = frame.seq
            self.arrived[frame.src].append((frame.seq, frame.payload))
            self.world.send(self.up[relay], Credit(self.rank, self.inc))
        elif isinstance(frame, Ack):
            pending = self.unacked.get(frame.dst, {})
            for seq in [s for s in pending if s <= frame.seq]:
                del pending[seq]
            self._maybe_exit()
        elif isinstance(frame, DetAck):
            self.det_acked = max(self.det_acked, frame.count)
            for index in [i for i in self.unacked_dets if i < frame.count]:
                del self.unacked_dets[index]
