"""Payloads of the coordinator's HTTP API (JSON), shared by the coordinator and its clients.

Prefix ``/api/v1``. Authentication by ``Authorization: Bearer <token>``:

- users (``vsdk``): an API token made by ``vpool-coordinator user add``/``user token``, the
  portal's account page or ``POST /api/v1/tokens``; revocable. Who may see what is decided in
  one place, ``coordinator/access.py``: a user's own jobs only (others' are 404); operators
  (``UserInfo.role``) also the agents, relays and every job;
- agents: the agent token (``AgentClaims``) returned by enroll and renewed by heartbeats;
- relays: the relay's own key (`vpool-coordinator relay add NAME`), which names it.

Every error is ``ErrorBody`` with a 4xx/5xx status. Endpoints::

    GET  /api/v1/pool                         -> PoolInfo            (no auth)
    GET  /api/v1/pool/ca                      -> the pool CA, PEM    (no auth; tls_ca)
    GET  /api/v1/pool/totals                  -> PoolTotals          (user)
    GET  /api/v1/pool/agents                  -> list[AgentInfo]     (user: without names)
    GET  /api/v1/pool/relays                  -> list[RelayStatus]   (operator)
    GET  /api/v1/whoami                       -> UserInfo            (user)
    GET  /api/v1/tokens                       -> list[TokenInfo]     (user: own tokens)
    POST /api/v1/tokens           TokenCreate -> TokenCreated (201)  (user)
    POST /api/v1/tokens/{id}/revoke           -> TokenInfo           (user: own tokens)
    PUT  /api/v1/blobs/{sha256}   raw bytes   -> BlobInfo            (user; hash checked)
    HEAD /api/v1/blobs/{sha256}               -> 200 / 404           (user)
    POST /api/v1/jobs             JobSubmit   -> JobInfo  (201)      (user)
    GET  /api/v1/jobs?state=&name=&sort=&order=&offset=&limit=&all= -> list[JobInfo]
                                                                     (user: own jobs; all=true
                                                                      every job, operators)
    GET  /api/v1/jobs/{id}                    -> JobDetail           (user)
    GET  /api/v1/jobs/{id}/timeline           -> web.timeline.Timeline (user)
    GET  /api/v1/jobs/{id}/output?after=&rank=&wait=&seen= -> OutputPage (user; long-poll)
    POST /api/v1/jobs/{id}/cancel             -> JobInfo             (user)
    POST /api/v1/jobs/{id}/checkpoint CheckpointAsk -> CheckpointAsked (202) (user)
    GET  /api/v1/jobs/{id}/results            -> application/zip     (user)

    POST /api/v1/agents/enroll    EnrollRequest -> EnrollResponse    (proof of key possession)
    POST /api/v1/agents/lease     LeaseRequest  -> LeaseResponse     (agent; long-poll)
    POST /api/v1/agents/heartbeat AgentHeartbeat -> AgentHeartbeatResponse (agent)
    GET  /api/v1/agents/blobs/{sha256}        -> raw bytes           (agent)
    POST /api/v1/agents/output    OutputBatch -> {}                  (agent)
    POST /api/v1/agents/exit      RankExit    -> {}                  (agent)
    POST /api/v1/agents/problem   RankProblem -> {}                  (agent)
    PUT  /api/v1/agents/results/{job}/{rank}/{incarnation}  zip      (agent)
    POST /api/v1/agents/checkpoint-failed CheckpointFailed -> {}      (agent)
    POST /api/v1/agents/restored  RestoreReport -> {}                (agent)

    POST /api/v1/relays/register  RelayRegister -> RelayRegistered   (relay key)
    POST /api/v1/relays/heartbeat RelayHeartbeat -> RelayHeartbeatResponse (relay key)
    POST /api/v1/relays/lost      RelayLost   -> {}                  (relay key)
    POST /api/v1/relays/diverged  RelayDiverged -> {}                (relay key)
    POST /api/v1/relays/refused   RelayRefused -> {}                 (relay key)
    POST /api/v1/relays/validated RelayValidated -> {}               (relay key)
    POST /api/v1/relays/checkpoint RelayCheckpoint -> CheckpointAccepted (relay key)
"""

