"""vpool.relay: the channel memory (MPICH-V) of a pool, serving agents over TCP + TLS 1.3.

Every message for a rank is deposited at the rank's home relay, appended to that rank's log on
disk, acknowledged, and pushed to the rank's agent in log order under flow control. Modules, by
concern:

- ``settings``: ``RelaySettings``, the declared settings (prefix ``VPOOL_RELAY``);
- ``server``: ``serve_relay``, the TCP/TLS listener around one ``Hub``;
- ``connection``: one agent connection (handshake, reader, writer: acks and pushes);
- ``connection_inbound``: what each agent message does (deposits, determinants, credits,
  attachments);
- ``hub``: shared state: mailboxes (``protocol.mailbox``) with their logs, attachments, fencing,
  lost ranks, group commit;
- ``log``: the on-disk segment files, their recovery after a crash;
- ``wire``: reading and writing whole frames with few copies;
- ``registry``: the coordinator client (register, heartbeat, lost ranks);
- ``cli``: the ``vpool-relay`` command;
- ``errors``: the relay's error types.
"""
