from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from vpool.protocol.errors import TokenError
from vpool.protocol.tokens import (
    AgentClaims,
    RankClaims,
    peek_claims,
    private_key_bytes,
    private_key_from_bytes,
    public_key_from_text,
    public_key_text,
    sign_possession,
    sign_token,
    verify_possession,
    verify_token,
)

KEY = Ed25519PrivateKey.generate()
PUB = KEY.public_key()
CLAIMS = RankClaims(job=4, rank=2, incarnation=1, size=8, agent="a1", expires=1000.0)


def _code(fn) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(TokenError) as info:
        fn()
    return info.value.code


def test_round_trip() -> None:
    token = sign_token(CLAIMS, KEY)
    assert verify_token(token, PUB, now=999.0, kind=RankClaims) == CLAIMS
    assert peek_claims(token) == CLAIMS


def test_each_failure_has_its_code() -> None:
    token = sign_token(CLAIMS, KEY)
    other = Ed25519PrivateKey.generate()
    assert _code(lambda: verify_token("", PUB, now=0, kind=RankClaims)) == "missing_token"
    assert _code(lambda: verify_token("abc", PUB, now=0, kind=RankClaims)) == "malformed_token"
    assert _code(lambda: verify_token("a.b.c", PUB, now=0, kind=RankClaims)) == "malformed_token"
    forged = sign_token(CLAIMS, other)
    assert _code(lambda: verify_token(forged, PUB, now=0, kind=RankClaims)) == "forged_token"
    assert _code(lambda: verify_token(token, PUB, now=1001.0, kind=RankClaims)) == "expired_token"
    assert _code(lambda: verify_token(token, PUB, now=0, kind=AgentClaims)) == "wrong_token"


def test_tampered_body_is_forged() -> None:
    _body, sig = sign_token(CLAIMS, KEY).split(".")
    evil = sign_token(
        RankClaims(job=5, rank=2, incarnation=1, size=8, agent="a1", expires=1000.0), KEY
    ).split(".")[0]
    assert (
        _code(lambda: verify_token(f"{evil}.{sig}", PUB, now=0, kind=RankClaims)) == "forged_token"
    )


@given(st.text(max_size=80))
def test_arbitrary_text_never_verifies(text: str) -> None:
    with pytest.raises(TokenError):
        verify_token(text, PUB, now=0, kind=RankClaims)


def test_keys_as_text_and_pem() -> None:
    assert public_key_text(public_key_from_text(public_key_text(PUB))) == public_key_text(PUB)
    again = private_key_from_bytes(private_key_bytes(KEY))
    assert public_key_text(again.public_key()) == public_key_text(PUB)


def test_possession_proof() -> None:
    pub, sig = sign_possession(KEY, 100.0)
    verify_possession(pub, 100.0, sig, now=110.0)
    with pytest.raises(TokenError):
        verify_possession(pub, 100.0, sig, now=1000.0)  # replayed much later
    other_pub, _ = sign_possession(Ed25519PrivateKey.generate(), 100.0)
    with pytest.raises(TokenError):
        verify_possession(other_pub, 100.0, sig, now=100.0)  # someone else's key
