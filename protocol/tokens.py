"""Tokens signed by the coordinator with Ed25519, verified by relays and by the coordinator.

A token is ``base64url(msgpack(claims)) + "." + base64url(signature)``. Claims are a tagged
union: ``RankClaims`` (an incarnation of a rank, bound to the agent running it) and
``AgentClaims`` (an enrolled agent). Verification takes ``now`` from the caller: no clock here.

Also here: helpers for Ed25519 keys as base64 text, and proof-of-possession signatures used when
an agent enrolls.
"""

from __future__ import annotations

import base64
import binascii
from typing import TypeVar

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from vpool.protocol.errors import ErrorCode, TokenError


class _Claims(msgspec.Struct, frozen=True, tag_field="kind"):
    pass


class RankClaims(_Claims, frozen=True, tag="rank"):
    """Incarnation ``incarnation`` of rank ``rank`` of job ``job`` (of ``size`` ranks), run by
    agent ``agent``. Relays accept a rank's traffic only with such a token."""

    job: int
    rank: int
    incarnation: int
    size: int
    agent: str
    expires: float
    # A re-execution that checks the original run (validation by replay): relays compare all
    # it sends with the log and let nothing new through (``api.RelayValidated``).
    validating: bool = False


class AgentClaims(_Claims, frozen=True, tag="agent"):
    """An enrolled agent; opens its connections to relays and authorizes its API calls."""

    agent: str
    expires: float


Claims = RankClaims | AgentClaims
C = TypeVar("C", RankClaims, AgentClaims)

_enc = msgspec.msgpack.Encoder()
_dec: msgspec.msgpack.Decoder[Claims] = msgspec.msgpack.Decoder(Claims)


def _b64e(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64d(text: str) -> bytes:
    pad = "=" * (-len(text) % 4)
    return base64.urlsafe_b64decode(text + pad)


def sign_token(claims: Claims, key: Ed25519PrivateKey) -> str:
    body = _enc.encode(claims)
    return _b64e(body) + "." + _b64e(key.sign(body))


def verify_token(token: str, key: Ed25519PublicKey, *, now: float, kind: type[C]) -> C:
    """Return the claims of a valid token of the given kind, else raise ``TokenError``."""
    if not token:
        raise TokenError("no token was presented", code=ErrorCode.MISSING_TOKEN)
    try:
        body_text, sig_text = token.split(".")
        body, sig = _b64d(body_text), _b64d(sig_text)
    except (ValueError, binascii.Error) as exc:
        raise TokenError(
            "token is not of the form BODY.SIGNATURE", code=ErrorCode.MALFORMED_TOKEN
        ) from exc
    try:
        key.verify(sig, body)
    except InvalidSignature as exc:
        raise TokenError(
            "token signature is not the coordinator's", code=ErrorCode.FORGED_TOKEN
        ) from exc
    try:
        claims = _dec.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise TokenError(
            f"token claims are malformed: {exc}", code=ErrorCode.MALFORMED_TOKEN
        ) from exc
    if not isinstance(claims, kind):
        raise TokenError(
            f"expected a {kind.__name__} token, got {type(claims).__name__}",
            code=ErrorCode.WRONG_TOKEN,
        )
    if claims.expires < now:
        raise TokenError("token has expired", code=ErrorCode.EXPIRED_TOKEN)
    return claims


def peek_claims(token: str) -> Claims:
    """Claims of a token *without* verifying it (for display and routing only)."""
    try:
        return _dec.decode(_b64d(token.split(".")[0]))
    except (ValueError, binascii.Error, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TokenError("token is malformed", code=ErrorCode.MALFORMED_TOKEN) from exc


def public_key_text(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return _b64e(raw)


def public_key_from_text(text: str) -> Ed25519PublicKey:
    try:
        return Ed25519PublicKey.from_public_bytes(_b64d(text))
    except (ValueError, binascii.Error) as exc:
        raise TokenError("not an Ed25519 public key", code=ErrorCode.MALFORMED_TOKEN) from exc


def private_key_bytes(key: Ed25519PrivateKey) -> bytes:
    """PEM (PKCS8, unencrypted) of a private key, for storing with 0600 permissions."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def private_key_from_bytes(data: bytes) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(data, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise TokenError("not an Ed25519 private key", code=ErrorCode.MALFORMED_TOKEN)
    return key


def possession_message(public_key: str, timestamp: float) -> bytes:
    """What an enrolling agent signs to prove it holds the private key of ``public_key``."""
    return f"vpool-enroll:{public_key}:{timestamp:.3f}".encode()


def sign_possession(key: Ed25519PrivateKey, timestamp: float) -> tuple[str, str]:
    pub = public_key_text(key.public_key())
    return pub, _b64e(key.sign(possession_message(pub, timestamp)))


def verify_possession(
    public_key: str, timestamp: float, signature: str, *, now: float, skew: float = 300.0
) -> None:
    if abs(now - timestamp) > skew:
        raise TokenError(
            "enrollment timestamp is too far from the coordinator's clock",
            code=ErrorCode.EXPIRED_TOKEN,
        )
    key = public_key_from_text(public_key)
    try:
        key.verify(_b64d(signature), possession_message(public_key, timestamp))
    except (InvalidSignature, ValueError, binascii.Error) as exc:
        raise TokenError(
            "enrollment signature does not match the public key", code=ErrorCode.FORGED_TOKEN
        ) from exc
