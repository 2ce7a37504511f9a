"""``mpi4py.rc`` and the ``MPI4PY_RC_*`` environment variables, read when ``mpi4py.MPI`` is
imported, as mpi4py reads them: a variable (``MPI4PY_RC_INITIALIZE=false``) overrides the
attribute and is written back to it; numbers, ``true/yes/on/y/1`` and ``false/no/off/n/0`` are
understood; a value out of range is warned about and the default kept.

What vpool's runtime does with them:

- ``initialize``: MPI starts at import (default), or when the program calls ``MPI.Init``;
- ``threads`` / ``thread_level``: the level ``Query_thread`` reports (at most serialized: ranks'
  threads may call MPI one at a time);
- ``errors``: ``exception`` (default) gives ``COMM_WORLD`` and ``COMM_SELF`` the handler
  ``ERRORS_RETURN`` (errors are raised as ``MPI.Exception``), ``fatal``/``default`` gives them
  ``ERRORS_ARE_FATAL`` and ``abort`` ``ERRORS_ABORT`` (``Call_errhandler`` then ends the job);
- ``finalize``, ``fast_reduce``, ``recv_mprobe``, ``irecv_bufsz``: accepted; the runtime always
  finalizes at exit (its fault tolerance needs it) and has its own collectives and receives.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

TRUE = ("true", "yes", "on", "y", "1")
FALSE = ("false", "no", "off", "n", "0")
LEVELS = {"single": 0, "funneled": 1, "serialized": 2, "multiple": 3}
ERRORS = ("exception", "default", "fatal", "abort")


def rc() -> Any:
    return getattr(sys.modules.get("mpi4py"), "rc", None)


def option(name: str, default: Any) -> Any:
    """``mpi4py.rc.<name>``, or the ``MPI4PY_RC_<NAME>`` variable over it."""
    options = rc()
    raw = os.environ.get(f"MPI4PY_RC_{name.upper()}")
    if raw is None:
        return getattr(options, name, default)
    text = raw.strip()
    value: Any
    if text.isdigit() and type(default) is int:
        value = int(text)
    elif text.lower() in TRUE:
        value = True
    elif text.lower() in FALSE:
        value = False
    else:
        value = text.lower()
    if options is not None:
        try:
            setattr(options, name, value)
        except (AttributeError, TypeError):
            pass
    return value


def _flag(name: str, default: bool) -> bool:
    value = option(name, default)
    if value in (True, "yes"):
        return True
    if value in (False, "no"):
        return False
    warnings.warn(f"mpi4py.rc.{name}: unexpected value {value!r}", RuntimeWarning, stacklevel=3)
    return default


def initialize() -> bool:
    return _flag("initialize", True)


def thread_level() -> int | None:
    """The level to ask of ``Init_thread``, or None for plain ``Init`` (``threads`` off)."""
    if not _flag("threads", True):
        return None
    level = option("thread_level", "multiple")
    if level not in LEVELS:
        warnings.warn(
            f"mpi4py.rc.thread_level: unexpected value {level!r}", RuntimeWarning, stacklevel=2
        )
        return LEVELS["multiple"]
    return LEVELS[level]


def errors() -> str:
    value = option("errors", "exception")
    if value not in ERRORS:
        warnings.warn(f"mpi4py.rc.errors: unexpected value {value!r}", RuntimeWarning, stacklevel=2)
        return "exception"
    return str(value)
