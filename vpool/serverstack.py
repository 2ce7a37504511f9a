"""The server stack: what the coordinator (and ``vsdk local up``, which starts one) needs beyond
the base install, which is the volunteer's agent's (``pip install "vpool[agent]"``).

A command that needs it checks first (``require``) and, where it is missing, says what to
install instead of failing on a bare ImportError. ``vpool-coordinator``'s console script is
``coordinator_main``, which checks before it imports anything of the coordinator's.
"""

from __future__ import annotations

import importlib.util
import sys

# Import name -> distribution, as pyproject.toml's `server` extra lists them.
MODULES = {
    "fastapi": "fastapi",
    "hypercorn": "hypercorn",
    "sqlite_utils": "sqlite-utils",
    "jinja2": "jinja2",
    "python_multipart": "python-multipart",
}
INSTALL = 'pip install "vpool[server]"'


class MissingServerStack(Exception):
    """The server stack, or part of it, is not installed."""


def missing() -> list[str]:
    """The distributions of the server stack that are not installed."""
    return [dist for module, dist in MODULES.items() if importlib.util.find_spec(module) is None]


def require(what: str) -> None:
    """Raise ``MissingServerStack``, naming ``what`` needs it, unless it is all installed."""
    lacking = missing()
    if lacking:
        raise MissingServerStack(
            f"{what} needs vpool's server stack, and {', '.join(lacking)} "
            f"{'is' if len(lacking) == 1 else 'are'} not installed: {INSTALL} "
            "(a volunteer's machine needs only vpool[agent])"
        )


def coordinator_main() -> None:
    """``vpool-coordinator``: ``vpool.coordinator.cli.main`` once the stack is there."""
    try:
        require("vpool-coordinator")
    except MissingServerStack as exc:
        print(f"vpool-coordinator: {exc}", file=sys.stderr)
        sys.exit(1)
    from vpool.coordinator.cli import main

    main()
