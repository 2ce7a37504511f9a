"""The fault-tolerance model's configuration (sizes, fault budget, protocol rules) and errors."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    relays: int = 2  # home of rank r: relay r % relays
    window: int = 2  # push window, in frames (every frame has size 1)
    max_rank_crashes: int = 3
    max_relay_crashes: int = 2
    # The protocol's rules, each of which a test turns off to show the model notices.
    pessimistic: bool = True  # deposit only once every earlier determinant is acknowledged
    flush_lazy: bool = True  # the lazy failed-poll record is logged before the next deposit
    # A new incarnation attaches to its home relay only once every logged determinant is durable
    # (else it could obey a determinant that a relay crash then loses).
    attach_after_durable: bool = True
    # After a relay restart the agent resends every unacknowledged message, also those the
    # relay says it holds (seq <= Attached.stored): the logged copy may come from an older
    # incarnation, and the relay's digest check is the only place a different one shows.
    resend_held: bool = True
    # Acks name no more than the current attachment deposited or re-sent (the relay's
    # ``Attachment.offered``): a dead incarnation's message, written after its successor
    # attached, must not acknowledge the successor's message of that seq unseen.
    acks_by_attachment: bool = True


class Divergence(Exception):
    """The protocol detected a non-deterministic program (what the job fails with)."""


class ModelError(AssertionError):
    """The protocol broke one of its own invariants (a bug, never a program's fault)."""
