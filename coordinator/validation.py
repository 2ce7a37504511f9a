"""Validation by replay: the rules, as pure functions (``sqlite_validation`` applies them).

Volunteers are strangers: one could return forged output, or send its peers forged messages.
BOINC answers with redundant computing (every work unit run twice or more, on different hosts)
and adaptive replication (hosts with a long record of valid results are replicated less). vpool
can do it for a fraction of the cost: every message a rank received and every nondeterministic
choice it made (its determinants) are already in its relays' logs, so a rank can be re-executed
alone, from its log, on another volunteer, without its peers.

- **When.** A validated job (``JobSubmit.validate``, or every job under the pool's
  ``validate_jobs``) whose ranks all exited does not end yet: it stays running, so its relays
  keep its logs, while the sampled ranks are re-executed.
- **Which ranks** (``chance``): a rank any of whose agents has fewer than ``trusted_after``
  agreements in a row is always re-executed; otherwise with probability ``trusted_after`` /
  streak, never below ``min_rate``. An agent found wrong starts its streak again.
- **Where** (``SqliteValidation._unrelated``): never on an agent that ran the rank, nor on one
  admitted by the same join token as one of those (one person's machines are one vote), nor
  on one calling from the same network (``network``: /24, /48); drawn at random among the rest
  (a colluder cannot place itself by its free slots).
- **Compared** (``Run``): the messages the re-execution sends (its relays compare each with the
  logged one and report, ``api.RelayValidated``), its stdout (a digest of all of it), its
  result files (a digest of each file's name and content, ``results.files_digest``) and its
  exit code. Stderr is not compared: it names paths of the machine.
- **Decided** (``decide``): the re-execution agrees with the original, or a third execution, on
  an agent related to neither, decides. The original wrong on output only: the rank's output
  and exit code become the agreed ones. The original wrong on messages: its peers computed with
  them, so the job fails, naming the rank and the agents. No two of three agreeing: the job
  fails (the program is not deterministic, or two of them are wrong).
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass

ORIGINAL, FIRST, SECOND = 0, 1, 2  # ``validations.round``: the original run, then re-executions


@dataclass(frozen=True)
class Policy:
    """The pool's validation settings (``validate_jobs``, ``validation_trusted_after``,
    ``validation_min_rate``)."""

    validate_jobs: bool = False
    trusted_after: int = 10
    min_rate: float = 0.1


def chance(streak: int, policy: Policy) -> float:
    """The probability that a rank run by an agent with ``streak`` agreements in a row (since
    it was last found wrong) is re-executed."""
    if streak < policy.trusted_after:
        return 1.0
    return max(policy.min_rate, min(1.0, policy.trusted_after / max(streak, 1)))


def group(agent_id: str, join_token: int | None) -> str:
    """Who stands behind an agent: the join token that admitted it (one person may run many
    machines with one token), or the agent itself when it needed none."""
    return f"token {join_token}" if join_token is not None else f"agent {agent_id}"


def network(address: str) -> str:
    """The network an agent calls from, as validation keeps agents apart: its /24 (IPv4) or
    /48 (IPv6); "" when unknown or a loopback address (every agent of a pool on one machine
    shares it: no signal)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return ""
    if ip.is_loopback:
        return ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    prefix = 24 if ip.version == 4 else 48
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


@dataclass(frozen=True)
class Run:
    """One execution of a rank as validation sees it. ``messages``: "" when every message it
    sent had the logged content (the original, by definition), else what a relay found."""

    exit_code: int
    stdout: str  # hex digest of its whole stdout
    messages: str = ""
    files: str = ""  # digest of its result files (``results.files_digest``; "": none)

    def same(self, other: Run) -> bool:
        """Two executions agree: same exit code, same stdout, and messages that agreed with
        the log. Two that both sent other messages than the log holds (the original's) agree
        against it, whatever else they did: a relay stops a re-execution at its first
        differing message, so the rest of its run says nothing."""
        if self.messages and other.messages:
            return True
        return (
            self.exit_code == other.exit_code
            and self.stdout == other.stdout
            and self.files == other.files
            and bool(self.messages) == bool(other.messages)
        )


class Verdict(enum.Enum):
    AGREED = "agreed"  # the original is confirmed
    THIRD = "third"  # the first re-execution disagrees: a second one decides
    VALIDATOR_WRONG = "validator_wrong"  # the original stands, the first re-execution lied
    ORIGINAL_OUTPUT_WRONG = "original_output_wrong"  # the re-executions' output replaces it
    ORIGINAL_MESSAGES_WRONG = "original_messages_wrong"  # the job cannot be trusted: it fails
    UNDECIDED = "undecided"  # no two of three agree: the job fails


def decide(original: Run, first: Run, second: Run | None = None) -> Verdict:
    if second is None:
        return Verdict.AGREED if first.same(original) else Verdict.THIRD
    if second.same(original):
        return Verdict.VALIDATOR_WRONG
    if second.same(first):
        if first.messages:
            return Verdict.ORIGINAL_MESSAGES_WRONG
        return Verdict.ORIGINAL_OUTPUT_WRONG
    return Verdict.UNDECIDED


def differences(original: Run, other: Run) -> str:
    """What ``other`` did differently, in words."""
    what = []
    if other.messages:
        what.append(f"its messages ({other.messages})")
    if other.exit_code != original.exit_code:
        what.append(f"its exit code ({other.exit_code}, not {original.exit_code})")
    if other.stdout != original.stdout:
        what.append("its stdout")
    if other.files != original.files:
        what.append("its result files")
    return ", ".join(what) or "nothing"
