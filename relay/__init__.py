"""vpool.relay: the channel memory (MPICH-V) of a pool, serving agents over TCP + TLS 1.3.

Every message for a rank is deposited at the rank's home relay, appended to that rank's log on
disk, acknowledged, and pushed to the rank's agent in log order under flow control. Modules, by
concern:

- ``settings``: ``RelaySettings``, the declared settings (prefix ``VPOOL_RELAY``);
- ``server``: ``serve_relay``, the TCP/TLS listener around one ``Hub`` (agent and checkpoint
  store connections on one port, told apart by the store's preamble);
- ``connection``: one agent connection (handshake, reader, writer: acks and pushes); what each
  agent message does is decided by the relay's core (``protocol.relay_core``);
- ``hub``: shared state: the core (attachments, fencing, lost ranks, mailboxes) and its files,
  group commit;
- ``log``: the on-disk segment files, their recovery after a crash;
- ``ckptstore``: the checkpoint store (images of ranks, retention, reports, log trims);
  ``storesupervisor``: the relay's side of its store process (``storeworker``, over the link
  ``storelink``), which serves store connections niced, each in a thread (``storethread``);
  ``directwrite``: image files written with ``O_DIRECT``; ``trim``: trimming logs behind images;
- ``wire``: reading and writing whole frames with few copies;
- ``registry``: the coordinator client (register, heartbeat, lost ranks);
- ``cli``: the ``vpool-relay`` command;
- ``errors``: the relay's error types.
"""
