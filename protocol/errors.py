"""Errors of the protocol core, and the one vocabulary of error codes.

    ProtocolError
     +-- LocalProtocolError    we tried something the protocol forbids (a bug on our side)
     +-- RemoteProtocolError   the peer sent something malformed, oversized or out of order
     +-- TokenError            a token is missing, malformed, forged, expired or for something else

Every error carries a short machine-readable ``code``, one of ``ErrorCode``, that travels on the
wire inside an ``Error`` message next to a human-readable message. Never a traceback, never a
pickle.

What an ``Error`` ends is decided in one place, ``ends_connection``: a code of ``Scope.RANK``
that names a rank (``Error.rank >= 0``) ends only what that rank asked for (its attachment,
its image request); the connection, which an agent shares between all its ranks, goes on.
Every other error, and every code this side does not know (a newer peer's), ends the
connection. Relays, agents, the store and ``Session`` all decide with it.
"""

from __future__ import annotations

import enum
from typing import Final


class Scope(enum.Enum):
    RANK = "rank"  # ends one rank's attachment or request; the shared connection goes on
    CONNECTION = "connection"  # the connection is closed after the Error


class ErrorCode(enum.StrEnum):
    """Every code an ``Error`` may carry, with what it means (``SCOPES`` says what it ends)."""

    # -- the bytes and the order of a connection -----------------------------------------
    BAD_FRAME = "bad_frame"  # bytes that are not a frame, a message that does not decode
    FRAME_TOO_LARGE = "frame_too_large"  # a prefix announcing more than the limits allow
    UNEXPECTED_MESSAGE = "unexpected_message"  # a well-formed message not allowed now
    BAD_VERSION = "bad_version"  # the peer speaks another protocol version
    BAD_ROLE = "bad_role"  # a Hello for a role this server does not serve
    BAD_CREDIT = "bad_credit"  # a negative Credit
    SEQ_GAP = "seq_gap"  # a deposit skipping a sequence number of its channel
    DET_GAP = "det_gap"  # a determinant skipping an index
    NOT_ATTACHED = "not_attached"  # frames of a rank not attached on this connection
    NOT_HOME = "not_home"  # a determinant sent to a relay that is not the rank's home
    BAD_RANK = "bad_rank"  # a rank outside its job
    BAD_DST = "bad_dst"  # a destination outside the job
    NOT_YOURS = "not_yours"  # a rank writing as another rank (agent's unix socket)
    UNKNOWN_SECRET = "unknown_secret"  # a rank's Hello with a secret no rank here has
    ALREADY_CONNECTED = "already_connected"  # a second connection for one rank (or control)
    WRONG_CHECKPOINT = "wrong_checkpoint"  # a clone announcing a checkpoint nobody asked for
    NOT_READY = "not_ready"  # the relay has not registered with the coordinator yet
    TIMEOUT = "timeout"  # nothing (or no Hello) in time
    # -- credentials -----------------------------------------------------------------------
    MISSING_TOKEN = "missing_token"
    MALFORMED_TOKEN = "malformed_token"
    FORGED_TOKEN = "forged_token"  # a signature that is not the coordinator's (or a bad secret)
    EXPIRED_TOKEN = "expired_token"
    WRONG_TOKEN = "wrong_token"  # a valid token for something or someone else
    # -- one rank ----------------------------------------------------------------------------
    FENCED = "fenced"  # a newer incarnation holds the rank: this one must stop
    TRIMMED = "trimmed"  # asks for what a committed checkpoint let the log drop
    NOT_DETERMINISTIC = "not_deterministic"  # a re-sent message differs from the logged one
    QUOTA_EXCEEDED = "quota_exceeded"  # the job's logs at this relay reached job_log_quota
    DISK_FULL = "disk_full"  # the relay's disk is down to disk_reserve: no new deposits
    STOPPED = "stopped"  # the relay stopped the rank (the job ended); agent-side only
    JOB_FINISHED = "job_finished"
    # -- checkpoint images (the store) ----------------------------------------------------------
    NOT_FOUND = "not_found"  # no such image
    STALE_CHECKPOINT = "stale_ckpt"  # an image older than the one the store holds
    BUSY = "busy"  # the image is being written
    TOO_LARGE = "too_large"  # an image over the store's limit
    CORRUPT = "corrupt"  # size or digest of an upload do not match its CkptEnd
    REFUSED = "refused"  # the coordinator refused to record the image
    STORAGE_ERROR = "storage_error"  # the relay's disk failed this request
    # -- this side only, never on the wire -------------------------------------------------------
    LINK_BROKEN = "link_broken"  # the connection failed (reset, timeout, closed)


SCOPES: Final[dict[ErrorCode, Scope]] = {
    **{code: Scope.CONNECTION for code in ErrorCode},
    **{
        code: Scope.RANK
        for code in (
            ErrorCode.FENCED,
            ErrorCode.TRIMMED,
            ErrorCode.NOT_DETERMINISTIC,
            ErrorCode.QUOTA_EXCEEDED,
            ErrorCode.DISK_FULL,
            ErrorCode.STOPPED,
            ErrorCode.JOB_FINISHED,
            ErrorCode.NOT_FOUND,
            ErrorCode.STALE_CHECKPOINT,
            ErrorCode.BUSY,
            ErrorCode.TOO_LARGE,
            ErrorCode.CORRUPT,
            ErrorCode.REFUSED,
            ErrorCode.STORAGE_ERROR,
        )
    },
}


def known(code: str) -> ErrorCode | None:
    """The ``ErrorCode`` of a code read off the wire, or None for one this side does not know."""
    try:
        return ErrorCode(code)
    except ValueError:
        return None


def ends_connection(code: str, rank: int) -> bool:
    """Whether an ``Error`` with this code about ``rank`` (-1: none) ends its connection."""
    member = known(code)
    return member is None or rank < 0 or SCOPES[member] is Scope.CONNECTION


class ProtocolError(Exception):
    """Base class of every error raised by ``vpool.protocol``."""

    code: str = ErrorCode.UNEXPECTED_MESSAGE

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class LocalProtocolError(ProtocolError):
    """We attempted something the protocol forbids in the current state."""


class RemoteProtocolError(ProtocolError):
    """The peer violated the protocol: bad bytes, oversized frame, wrong order."""

    code = ErrorCode.BAD_FRAME


class TokenError(ProtocolError):
    """A token is missing, malformed, has a bad signature, is expired or names something else
    (one of the token codes of ``ErrorCode``)."""

    code = ErrorCode.MALFORMED_TOKEN


def divergence_message(src: int, dst: int | None = None, seq: int | None = None) -> str:
    """How a re-sent message that differs from the logged one is reported, everywhere."""
    what = (
        f"message {seq} to rank {dst} (channel {src}->{dst})"
        if dst is not None and seq is not None
        else "a message"
    )
    return f"program is not deterministic: rank {src} re-sent {what} with different content"