from __future__ import annotations

from typing import Literal

import msgspec

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
# What a lost rank means to a job (``JobSubmit.on_failure``). "transparent": it is restarted
# elsewhere and replays its log, the program never notices. "abort": the job fails. "ulfm": it
# is declared failed, fenced at the relays, and the surviving ranks are told (``Failed``), which
# the program sees the ULFM way (``MPI.ERR_PROC_FAILED``, ``Comm.Revoke``/``Agree``/``Shrink``).
# "blank", "shrink", "rebuild" (FT-MPI's modes): the same as "ulfm" outside the MPI runtime; in
# it, every operation on a communicator with a failed member fails, and ``COMM_WORLD.Dup()``
# rebuilds the world with holes at the failed ranks, without them (renumbered), or with new
# processes (spawned, the job's program) in their places.
FailureMode = Literal["transparent", "abort", "ulfm", "blank", "shrink", "rebuild"]
FAILURE_MODES: tuple[FailureMode, ...] = (
    "transparent",
    "abort",
    "ulfm",
    "blank",
    "shrink",
    "rebuild",
)
# The modes in which a lost rank is reported to the survivors instead of ending the job.
REPORTING_MODES: frozenset[str] = frozenset({"ulfm", "blank", "shrink", "rebuild"})
Stream = Literal["stdout", "stderr"]


class ErrorDetail(msgspec.Struct, frozen=True):
    code: str
    message: str


class ErrorBody(msgspec.Struct, frozen=True):
    """The one error shape of the HTTP API."""

    error: ErrorDetail


class PoolInfo(msgspec.Struct, frozen=True):
    name: str
    version: str
    signing_key: str  # coordinator's Ed25519 public key (base64url raw)
    api_version: int = 1
    agents: int = 0  # live agents (enrolled and heartbeating)
    relays: int = 0  # live relays


class AgentInfo(msgspec.Struct, frozen=True):
    """An agent of the pool as users see it (``vsdk status`` without a job, the dashboard).
    ``isolation`` is the level of its last ``IsolationReport`` ("": none yet, so it gets no
    ranks); ``rank_memory`` the bytes one rank may use there (0: no limit).

    ``state``: "alive" (heartbeating), "lost" (silent: its ranks were restarted elsewhere),
    "gone" (it said it was leaving, then went silent: it stopped cleanly) or "banned".
    ``activity``: what its volunteer's preferences let it do, as its last heartbeat said
    (``AgentHeartbeat.activity``): "available" (takes ranks), "busy" (available, no free
    slot), "suspended" (its ranks are frozen, it takes none) or "leaving"; why in
    ``activity_reason`` (operators only), since ``activity_since``."""

    id: str
    name: str
    state: str  # alive | lost | gone | banned
    slots: int
    ranks: int  # ranks placed there now
    last_seen: float
    isolation: str = ""
    isolation_detail: str = ""  # why the level is not stronger
    rank_memory: int = 0
    checkpoints: bool = False  # it can checkpoint and restore ranks (CRIU)
    activity: str = "available"
    activity_reason: str = ""
    activity_since: float = 0.0
    integrity_failures: int = 0  # sealed messages that did not open here (``RankProblem``)

    def doing(self) -> str:
        """What listings show of its activity: "-" when it is not alive (``state`` says why),
        else the activity, with the reason of a suspension or a departure."""
        if self.state != "alive":
            return "-"
        if self.activity_reason and self.activity in ("suspended", "leaving"):
            return f"{self.activity}: {self.activity_reason}"
        return self.activity


Role = Literal["user", "operator"]
ROLES: tuple[Role, ...] = ("user", "operator")


class RelayStatus(msgspec.Struct, frozen=True):
    """A relay as operators see it (``GET /api/v1/pool/relays``, the portal's pool page)."""

    name: str
    host: str
    port: int
    state: str  # alive | lost
    last_seen: float
    load: RelayLoad
    integrity_failures: int = 0  # sealed messages it pushed that did not open at an agent


class PoolTotals(msgspec.Struct, frozen=True):
    """What every user may know of the pool: how big and how busy it is."""

    agents: int  # alive
    slots: int  # of the live agents
    busy: int  # ranks placed on live agents
    relays: int  # alive
    jobs: dict[str, int]  # every user's jobs per state


