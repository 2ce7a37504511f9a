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
  result files (a digest of each file's name and content, ``results.files_digest``), its
  stderr (a digest after ``StderrPaths`` put the paths that name the machine in the sandbox's
  terms: the rank's directory and its environment's) and its exit code.
- **Decided** (``decide``): the re-execution agrees with the original, or a third execution, on
  an agent related to neither, decides. The original wrong on output only: the rank's output
  and exit code become the agreed ones. The original wrong on messages: its peers computed with
  them, so the job fails, naming the rank and the agents. No two of three agreeing: the job
  fails (the program is not deterministic, or two of them are wrong).
"""

from __future__ import annotations

import enum
import hashlib
import ipaddress
import re
from collections.abc import Iterable
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


RANK_DIR = b"/vpool/rank/"  # ``worker_agent.sandbox.RANK_DIR``, as a sandboxed rank sees it
ENV_DIR = b"/vpool/env/"  # ``worker_agent.sandbox.ENV_DIR``
_BOUNDARY = re.compile(rb"[\s'\"]")  # what ends a path in text (``\s``: the regex's space)
LONGEST_LINE = 1 << 20  # bytes: a longer line is normalised in pieces of this size


class StderrPaths:
    """What of a rank's stderr names the machine it ran on, put in the sandbox's terms, so
    that two honest executions of a rank on different volunteers print the same stderr: a
    traceback names ``/vpool/rank/work/app.py`` sandboxed, and
    ``<rank_root>/<job>-<rank>-<incarnation>-<random>/work/app.py`` unsandboxed (the
    incarnation differs between an original and its re-execution too); a package of the
    job's environment ``/vpool/env/`` or ``<agent work dir>/envs/<key>/site/``. Only those
    change: any other difference is a difference.

    Linear in the text whatever it holds (it is the program's, so anyone's): the distinctive
    part of a path is found first, then its head, back to the space or quote before it."""

    def __init__(self, job_key: str, rank: int) -> None:
        rank_dir = rb"/" + re.escape(f"{job_key}-{rank}-".encode()) + rb"[0-9]+-[^/\s'\"]+/"
        self._parts = [
            (re.compile(rank_dir), RANK_DIR),
            (re.compile(rb"/envs/[0-9a-f]+/site/"), ENV_DIR),
        ]

    def line(self, text: bytes) -> bytes:
        for part, replacement in self._parts:
            text = _replace_paths(text, part, replacement)
        return text

    def digest(self, chunks: Iterable[bytes]) -> str:
        """SHA-256 (hex) of the stream ``chunks`` make, normalised a line at a time (a path
        never spans lines; memory stays bounded by ``LONGEST_LINE``)."""
        digest = hashlib.sha256()
        held = b""
        for chunk in chunks:
            held += chunk
            cut = held.rfind(b"\n") + 1
            if not cut and len(held) > LONGEST_LINE:
                cut = len(held)
            if cut:
                digest.update(self.line(held[:cut]))
                held = held[cut:]
        digest.update(self.line(held))
        return digest.hexdigest()


def _replace_paths(text: bytes, part: re.Pattern[bytes], replacement: bytes) -> bytes:
    """``text`` with each absolute path that ``part`` ends (from its first ``/``) replaced."""
    out: list[bytes] = []
    done = 0
    for m in part.finditer(text):
        head = text[done : m.start()]
        boundary = _BOUNDARY.search(head[::-1])  # the nearest space or quote before it
        word = len(head) - boundary.start() if boundary else 0
        slash = head.find(b"/", word)
        start = done + (slash if slash >= 0 else len(head))
        out += [text[done:start], replacement]
        done = m.end()
    out.append(text[done:])
    return b"".join(out)


@dataclass(frozen=True)
class Run:
    """One execution of a rank as validation sees it. ``messages``: "" when every message it
    sent had the logged content (the original, by definition), else what a relay found."""

    exit_code: int
    stdout: str  # hex digest of its whole stdout
    messages: str = ""
    files: str = ""  # digest of its result files (``results.files_digest``; "": none)
    stderr: str = ""  # hex digest of its whole stderr, its paths normalised (``StderrPaths``)

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
            and self.stderr == other.stderr
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
    if other.stderr != original.stderr:
        what.append("its stderr")
    return ", ".join(what) or "nothing"
