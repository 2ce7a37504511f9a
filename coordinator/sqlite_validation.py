"""Validation by replay in SQLite: sampling a validated job's ranks once they all exited,
placing their re-executions, hearing the relays' verdicts and the re-executions' exits, and
deciding (the rules are ``coordinator.validation``).

A re-execution is an incarnation of the rank like any replacement: a signed token (with
``RankClaims.validating``, so relays compare everything it sends with the log and let nothing
new through), the rank's home relay, a lease that starts it from the beginning (never from a
checkpoint image, which the original's agent made). Its loss is a loss like any other: another
re-execution takes its place, counted against the job's restarts. Its stdout and stderr go
to ``validation_output``, never to the job's output; its result files are not kept unless the
original is found wrong.

Bookkeeping: ``validations`` round 0 records the original run of each rank (its agents, exit
code, stdout, stderr and result files digests) when validation starts; rounds 1 and 2 the
re-executions (agent, incarnation, exit code, the same digests, each relay's verdict).
``ranks.validating`` is the round in progress (0: none); ``ranks.validation`` what came of it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Iterable
from typing import Any

import sqlite_utils

from vpool.coordinator import scheduler, validation
from vpool.coordinator.validation import FIRST, ORIGINAL, SECOND, Run, Verdict
from vpool.protocol import api

_random = secrets.SystemRandom()
NOT_FINISHED = -1  # a re-execution's exit code when a relay's verdict ended it first
VALIDATION_SLACK = 4.0  # a re-execution may take this many times the original's wall time
VALIDATION_MIN_WAIT = 300.0  # s: and at least this long


class ValidationMixin:
    db: sqlite_utils.Database
    validation: validation.Policy
    restarts: scheduler.RestartPolicy

    def _one(self, sql: str, params: Any = ()) -> dict[str, Any] | None:
        raise NotImplementedError

    def job_row(self, job_id: int) -> dict[str, Any] | None:
        raise NotImplementedError

    def _event(
        self, job: int, now: float, kind: str, message: str, rank: int | None = None
    ) -> None:
        raise NotImplementedError

    def _end(self, job: int, state: str, exit_code: int | None, reason: str, now: float) -> None:
        raise NotImplementedError

    def _agent_name(self, agent_id: str) -> str:
        raise NotImplementedError

    # -- starting -----------------------------------------------------------------------------

    def _maybe_all_exited(self, job: int, now: float) -> None:
        """The job succeeds (``_all_exited``) once no rank is left that has not exited with
        code 0, apart from ranks declared failed (in a job whose mode reports failures, the
        survivors carried on without them)."""
        left = self._one(
            "SELECT COUNT(*) AS n FROM ranks WHERE job = ? AND NOT "
            "((state = 'exited' AND exit_code = 0) OR state = 'failed')",
            [job],
        )
        if left is not None and left["n"] == 0:
            self._all_exited(job, now)

    def _all_exited(self, job_id: int, now: float) -> None:
        """Every rank of the job exited with code 0 (inside ``rank_exit``'s transaction): it
        succeeds, or, validated, its sampled ranks are re-executed first."""
        row = self.job_row(job_id)
        assert row is not None
        if not row["validate"]:
            failed = json.loads(row["failed_ranks"])
            reason = "every rank exited with code 0"
            if failed:
                reason = (
                    f"every surviving rank exited with code 0; rank(s) "
                    f"{', '.join(map(str, failed))} failed and the program carried on "
                    f"without them (on-failure {row['on_failure']})"
                )
            self._end(job_id, "succeeded", 0, reason, now)
            return
        sampled: list[int] = []
        skipped: list[str] = []
        for r in list(self.db.query("SELECT * FROM ranks WHERE job = ? ORDER BY rank", [job_id])):
            rank = int(r["rank"])
            agents = self._original_agents(job_id, rank)
            self.db.execute(
                "INSERT OR REPLACE INTO validations (job, rank, round, incarnation, agents, "
                "exit_code, stdout, exited, files, stderr) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    job_id,
                    rank,
                    ORIGINAL,
                    r["incarnation"],
                    json.dumps(agents),
                    r["exit_code"],
                    self._stdout_digest(job_id, rank),
                    now,
                    self._files_digest(job_id, rank, int(r["incarnation"])),
                    self._stderr_digest(
                        row,
                        rank,
                        "SELECT data FROM output WHERE job = ? AND rank = ? AND "
                        "stream = 'stderr' ORDER BY offset",
                        [job_id, rank],
                    ),
                ],
            )
            streak = min((self._streak(a) for a in agents), default=0)
            if _random.random() < validation.chance(streak, self.validation):
                sampled.append(rank)
                continue
            skipped.append(str(rank))
            self.db.execute(
                "UPDATE ranks SET validation = 'skipped', validated_by = ? WHERE job = ? "
                "AND rank = ?",
                [f"not sampled: its agents agreed {streak} times in a row", job_id, rank],
            )
        if not sampled:
            text = "no rank sampled: every rank ran on agents with a long record of agreeing"
            self.db.execute("UPDATE jobs SET validation = ? WHERE id = ?", [text, job_id])
            self._end(job_id, "succeeded", 0, f"every rank exited with code 0; {text}", now)
            return
        names = ", ".join(str(r) for r in sampled)
        note = f" (ranks {', '.join(skipped)} not sampled: trusted agents)" if skipped else ""
        self._event(
            job_id,
            now,
            "validating",
            f"every rank exited with code 0; validating: rank(s) {names} re-executed from their "
            f"logs on other volunteers{note}",
        )
        self._set_summary(job_id, f"validating rank(s) {names}{note}")
        for rank in sampled:
            self._reexecute(job_id, rank, FIRST)

    def _original_agents(self, job: int, rank: int) -> list[str]:
        return [
            str(r["agent"])
            for r in self.db.query(
                "SELECT DISTINCT agent FROM incarnations WHERE job = ? AND rank = ? "
                "AND validates = 0 AND agent IS NOT NULL AND delivered IS NOT NULL "
                "ORDER BY agent",
                [job, rank],
            )
        ]

    def _streak(self, agent_id: str) -> int:
        row = self._one("SELECT agreed_streak FROM agents WHERE id = ?", [agent_id])
        return int(row["agreed_streak"]) if row else 0

    def _reexecute(self, job: int, rank: int, round_: int) -> None:
        """A new incarnation of ``rank`` waits for an unrelated agent (``place_replacements``)
        to re-execute it from its log."""
        self.db.execute(
            "UPDATE ranks SET incarnation = incarnation + 1, state = 'pending', agent = NULL, "
            "exit_code = NULL, avoid = NULL, from_start = 1, not_before = NULL, "
            "relay_losses = 0, relay_since = NULL, waiting_since = NULL, validating = ?, "
            "validation = 'running', validated_by = '' WHERE job = ? AND rank = ?",
            [round_, job, rank],
        )
        self.db.execute(
            "INSERT OR REPLACE INTO validations (job, rank, round) VALUES (?, ?, ?)",
            [job, rank, round_],
        )

    def _set_summary(self, job: int, text: str) -> None:
        self.db.execute("UPDATE jobs SET validation = ? WHERE id = ?", [text, job])

    # -- placing ------------------------------------------------------------------------------

    def _unrelated(self, job: int, rank: int, round_: int, fit: dict[str, int]) -> dict[str, int]:
        """The agents of ``fit`` that may re-execute the rank in ``round_``: none that ran it
        before (the original, an earlier re-execution), nor one admitted by the same join
        token as one of those."""
        ran: set[str] = set()
        for row in self.db.query(
            "SELECT agents FROM validations WHERE job = ? AND rank = ? AND round < ?",
            [job, rank, round_],
        ):
            ran.update(json.loads(row["agents"]))
        # Loss of an earlier re-execution in this round: its agent is out too.
        for row in self.db.query(
            "SELECT agent FROM incarnations WHERE job = ? AND rank = ? AND validates = ?",
            [job, rank, round_],
        ):
            ran.add(str(row["agent"]))
        taken = {mark for marks in self._groups(ran).values() for mark in marks}
        mine = self._groups(fit)
        return {a: n for a, n in fit.items() if not mine.get(a, set()) & taken}

    def _groups(self, agents: Iterable[str]) -> dict[str, set[str]]:
        """Per agent, who stands behind it: its join token's group and its network."""
        ids = list(agents)
        if not ids:
            return {}
        marks = ", ".join("?" * len(ids))
        found: dict[str, set[str]] = {}
        for r in self.db.query(
            f"SELECT id, join_token, address FROM agents WHERE id IN ({marks})", ids
        ):
            agent = str(r["id"])
            found[agent] = {validation.group(agent, r["join_token"])}
            if net := validation.network(str(r["address"] or "")):
                found[agent].add(f"network {net}")
        return found

    def _validation_waits(self, job: int, rank: int, round_: int) -> None:
        """No free agent unrelated to the rank's earlier runs: the job says so."""
        ran = self._ran_by(job, rank, round_)
        text = (
            f"validating: rank {rank} waits for a free agent unrelated to {ran} "
            "(not one of them, nor admitted by the same join token)"
        )
        self.db.execute(
            "UPDATE jobs SET validation = ? WHERE id = ? AND validation != ?", [text, job, text]
        )

    def _ran_by(self, job: int, rank: int, round_: int) -> str:
        ran: list[str] = []
        for row in self.db.query(
            "SELECT agents FROM validations WHERE job = ? AND rank = ? AND round < ? "
            "ORDER BY round",
            [job, rank, round_],
        ):
            ran.extend(json.loads(row["agents"]))
        return self._names(ran)

    def _names(self, agents: Iterable[str]) -> str:
        names = [self._agent_name(a) for a in dict.fromkeys(agents)]
        return ", ".join(names) if names else "nobody"

    def _validator_placed(
        self, job: int, rank: int, round_: int, incarnation: int, agent: str, now: float
    ) -> None:
        self.db.execute(
            "UPDATE validations SET incarnation = ?, agents = ?, exit_code = NULL, "
            "stdout = NULL, stderr = NULL, relays = '{}', exited = NULL, files = '', blob = NULL "
            "WHERE job = ? AND rank = ? AND round = ?",
            [incarnation, json.dumps([agent]), job, rank, round_],
        )
        # A lost re-execution of this round printed for nothing; earlier rounds' output may
        # still become the rank's (``_replace_stdout``).
        self.db.execute(
            "DELETE FROM validation_output WHERE job = ? AND rank = ? AND incarnation < ? "
            "AND incarnation NOT IN (SELECT incarnation FROM validations WHERE job = ? "
            "AND rank = ? AND round < ? AND incarnation IS NOT NULL)",
            [job, rank, incarnation, job, rank, round_],
        )
        what = "re-executed to validate it" if round_ == FIRST else "re-executed a third time"
        name = self._agent_name(agent)
        self._event(
            job,
            now,
            "rank_validating",
            f"rank {rank} incarnation {incarnation} {what}, from its log, on agent {name}",
            rank,
        )
        self._set_summary(job, f"validating: rank {rank} {what} on agent {name}")

    # -- what re-executions say ---------------------------------------------------------------

    def _files_digest(self, job: int, rank: int, incarnation: int) -> str:
        """The digest of the result files incarnation ``incarnation`` uploaded ("": none)."""
        row = self._one(
            "SELECT files FROM results WHERE job = ? AND rank = ? AND incarnation = ?",
            [job, rank, incarnation],
        )
        return str(row["files"]) if row else ""

    def _validating_round(self, job: int, rank: int, incarnation: int) -> int:
        row = self._one(
            "SELECT validates FROM incarnations WHERE job = ? AND rank = ? AND incarnation = ?",
            [job, rank, incarnation],
        )
        return int(row["validates"]) if row else 0

    def _add_validation_output(self, chunk: api.OutputChunk, limit: int) -> None:
        """A re-execution's stdout or stderr: bytes beyond what is stored, at most ``limit``
        per stream (the job's output quota)."""
        key = [chunk.job, chunk.rank, chunk.incarnation, chunk.stream]
        last = self._one(
            "SELECT offset, length(data) AS n FROM validation_output WHERE job = ? AND rank = ? "
            "AND incarnation = ? AND stream = ? ORDER BY offset DESC LIMIT 1",
            key,
        )
        end = int(last["offset"]) + int(last["n"]) if last else 0
        skip = end - chunk.offset
        if skip >= len(chunk.data) or chunk.offset > end:
            return  # a copy, or a gap (a chunk lost on the way is sent again before later ones)
        data = chunk.data[skip:][: max(0, limit - end)]
        if data:
            self.db.execute(
                "INSERT OR IGNORE INTO validation_output (job, rank, incarnation, stream, "
                "offset, data) VALUES (?, ?, ?, ?, ?, ?)",
                [*key, end, data],
            )

    def _validator_exited(self, agent_id: str, ex: api.RankExit, round_: int, now: float) -> bool:
        """A re-execution exited (not lost): record its exit code and output digests, and
        decide if every relay's verdict is in."""
        self.db.execute(
            "UPDATE incarnations SET ended = ?, exit_code = ? WHERE job = ? AND rank = ? "
            "AND incarnation = ?",
            [now, ex.code, ex.job, ex.rank, ex.incarnation],
        )
        self.db.execute(
            "UPDATE ranks SET state = 'exited', exit_code = ? WHERE job = ? AND rank = ?",
            [ex.code, ex.job, ex.rank],
        )
        streams = (
            "SELECT data FROM validation_output WHERE job = ? AND rank = ? AND incarnation = ? "
            "AND stream = ? ORDER BY offset"
        )
        stdout = self._digest(streams, [ex.job, ex.rank, ex.incarnation, "stdout"])
        job = self.job_row(ex.job)
        assert job is not None
        stderr = self._stderr_digest(
            job, ex.rank, streams, [ex.job, ex.rank, ex.incarnation, "stderr"]
        )
        self.db.execute(
            "UPDATE validations SET exit_code = ?, stdout = ?, stderr = ?, exited = ? "
            "WHERE job = ? AND rank = ? AND round = ?",
            [ex.code, stdout, stderr, now, ex.job, ex.rank, round_],
        )
        self._event(
            ex.job,
            now,
            "rank_reexecuted",
            f"rank {ex.rank}'s re-execution on agent {self._agent_name(agent_id)} exited with "
            f"code {ex.code}",
            ex.rank,
        )
        self._settle(ex.job, ex.rank, now)
        return True

    def relay_validated(self, report: api.RelayValidated, now: float) -> bool:
        """A relay's verdict on a re-execution's messages (``api.RelayValidated``)."""
        with self.db.atomic():
            row = self._check_serves(report.name, report.job)
            if row is None or row["state"] != "running":
                return False
            return self._relay_verdict(
                report.name,
                report.job,
                report.rank,
                report.incarnation,
                report.agreed,
                report.message,
                now,
            )

    def _relay_verdict(
        self,
        relay: str,
        job: int,
        rank: int,
        incarnation: int,
        agreed: bool,
        message: str,
        now: float,
    ) -> bool:
        """Record ``relay``'s verdict on the re-execution ``incarnation`` of ``rank`` (False if
        it is not one, or no longer the rank's current one)."""
        v = self._one(
            "SELECT v.round, v.relays FROM validations v JOIN ranks r ON r.job = v.job "
            "AND r.rank = v.rank AND r.validating = v.round WHERE v.job = ? AND v.rank = ? "
            "AND v.round > 0 AND v.incarnation = ?",
            [job, rank, incarnation],
        )
        if v is None:
            return False
        verdicts: dict[str, str] = json.loads(v["relays"])
        if relay in verdicts:
            return False
        verdicts[relay] = "" if agreed else (message[:2000] or "a message differed")
        self.db.execute(
            "UPDATE validations SET relays = ? WHERE job = ? AND rank = ? AND round = ?",
            [json.dumps(verdicts), job, rank, v["round"]],
        )
        if not agreed:
            self._event(
                job,
                now,
                "validation_mismatch",
                f"relay {relay}: rank {rank}'s re-execution (incarnation {incarnation}) sent "
                f"other messages than the original: {verdicts[relay]}",
                rank,
            )
        self._settle(job, rank, now)
        return True

    def _check_serves(self, relay: str, job: int) -> dict[str, Any] | None:
        raise NotImplementedError

    def _validator_unfinished(self, job: int, rank: int, incarnation: int, now: float) -> bool:
        """A re-execution that exited was lost at a relay before its verdict there (its
        agent never detached it): run that round again."""
        row = self._one(
            "SELECT r.validating, r.incarnation, r.state, j.restarts, j.state AS job_state "
            "FROM ranks r JOIN jobs j ON j.id = r.job WHERE r.job = ? AND r.rank = ?",
            [job, rank],
        )
        if (
            row is None
            or not row["validating"]
            or row["incarnation"] != incarnation
            or row["state"] != "exited"
            or row["job_state"] != "running"
        ):
            return False
        if row["restarts"] >= self.restarts.max_restarts:
            self._end(
                job,
                "failed",
                None,
                f"rank {rank}'s re-execution for validation was lost before every relay "
                f"judged it, and the job had {row['restarts']} restarts (max_restarts)",
                now,
            )
            return True
        self.db.execute("UPDATE jobs SET restarts = restarts + 1 WHERE id = ?", [job])
        self._event(
            job,
            now,
            "rank_lost",
            f"rank {rank}'s re-execution (incarnation {incarnation}) was lost before every "
            "relay judged its messages; it runs again",
            rank,
        )
        self._reexecute(job, rank, int(row["validating"]))
        return True

    def expire_validations(self, now: float) -> bool:
        """Re-executions that ran past their deadline are lost (a volunteer's machine that
        never finishes, or never says so), and run again on another agent: a deadline of
        ``VALIDATION_SLACK`` times the original run's wall time, at least
        ``VALIDATION_MIN_WAIT`` s, from when the re-execution was placed."""
        changed = False
        with self.db.atomic():
            rows = list(
                self.db.query(
                    "SELECT r.job, r.rank, r.incarnation, a.name, i.created, "
                    "v.exited - j.started AS took FROM ranks r JOIN jobs j ON j.id = r.job "
                    "JOIN incarnations i ON i.job = r.job AND i.rank = r.rank "
                    "AND i.incarnation = r.incarnation "
                    "JOIN validations v ON v.job = r.job AND v.rank = r.rank AND v.round = 0 "
                    "LEFT JOIN agents a ON a.id = r.agent "
                    "WHERE r.validating > 0 AND r.state IN ('leased', 'running') "
                    "AND j.state = 'running'"
                )
            )
            for r in rows:
                limit = max(VALIDATION_MIN_WAIT, VALIDATION_SLACK * float(r["took"] or 0.0))
                if now - float(r["created"]) < limit:
                    continue
                reason = (
                    f"rank {r['rank']}'s re-execution on agent {r['name']} did not finish "
                    f"within {limit:.0f} s ({VALIDATION_SLACK:g} times the original run)"
                )
                changed = self._lose(r["job"], r["rank"], reason, now, suspect=True) or changed
        return changed

    def _lose(
        self,
        job: int,
        rank: int,
        reason: str,
        now: float,
        *,
        suspect: bool,
        exit_code: int | None = None,
        outage: str = "",
    ) -> bool:
        raise NotImplementedError  # FaultsMixin

    # -- deciding -----------------------------------------------------------------------------

    def _settle(self, job: int, rank: int, now: float) -> None:
        """Decide the rank's validation once the round in progress has spoken: every relay
        agreed and the re-execution exited, or a relay disagreed (then it need not finish)."""
        r = self._one("SELECT validating FROM ranks WHERE job = ? AND rank = ?", [job, rank])
        jrow = self.job_row(job)
        if r is None or jrow is None or not r["validating"] or jrow["state"] != "running":
            return
        round_ = int(r["validating"])
        runs = {
            int(v["round"]): v
            for v in self.db.query(
                "SELECT * FROM validations WHERE job = ? AND rank = ?", [job, rank]
            )
        }
        current = runs[round_]
        verdicts: dict[str, str] = json.loads(current["relays"])
        disagreed = [f"relay {n}: {m}" for n, m in sorted(verdicts.items()) if m]
        relays = json.loads(jrow["relays"])
        if not disagreed and (current["exited"] is None or any(n not in verdicts for n in relays)):
            return
        original = _run(runs[ORIGINAL])
        first = _run(runs[FIRST], original)
        second = _run(runs[SECOND], original) if round_ == SECOND else None
        verdict = validation.decide(original, first, second)
        names = {k: self._names(json.loads(v["agents"])) for k, v in runs.items()}
        o_agents = json.loads(runs[ORIGINAL]["agents"])
        v_agents = json.loads(runs[FIRST]["agents"])
        t_agents = json.loads(runs[SECOND]["agents"]) if second is not None else []
        if verdict is Verdict.THIRD:
            self._event(
                job,
                now,
                "validation_mismatch",
                f"rank {rank}: its re-execution on agent {names[FIRST]} differs from the "
                f"original on agent {names[ORIGINAL]} in "
                f"{validation.differences(original, first)}; a third execution decides",
                rank,
            )
            self._set_summary(job, f"validating: rank {rank} disagreed; a third execution decides")
            self._reexecute(job, rank, SECOND)
            return
        if verdict is Verdict.AGREED:
            self._judged(o_agents + v_agents, [], job, rank, now)
            self._rank_validated(job, rank, original, "agreed", f"agent {names[FIRST]}")
        elif verdict is Verdict.VALIDATOR_WRONG:
            self._judged(o_agents + t_agents, v_agents, job, rank, now)
            self._rank_validated(
                job,
                rank,
                original,
                "agreed",
                f"agent {names[SECOND]} (agent {names[FIRST]} disagreed, and was wrong)",
            )
        elif verdict is Verdict.ORIGINAL_OUTPUT_WRONG:
            self._judged(v_agents + t_agents, o_agents, job, rank, now)
            self._replace_output(job, rank, int(runs[FIRST]["incarnation"]))
            self._replace_results(job, rank, runs[FIRST])
            self._event(
                job,
                now,
                "validation_corrected",
                f"rank {rank}: two re-executions (agents {names[FIRST]}, {names[SECOND]}) "
                f"agree, and differ from the original on agent {names[ORIGINAL]} in "
                f"{validation.differences(first, original)}: the rank's output, result files "
                "and exit code are theirs",
                rank,
            )
            self._rank_validated(
                job, rank, first, "corrected", f"agents {names[FIRST]}, {names[SECOND]}"
            )
            if first.exit_code != 0:
                self._end(
                    job,
                    "failed",
                    first.exit_code,
                    f"validation: rank {rank} exits with code {first.exit_code} when "
                    f"re-executed (agents {names[FIRST]}, {names[SECOND]}); agent "
                    f"{names[ORIGINAL]} reported code {original.exit_code}",
                    now,
                )
                return
        elif verdict is Verdict.ORIGINAL_MESSAGES_WRONG:
            self._judged(v_agents + t_agents, o_agents, job, rank, now)
            self._failed_validation(
                job,
                rank,
                now,
                f"validation: rank {rank}'s run on agent {names[ORIGINAL]} sent other messages "
                f"than two re-executions of it (agents {names[FIRST]}, {names[SECOND]}: "
                f"{first.messages}); its peers computed with them, so the job's output cannot "
                "be trusted: submit it again",
            )
            return
        else:
            self._failed_validation(
                job,
                rank,
                now,
                f"validation: no two of three executions of rank {rank} agree (agent "
                f"{names[ORIGINAL]}; agent {names[FIRST]} differs in "
                f"{validation.differences(original, first)}; agent {names[SECOND]} in "
                f"{validation.differences(original, second or first)}): the program may not be "
                "deterministic",
            )
            return
        self._maybe_validated(job, now)

    def _rank_validated(self, job: int, rank: int, run: Run, outcome: str, by: str) -> None:
        self.db.execute(
            "UPDATE ranks SET state = 'exited', exit_code = ?, validating = 0, validation = ?, "
            "validated_by = ? WHERE job = ? AND rank = ?",
            [run.exit_code, outcome, by, job, rank],
        )

    def _failed_validation(self, job: int, rank: int, now: float, reason: str) -> None:
        self.db.execute(
            "UPDATE ranks SET validating = 0, validation = 'disagreed' WHERE job = ? AND rank = ?",
            [job, rank],
        )
        self._set_summary(job, reason)
        self._end(job, "failed", None, reason, now)

    def _maybe_validated(self, job: int, now: float) -> None:
        """Every re-executed rank is decided: the job succeeds."""
        if self._one("SELECT 1 FROM ranks WHERE job = ? AND validating > 0 LIMIT 1", [job]):
            return
        counts: dict[str, list[str]] = {}
        for r in self.db.query(
            "SELECT rank, validation FROM ranks WHERE job = ? ORDER BY rank", [job]
        ):
            counts.setdefault(str(r["validation"]), []).append(str(r["rank"]))
        parts = [
            f"rank(s) {', '.join(counts[k])} {what}"
            for k, what in (
                ("agreed", "re-executed and confirmed"),
                ("corrected", "re-executed and corrected (their original agent was wrong)"),
                ("skipped", "not sampled (trusted agents)"),
            )
            if k in counts
        ]
        text = "validated: " + "; ".join(parts)
        self._set_summary(job, text)
        self._end(job, "succeeded", 0, f"every rank exited with code 0; {text}", now)

    def _replace_output(self, job: int, rank: int, incarnation: int) -> None:
        """The rank's stdout and stderr become those of re-execution ``incarnation``."""
        old = self._one(
            "SELECT COALESCE(SUM(length(data)), 0) AS n FROM output WHERE job = ? AND rank = ?",
            [job, rank],
        )
        self.db.execute("DELETE FROM output WHERE job = ? AND rank = ?", [job, rank])
        self.db.execute(
            "INSERT INTO output (job, rank, stream, offset, data) SELECT job, rank, stream, "
            "offset, data FROM validation_output WHERE job = ? AND rank = ? AND incarnation = ? "
            "ORDER BY rowid",  # as they arrived
            [job, rank, incarnation],
        )
        new = self._one(
            "SELECT COALESCE(SUM(length(data)), 0) AS n FROM output WHERE job = ? AND rank = ?",
            [job, rank],
        )
        self.db.execute(
            "UPDATE jobs SET output_bytes = output_bytes + ? WHERE id = ?",
            [int(new["n"] if new else 0) - int(old["n"] if old else 0), job],
        )

    def _replace_results(self, job: int, rank: int, agreed: dict[str, Any]) -> None:
        """The rank's result files become those of the re-execution the others agreed with
        (none, if it made none): the original's were found wrong."""
        self.db.execute("DELETE FROM results WHERE job = ? AND rank = ?", [job, rank])
        if agreed["blob"]:
            self.db.execute(
                "INSERT INTO results (job, rank, incarnation, blob, files) VALUES (?, ?, ?, ?, ?)",
                [job, rank, agreed["incarnation"], agreed["blob"], agreed["files"]],
            )

    def _stdout_digest(self, job: int, rank: int) -> str:
        return self._digest(
            "SELECT data FROM output WHERE job = ? AND rank = ? AND stream = 'stdout' "
            "ORDER BY offset",
            [job, rank],
        )

    def _stderr_digest(self, job: dict[str, Any], rank: int, sql: str, params: list[Any]) -> str:
        """The digest of the stderr the rows ``sql`` selects, its paths normalised."""
        paths = validation.StderrPaths(str(job["job_uid"] or job["id"]), rank)
        return paths.digest(row["data"] for row in self.db.query(sql, params))

    def _digest(self, sql: str, params: list[Any]) -> str:
        """SHA-256 (hex) of the ``data`` of the rows ``sql`` selects, in order."""
        digest = hashlib.sha256()
        for row in self.db.query(sql, params):
            digest.update(row["data"])
        return digest.hexdigest()

    # -- trust --------------------------------------------------------------------------------

    def _judged(self, right: list[str], wrong: list[str], job: int, rank: int, now: float) -> None:
        """The agents on the agreeing side gain an agreement; those found wrong lose trust."""
        self._trust(right)
        self._distrust(wrong, job, rank, now)

    def _trust(self, agents: list[str]) -> None:
        for agent in dict.fromkeys(agents):
            self.db.execute(
                "UPDATE agents SET agreed = agreed + 1, agreed_streak = agreed_streak + 1 "
                "WHERE id = ?",
                [agent],
            )

    def _distrust(self, agents: list[str], job: int, rank: int, now: float) -> None:
        for agent in dict.fromkeys(agents):
            self.db.execute(
                "UPDATE agents SET wrong = wrong + 1, agreed_streak = 0 WHERE id = ?", [agent]
            )
            self._event(
                job,
                now,
                "agent_distrusted",
                f"agent {self._agent_name(agent)} was found wrong about rank {rank}: its ranks "
                "are always re-executed until it agrees again "
                f"{self.validation.trusted_after} times in a row",
                rank,
            )


def _run(row: dict[str, Any], original: Run | None = None) -> Run:
    """The execution a ``validations`` row records. A re-execution that exited with another
    code than the original ran differently (it crashed, say): what the relays found of its
    messages (too few, most likely) is no evidence against the original's, so only its exit
    code and stdout count."""
    verdicts: dict[str, str] = json.loads(row["relays"])
    disagreed = "; ".join(f"relay {n}: {m}" for n, m in sorted(verdicts.items()) if m)
    code = NOT_FINISHED if row["exit_code"] is None else int(row["exit_code"])
    if original is not None and code not in (NOT_FINISHED, original.exit_code):
        disagreed = ""
    return Run(
        exit_code=code,
        stdout=row["stdout"] or "",
        messages=disagreed,
        files=row["files"] or "",
        stderr=row["stderr"] or "",
    )