class UserInfo(msgspec.Struct, frozen=True):
    """Who a credential belongs to. Operators also see the whole pool (agents, relays, every
    user's jobs); users see their own jobs and the pool's totals."""

    name: str
    role: Role = "user"


class TokenInfo(msgspec.Struct, frozen=True):
    """One of a user's API tokens (only its hash is stored; the token is shown once)."""

    id: int
    label: str
    created: float
    last_used: float | None = None
    revoked: float | None = None


class TokenCreate(msgspec.Struct, frozen=True):
    label: str = ""


class TokenCreated(msgspec.Struct, frozen=True):
    info: TokenInfo
    token: str  # shown this once


class BlobInfo(msgspec.Struct, frozen=True):
    sha256: str
    size: int


# ``JobSubmit.memory``: 0 or a size in [MIN_JOB_MEMORY, MAX_JOB_MEMORY] bytes.
MIN_JOB_MEMORY = 16 * 1024**2
MAX_JOB_MEMORY = 2**50


class JobSubmit(msgspec.Struct, frozen=True):
    """A job: ``bundle`` is the sha256 of an uploaded zip holding the program and its input
    files; ``entry`` the path of the program inside it; ``stdin`` the sha256 of an uploaded blob
    fed to rank 0's standard input, or None."""

    ranks: int
    bundle: str
    entry: str
    args: list[str] = []
    stdin: str | None = None
    name: str = ""
    # False: no determinant logging (ranks get VPOOL_FT=0) and a lost rank fails the job.
    fault_tolerance: bool = True
    # Seconds between periodic checkpoints of every rank (0: none; ``vsdk checkpoint`` still
    # works). Needs fault tolerance.
    checkpoint_every: float = 0.0
    # Bytes of memory each rank may use (0: what each agent offers). Lowers an agent's own
    # limit; an agent that offers less gets none of the job's ranks.
    memory: int = 0
    # Whether ranks may run on agents that cannot sandbox them (their volunteers allowed it).
    unsandboxed: bool = False
    # Packages the program needs beyond what agents have (``vpool.requirements``: normalized,
    # from the index only); each agent builds that environment once and keeps it.
    requirements: list[str] = []
    # Validation by replay: once every rank exited, ranks are re-executed from their logs on
    # other, unrelated volunteers and compared (sent messages, stdout, exit code). The pool may
    # validate every job whatever this says (``validate_jobs``).
    validate: bool = False
    # What a lost rank means (``FailureMode``). Anything but "transparent" turns fault
    # tolerance off (nothing is logged, no checkpoints); ``fault_tolerance=False`` alone means
    # "abort".
    on_failure: FailureMode = "transparent"
    # The most processes the job may have at once, its first ranks and those its ranks spawn
    # (``MPI.Comm.Spawn``, ``mpi4py.futures.MPIPoolExecutor``) together: MPI's universe size
    # (``mpiexec -usize``). 0: ``ranks`` + the pool's ``spawn_default``.
    universe: int = 0
    # Run the program as ``python -m MODULE ENTRY ARGS`` (e.g. "mpi4py.futures", as
    # ``mpiexec -n 5 python -m mpi4py.futures app.py``; "mpi4py", mpi4py's runner). "": as
    # ``python ENTRY ARGS``.
    module: str = ""


class JobInfo(msgspec.Struct, frozen=True):
    id: int
    name: str
    user: str
    state: JobState
    ranks: int
    exit_code: int | None
    reason: str
    created: float
    started: float | None
    finished: float | None
    fault_tolerance: bool = True
    checkpoint_every: float = 0.0
    memory: int = 0  # ``JobSubmit.memory``
    unsandboxed: bool = False  # ``JobSubmit.unsandboxed``
    # Why a queued job is not placed yet ("" once it is), and whether the pool as it is can
    # never run it (more ranks than all the agents that may run it have slots, say).
    waiting: str = ""
    never_fits: bool = False
    restarts: int = 0  # replacement incarnations started so far, all ranks together
    requirements: list[str] = []  # ``JobSubmit.requirements``
    validate: bool = False  # validated by replay (asked, or the pool's policy)
    # What validation did so far, in words ("" when not validated): which ranks were
    # re-executed where, and what came of it.
    validation: str = ""
    on_failure: str = "transparent"  # ``JobSubmit.on_failure``
    universe: int = 0  # ``JobSubmit.universe`` as decided at submission (0: from before)
    spawned: int = 0  # processes its ranks spawned so far (ranks ``ranks`` and up)
    module: str = ""  # ``JobSubmit.module``
    # The ranks declared failed, in a job whose failure mode reports failures.
    failed_ranks: list[int] = []

    def output_withheld(self) -> bool:
        """A job validated by replay shows no output (nor results) until it ended: until then
        it may be a stranger's forged output, replaced once outvoted. Every reader of output
        (the API, the portal) asks this."""
        return self.validate and self.state not in TERMINAL_STATES


