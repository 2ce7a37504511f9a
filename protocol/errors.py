"""Errors of the protocol core.

    ProtocolError
     +-- LocalProtocolError    we tried something the protocol forbids (a bug on our side)
     +-- RemoteProtocolError   the peer sent something malformed, oversized or out of order
     +-- TokenError            a token is missing, malformed, forged, expired or for something else

Every error carries a short machine-readable ``code`` that travels on the wire inside an
``Error`` message, next to a human-readable message. Never a traceback, never a pickle.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class of every error raised by ``vpool.protocol``."""

    code = "protocol_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class LocalProtocolError(ProtocolError):
    """We attempted something the protocol forbids in the current state."""

    code = "local_protocol_error"


class RemoteProtocolError(ProtocolError):
    """The peer violated the protocol: bad bytes, oversized frame, wrong order."""

    code = "bad_frame"


class TokenError(ProtocolError):
    """A token is missing, malformed, has a bad signature, is expired or names something else.

    ``code`` is one of: ``missing_token``, ``malformed_token``, ``forged_token``,
    ``expired_token``, ``wrong_token``.
    """

    code = "bad_token"
