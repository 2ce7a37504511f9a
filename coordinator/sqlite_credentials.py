"""Trust between parties, in SQLite: join tokens that admit agents, one key per relay, bans.

Enrollment is closed unless the operator opens it: a new agent key is admitted by a live join
token (not revoked, not expired, uses left), which it consumes. A key already enrolled needs no
token to enroll again (the agent restarted, or the coordinator forgot its agent token): proving
possession of the key is the credential from then on. A banned agent's key is refused for
good; its active ranks are lost and restarted elsewhere, and every job it ran a rank of records
that the rank's results came from a banned agent.

A relay authenticates with its own key (``vpool-coordinator relay add NAME``); the key says
which relay it is, so a relay can only speak for itself. Only hashes are stored, as for users'
API tokens (``sqlite_accounts``).
"""

from __future__ import annotations

from typing import Any

import sqlite_utils

from vpool.coordinator.errors import Conflict, Forbidden, NotFound
from vpool.protocol import api

MAX_LABEL = 100
MAX_REASON = 500


class CredentialsMixin:
    db: sqlite_utils.Database

    def _one(self, sql: str, params: Any = ()) -> dict[str, Any] | None:
        raise NotImplementedError

    def _lose(
        self,
        job: int,
        rank: int,
        reason: str,
        now: float,
        *,
        suspect: bool,
        exit_code: int | None = None,
    ) -> bool:
        raise NotImplementedError

    def _event(
        self, job: int, now: float, kind: str, message: str, rank: int | None = None
    ) -> None:
        raise NotImplementedError

    # -- join tokens --------------------------------------------------------------------------

    def create_join_token(
        self, token_hash: str, label: str, now: float, *, uses: int | None, expires: float | None
    ) -> api.JoinTokenInfo:
        if uses is not None and uses < 1:
            raise ValueError("a join token admits at least one agent")
        with self.db.atomic():
            cursor = self.db.execute(
                "INSERT INTO join_tokens (hash, label, created, expires, uses_left) "
                "VALUES (?, ?, ?, ?, ?)",
                [token_hash, label[:MAX_LABEL], now, expires, uses],
            )
            row = self._one("SELECT * FROM join_tokens WHERE id = ?", [cursor.lastrowid])
        assert row is not None
        return _join_token_info(row, now)

    def list_join_tokens(self, now: float) -> list[api.JoinTokenInfo]:
        rows = self.db.query("SELECT * FROM join_tokens ORDER BY id")
        return [_join_token_info(row, now) for row in rows]

    def revoke_join_token(self, token_id: int, now: float) -> api.JoinTokenInfo:
        with self.db.atomic():
            self.db.execute(
                "UPDATE join_tokens SET revoked = COALESCE(revoked, ?) WHERE id = ?",
                [now, token_id],
            )
            row = self._one("SELECT * FROM join_tokens WHERE id = ?", [token_id])
        if row is None:
            raise NotFound(f"no join token {token_id}", code="unknown_join_token")
        return _join_token_info(row, now)

    def _admit_agent(
        self, agent_id: str, token_hash: str | None, now: float, *, open_: bool
    ) -> int | None:
        """May the key of ``agent_id`` enroll? Raises ``Forbidden`` if not. A new key admitted
        by a join token consumes one of its uses and gets the token's id back. Runs inside
        ``enroll_agent``'s transaction."""
        known = self._one("SELECT state, banned FROM agents WHERE id = ?", [agent_id])
        if known is not None:
            if known["state"] == "banned":
                raise Forbidden(
                    f"agent {agent_id} is banned from this pool: {known['banned']}",
                    code="agent_banned",
                )
            return None
        if token_hash is None:
            if open_:
                return None
            raise Forbidden(
                "this pool admits agents with a join token only: ask its operator for one "
                "(vpool-coordinator join-token create) and set join_token",
                code="join_token_required",
            )
        row = self._one("SELECT * FROM join_tokens WHERE hash = ?", [token_hash])
        why = _unusable(row, now)
        if why:
            if open_:
                return None
            raise Forbidden(f"the join token {why}", code="bad_join_token")
        assert row is not None
        self.db.execute(
            "UPDATE join_tokens SET used = used + 1, "
            "uses_left = CASE WHEN uses_left IS NULL THEN NULL ELSE uses_left - 1 END "
            "WHERE id = ?",
            [row["id"]],
        )
        return int(row["id"])

    # -- bans ---------------------------------------------------------------------------------

    def ban_agent(self, who: str, reason: str, now: float) -> dict[str, Any]:
        """Ban the agent with id or name ``who``; return its row (``affected``: the jobs it ran
        ranks of). Its active ranks are lost and restarted on other agents, and its record of
        agreeing (validation by replay) starts again: unbanned, its ranks of validated jobs
        are always re-executed until it has agreed often enough again."""
        reason = reason.strip()[:MAX_REASON] or "banned by an operator"
        with self.db.atomic():
            agent = self._find_agent(who)
            if agent["state"] == "banned":
                raise Conflict(f"agent {agent['id']} is banned already", code="agent_banned")
            self.db.execute(
                "UPDATE agents SET state = 'banned', banned = ?, free_slots = 0, "
                "agreed_streak = 0 WHERE id = ?",
                [reason, agent["id"]],
            )
            name = agent["name"]
            active = list(
                self.db.query(
                    "SELECT job, rank FROM ranks WHERE agent = ? AND state IN "
                    "('leased', 'running') ORDER BY job, rank",
                    [agent["id"]],
                )
            )
            for r in active:
                self._lose(
                    r["job"],
                    r["rank"],
                    f"rank {r['rank']} lost: agent {name} was banned ({reason})",
                    now,
                    suspect=True,
                )
            ran = list(
                self.db.query(
                    "SELECT job, group_concat(DISTINCT rank) AS ranks FROM incarnations "
                    "WHERE agent = ? GROUP BY job ORDER BY job",
                    [agent["id"]],
                )
            )
            for r in ran:
                ranks = ", ".join(sorted(str(r["ranks"]).split(","), key=int))
                self._event(
                    r["job"],
                    now,
                    "agent_banned",
                    f"agent {name} was banned ({reason}): what it ran of rank(s) {ranks} is "
                    "not trusted",
                )
            agent["affected"] = [int(r["job"]) for r in ran]
            agent["lost"] = len(active)
        return agent

    def unban_agent(self, who: str) -> dict[str, Any]:
        with self.db.atomic():
            agent = self._find_agent(who)
            if agent["state"] != "banned":
                raise Conflict(f"agent {agent['id']} is not banned", code="not_banned")
            # It enrolls again to be heard from: until then it counts as lost.
            self.db.execute(
                "UPDATE agents SET state = 'lost', banned = '' WHERE id = ?", [agent["id"]]
            )
        return agent

    def _find_agent(self, who: str) -> dict[str, Any]:
        rows = list(
            self.db.query(
                "SELECT id, name, state, banned FROM agents WHERE id = ? OR name = ?", [who, who]
            )
        )
        if not rows:
            raise NotFound(f"no agent {who!r}", code="unknown_agent")
        exact = [r for r in rows if r["id"] == who]
        if exact:
            return exact[0]
        if len(rows) > 1:
            ids = ", ".join(r["id"] for r in rows)
            raise Conflict(f"{len(rows)} agents are named {who!r} ({ids}): give the id")
        return rows[0]

    # -- relay keys ---------------------------------------------------------------------------

    def add_relay_key(self, name: str, key_hash: str, now: float, *, replace: bool) -> None:
        with self.db.atomic():
            row = self._one("SELECT revoked FROM relay_keys WHERE name = ?", [name])
            if row is not None and row["revoked"] is None and not replace:
                raise Conflict(
                    f"relay {name!r} has a key already (make a new one with --rotate)",
                    code="relay_exists",
                )
            self.db.execute(
                "INSERT INTO relay_keys (name, hash, created) VALUES (?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET hash = excluded.hash, "
                "created = excluded.created, revoked = NULL",
                [name, key_hash, now],
            )

    def relay_by_key_hash(self, key_hash: str) -> str | None:
        row = self._one(
            "SELECT name FROM relay_keys WHERE hash = ? AND revoked IS NULL", [key_hash]
        )
        return None if row is None else str(row["name"])

    def revoke_relay_key(self, name: str, now: float) -> None:
        with self.db.atomic():
            cursor = self.db.execute(
                "UPDATE relay_keys SET revoked = ? WHERE name = ? AND revoked IS NULL",
                [now, name],
            )
            if not cursor.rowcount:
                raise NotFound(f"relay {name!r} has no live key", code="unknown_relay")

    def list_relay_keys(self) -> list[dict[str, Any]]:
        return list(
            self.db.query(
                "SELECT k.name, k.created, k.revoked, r.state, r.last_seen, r.host, r.port "
                "FROM relay_keys k LEFT JOIN relays r ON r.name = k.name ORDER BY k.name"
            )
        )


def _unusable(row: dict[str, Any] | None, now: float) -> str:
    """Why a join token admits nobody ("" if it does)."""
    if row is None:
        return "is not one of this pool's"
    if row["revoked"] is not None:
        return f"{row['id']} was revoked"
    if row["expires"] is not None and row["expires"] <= now:
        return f"{row['id']} has expired"
    if row["uses_left"] is not None and row["uses_left"] <= 0:
        return f"{row['id']} has been used up"
    return ""


def _join_token_info(row: dict[str, Any], now: float) -> api.JoinTokenInfo:
    why = _unusable(row, now)
    return api.JoinTokenInfo(
        id=int(row["id"]),
        label=row["label"],
        created=row["created"],
        expires=row["expires"],
        uses_left=row["uses_left"],
        used=int(row["used"]),
        revoked=row["revoked"],
        usable=not why,
    )