JobSort = Literal["id", "name", "state", "ranks", "created", "finished"]
JOB_SORTS: tuple[JobSort, ...] = ("id", "name", "state", "ranks", "created", "finished")


class JobQuery(msgspec.Struct, frozen=True):
    """Which of a user's jobs a listing shows (``GET /api/v1/jobs``, the portal's jobs page):
    ``state`` exactly, ``name`` as a case-insensitive substring, sorted, one page of them."""

    state: JobState | None = None
    name: str = ""
    sort: JobSort = "id"
    descending: bool = True
    offset: int = 0
    limit: int = 100


class JobPage(msgspec.Struct, frozen=True):
    """One page of a listing; ``total`` jobs matched, ``counts`` are the owner's jobs per state
    (all of them, whatever the filter)."""

    jobs: list[JobInfo]
    total: int
    counts: dict[str, int]


class RankInfo(msgspec.Struct, frozen=True):
    rank: int
    incarnation: int
    agent: str | None
    relay: str | None  # home relay
    # pending | leased | running | exited | lost | killed | failed (declared failed and fenced,
    # in a job whose failure mode reports failures: it never runs again)
    state: str
    exit_code: int | None
    # The checkpoint (id: its wall-clock time in ms) this incarnation was restored from; -1 when
    # it started from the beginning (or has not said yet).
    restored_from: int = -1
    agent_name: str = ""  # the name of ``agent`` (as the job's events name it)
    last_checkpoint: float | None = None  # when its newest committed image was made
    # Validation of this rank: "" (none), "sampled", "running", "agreed", "disagreed",
    # "skipped" (its agents are trusted and it was not sampled), with who in ``validated_by``.
    validation: str = ""
    validated_by: str = ""
    # When this incarnation was frozen on its agent (its volunteer's machine is in use); None
    # while it is not.
    suspended_since: float | None = None


class JobEvent(msgspec.Struct, frozen=True):
    time: float
    kind: str
    message: str
    rank: int | None = None
    id: int = 0  # increasing over the pool's events: a cursor for live pages


class JobDetail(msgspec.Struct, frozen=True):
    """A job, its ranks and its events. ``mark`` is a digest of all of them: ``GET
    /jobs/{id}?wait=S&seen=MARK`` returns once the detail differs from the one that had that
    mark (a long-poll: ``Client.wait`` and ``vsdk wait`` follow a job with it)."""

    job: JobInfo
    ranks: list[RankInfo]
    events: list[JobEvent]
    mark: str = ""


class OutputRecord(msgspec.Struct, frozen=True):
    id: int
    rank: int
    stream: Stream
    data: bytes


class OutputPage(msgspec.Struct, frozen=True):
    """Output records with id > ``after``, in arrival order. ``next`` is the cursor for the
    next call; ``complete`` is true once the job is terminal and every record was returned.
    ``waiting``, ``restarts`` and ``validation`` are the job's (``JobInfo``); ``mark`` sums up
    its state, reason, restarts and validation: a long-poll given ``seen=MARK`` also returns
    when they change."""

    records: list[OutputRecord]
    next: int
    complete: bool
    state: JobState
    waiting: str = ""
    never_fits: bool = False
    restarts: int = 0
    running: int = 0  # ranks whose current incarnation runs now
    ranks: int = 0  # the job's ranks
    mark: str = ""
    validation: str = ""  # ``JobInfo.validation``


