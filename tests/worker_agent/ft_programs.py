"""Rank programs of the fault-tolerance tests."""

from __future__ import annotations

import textwrap

# A rank speaking the frame protocol itself, with determinants.
FT_PROGRAM = textwrap.dedent(
    """
    import json, os, socket, sys
    from vpool.protocol import framing, messages as m

    sock = socket.socket(socket.AF_UNIX)
    sock.connect(os.environ["VPOOL_AGENT_SOCKET"])
    dec = framing.FrameDecoder()

    def recv():
        while (f := dec.next_frame()) is None:
            data = sock.recv(1 << 20)
            if not data:
                sys.exit("agent closed the socket")
            dec.receive_data(data)
        return f.message

    def send(msg, payload=b""):
        sock.sendall(framing.encode_frame(msg, payload))

    def say(**kw):
        print(json.dumps(kw), flush=True)

    def show(msg):
        fields = [getattr(msg, k) for k in msg.__struct_fields__]
        return [type(msg).__name__] + [f.decode() if isinstance(f, bytes) else f for f in fields]

    with open(os.environ["VPOOL_RANK_SECRET_FILE"]) as _f:  # the agent writes it
        SECRET = _f.read()
    send(m.RankHello(version=m.PROTOCOL_VERSION, secret=SECRET))
    w = recv()
    job, me = w.job, w.rank
    say(welcome=[w.incarnation, w.replay_dets], replay_sent=w.replay_sent)
    mode = sys.argv[1]
    if mode == "det":
        for _ in range(w.replay_dets):
            say(got=show(recv()))
        send(m.Det(job=job, rank=me, index=w.replay_dets, data=b"live"))
        say(got=show(recv()))  # the DetAck
        send(m.Data(job=job, src=me, dst=1, seq=1, ctx=0, tag=0), b"after")
        say(got=show(recv()))  # the Ack
        send(m.Det(job=job, rank=me + 1, index=0, data=b"forged"))
        say(got=show(recv()))  # refused
    elif mode == "local_then_die":
        # rank 0 sends rank 1 (same agent) one message and dies before it is logged; rank 1
        # says it got it and waits.
        if me == 0:
            send(m.Data(job=job, src=0, dst=1, seq=1, ctx=0, tag=0), b"early")
            os._exit(3)
        say(got=show(recv()))
        recv()
    elif mode == "reconnect":
        send(m.Data(job=job, src=me, dst=1, seq=1, ctx=0, tag=0), b"one")
        send(m.Data(job=job, src=me, dst=1, seq=2, ctx=0, tag=0), b"two" * 30000)
        send(m.Det(job=job, rank=me, index=0, data=b"d0"))
        for _ in range(3):  # two pushed messages and an Ack, over the first connection
            say(got=show(recv()))
        send(m.Data(job=job, src=me, dst=1, seq=3, ctx=0, tag=0), b"three")
        for _ in range(3):  # DetAck, Ack and one more pushed message, over the second
            say(got=show(recv()))
        send(m.Finalize())
    """
)
