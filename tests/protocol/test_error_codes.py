"""One vocabulary of error codes, and one rule for what an ``Error`` ends."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vpool.protocol import messages as m
from vpool.protocol.errors import (
    SCOPES,
    ErrorCode,
    Scope,
    divergence_message,
    ends_connection,
    known,
)
from vpool.protocol.session import Session

ROOT = Path(__file__).resolve().parents[2]
# Every folder whose code sends, raises or compares protocol error codes.
SHELLS = ("relay", "worker_agent", "sdk", "mpi", "protocol")
# Calls that take a protocol error code: the position of the code among their arguments
# (None: only as ``code=``).
CODE_CALLS: dict[str, int | None] = {"Error": 0, "Refused": 0, "_refuse": 1, "StoreError": 1}
CODE_CALLS |= dict.fromkeys(
    ("ProtocolError", "RemoteProtocolError", "LocalProtocolError", "TokenError", "_resolve")
)


def test_every_code_has_a_scope_and_a_distinct_value() -> None:
    assert set(SCOPES) == set(ErrorCode)
    assert len({c.value for c in ErrorCode}) == len(ErrorCode)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_what_an_error_ends(code: ErrorCode) -> None:
    # Without a rank, every error ends the connection; with one, the code's scope decides.
    assert ends_connection(code, -1)
    assert ends_connection(code, 3) is (SCOPES[code] is Scope.CONNECTION)


def test_an_unknown_code_ends_the_connection() -> None:
    assert known("from_a_newer_peer") is None
    assert ends_connection("from_a_newer_peer", 3)
    assert known("fenced") is ErrorCode.FENCED


def test_rank_codes_are_those_that_concern_one_rank_only() -> None:
    rank = {c for c, s in SCOPES.items() if s is Scope.RANK}
    assert {ErrorCode.FENCED, ErrorCode.TRIMMED, ErrorCode.NOT_DETERMINISTIC} <= rank
    # A malformed frame or a forged token says the peer itself is broken or hostile.
    assert not {ErrorCode.BAD_FRAME, ErrorCode.FORGED_TOKEN, ErrorCode.SEQ_GAP} & rank


def _open_session() -> Session:
    s = Session("relay", "client")
    s.send(m.Hello(version=m.PROTOCOL_VERSION, role="agent", token="t"))
    s.receive(m.Welcome(version=m.PROTOCOL_VERSION, relay="r"))
    assert s.is_open
    return s


@pytest.mark.parametrize("code", list(ErrorCode))
def test_a_session_follows_the_same_rule(code: ErrorCode) -> None:
    s = _open_session()
    s.receive(m.Error(code=code, message="x", job=1, rank=2))
    assert s.is_open is not ends_connection(code, 2)


def test_the_error_codes_travel_as_plain_strings() -> None:
    err = m.Error(code=ErrorCode.TRIMMED, message="x", job=1, rank=0)
    back = m.decode(m.encode(err))
    assert isinstance(back, m.Error) and back.code == "trimmed" and type(back.code) is str


def test_divergence_is_reported_in_one_wording() -> None:
    assert divergence_message(1, 2, 3) == (
        "program is not deterministic: rank 1 re-sent message 3 to rank 2 (channel 1->2) "
        "with different content"
    )
    assert divergence_message(4).startswith("program is not deterministic: rank 4 re-sent")


def _literal_codes(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        values: list[ast.expr] = []
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in CODE_CALLS:
                pos = CODE_CALLS[name]
                if pos is not None and len(node.args) > pos:
                    values.append(node.args[pos])
                values += [k.value for k in node.keywords if k.arg == "code"]
        elif isinstance(node, ast.Compare):
            left = node.left
            if isinstance(left, ast.Attribute) and left.attr == "code":
                values += node.comparators
        for v in values:
            if isinstance(v, ast.Constant) and isinstance(v.value, str):
                found.append((v.lineno, v.value))
    return found


def test_shells_use_the_enum_never_a_bare_string() -> None:
    offenders = []
    for folder in SHELLS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "errors.py" and folder == "protocol":
                continue
            for line, value in _literal_codes(ast.parse(path.read_text())):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {value!r}")
    assert offenders == [], "use protocol.errors.ErrorCode:\n" + "\n".join(offenders)


def test_the_guard_finds_a_bare_string() -> None:
    src = (
        'Error(code="fenced", message="m")\nRefused("trimmed", "m")\nif e.code == "x": pass\n'
        'StoreError("message", "protocol")\n_refuse(s, "version", "m")\nStoreError("only m")\n'
    )
    found = sorted(v for _, v in _literal_codes(ast.parse(src)))
    assert found == ["fenced", "protocol", "trimmed", "version", "x"]
