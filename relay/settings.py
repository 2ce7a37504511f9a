"""Settings of ``vpool-relay`` (environment prefix ``VPOOL_RELAY``)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from vpool import paths
from vpool.config import load_settings, setting

PREFIX = "VPOOL_RELAY"
MiB = 1024 * 1024
GiB = 1024 * MiB


@dataclass(frozen=True)
class RelaySettings:
    name: str = setting("", "Name registered with the coordinator; empty = <hostname>-<port>.")
    host: str = setting("127.0.0.1", "Address to listen on (0.0.0.0 for every interface).")
    port: int = setting(7700, "TCP port to listen on (0 = any free port).")
    advertise_host: str = setting(
        "",
        "Host agents connect to, told to the coordinator; empty = host (or the hostname "
        "when host is a wildcard address).",
    )
    data_dir: str = setting(
        "",
        "Directory of the message logs (jobs/<job>/<dst>/*.seg) and checkpoint images "
        "(jobs/<job>/<rank>/ckpt/); "
        "empty = <vpool state dir>/relay-<name>.",
    )
    tls_cert: str = setting("", "PEM certificate (chain) of the relay, issued by the pool CA.")
    tls_key: str = setting("", "PEM private key of tls_cert.")
    insecure_tcp: bool = setting(
        False, "Accept plain TCP when tls_cert/tls_key are empty (tests and benchmarks only)."
    )
    coordinator_url: str = setting(
        "",
        "Base URL of the coordinator, e.g. https://coord:8443; empty = run standalone "
        "with signing_key (tests).",
    )
    coordinator_ca: str = setting(
        "",
        "PEM file of the pool CA that signed the coordinator's certificate; empty = the "
        "system's trust store.",
    )
    relay_key: str = setting(
        "",
        "This relay's own key, presented to the coordinator (Bearer); the operator makes it "
        "with `vpool-coordinator relay add NAME`, NAME being this relay's name.",
    )
    signing_key: str = setting(
        "",
        "Coordinator's Ed25519 public key (base64url) to verify tokens with when "
        "coordinator_url is empty; otherwise it comes from registration.",
    )
    push_window: int = setting(
        4 * MiB,
        "Bytes pushed to one receiving rank and not yet credited by its agent: the window "
        "each attachment starts with, and the least it has.",
    )
    push_window_max: int = setting(
        64 * MiB,
        "Largest push window of one receiving rank, in bytes: while the window limits a "
        "stream it grows from push_window toward twice the bandwidth-delay product measured "
        "on the rank's link (plus the largest frame), up to this, which the rank's agent may "
        "have to buffer; push_window or less keeps the window fixed.",
    )
    max_payload: int = setting(1024 * MiB, "Largest Data payload accepted, in bytes.")
    lost_grace: float = setting(
        2.0, "Seconds a dropped rank may take to reattach before the relay reports it lost."
    )
    memory_budget: int = setting(
        256 * MiB,
        "Bytes of not-yet-pushed frames kept in memory; the rest is read back "
        "from the log files when pushed.",
    )
    connection_memory: int = setting(
        64 * MiB,
        "Bytes of memory_budget the frames deposited by one connection (one agent) may hold; "
        "beyond it they are read back from the log files too, so an agent sending what nobody "
        "receives does not take the memory others' messages need.",
    )
    fsync: bool = setting(
        False, "fdatasync the log before acknowledging (survives a machine crash, slower)."
    )
    segment_size: int = setting(64 * MiB, "Size at which a log segment file is closed.")
    job_log_quota: int = setting(
        16 * GiB,
        "Bytes of message and determinant logs and checkpoint images one job may hold here; "
        "a job that stores more fails, naming this quota, and its files are deleted (nobody "
        "else notices).",
    )
    disk_reserve: int = setting(
        512 * MiB,
        "Bytes kept free on the disk of data_dir: a deposit that would leave less is refused "
        "(its job fails with the relay's disk full) and the relay keeps serving the rest.",
    )
    handshake_timeout: float = setting(
        10.0, "Seconds an agent has to complete TLS and Hello after connecting."
    )
    agent_idle_timeout: float = setting(
        30.0,
        "Seconds an agent connection may bring nothing at all before the relay closes it as "
        "dead (its ranks then get lost_grace to reattach); agents ping a quiet relay every "
        "few seconds, so only a dead one stays silent this long. Agents too old to ping are "
        "never closed for it (0: never).",
    )
    write_threads: int = setting(4, "Threads doing large log writes and reads at once.")
    store_nice: int = setting(
        19,
        "Niceness added to the relay's store process, which receives and sends checkpoint "
        "images, so that on a machine that also runs ranks it takes the CPU the ranks leave "
        "idle (0: the relay's).",
    )
    checkpoint_keep: int = setting(
        2,
        "Checkpoint images kept per rank (newest first); older ones are deleted and the "
        "rank's log is trimmed behind the oldest one kept.",
    )
    checkpoint_max_bytes: int = setting(
        64 * GiB, "Largest checkpoint image accepted from an agent, in bytes."
    )
    store_threads: int = setting(
        8,
        "Checkpoint store connections served at once (one thread each in the store "
        "process); more wait before their TLS handshake.",
    )
    store_bulk: bool = setting(
        True,
        "Let agents send an image's bytes (AES-GCM ciphertext already) beneath TLS on the "
        "store connection, checked by the image's digest; off: every byte through TLS.",
    )
    store_idle_timeout: float = setting(
        60.0, "Seconds a checkpoint store connection may stay silent before it is closed."
    )
    local_socket: bool = setting(
        True,
        "Also listen on an abstract Unix socket named after the port (protocol.local), for "
        "agents on this machine: cheaper than loopback TCP, and checkpoint puts over it need "
        "no transport MAC.",
    )
    store_report_wait: float = setting(
        10.0,
        "Seconds a committed image's CkptStored waits for the coordinator to accept its "
        "report (so that a replacement placed after it restores from it); past that the "
        "image counts as stored and its report is still retried.",
    )

    def relay_name(self, port: int) -> str:
        return self.name or f"{socket.gethostname()}-{port}"

    def advertised_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("", "0.0.0.0", "::"):
            return socket.gethostname()
        return self.host

    def data_path(self, name: str) -> Path:
        return Path(self.data_dir) if self.data_dir else paths.state_dir() / f"relay-{name}"


def load(file: Path | None = None, **overrides: object) -> RelaySettings:
    return load_settings(RelaySettings, prefix=PREFIX, file=file, overrides=overrides)