class CheckpointAsk(msgspec.Struct, frozen=True):
    """``vsdk checkpoint JOB [--rank R]``: checkpoint one rank, or every rank (None)."""

    rank: int | None = None


class CheckpointAsked(msgspec.Struct, frozen=True):
    job: int
    ranks: list[int]  # the ranks whose agents were asked


class EnrollRequest(msgspec.Struct, frozen=True):
    public_key: str
    timestamp: float
    signature: str  # over tokens.possession_message(public_key, timestamp)
    name: str
    slots: int
    software: str = ""
    # What the pool's operator gave the volunteer (``vpool-coordinator join-token create``):
    # needed by a key the pool has not seen, unless enrollment is open.
    join_token: str = ""


class JoinTokenInfo(msgspec.Struct, frozen=True):
    """A join token as operators see it (never the token itself: it is shown once)."""

    id: int
    label: str
    created: float
    expires: float | None  # None: never
    uses_left: int | None  # None: unlimited
    used: int  # agents it admitted
    revoked: float | None
    usable: bool  # admits an agent now


class EnrollResponse(msgspec.Struct, frozen=True):
    agent_id: str
    agent_token: str
    signing_key: str
    heartbeat_interval: float


class RelayInfo(msgspec.Struct, frozen=True):
    name: str
    host: str
    port: int


class CheckpointRef(msgspec.Struct, frozen=True):
    """A committed checkpoint image of a rank, as the coordinator knows it (``RelayCheckpoint``).
    The image lives in the store of ``relay`` (an index into ``Lease.relays``: the rank's home
    relay)."""

    ckpt: int
    incarnation: int  # the incarnation that made it
    relay: int
    size: int
    digest: str  # hex digest of the image (protocol.ckptdigest: BLAKE3-256 of its skeleton)
    fingerprint: str
    received: dict[int, int] = {}
    dets: int = 0
    meta: bytes = b""


class Lease(msgspec.Struct, frozen=True):
    """One incarnation of one rank to run. ``homes[r]`` is the index in ``relays`` of rank r's
    home relay. ``token`` is the signed ``RankClaims`` for relays."""

    job: int
    rank: int
    incarnation: int
    size: int
    token: str
    bundle: str
    entry: str
    args: list[str]
    stdin: str | None
    relays: list[RelayInfo]
    homes: list[int]
    env: dict[str, str] = {}
    # Checkpoints. ``job_uid``: random, fixed for the job (names the rank's directory, which an
    # image restores to). ``ckpt_key``: the job's AES-256-GCM key (base64url). ``restore``: the
    # images this incarnation should try, newest first; ``from_start``: whether starting the
    # program from the beginning (and replaying) is still possible when none works (false once
    # the home relay dropped log entries behind a checkpoint).
    job_uid: str = ""
    ckpt_key: str = ""
    checkpoint_every: float = 0.0
    restore: list[CheckpointRef] = []
    from_start: bool = True
    # The job's own memory limit per rank (``JobSubmit.memory``; 0: the agent's).
    memory: int = 0
    # What the rank needs installed (``JobSubmit.requirements``): the agent builds it first.
    requirements: list[str] = []
    # Who submitted the job (the volunteer's ``vpool-agent status`` shows it).
    user: str = ""
    # The job's failure mode (``JobSubmit.on_failure``), told to the rank in its welcome.
    on_failure: str = "transparent"
    # Processes made by ``MPI.Comm.Spawn`` (``size`` is then the job's universe: every rank
    # number the job may ever use, for routes and tokens). ``world``: the job ranks of this
    # process's ``COMM_WORLD`` in order (empty: 0 to size - 1). ``parent``: the job ranks of the
    # group that spawned it, and ``parent_ctx`` the context they agreed for the
    # intercommunicator (``MPI.Comm.Get_parent``); empty for a process not spawned.
    # ``command``: what the process runs (Python's arguments after the interpreter, e.g.
    # ``["-m", "mpi4py.futures.server"]``) instead of ``entry`` and ``args``.
    world: list[int] = []
    parent: list[int] = []
    parent_ctx: int = 0
    command: list[str] = []
    # The job's universe (``JobSubmit.universe``: processes alive at once; MPI.UNIVERSE_SIZE);
    # 0: ``size``.
    universe: int = 0


