"""``MPI.Grequest``: generalized requests, completed by the program (``Complete``).

The operation calls the program's query function when the request completes (to fill the
status), its free function when the request is released, and its cancel function on ``Cancel``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vpool.mpi.request import Request
from vpool.mpi.status import Status


class GreqOp:
    __slots__ = ("args", "cancel_fn", "done", "free_fn", "kwargs", "query_fn")

    def __init__(
        self,
        query_fn: Callable[..., Any] | None,
        free_fn: Callable[..., Any] | None,
        cancel_fn: Callable[..., Any] | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.query_fn, self.free_fn, self.cancel_fn = query_fn, free_fn, cancel_fn
        self.args, self.kwargs = args, kwargs
        self.done = False

    def finish(self, status: Status | None) -> None:
        st = status if status is not None else Status()
        st._fill(-2, -1, 0)  # ANY_SOURCE, ANY_TAG unless the query function says otherwise
        try:
            if self.query_fn is not None:
                self.query_fn(st, *self.args, **self.kwargs)
        finally:
            if self.free_fn is not None:
                self.free_fn(*self.args, **self.kwargs)
        return None

    def cancel(self) -> None:
        if self.cancel_fn is not None:
            self.cancel_fn(self.done, *self.args, **self.kwargs)


class Grequest(Request):
    """``MPI.Grequest``."""

    __slots__ = ()

    def __init__(self, request: Request | None = None) -> None:
        if request is not None and not isinstance(request, Grequest):
            raise TypeError(f"expected a Grequest, got {type(request).__name__}")
        super().__init__(request)

    @classmethod
    def Start(
        cls,
        query_fn: Callable[..., Any] | None = None,
        free_fn: Callable[..., Any] | None = None,
        cancel_fn: Callable[..., Any] | None = None,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> Grequest:
        op = GreqOp(query_fn, free_fn, cancel_fn, tuple(args or ()), dict(kwargs or {}))
        req = cls.__new__(cls)
        req._op = op
        req._start = None
        return req

    def Complete(self) -> None:
        if self._op is not None:
            self._op.done = True

    complete = Complete
