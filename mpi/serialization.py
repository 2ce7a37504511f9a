"""Pickled messages (lower-case ``send``/``recv``) without extra payload copies.

Pickle protocol 5 with out-of-band buffers: large buffers inside the object (numpy arrays,
``PickleBuffer``s) are not copied into the pickle stream but sent as separate parts of the
payload, straight from the object's memory. The receiver unpickles with memoryview slices of the
received payload, so a received array is backed by the receive buffer itself.

Wire form: payload = pickle stream, then each out-of-band buffer. ``Data.parts`` lists the length
of every part (stream first) when there are out-of-band buffers and is empty otherwise.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

# Below this size an out-of-band buffer costs more (one more part to track) than copying it.
OOB_MIN_BYTES = 8192
PROTOCOL = 5


class WirePickle:
    """The serializer behind lower-case calls, producing payload parts (see the docstring).

    Programs configure it through ``MPI.pickle`` (``PublicPickle``)."""

    def __init__(
        self,
        dumps: Callable[..., bytes] | None = None,
        loads: Callable[..., Any] | None = None,
        protocol: int | None = None,
    ) -> None:
        self._dumps = dumps
        self._loads = loads
        self.PROTOCOL = PROTOCOL if protocol is None else protocol
        self.THRESHOLD = OOB_MIN_BYTES

    def dumps(self, obj: Any) -> tuple[list[Any], list[int]]:
        """The payload parts of ``obj`` and their lengths (empty when there is only a stream)."""
        if self._dumps is not None:
            proto = self.PROTOCOL
            data = self._dumps(obj) if proto is None else self._dumps(obj, proto)
            return [data], []
        if 0 <= self.PROTOCOL < PROTOCOL:
            return [pickle.dumps(obj, self.PROTOCOL)], []  # no out-of-band buffers before 5
        buffers: list[memoryview] = []
        threshold = self.THRESHOLD

        def keep(pb: pickle.PickleBuffer) -> bool:
            raw = pb.raw()
            if raw.nbytes < threshold:
                return True  # in-band
            buffers.append(raw)
            return False

        stream = pickle.dumps(obj, self.PROTOCOL, buffer_callback=keep)
        if not buffers:
            return [stream], []
        return [stream, *buffers], [len(stream), *(b.nbytes for b in buffers)]

    def loads(self, payload: Any, parts: list[int]) -> Any:
        if self._loads is not None:
            return self._loads(payload)
        if not parts:
            return pickle.loads(payload)
        view = memoryview(payload)
        pos = parts[0]
        buffers = []
        for n in parts[1:]:
            buffers.append(view[pos : pos + n])
            pos += n
        return pickle.loads(view[: parts[0]], buffers=buffers)


pickle_ = WirePickle()


class Pickle:
    """``MPI.Pickle`` as mpi4py has it: ``dumps(obj) -> bytes`` and ``loads(bytes)``.

    ``MPI.pickle`` is the instance that configures the serializer of lower-case calls:
    ``MPI.pickle.__init__(dill.dumps, dill.loads)`` makes every message use dill."""

    def __init__(
        self,
        dumps: Callable[..., bytes] | None = None,
        loads: Callable[..., Any] | None = None,
        protocol: int | None = None,
    ) -> None:
        wire = self.__dict__.get("_wire")
        if wire is None:
            wire = WirePickle()
            self._wire = wire
        wire._dumps, wire._loads = dumps, loads
        if protocol is None:
            protocol = PROTOCOL if dumps is None else None
        elif protocol < 0:
            protocol = pickle.HIGHEST_PROTOCOL if dumps is None else protocol
        wire.PROTOCOL = protocol  # type: ignore[assignment]

    @classmethod
    def _over(cls, wire: WirePickle) -> Pickle:
        obj = cls.__new__(cls)
        obj._wire = wire
        return obj

    @property
    def PROTOCOL(self) -> int | None:
        return self._wire.PROTOCOL

    @PROTOCOL.setter
    def PROTOCOL(self, value: int) -> None:
        self._wire.PROTOCOL = value

    @property
    def THRESHOLD(self) -> int:
        return self._wire.THRESHOLD

    @THRESHOLD.setter
    def THRESHOLD(self, value: int) -> None:
        self._wire.THRESHOLD = value

    def dumps(self, obj: Any) -> bytes:
        wire = self._wire
        if wire._dumps is not None:
            proto = wire.PROTOCOL
            return wire._dumps(obj) if proto is None else wire._dumps(obj, proto)
        return pickle.dumps(obj, wire.PROTOCOL)

    def loads(self, data: Any) -> Any:
        wire = self._wire
        if wire._loads is not None:
            return wire._loads(data)
        return pickle.loads(data)

    def __repr__(self) -> str:
        return f"<mpi4py.MPI.Pickle protocol={self.PROTOCOL}>"


public_pickle = Pickle._over(pickle_)
