"""Starting an incarnation from a checkpoint image (docs/internals.md, "Checkpoints", Agent).

For each image of ``Lease.restore``, newest first, until one runs:

1. usable here? CRIU present, the image's environment fingerprint equal to this agent's, its
   manifest's rank directory under ``rank_root``;
2. fetch it from the store of ``lease.relays[ref.relay]`` (``CkptGet`` with the new rank
   token) into ``ckpt_image.ImageReader.unpack``: CRIU images to a scratch directory, the rank
   directory back to the path it had (a stale directory there is removed first);
3. two FIFOs for the restored process's stdout and stderr (the agent holds the read ends, and
   write ends of its own so that they read as empty, not ended, until the process ends), and
   ``.vpool-restore.json`` in the rank directory for the restored runtime;
4. attach to the relays with the image's counters (``Attach.received``, ``dets_from``);
5. run ``criu.restore_command`` (``unshare --pid --fork`` ... ``restore_init``) and wait for
   the restored process to appear in its process tree.

Whatever fails before the process runs is one ``RestoreAttempt`` and the next image is tried
(the relays are detached and the rank's counters reset first).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from vpool import paths
from vpool.protocol.api import CheckpointRef, RestoreAttempt
from vpool.protocol.rank_link import Delivery
from vpool.worker_agent import ckpt_image, criu, sandbox, sandboxed
from vpool.worker_agent.bundle import Snapshot
from vpool.worker_agent.checkpoints import image_fingerprint, job_key
from vpool.worker_agent.errors import AgentError, RelayLinkError
from vpool.worker_agent.local_ranks import LocalRank, Outbox
from vpool.worker_agent.store_client import Aborter, run_in_thread

if TYPE_CHECKING:
    from vpool.worker_agent.ranks import Prepared, RankServices

log = logging.getLogger("vpool.agent")

RESTORE_FILE = ".vpool-restore.json"
SNAPSHOT_FILE = ".vpool-snapshot.json"  # the work directory as extracted (results diff)
FETCH_TIMEOUT = 600.0
RESTORE_TIMEOUT = 120.0  # s for criu restore to bring the process back
_POLL = 0.02
_CAPABILITY_TIMEOUT = 300.0


class RestoreError(AgentError):
    """One image could not be restored (the reason goes into a ``RestoreAttempt``)."""


@dataclass
class Restored:
    """A rank process brought back from image ``ckpt``, running."""

    ckpt: int
    prepared: Prepared
    process: trio.Process  # the unshare process (the restored one lives in its namespace)
    pid: int  # the restored process
    scratch: Path
    status_file: Path
    fifo_dir: Path
    stdout: trio.lowlevel.FdStream
    stderr: trio.lowlevel.FdStream
    holders: list[int]  # the agent's own write ends of the FIFOs
    out_offsets: dict[str, int] = field(default_factory=dict)
    box: sandboxed.Sandboxed | None = None  # its sandbox (a restore into one)

    def release_holders(self) -> None:
        """The process ended: let the output pump see the FIFOs end."""
        for fd in self.holders:
            try:
                os.close(fd)
            except OSError:
                pass
        self.holders = []

    def returncode(self) -> int | None:
        """The restored process's exit status (negative: a signal), None when unknown."""
        return criu.read_status(self.status_file)

    def signal(self, sig: int) -> None:
        """Signal the restored process; SIGKILL also ends its whole namespace."""
        if self.box is not None:
            if sig == signal.SIGKILL:
                self.box.signal(sig)
            else:
                try:
                    os.kill(self.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            return
        for pid, group in ((self.pid, False), (self.process.pid, True)):
            if group and sig != signal.SIGKILL:
                continue
            try:
                os.killpg(pid, sig) if group else os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def cleanup(self) -> None:
        self.release_holders()
        shutil.rmtree(self.scratch, ignore_errors=True)
        shutil.rmtree(self.fifo_dir, ignore_errors=True)


Attach = Callable[["RankServices", LocalRank], Awaitable[None]]


async def restore_rank(
    svc: RankServices, rank: LocalRank, attach: Attach
) -> tuple[Restored | None, list[RestoreAttempt]]:
    """Try the lease's images newest first; the running process, or None, and the images
    that were not used with why. Raises ``RelayLinkError`` when attaching fails (not the
    image's fault)."""
    tried: list[RestoreAttempt] = []
    for ref in sorted(rank.lease.restore, key=lambda r: r.ckpt, reverse=True):
        if rank.stop_requested.is_set():
            tried.append(RestoreAttempt(ckpt=ref.ckpt, reason=f"stopped: {rank.stop_reason}"))
            continue
        try:
            restored = await _restore_one(svc, rank, ref, attach)
        except RelayLinkError:
            raise
        except Exception as exc:
            reason = _describe(exc)
            if isinstance(exc, criu.CriuError):
                reason = f"criu: {reason}"
            elif isinstance(exc, ckpt_image.ImageError):
                reason = f"bad image: {reason}"
            log.warning("%s: checkpoint %d not restored: %s", rank.label, ref.ckpt, reason)
            tried.append(RestoreAttempt(ckpt=ref.ckpt, reason=reason))
            continue
        return restored, tried
    return None, tried


def usable(
    svc: RankServices, ref: CheckpointRef, relays: int, rank: LocalRank | None = None
) -> str:
    """Why image ``ref`` cannot be restored on this agent ("" = it can be tried); for
    ``rank``, in its job environment if it has one."""
    cap = svc.capability
    if not cap.criu:
        return "this agent has no usable CRIU"
    here = image_fingerprint(svc, rank) if rank is not None else cap.fingerprint
    if ref.fingerprint != here:
        return (
            f"the image was made in another environment (fingerprint {ref.fingerprint[:12]}, "
            f"this agent {here[:12]})"
        )
    if not 0 <= ref.relay < relays:
        return f"the image names relay {ref.relay}, which the lease does not have"
    return ""


def manifest_paths(meta: bytes, rank_root: Path | None) -> tuple[dict[str, Any], Path, Path, Path]:
    """The image's manifest and its rank, work and home directories, which must lie inside
    ``rank_root`` (a directory the agent removes before unpacking), or, with None (a
    sandboxed image), be the sandbox's own ``/vpool/rank``."""
    try:
        manifest = msgspec.msgpack.decode(meta)
    except msgspec.DecodeError as exc:
        raise RestoreError(f"unreadable manifest: {exc}") from exc
    if not isinstance(manifest, dict):
        raise RestoreError("the manifest is not a map")
    try:
        rank_dir = Path(str(manifest["rank_dir"]))
        work = Path(str(manifest["work"]))
        home = Path(str(manifest["home"]))
    except KeyError as exc:
        raise RestoreError(f"the manifest lacks {exc}") from exc
    if rank_root is None:
        if rank_dir != Path(sandbox.RANK_DIR):
            raise RestoreError(f"the image's rank directory {rank_dir} is not a sandbox's")
        root = Path(sandbox.ROOT)
    else:
        root = Path(os.path.abspath(rank_root))
    if (
        not rank_dir.is_absolute()
        or Path(os.path.abspath(rank_dir)).parent != root
        or ".." in rank_dir.parts
    ):
        raise RestoreError(f"the image's rank directory {rank_dir} is not under {root}")
    for sub in (work, home):
        if Path(os.path.abspath(sub)).parent != Path(os.path.abspath(rank_dir)):
            raise RestoreError(f"{sub} is not inside the image's rank directory {rank_dir}")
    return manifest, rank_dir, work, home


async def _restore_one(
    svc: RankServices, rank: LocalRank, ref: CheckpointRef, attach: Attach
) -> Restored:
    from vpool.worker_agent.ranks import Prepared

    lease, settings = rank.lease, svc.settings
    with trio.move_on_after(_CAPABILITY_TIMEOUT):
        await svc.capability.ready.wait()
    why = usable(svc, ref, len(lease.relays), rank)
    if why:
        raise RestoreError(why)
    boxed = svc.isolation.on
    root = settings.rank_root_path
    manifest, rank_dir, work, home = manifest_paths(ref.meta, None if boxed else root)
    if boxed:
        # Anywhere of this agent's own: the sandbox shows it at /vpool/rank.
        await trio.to_thread.run_sync(paths.private_dir, root)
        prefix = f"{lease.job_uid or lease.job}-{lease.rank}-{lease.incarnation}-"
        rank_dir = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        work, home = rank_dir / work.name, rank_dir / home.name
    scratch_root = settings.scratch_path
    scratch_root.mkdir(parents=True, exist_ok=True, mode=0o700)
    scratch = Path(
        tempfile.mkdtemp(prefix=f"restore-{lease.job}-{lease.rank}-{ref.ckpt}-", dir=scratch_root)
    )
    fifo_dir: Path | None = None
    holders: list[int] = []
    readers: list[int] = []
    process: trio.Process | None = None
    box = None
    attached = False
    try:
        images = scratch / "images"
        images.mkdir()
        if not boxed:
            await _remove_stale(rank_dir)
            rank_dir.parent.mkdir(parents=True, exist_ok=True)
        await _fetch(svc, rank, ref, images, rank_dir)
        # FIFOs for the restored process's stdout and stderr.
        fifo_dir = Path(tempfile.mkdtemp(prefix="fifo-", dir=settings.work_path))
        fifos = [fifo_dir / "stdout", fifo_dir / "stderr"]
        for path in fifos:
            os.mkfifo(path, 0o600)
            readers.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
            holders.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        # Rank 0's stdin file (the restored process reopens it where it stood at the fork).
        stdin = await svc.blobs.get(lease.stdin) if lease.stdin and lease.rank == 0 else None
        seen = {  # the paths as the restored process sees them
            "socket": sandbox.SOCKET if boxed else str(svc.socket_path),
            "stdout": f"{sandbox.IO_DIR}/stdout" if boxed else str(fifos[0]),
            "stderr": f"{sandbox.IO_DIR}/stderr" if boxed else str(fifos[1]),
            "stdin": None if stdin is None else sandbox.STDIN if boxed else str(stdin),
        }
        info = {"checkpoint": ref.ckpt, "secret": rank.secret, "incarnation": lease.incarnation}
        fd = os.open(rank_dir / RESTORE_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(info | seen, f)
        before = _load_snapshot(rank_dir / SNAPSHOT_FILE, work)
        # The relays resume after the image's counters.
        rank.delivery = Delivery({int(k): int(v) for k, v in ref.received.items()}, ref.dets)
        rank.restored_from = ref.ckpt
        attached = True
        await attach(svc, rank)
        status_file = scratch / "status"
        box: sandboxed.Sandboxed | None = None
        with open(scratch / "restore.log", "wb") as restore_log:  # noqa: ASYNC230 - an fd
            if boxed:
                box = await _start_boxed(svc, rank, scratch, rank_dir, fifo_dir, stdin, restore_log)
                process = box.process
            else:
                argv = criu.restore_command(images, status_file, criu=settings.criu)
                process = await trio.lowlevel.open_process(
                    argv,
                    cwd=work,
                    stdin=subprocess.DEVNULL,
                    stdout=restore_log,
                    stderr=subprocess.STDOUT,
                    # Its own process group, in the agent's session: see ranks.py.
                    process_group=0,
                )
        pid = await _wait_restored(process, images, status_file, scratch / "restore.log")
        out_offsets = manifest.get("out_offsets") or {}
        restored = Restored(
            ckpt=ref.ckpt,
            prepared=Prepared(rank_dir, work, home, work, stdin, before),
            process=process,
            pid=pid,
            scratch=scratch,
            status_file=status_file,
            fifo_dir=fifo_dir,
            stdout=trio.lowlevel.FdStream(readers[0]),
            stderr=trio.lowlevel.FdStream(readers[1]),
            holders=holders,
            out_offsets={k: int(v) for k, v in dict(out_offsets).items()},
            box=box,
        )
        log.info("restored %s from checkpoint %d (pid %d)", rank.label, ref.ckpt, pid)
        return restored
    except BaseException:
        with trio.move_on_after(10, shield=True):
            if box is not None:
                await box.aclose()
            elif process is not None:
                _killpg(process.pid)
                await process.wait()
            for fd in holders + readers:
                os.close(fd)
            if attached:
                await _reset(rank)
            shutil.rmtree(scratch, ignore_errors=True)
            if fifo_dir is not None:
                shutil.rmtree(fifo_dir, ignore_errors=True)
            if boxed:
                # A directory of this attempt's own (the next image gets another).
                shutil.rmtree(rank_dir, ignore_errors=True)
        raise


async def _start_boxed(
    svc: RankServices,
    rank: LocalRank,
    scratch: Path,
    rank_dir: Path,
    fifo_dir: Path,
    stdin: Path | None,
    restore_log: Any,
) -> sandboxed.Sandboxed:
    """Start ``restore_init`` as pid 1 of a new sandbox like the one the image was made in."""
    settings, lease = svc.settings, rank.lease
    try:
        return await sandboxed.start_restore(
            svc.isolation,
            sandbox.Mounts(
                rank_dir, svc.socket_path, stdin=stdin, io_dir=fifo_dir, env_dir=rank.env_site
            ),
            scratch,
            python=settings.python_path,
            criu=settings.criu,
            name=f"{lease.job}-{lease.rank}-{lease.incarnation}-r{os.getpid()}",
            limits=svc.limits_for(lease),
            log=restore_log.fileno(),
        )
    except sandboxed.SandboxStartError as exc:
        raise RestoreError(str(exc)) from exc


async def _fetch(
    svc: RankServices, rank: LocalRank, ref: CheckpointRef, images: Path, rank_dir: Path
) -> None:
    lease = rank.lease
    reader = ckpt_image.ImageReader(
        job_key(lease),
        job=lease.job,
        rank=lease.rank,
        ckpt=ref.ckpt,
        size=ref.size,
        digest=bytes.fromhex(ref.digest),
    )
    home = lease.relays[ref.relay]

    def fetch(aborter: Aborter) -> None:
        # One thread reads, checks and unpacks (ImageReader): no hand-over per piece.
        with svc.open_store(home, aborter) as conn:
            info, chunks = conn.get(lease.token, ref.ckpt)
            if info.size != ref.size or info.digest.hex() != ref.digest:
                raise RestoreError(
                    f"the store holds another image {ref.ckpt} ({info.size} bytes) than the "
                    f"coordinator knows ({ref.size} bytes)"
                )
            reader.unpack(chunks, images, rank_dir)

    with trio.move_on_after(FETCH_TIMEOUT) as fetched:
        await run_in_thread(fetch)
    if fetched.cancelled_caught:
        raise RestoreError(f"fetching the image took more than {FETCH_TIMEOUT:g} s")


async def _wait_restored(
    process: trio.Process, images: Path, status_file: Path, log_file: Path
) -> int:
    """The pid of the restored process once criu is done with it (raises ``RestoreError``
    if restore ends otherwise)."""
    with trio.move_on_after(RESTORE_TIMEOUT):
        while True:
            if process.poll() is not None:
                status = criu.read_status(status_file)
                raise RestoreError(
                    f"restore ended (exit {process.returncode}, status {status}): {_tail(log_file)}"
                )
            pid = criu.restored_host_pid(process.pid, images)
            if pid is not None:
                return pid
            await trio.sleep(_POLL)
    raise RestoreError(f"criu restore took more than {RESTORE_TIMEOUT:g} s: {_tail(log_file)}")


async def _reset(rank: LocalRank) -> None:
    """Undo an attachment made with an image's counters, for the next image or a fresh start."""
    for link in rank.links:
        await link.detach(rank)
    rank.links = []
    rank.route = []
    rank.delivery = Delivery()
    rank.replay_dets = 0
    rank.replay_sent = {}
    rank.deposited = {}
    rank.restored_from = -1
    rank.outbox = Outbox()  # what the relays pushed for the image's counters is moot


async def _remove_stale(rank_dir: Path) -> None:
    """Move a directory left at ``rank_dir`` aside and delete it."""

    def remove() -> None:
        if not os.path.lexists(rank_dir):
            return
        aside = rank_dir.with_name(f"{rank_dir.name}.stale-{os.getpid()}-{id(rank_dir)}")
        os.rename(rank_dir, aside)
        shutil.rmtree(aside, ignore_errors=True)

    await trio.to_thread.run_sync(remove)


def save_snapshot(path: Path, before: Snapshot) -> None:
    path.write_text(json.dumps({k: list(v) for k, v in before.items()}))


def _load_snapshot(path: Path, work: Path) -> Snapshot:
    """The work directory as first extracted. An image's files come back with their mtime
    cut to what the image format keeps: an entry whose size matches and whose mtime agrees
    to the second takes the file's current mtime, so it does not count as a result."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out: Snapshot = {}
    for rel, (size, mtime_ns) in raw.items():
        try:
            st = (work / rel).stat()
        except OSError:
            out[rel] = (size, mtime_ns)
            continue
        if st.st_size == size and st.st_mtime_ns // 10**9 == mtime_ns // 10**9:
            out[rel] = (size, st.st_mtime_ns)
        else:
            out[rel] = (size, mtime_ns)
    return out


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, n: int = 600) -> str:
    try:
        data = path.read_bytes()[-n:]
    except OSError:
        return ""
    return data.decode(errors="replace").strip().replace("\n", " | ")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return str(exc) or type(exc).__name__
