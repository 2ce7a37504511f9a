"""mpi4py as served by vpool: ``from mpi4py import MPI`` gets vpool's MPI runtime.

This package is put first on the ``PYTHONPATH`` of rank processes, ahead of any real mpi4py.
"""

from __future__ import annotations

import os
from typing import Any

__version__ = "4.1.2"
__author__ = "vpool (mpi4py-compatible runtime)"
__credits__ = "mpi4py by Lisandro Dalcin, whose API this follows"

__all__ = ["MPI", "get_config", "get_include", "profile", "rc"]


class Rc:
    """Runtime configuration options, as ``mpi4py.rc``; set them before importing MPI."""

    initialize = True
    threads = True
    thread_level = "multiple"
    finalize = None
    fast_reduce = True
    recv_mprobe = True
    irecv_bufsz = 32768
    errors = "exception"

    def __init__(self, **kwargs: Any) -> None:
        self(**kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        if not hasattr(self, name):
            raise TypeError(f"object has no attribute {name!r}")
        super().__setattr__(name, value)

    def __call__(self, **kwargs: Any) -> None:
        for key in kwargs:
            if not hasattr(self, key):
                raise TypeError(f"unexpected argument {key!r}")
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return f"<{__name__}.rc>"


rc = Rc()
# ``import mpi4py.rc`` works, as with mpi4py (MPI4PY_RC_* variables: vpool.mpi.rcopts).
__import__("sys").modules[__name__ + ".rc"] = rc


def get_include() -> str:
    return os.path.join(os.path.dirname(__file__), "include")


def get_config() -> dict[str, str]:
    return {}


def profile(name: str = "", *, path: Any = None) -> None:
    """Profiling libraries cannot be loaded into vpool's runtime; accepted and ignored."""
