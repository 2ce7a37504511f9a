"""Users, their API tokens and the portal's sessions, in SQLite.

Only hashes of secrets are stored: a token's sha256, a session cookie's sha256. A token is
looked up by hash, never compared in Python. ``last_used`` is written at most once a minute per
token, so authenticated reads stay reads.
"""

from __future__ import annotations

from typing import Any

import sqlite_utils

from vpool.coordinator.access import Principal
from vpool.coordinator.errors import BadRequest, Conflict, NotFound
from vpool.protocol import api

LAST_USED_PRECISION = 60.0  # seconds
MAX_TOKENS = 100  # live tokens per user
MAX_LABEL = 100


class AccountsMixin:
    db: sqlite_utils.Database

    def _one(self, sql: str, params: Any = ()) -> dict[str, Any] | None:
        raise NotImplementedError

    def add_user(
        self,
        name: str,
        token_hash: str,
        now: float,
        *,
        role: api.Role = "user",
        label: str = "first token",
    ) -> None:
        """A new user with one API token."""
        _check_role(role)
        with self.db.atomic():
            if self._one("SELECT name FROM accounts WHERE name = ?", [name]):
                raise Conflict(f"user {name!r} already exists", code="user_exists")
            self.db.execute(
                "INSERT INTO accounts (name, role, created) VALUES (?, ?, ?)", [name, role, now]
            )
            self._insert_token(name, token_hash, label, now)

    def list_users(self) -> list[dict[str, Any]]:
        """Every user with their role and number of live tokens."""
        return list(
            self.db.query(
                "SELECT a.name, a.role, a.created, COUNT(t.id) AS tokens FROM accounts a "
                "LEFT JOIN tokens t ON t.user = a.name AND t.revoked IS NULL "
                "GROUP BY a.name ORDER BY a.name"
            )
        )

    def set_role(self, name: str, role: api.Role) -> None:
        _check_role(role)
        with self.db.atomic():
            if self._one("SELECT name FROM accounts WHERE name = ?", [name]) is None:
                raise NotFound(f"no user {name!r}", code="unknown_user")
            self.db.execute("UPDATE accounts SET role = ? WHERE name = ?", [role, name])

    def principal_by_token_hash(self, token_hash: str, now: float) -> Principal | None:
        row = self._one(
            "SELECT t.id, t.user, t.last_used, a.role FROM tokens t "
            "JOIN accounts a ON a.name = t.user WHERE t.hash = ? AND t.revoked IS NULL",
            [token_hash],
        )
        if row is None:
            return None
        if row["last_used"] is None or now - row["last_used"] >= LAST_USED_PRECISION:
            self.db.execute("UPDATE tokens SET last_used = ? WHERE id = ?", [now, row["id"]])
        return Principal(name=row["user"], role=row["role"], token=row["id"])

    # -- tokens -------------------------------------------------------------------------------

    def create_token(self, user: str, token_hash: str, label: str, now: float) -> api.TokenInfo:
        with self.db.atomic():
            if self._one("SELECT name FROM accounts WHERE name = ?", [user]) is None:
                raise NotFound(f"no user {user!r}", code="unknown_user")
            live = self._one(
                "SELECT COUNT(*) AS n FROM tokens WHERE user = ? AND revoked IS NULL", [user]
            )
            if live is not None and live["n"] >= MAX_TOKENS:
                raise Conflict(
                    f"a user has at most {MAX_TOKENS} live tokens; revoke some first",
                    code="too_many_tokens",
                )
            token_id = self._insert_token(user, token_hash, label, now)
        info = self._token(user, token_id)
        assert info is not None
        return info

    def list_tokens(self, user: str) -> list[api.TokenInfo]:
        rows = self.db.query("SELECT * FROM tokens WHERE user = ? ORDER BY id", [user])
        return [_token_info(r) for r in rows]

    def revoke_token(self, user: str, token_id: int, now: float) -> api.TokenInfo:
        """Revoke one of ``user``'s tokens and end the portal sessions opened with it. Tokens
        of other users do not exist for them."""
        with self.db.atomic():
            info = self._token(user, token_id)
            if info is None:
                raise NotFound(f"no token {token_id}", code="unknown_token")
            if info.revoked is None:
                self.db.execute("UPDATE tokens SET revoked = ? WHERE id = ?", [now, token_id])
            self.db.execute("DELETE FROM sessions WHERE token = ?", [token_id])
        revoked = self._token(user, token_id)
        assert revoked is not None
        return revoked

    def _insert_token(self, user: str, token_hash: str, label: str, now: float) -> int:
        label = label.strip()
        if len(label) > MAX_LABEL:
            raise BadRequest(f"a token's label is at most {MAX_LABEL} characters", code="bad_label")
        cursor = self.db.execute(
            "INSERT INTO tokens (user, hash, label, created) VALUES (?, ?, ?, ?)",
            [user, token_hash, label or "token", now],
        )
        return int(cursor.lastrowid or 0)

    def _token(self, user: str, token_id: int) -> api.TokenInfo | None:
        row = self._one("SELECT * FROM tokens WHERE id = ? AND user = ?", [token_id, user])
        return None if row is None else _token_info(row)

    # -- portal sessions ----------------------------------------------------------------------

    def create_session(
        self, session_hash: str, token: int, csrf: str, now: float, expires: float
    ) -> None:
        with self.db.atomic():
            self.db.execute("DELETE FROM sessions WHERE expires <= ?", [now])
            self.db.execute(
                "INSERT INTO sessions (hash, token, csrf, created, expires) VALUES (?, ?, ?, ?, ?)",
                [session_hash, token, csrf, now, expires],
            )

    def session(self, session_hash: str, now: float) -> tuple[Principal, str] | None:
        """The principal and CSRF secret of a live session (its token not revoked)."""
        row = self._one(
            "SELECT s.csrf, t.id, t.user, a.role FROM sessions s "
            "JOIN tokens t ON t.id = s.token JOIN accounts a ON a.name = t.user "
            "WHERE s.hash = ? AND s.expires > ? AND t.revoked IS NULL",
            [session_hash, now],
        )
        if row is None:
            return None
        return Principal(name=row["user"], role=row["role"], token=row["id"]), str(row["csrf"])

    def end_session(self, session_hash: str) -> None:
        self.db.execute("DELETE FROM sessions WHERE hash = ?", [session_hash])


def _check_role(role: str) -> None:
    if role not in api.ROLES:
        raise BadRequest(f"a role is one of {', '.join(api.ROLES)}, not {role!r}", code="bad_role")


def _token_info(row: dict[str, Any]) -> api.TokenInfo:
    return api.TokenInfo(
        id=row["id"],
        label=row["label"],
        created=row["created"],
        last_used=row["last_used"],
        revoked=row["revoked"],
    )