class SpawnAsk(msgspec.Struct, frozen=True):
    """Agent -> coordinator: rank ``rank`` (incarnation ``incarnation``) of ``job`` is the root of
    an ``MPI.Comm.Spawn``, its ``seq``-th (counted by the rank: a replaying incarnation asks the
    same question again and gets the same answer). Start ``maxprocs`` processes, at least
    ``least`` of them (MPI's "soft" info; ``least == maxprocs``: exactly), running ``command``
    (Python's arguments after the interpreter). ``parent``: the job ranks of the spawning
    communicator's group; ``ctx``: the context id they agreed for the intercommunicator."""

    job: int
    rank: int
    incarnation: int
    seq: int
    command: list[str]
    maxprocs: int
    least: int
    parent: list[int]
    ctx: int
    # A lost process of this spawn is declared failed and the job's ranks told (as in the
    # ``REPORTING_MODES``), whatever the job's failure mode: a farm's master re-dispatches the
    # lost worker's tasks (``mpi4py.futures`` on the pool) instead of having it replayed.
    reported: bool = False


class SpawnAnswer(msgspec.Struct, frozen=True):
    """The job ranks of the new processes, in order (their ``COMM_WORLD``), or ``error`` (none
    started): the job's universe is full, the command is not a Python program, ..."""

    ranks: list[int] = []
    error: str = ""


class LeaseRequest(msgspec.Struct, frozen=True):
    free_slots: int
    wait: float = 20.0


class LeaseResponse(msgspec.Struct, frozen=True):
    leases: list[Lease]


class RankState(msgspec.Struct, frozen=True):
    job: int
    rank: int
    incarnation: int
    state: str  # starting | running | suspended (frozen: its volunteer's machine is in use)
    replay_dets: int = 0  # determinants this incarnation was given to replay (0: fresh start)
    restored_from: int = -1  # the checkpoint this incarnation was restored from (-1: none)
    suspended_for: float = 0.0  # seconds it has been frozen (state "suspended")


class IsolationReport(msgspec.Struct, frozen=True):
    """How an agent isolates the ranks it runs (``vpool-agent selftest`` shows the same).

    ``level``: "sandbox" (namespaces, no network, seccomp, a cgroup with limits per rank),
    "sandbox-rlimits" (the same, but no cgroup could be had: no memory or process limit,
    limits by rlimits only) or "none" (ranks run as the agent's user: only agents whose
    volunteer allowed it, and only jobs that accept it, ``JobSubmit.unsandboxed``)."""

    level: str
    detail: str = ""  # why the level is not stronger ("" for "sandbox")
    rank_memory: int = 0  # bytes one rank may use here (0: no limit)
    rank_processes: int = 0
    rank_disk: int = 0
    checkpoints: bool = False  # sandboxed ranks can be checkpointed and restored here
    probes: dict[str, str] = {}  # what the last selftest saw, probe -> outcome


class AgentHeartbeat(msgspec.Struct, frozen=True):
    ranks: list[RankState]
    free_slots: int
    # Checkpoint capability: CRIU's version when ``criu check`` passed at start ("" = none),
    # and the environment fingerprint an image made here needs where it is restored.
    criu: str = ""
    fingerprint: str = ""
    # Seconds the coordinator may hold the answer while none of ``ranks`` has to stop (at most
    # its heartbeat interval), so that a stop order reaches the agent the moment it exists.
    wait: float = 0.0
    # Ids of the ``CheckpointOrder``s received: the coordinator hands an order out again in
    # every answer until a heartbeat acknowledges it (at-least-once; the agent de-duplicates).
    checkpoint_acks: list[int] = []
    # How this agent isolates its ranks (None: an agent from before sandboxes, or one that
    # has not found out yet: it takes no leases until it has).
    isolation: IsolationReport | None = None
    # The environments built here (``vpool.requirements.key`` of their requirements): the
    # coordinator places jobs that need one where it already is. ``env_fingerprints``: the
    # fingerprints checkpoint images of ranks in those environments have here (this agent's
    # fingerprint with the environment's contents), so it may restore them.
    environments: list[str] = []
    env_fingerprints: list[str] = []
    # What the volunteer's preferences make of the agent now (``worker_agent.manners``):
    # "available" (takes work), "suspended" (its owner uses the machine, it runs on battery,
    # it is outside its hours or paused: its ranks are frozen and it asks for no work) or
    # "leaving" (stopping cleanly: what it still runs is being checkpointed and handed back).
    # ``activity_reason`` says why, for people ("the owner is using the machine").
    activity: str = "available"
    activity_reason: str = ""
    # The failed ranks the agent knows of (``AgentHeartbeatResponse.failed``, as last told): a
    # held answer goes out at once when the coordinator knows more.
    failed_known: list[JobFailures] = []


