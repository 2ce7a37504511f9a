"""vpool: unmodified mpi4py programs on volatile, firewalled volunteer machines.

The installed import root. The repository's top-level folders map onto it (see pyproject.toml):
``protocol/`` is ``vpool.protocol``, ``relay/`` is ``vpool.relay``, and so on. This package itself
holds only the few helpers every I/O shell shares (settings loading, TLS contexts, paths).
"""

__version__ = "0.1.0"
