"""vpool.sdk: the scientist's side of vpool, ``Client`` and the ``vsdk`` command.

Kept light on purpose: rank processes import ``vpool.mpi`` (which imports this package
first), so nothing here is imported until it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vpool.sdk.client import Client
    from vpool.sdk.errors import (
        ApiError,
        AuthError,
        ConfigError,
        ConnectionError,
        NotFoundError,
        VsdkError,
    )

__all__ = [
    "ApiError",
    "AuthError",
    "Client",
    "ConfigError",
    "ConnectionError",
    "NotFoundError",
    "VsdkError",
]

_LAZY = {
    "Client": "vpool.sdk.client",
    "ApiError": "vpool.sdk.errors",
    "AuthError": "vpool.sdk.errors",
    "ConfigError": "vpool.sdk.errors",
    "ConnectionError": "vpool.sdk.errors",
    "NotFoundError": "vpool.sdk.errors",
    "VsdkError": "vpool.sdk.errors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vpool.sdk' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
