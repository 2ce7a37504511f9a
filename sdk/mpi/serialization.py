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


class Pickle:
    """``MPI.pickle``: the serializer behind lower-case calls; programs may swap dumps/loads."""

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
            data = self._dumps(obj)
            return [data], []
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

    def __repr__(self) -> str:
        return f"<mpi4py.MPI.Pickle protocol={self.PROTOCOL}>"


pickle_ = Pickle()