class StopOrder(msgspec.Struct, frozen=True):
    job: int
    rank: int
    incarnation: int
    reason: str


class JobFailures(msgspec.Struct, frozen=True):
    """The ranks of ``job`` declared failed so far, every one of them already fenced at every
    relay of the job (nothing it sends reaches anybody): the agent tells its ranks of the job
    (``messages.Failed``)."""

    job: int
    ranks: list[int]


class CheckpointOrder(msgspec.Struct, frozen=True):
    job: int
    rank: int
    incarnation: int
    id: int = 0  # the order's id, acknowledged in ``AgentHeartbeat.checkpoint_acks`` (0: none)


class AgentHeartbeatResponse(msgspec.Struct, frozen=True):
    stop: list[StopOrder]
    agent_token: str = ""
    checkpoint: list[CheckpointOrder] = []  # ranks to checkpoint now (``vsdk checkpoint``)
    # Seconds a rank may stay suspended before the agent checkpoints it and hands it back to
    # be moved elsewhere (the pool's ``suspend_limit``; 0: the agent's own default).
    suspend_limit: float = 0.0
    # Failed ranks of the jobs whose ranks this agent runs, in jobs whose failure mode reports
    # failures (``REPORTING_MODES``).
    failed: list[JobFailures] = []


class OutputChunk(msgspec.Struct, frozen=True):
    job: int
    rank: int
    incarnation: int
    stream: Stream
    offset: int  # byte offset of ``data`` in this stream of this rank (idempotent re-sends)
    data: bytes


class OutputBatch(msgspec.Struct, frozen=True):
    chunks: list[OutputChunk]


class RankExit(msgspec.Struct, frozen=True):
    """A rank process ended. ``aborted`` when it called ``MPI.Abort(code)``. ``lost`` when it
    died of something that is not the program's doing (a signal the agent did not send, e.g.
    SIGKILL from the OOM killer or a volunteer): the coordinator restarts it instead of failing
    the job."""

    job: int
    rank: int
    incarnation: int
    code: int
    aborted: bool = False
    message: str = ""
    lost: bool = False


class CheckpointFailed(msgspec.Struct, frozen=True):
    """An agent could not make or store checkpoint ``ckpt`` of a rank (event
    ``checkpoint_failed``); the rank runs on."""

    job: int
    rank: int
    incarnation: int
    ckpt: int
    message: str


class RestoreAttempt(msgspec.Struct, frozen=True):
    ckpt: int
    reason: str  # why this image was not used


class RestoreReport(msgspec.Struct, frozen=True):
    """How an incarnation started: from image ``ckpt``, or (-1) from the beginning with replay.
    ``tried``: the images given in the lease that were not used, and why."""

    job: int
    rank: int
    incarnation: int
    ckpt: int
    tried: list[RestoreAttempt] = []
    message: str = ""


class RankProblem(msgspec.Struct, frozen=True):
    """The agent lost something a rank needs (e.g. its relay connection dropped). ``relay``
    names the relay of the job it could not reach when that is the cause: the coordinator
    restarts the rank with backoff, against the relay's outage rather than the job's restart
    budget.

    ``failure``: how the rank failed in words any agent would use for the same failure (no
    agent name, path or time; "" when the problem is not one that repeats): the coordinator
    ends the job when a rank fails the same way on two agents (``scheduler.RestartPolicy``).
    ``unopened_from``: the relay that pushed a sealed message that did not open here (an
    integrity failure, counted against that relay and this agent, not as a lost rank)."""

    job: int
    rank: int
    incarnation: int
    message: str
    relay: str = ""
    failure: str = ""
    unopened_from: str = ""


