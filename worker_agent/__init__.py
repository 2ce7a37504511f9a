"""vpool.worker_agent: the volunteer's agent (``vpool-agent``).

It makes only outbound connections: HTTPS to the coordinator (enroll, lease long-poll,
heartbeat, output, exit reports) and TCP+TLS to relays. It runs leased ranks as local processes
and proxies their MPI frames between its unix socket and the relays.

Modules by concern: ``settings``, ``identity`` (key, enrollment request), ``coordinator``
(HTTP client), ``bundle`` (blob cache, extraction, results), ``output`` (stdout/stderr pump),
``ranks`` (one lease from start to exit report), ``local_ranks`` (shared per-rank state),
``proxy`` (rank socket), ``relay_link`` (relay connections), ``relay_inbound`` (what relays
send, routed to the ranks), ``wire`` (frame I/O), ``agent`` (``run_agent``), ``cli``.
"""
