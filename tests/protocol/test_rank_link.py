"""The store of deposited frames awaiting acknowledgement, kept for resending."""

from __future__ import annotations

from vpool.worker_agent.unacked import Unacked


def test_acks_release_frames_and_resend_takes_every_unacked_message() -> None:
    store = Unacked()
    frames = {(dst, seq): [b"d%d-%d" % (dst, seq)] for dst in (1, 2) for seq in (1, 2, 3)}
    for (dst, seq), parts in frames.items():
        store.add_data(dst, seq, parts)
    for index in range(3):
        store.add_det(index, [b"det%d" % index])
    assert len(store) == 9
    store.ack(1, 2)  # cumulative
    store.det_ack(1)
    assert len(store) == 6
    store.ack(1, 1)  # an older ack changes nothing
    assert len(store) == 6

    # The relay came back with channel 0->2 logged up to seq 1 and two determinants: every
    # unacked message goes again (the relay digest-checks what it holds), determinants only
    # from the third.
    resend = store.to_resend({2: 1}, dets_logged=2)
    assert resend == [[b"det2"], frames[(1, 3)], frames[(2, 1)], frames[(2, 2)], frames[(2, 3)]]
    assert len(store) == 5
    # Not the home link: the determinants stay as they are.
    assert store.to_resend({1: 3, 2: 3}, dets_logged=None)[0] == [b"det2"]
    store.det_ack(3)
    store.ack(1, 3)
    store.ack(2, 3)
    assert len(store) == 0


def test_buffers_are_kept_not_copied() -> None:
    store = Unacked()
    payload = bytearray(b"x" * 1000)
    parts = [b"head", payload]
    store.add_data(1, 1, parts)
    [again] = store.to_resend({}, dets_logged=None)
    assert again is parts and again[1] is payload
