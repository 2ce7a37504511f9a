"""The agent's settings table (prefix ``VPOOL_AGENT``), loaded by ``vpool.config.load_settings``."""

from __future__ import annotations

import hashlib
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from vpool import paths
from vpool.config import load_settings, setting
from vpool.worker_agent import manners

ENV_PREFIX = "VPOOL_AGENT"
# Where an agent run as root listens for `vpool-agent status` (a directory anyone may enter).
SYSTEM_CONTROL_SOCKET = Path("/run/vpool-agent/control.sock")


@dataclass(frozen=True)
class AgentSettings:
    name: str = setting("", "Name shown in the pool; empty = this machine's hostname.")
    coordinator_url: str = setting(
        "https://127.0.0.1:8443", "Base URL of the coordinator (the /api/v1 prefix is added)."
    )
    coordinator_ca: str = setting(
        "",
        "PEM file of the pool CA, trusted for the coordinator and the relays; empty = system CAs.",
    )
    join_token: str = setting(
        "",
        "Join token from the pool's operator; needed the first time this agent enrolls "
        "(its identity key is its credential from then on), unless the pool is open.",
    )
    identity_dir: str = setting(
        "", "Directory of identity.key (Ed25519, mode 0600); empty = <config dir>/agent."
    )
    work_dir: str = setting(
        "",
        "Directory of agent.sock, the blob cache and the ranks' work directories; "
        "empty = <state dir>/agent.",
    )
    slots: int = setting(0, "Ranks run at once; 0 = the number of CPUs.")
    python: str = setting("", "Interpreter that runs the ranks; empty = the agent's own.")
    keep_workdirs: bool = setting(False, "Keep each rank's work directory after it ends.")
    lease_wait: float = setting(20.0, "Seconds a lease request waits on the coordinator for work.")
    retry_max_delay: float = setting(
        2.0,
        "Longest pause (s) between retries while the coordinator is unreachable (kept short: "
        "a restarted coordinator must hear from the agent before its agent_timeout).",
    )
    local_delivery: bool = setting(
        True,
        "Hand a message between two ranks of this agent straight to the receiver (it is still "
        "logged at the receiver's home relay, which then does not send it back); off: every "
        "message comes to its receiver from the relay.",
    )
    seal_messages: bool = setting(
        True,
        "Encrypt the messages your ranks send before they reach a relay (relays then keep "
        "only ciphertext); off only to measure what it costs.",
    )
    relay_reconnect: float = setting(
        30.0,
        "Seconds a dropped relay connection is retried (ranks keep running, their messages "
        "wait) before its ranks are reported lost.",
    )
    relay_ping_interval: float = setting(
        5.0,
        "Seconds without a byte from a relay after which the agent pings it, and again every "
        "as many seconds while it stays silent (0: no pings, no relay_dead_after either: only "
        "TCP keepalive notices a dead connection).",
    )
    relay_dead_after: float = setting(
        12.0,
        "Seconds without a byte from a relay (pings unanswered) after which its connection is "
        "taken for dead (a middlebox dropped it silently): it is closed and reconnected, as "
        "after any drop. More than relay_ping_interval.",
    )
    stop_grace: float = setting(
        3.0, "Seconds a rank told to stop gets after SIGTERM before SIGKILL."
    )
    max_bundle_bytes: int = setting(
        4 * 1024**3, "Largest total size of an extracted bundle (zip bomb guard)."
    )
    max_bundle_members: int = setting(
        100_000, "Most files and directories a bundle may hold (zip bomb guard)."
    )
    disk_keep_free: int = setting(
        2 * 1024**3,
        "Bytes of the disk holding the ranks' directories the agent keeps free: a bundle that "
        "would extract beyond it (with the extractions under way) is not extracted here, and "
        "its rank runs on another agent; 0 = no bound beyond each rank's.",
    )
    package_index: str = setting(
        "",
        "Package index jobs' environments are installed from (a URL for pip --index-url; "
        "empty: pip's own configuration, normally PyPI).",
    )
    env_cache_size: int = setting(
        10 * 1024**3,
        "Most disk the built job environments may take together; the least recently used "
        "ones (no rank using them) are deleted beyond it.",
    )
    env_max_size: int = setting(
        4 * 1024**3, "Largest environment one job may have installed here (bytes)."
    )
    env_build_timeout: float = setting(
        900.0, "Seconds the installation of one job environment may take."
    )
    max_results_bytes: int = setting(
        256 * 1024**2, "Largest results zip per rank; files beyond it are left out and reported."
    )
    max_payload: int = setting(
        1024**3, "Largest payload of one MPI message accepted from a rank or a relay (bytes)."
    )
    criu: str = setting("criu", "Path of the CRIU binary (checkpoints need CRIU >= 4).")
    sandbox: str = setting(
        "on",
        "Isolation of the ranks: 'on' runs every rank in a sandbox (bubblewrap, a cgroup) and "
        "refuses to run ranks where none can be made; 'prefer' falls back to running them "
        "unsandboxed, as this user, when it cannot (the volunteer's explicit choice: the "
        "coordinator then places only jobs that accept unsandboxed agents here); 'off' never "
        "sandboxes (trusted programs only).",
    )
    bwrap: str = setting("bwrap", "Path of bubblewrap's bwrap, which makes the sandboxes.")
    rank_memory: int = setting(
        0,
        "Memory (bytes) a rank may use, its checkpoint clone's copies included; 0 = memory "
        "divided among the slots.",
    )
    rank_processes: int = setting(
        64, "Processes and threads a rank may have at once (its cgroup's pids.max)."
    )
    rank_disk: int = setting(
        4 * 1024**3,
        "Bytes a rank may write into its work directory (its largest file, and all of them "
        "together, checked every 2 s).",
    )
    rank_tmp: int = setting(
        256 * 1024**2, "Size (bytes) of a rank's private /tmp, and of its /dev/shm."
    )
    rank_open_files: int = setting(1024, "Files a rank may have open at once (RLIMIT_NOFILE).")
    rank_idle_priority: bool = setting(
        True,
        "Ranks run in the idle scheduling class (SCHED_IDLE): they get only CPU time nothing "
        "else of the volunteer's wants.",
    )
    rank_root: str = setting(
        "",
        "Unsandboxed ranks only: directory of the ranks' directories, which must be the same "
        "path on agents that restore each other's checkpoints; empty = <work dir>/ranks. "
        "Sandboxed ranks live in <work dir>/ranks and see it as /vpool/rank wherever they run.",
    )
    fingerprint_salt: str = setting(
        "", "Mixed into this agent's environment fingerprint (tests: agents that differ)."
    )
    selftest_cache: str = setting(
        "",
        "A file where the agent keeps its selftest's findings and reuses them at its next "
        "start while nothing they depend on changed (the boot, vpool, the interpreter, bwrap, "
        "CRIU, the settings); empty = probe at every start. A local pool's agents share one.",
    )
    checkpoint_scratch: str = setting(
        "",
        "Directory for CRIU images being made or restored; empty = a directory of this agent's "
        "own in /dev/shm when it exists (vpool-ckpt-<uid>-<hash of the work dir>), else "
        "<work dir>/ckpt.",
    )
    checkpoint_zstd_level: int = setting(1, "zstd level of checkpoint images.")
    store_local_socket: bool = setting(
        True,
        "Reach a checkpoint store at a loopback address through its relay's same-host Unix "
        "socket (protocol.local) when it has one: cheaper than TCP, no transport MAC.",
    )
    checkpoint_stream_pages: bool = setting(
        True,
        "CRIU writes a checkpoint's memory pages into a pipe that the upload reads while the "
        "dump runs, instead of into a file in the scratch directory first.",
    )
    checkpoint_nice: int = setting(
        19,
        "Niceness added to a checkpoint's dump, packing and upload, so that they take the CPU "
        "the ranks leave idle rather than the ranks' own (0: the agent's priority).",
    )
    checkpoint_clone_timeout: float = setting(
        600.0, "Seconds a checkpoint clone waits to be dumped before it exits by itself."
    )
    lost_checkpoint_grace: float = setting(
        30.0,
        "Seconds the agent lets a lost rank's checkpoint in flight (forked before the rank "
        "died) finish before it reports the loss, so the replacement restores from it; 0: "
        "report at once and drop it.",
    )

    leave_checkpoint_grace: float = setting(
        20.0,
        "Seconds a stopping agent (first SIGTERM or Ctrl-C: its volunteer quits, logs out or "
        "suspends the machine) spends checkpointing its ranks before it stops them, so that "
        "their replacements restore from that moment; a second signal stops at once; 0: stop "
        "at once (a local pool's agents: `vsdk local down` stops the whole pool).",
    )

    # -- the owner's preferences (worker_agent/manners.py) -----------------------------------

    run_when: str = setting(
        "always",
        "'always': ranks run whenever the other preferences allow (at the idle CPU priority); "
        "'idle': only once the owner has been away for idle_after, and they are suspended "
        "(frozen, not killed) the moment the owner is back.",
    )
    idle_after: float = setting(
        300.0, "Seconds the machine must have been idle before ranks run (run_when 'idle')."
    )
    idle_source: str = setting(
        "auto",
        "How the agent tells that the owner is away: 'logind' (the desktop session's idle "
        "hint, over D-Bus), 'terminals' (time since anyone typed at a console or SSH "
        "terminal), 'auto' (logind, else terminals).",
    )
    pause_on_battery: bool = setting(True, "Suspend the ranks while the machine runs on battery.")
    evacuate_battery_below: float = setting(
        10.0,
        "Charge (percent) of a discharging battery below which every rank is checkpointed and "
        "handed back to run elsewhere.",
    )
    pause_while: list[str] = setting(  # noqa: RUF009 (a default_factory: setting copies it)
        [],
        "Programs (process names, e.g. 'steam', 'blender') during which the ranks are suspended.",
    )
    run_hours: str = setting(
        "",
        "Hours of the day the ranks may run, e.g. '22:00-07:00, 12:00-13:30' (local time); "
        "empty: any time. Outside them they are suspended.",
    )
    memory: int = setting(
        0,
        "Memory (bytes) offered to ranks in all; 0 = three quarters of this machine's. Each "
        "rank may use its share (memory / slots) unless rank_memory says otherwise.",
    )
    manners_interval: float = setting(
        1.0,
        "Seconds between two looks at the machine (idle, battery, programs, hours): the "
        "longest the ranks run on once the owner is back.",
    )
    suspend_limit: float = setting(
        0.0,
        "Seconds a rank may stay suspended before it is checkpointed and moved to another "
        "machine; 0 = the pool's suspend_limit (the coordinator's, else 600 s).",
    )
    power_supply_dir: str = setting(
        "/sys/class/power_supply", "Where the battery and the mains supply are read."
    )
    logind_bus: str = setting(
        "",
        "D-Bus address of logind's bus; empty = the system bus. (Tests point it at a bus of "
        "their own.)",
    )
    control_socket: str = setting(
        "",
        "Unix socket on which `vpool-agent status`, `pause` and `resume` reach the agent; "
        "empty = <work_dir>/control.sock when work_dir is set, else "
        "$XDG_RUNTIME_DIR/vpool-agent.sock, or /run/vpool-agent/control.sock for an agent run "
        "as root.",
    )
    control_users: list[str] = setting(  # noqa: RUF009
        [],
        "Users besides the agent's own (and root) who may pause and resume it; anyone on the "
        "machine may read its status.",
    )

    def __post_init__(self) -> None:
        self.preferences()  # a preference that cannot be understood fails here, at load
        if self.relay_ping_interval > 0 and not self.relay_dead_after > self.relay_ping_interval:
            raise ValueError(
                f"relay_dead_after ({self.relay_dead_after:g} s) must be more than "
                f"relay_ping_interval ({self.relay_ping_interval:g} s)"
            )

    def preferences(self) -> manners.Preferences:
        return manners.Preferences(
            run_when=self.run_when,
            idle_after=self.idle_after,
            pause_on_battery=self.pause_on_battery,
            evacuate_battery_below=self.evacuate_battery_below,
            pause_while=frozenset(n.strip() for n in self.pause_while if n.strip()),
            hours=manners.parse_hours(self.run_hours),
        )

    # Resolved values: the empty defaults above mean "the platform's choice".

    @property
    def agent_name(self) -> str:
        return self.name or socket.gethostname()

    @property
    def identity_path(self) -> Path:
        return Path(self.identity_dir) if self.identity_dir else paths.config_dir() / "agent"

    @property
    def work_path(self) -> Path:
        return Path(self.work_dir) if self.work_dir else paths.state_dir() / "agent"

    @property
    def slot_count(self) -> int:
        return self.slots if self.slots > 0 else (os.cpu_count() or 1)

    @property
    def python_path(self) -> str:
        return self.python or sys.executable

    @property
    def scratch_path(self) -> Path:
        if self.checkpoint_scratch:
            return Path(self.checkpoint_scratch)
        if Path("/dev/shm").is_dir():
            # Not one fixed path for every agent of the machine: another agent (another user)
            # could make it first and read or swap what is in it. ``paths.private_dir``
            # checks the owner and the mode before using it.
            tag = hashlib.sha256(str(self.work_path.absolute()).encode()).hexdigest()[:12]
            return Path(f"/dev/shm/vpool-ckpt-{os.getuid()}-{tag}")
        return self.work_path / "ckpt"

    @property
    def rank_root_path(self) -> Path:
        return Path(self.rank_root) if self.rank_root else self.work_path / "ranks"

    @property
    def rank_memory_bytes(self) -> int:
        if self.rank_memory > 0:
            return self.rank_memory
        return max(256 * 1024**2, self.memory_offered // self.slot_count)

    @property
    def memory_offered(self) -> int:
        if self.memory > 0:
            return self.memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 3 // 4

    @property
    def control_path(self) -> Path:
        if self.control_socket:
            return Path(self.control_socket)
        if self.work_dir:  # one of several agents on this machine (a local pool)
            return self.work_path / "control.sock"
        if os.getuid() == 0:
            return SYSTEM_CONTROL_SOCKET
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        if runtime:
            return Path(runtime) / "vpool-agent.sock"
        return self.work_path / "control.sock"

    @property
    def ca_path(self) -> Path | None:
        return Path(self.coordinator_ca) if self.coordinator_ca else None


def load_agent_settings(
    file: Path | None = None, overrides: dict[str, object] | None = None
) -> AgentSettings:
    return load_settings(AgentSettings, prefix=ENV_PREFIX, file=file, overrides=overrides)