class RelayRegister(msgspec.Struct, frozen=True):
    name: str
    host: str
    port: int
    software: str = ""


class RelayRegistered(msgspec.Struct, frozen=True):
    signing_key: str
    heartbeat_interval: float


class RelayLoad(msgspec.Struct, frozen=True):
    connections: int = 0
    ranks: int = 0
    messages_stored: int = 0
    bytes_stored: int = 0
    disk_free: int = 0  # bytes free on the disk of its logs and images (0: not reported)


class RankFence(msgspec.Struct, frozen=True):
    """Incarnation ``incarnation`` of rank ``rank`` of ``job`` is declared failed."""

    job: int
    rank: int
    incarnation: int


class RankLost(msgspec.Struct, frozen=True):
    job: int
    rank: int
    incarnation: int
    reason: str


MAX_HELD_JOBS = 10_000


class RelayHeartbeat(msgspec.Struct, frozen=True):
    name: str
    load: RelayLoad
    # The jobs whose logs or images the relay holds (at most MAX_HELD_JOBS): the answer says
    # which of them are over, however long ago, or never ran here (their files are deleted).
    jobs: list[int] = []
    # The fences of ``RelayHeartbeatResponse.fence`` the relay has put up.
    fenced: list[RankFence] = []


class RelayHeartbeatResponse(msgspec.Struct, frozen=True):
    finished_jobs: list[int] = []
    # Ranks declared failed (``REPORTING_MODES``, reported spawns): the relay refuses their
    # incarnation ``incarnation`` and older from now on, stops the current attachment, and says
    # so in its next heartbeat (sent at once). Repeated until it has.
    fence: list[RankFence] = []


class RelayLost(msgspec.Struct, frozen=True):
    name: str
    lost: list[RankLost]


class RelayRefused(msgspec.Struct, frozen=True):
    """A relay refuses a job's deposits for good: its logs there reached the relay's
    ``job_log_quota`` (``quota_exceeded``), or the relay's disk is down to its
    ``disk_reserve`` (``disk_full``). The coordinator fails the job with ``message``."""

    name: str
    job: int
    code: str
    message: str


class RelayDiverged(msgspec.Struct, frozen=True):
    """A relay found a re-sent message whose digest differs from the logged one: the program
    is not deterministic. The coordinator fails the job with ``message``."""

    name: str
    job: int
    rank: int  # the sender whose re-sent message differs
    incarnation: int
    message: str


class RelayValidated(msgspec.Struct, frozen=True):
    """A relay's verdict on a validating incarnation (``RankClaims.validating``: a rank
    re-executed from its log to check the original run). ``agreed``: every message it sent to
    ranks whose log this relay holds had the logged digest, it sent none the original did not,
    and it left none out (checked when it detached). Otherwise ``message`` says what differed;
    the relay reports a disagreement at once and drops the incarnation's further deposits."""

    name: str
    job: int
    rank: int
    incarnation: int
    agreed: bool
    message: str = ""


class CheckpointAccepted(msgspec.Struct, frozen=True):
    """The coordinator's answer to ``RelayCheckpoint``. ``trim``: the relay may drop the rank's
    log behind the image. False for a job that is validated by replay: a validating
    re-execution starts from the beginning and needs the whole log."""

    trim: bool = True


class RelayCheckpoint(msgspec.Struct, frozen=True):
    """A relay's store committed image ``ckpt`` of (job, rank). ``retained``: the images of this
    rank it keeps, newest first (older ones are deleted). The relay drops the rank's log entries
    behind the oldest retained image only after this report is accepted (``trimmed`` then says
    the log no longer starts at the beginning). A 409 answer (stale incarnation, job over)
    tells the relay to delete the image instead."""

    name: str
    job: int
    rank: int
    incarnation: int
    ckpt: int
    size: int
    digest: str  # hex digest of the image (protocol.ckptdigest: BLAKE3-256 of its skeleton)
    fingerprint: str
    received: dict[int, int]
    dets: int
    meta: bytes
    retained: list[int]
    trimmed: bool = False
