"""The fault-tolerance model's configuration (sizes, fault budget, protocol rules) and errors."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    relays: int = 2  # home of rank r: relay r % relays
    # Worker agents: rank r runs on agent r % agents; 0 is one agent per rank (no two ranks
    # share one, so nothing is delivered locally and no agent crash is possible).
    agents: int = 0
    window: int = 2  # push window, in frames (every frame has size 1)
    max_rank_crashes: int = 3
    max_relay_crashes: int = 2
    max_agent_crashes: int = 1  # an agent crash takes every live rank of the agent at once
    # Agent-local delivery: a message between two ranks of one agent goes straight to the
    # receiver (and is deposited at its home relay all the same, with a ``Delivered`` notice).
    local_delivery: bool = True
    # The protocol's rules, each of which a test turns off to show the model notices.
    pessimistic: bool = True  # deposit only once every earlier determinant is acknowledged
    flush_lazy: bool = True  # the lazy failed-poll record is logged before the next deposit
    # A rank that ended with messages it gave to ranks of its agent not yet logged: its
    # agent waits for their acks before it detaches, and restarts those receivers when it
    # cannot have them (``RelayLink._settle_local``). The model takes the second way at once
    # (the crashed rank's links are gone): the receivers crash with it.
    settle_local: bool = True
    # A new incarnation attaches to its home relay only once every logged determinant is durable
    # (else it could obey a determinant that a relay crash then loses).
    attach_after_durable: bool = True
    # After a relay restart the agent resends every unacknowledged message, also those the
    # relay says it holds (seq <= Attached.stored): the logged copy may come from an older
    # incarnation, and the relay's digest check is the only place a different one shows.
    resend_held: bool = True
    # After a relay restart the agent resends the determinants the relay lacks (index >=
    # Attached.dets) and tells the rank that the others are durable (a DetAck of
    # Attached.dets), as the product's agent does: else a rank whose DetAck was lost with the
    # connection is never told again, and its next deposit waits forever.
    detack_from_attached: bool = True
    # Acks name no more than the current attachment deposited or re-sent (the relay's
    # ``Attachment.offered``): a dead incarnation's message, written after its successor
    # attached, must not acknowledge the successor's message of that seq unseen.
    acks_by_attachment: bool = True
    # A ``Delivered`` is honoured only from the receiver's current home attachment, on its
    # connection and of its incarnation (``RelayCore.delivered``): a dead incarnation's notice
    # must not keep the relay from pushing those messages to its successor.
    delivered_by_attachment: bool = True
    # An agent delivers a message locally only if it is the next one of its channel for the
    # receiver (``Delivery.local``): an earlier one still to come from the relay would be
    # overtaken (and then dropped as delivered).
    local_in_order: bool = True
    # A locally delivered message is still deposited at the receiver's home relay: the
    # receiver's successor (after a crash) gets it from there, and the sender's channel
    # numbering stays gapless there.
    deposit_local: bool = True
    # A push the agent drops (the message was delivered locally already) is still credited:
    # the relay counts it in its window.
    credit_dropped: bool = True


class Divergence(Exception):
    """The protocol detected a non-deterministic program (what the job fails with)."""


class ModelError(AssertionError):
    """The protocol broke one of its own invariants (a bug, never a program's fault)."""
