"""Settings of ``vpool-coordinator`` (environment prefix ``VPOOL_COORDINATOR``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from vpool import paths
from vpool.config import load_settings, setting

PREFIX = "VPOOL_COORDINATOR"
MAX_AGENT_TIMEOUT = 15.0


@dataclass(frozen=True)
class CoordinatorSettings:
    host: str = setting("127.0.0.1", "Address to listen on.")
    port: int = setting(8443, "TCP port to listen on (0 = any free port).")
    state_dir: str = setting(
        "",
        "Directory of the SQLite db (vpool.db), blobs and signing.key; "
        "empty = <vpool state dir>/coordinator.",
    )
    tls_cert: str = setting("", "PEM certificate (chain) of the HTTPS server.")
    tls_key: str = setting("", "PEM private key of tls_cert.")
    tls_ca: str = setting(
        "",
        "PEM certificate of the pool CA (which signed tls_cert), served to anyone at GET "
        "/api/v1/pool/ca: `vpool-agent join --ca-sha256` fetches it there and trusts it if its "
        "digest is the one the operator gave (join-token create prints it); empty: not served.",
    )
    insecure_http: bool = setting(
        False, "Serve plain HTTP when tls_cert/tls_key are empty (tests and demos only)."
    )
    open_enrollment: bool = setting(
        False,
        "Let any agent enroll without a join token (a private pool of trusted machines only); "
        "by default a new agent needs one (vpool-coordinator join-token create).",
    )
    heartbeat_interval: float = setting(
        2.0, "Seconds between heartbeats, told to agents and relays."
    )
    agent_timeout: float = setting(
        10.0,
        "Seconds without an agent heartbeat before its ranks are lost and restarted elsewhere "
        f"(at most {MAX_AGENT_TIMEOUT:g}).",
    )
    relay_timeout: float = setting(
        10.0, "Seconds without a relay heartbeat before it counts as down (no new jobs on it)."
    )
    relay_down_timeout: float = setting(
        300.0,
        "Seconds a running job waits for a down relay to come back before it fails "
        "(relays keep their logs on disk, so a restarted relay loses nothing).",
    )
    max_restarts: int = setting(50, "Lost ranks a job may have restarted in all before it fails.")
    restart_quick: float = setting(
        60.0,
        "Seconds after it was handed out within which losing a rank counts as a quick loss. "
        "The first quick loss is replaced at once; each further one in a row waits "
        "restart_backoff_first, doubling up to restart_backoff_max, plus up to half of it at "
        "random. A failure worded the same on two agents, or three times in a row, ends the "
        "job at once.",
    )
    restart_backoff_first: float = setting(
        1.0, "Seconds the second quick loss of a rank in a row waits before its replacement."
    )
    restart_backoff_max: float = setting(
        60.0, "Longest wait before a replacement, however many quick losses came before."
    )
    restore_wait_timeout: float = setting(
        600.0,
        "Seconds a lost rank that can only restart from a checkpoint image (its home relay "
        "dropped the log before it) waits for a free agent with CRIU and the image's "
        "environment fingerprint before its job fails.",
    )
    suspend_limit: float = setting(
        600.0,
        "Seconds a rank may stay suspended on its volunteer's machine (the owner uses it, it "
        "runs on battery, it is outside its hours or paused) before its agent checkpoints it "
        "and hands it back, to be restarted elsewhere from that image; told to agents in every "
        "heartbeat answer. A rank still suspended 2 heartbeat intervals + 60 s past it (its "
        "agent could not move it) is replaced by the coordinator from its newest checkpoint. "
        "0 = never move a suspended rank: it waits for the owner.",
    )
    min_checkpoint_every: float = setting(
        1.0, "Shortest checkpoint period (JobSubmit.checkpoint_every, seconds) a job may ask for."
    )
    pool_name: str = setting("vpool", "Name of the pool, shown to users and volunteers.")
    max_blob_bytes: int = setting(
        1 << 30, "Largest blob (bundle, stdin, a rank's results) accepted, per blob."
    )
    max_bundle_members: int = setting(
        20_000,
        "Most files and directories a job's bundle may hold; a bundle with more is refused at "
        "submit (agents have their own, larger, max_bundle_members).",
    )
    max_user_blob_bytes: int = setting(
        4 << 30,
        "Bytes of uploads (bundles and stdin, each distinct blob once) a user's queued and "
        "running jobs may hold together; a submission beyond it is refused (409 "
        "quota_exceeded) until some of them have ended.",
    )
    max_queued_jobs: int = setting(
        100,
        "Jobs a user may have queued or running at once; one more is refused (409 "
        "quota_exceeded) until some of them have ended.",
    )
    max_job_output: int = setting(
        64 << 20,
        "Bytes of stdout and stderr (all ranks together) the coordinator stores per job; a "
        "job whose output goes past it fails, naming the quota, and the rest is not stored.",
    )
    blob_keep: float = setting(
        86400.0,
        "Seconds an upload that no job or result names is kept (a bundle uploaded and never "
        "submitted) before it is deleted; uploading it again keeps it anew.",
    )
    upload_idle_timeout: float = setting(
        60.0,
        "Seconds a request body (an upload) may send nothing before the request is refused "
        "(408 upload_stalled) and what it sent is dropped.",
    )
    validate_jobs: bool = setting(
        False,
        "Validate every job by replay, whether its submission asked or not: once its ranks "
        "exited, sampled ranks are re-executed from their logs on other, unrelated volunteers "
        "and compared before the job succeeds.",
    )
    validation_trusted_after: int = setting(
        10,
        "Agreements in a row after which an agent's ranks are no longer always re-executed "
        "by validation; beyond it a rank is re-executed with probability "
        "validation_trusted_after / agreements.",
    )
    validation_min_rate: float = setting(
        0.1,
        "Least probability that a validated job's rank is re-executed, however long its "
        "agents' record of agreeing.",
    )
    max_ranks: int = setting(
        256,
        "Largest number of ranks a job may ask for; also the largest universe (processes at "
        "once, its first ranks and those they spawn).",
    )
    spawn_default: int = setting(
        16,
        "Processes a job may spawn (MPI.Comm.Spawn, mpi4py.futures' MPIPoolExecutor) on top of "
        "its ranks, alive at once, when its submission does not say (universe 0).",
    )
    max_spawned: int = setting(
        1024,
        "Processes a job's ranks may spawn over its whole run (each takes a new rank number).",
    )
    public_url: str = setting(
        "", "URL clients use to reach this coordinator (shown on the web portal's pool page)."
    )
    guess_limit: int = setting(
        30,
        "Wrong credentials (API tokens, session cookies, join tokens, agent and relay keys) "
        "one client address may present within guess_window seconds; past it, every "
        "credential it presents gets 429 until the oldest wrong one is guess_window old "
        "(0: no limit).",
    )
    guess_window: float = setting(60.0, "Seconds over which guess_limit counts (see there).")
    max_request_bytes: int = setting(
        64 << 20, "Largest JSON request body (e.g. an agent's output batch)."
    )
    max_wait: float = setting(
        60.0, "Longest a long-poll (lease, output, job status) may wait, in seconds."
    )
    session_lifetime: float = setting(
        12 * 3600.0, "Seconds a web portal sign-in lasts before the user signs in again."
    )

    def __post_init__(self) -> None:
        if not 0 < self.agent_timeout <= MAX_AGENT_TIMEOUT:
            raise ValueError(
                f"agent_timeout must be more than 0 and at most {MAX_AGENT_TIMEOUT:g} s, "
                f"not {self.agent_timeout:g}"
            )
        if not self.session_lifetime > 0:
            raise ValueError(
                f"session_lifetime must be more than 0 s, not {self.session_lifetime:g}"
            )
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, not {self.max_restarts}")
        if not 0 <= self.restart_backoff_first <= self.restart_backoff_max < math.inf:
            raise ValueError(
                "restart_backoff_first and restart_backoff_max must be 0 <= first <= max, not "
                f"{self.restart_backoff_first:g} and {self.restart_backoff_max:g}"
            )
        if not 0 <= self.restart_quick < math.inf:
            raise ValueError(f"restart_quick must be >= 0 s, not {self.restart_quick:g}")
        if not self.restore_wait_timeout > 0:
            raise ValueError(
                f"restore_wait_timeout must be more than 0 s, not {self.restore_wait_timeout:g}"
            )
        for quota in ("max_queued_jobs", "max_job_output", "max_user_blob_bytes"):
            if getattr(self, quota) < 1:
                raise ValueError(f"{quota} must be at least 1, not {getattr(self, quota)}")
        if self.validation_trusted_after < 0:
            raise ValueError(
                f"validation_trusted_after must be >= 0, not {self.validation_trusted_after}"
            )
        if not 0 <= self.validation_min_rate <= 1:
            raise ValueError(
                f"validation_min_rate is a probability (0 to 1), not {self.validation_min_rate:g}"
            )
        if not 0 <= self.suspend_limit < math.inf:
            raise ValueError(
                f"suspend_limit must be 0 (never move a suspended rank) or more seconds, "
                f"not {self.suspend_limit:g}"
            )
        if not self.min_checkpoint_every > 0:
            raise ValueError(
                f"min_checkpoint_every must be more than 0 s, not {self.min_checkpoint_every:g}"
            )

    def state_path(self) -> Path:
        return Path(self.state_dir) if self.state_dir else paths.state_dir() / "coordinator"


def load(file: Path | None = None, **overrides: object) -> CoordinatorSettings:
    return load_settings(CoordinatorSettings, prefix=PREFIX, file=file, overrides=overrides)
