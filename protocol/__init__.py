"""vpool.protocol: the sans-IO core shared by every role.

Pure and synchronous: typed wire messages (``messages``), length-prefixed framing
(``framing``), signed tokens (``tokens``), the HTTP API payloads (``api``), connection session
state machines (``session``) and certificate material (``pki``). Nothing here performs I/O or
reads a clock; callers pass ``now`` in. ``tests/protocol/test_sans_io.py`` walks the imports to
keep it that way.
"""

from vpool.protocol.errors import (
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    TokenError,
)

__all__ = ["LocalProtocolError", "ProtocolError", "RemoteProtocolError", "TokenError"]
