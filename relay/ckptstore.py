"""The relay's checkpoint store: encrypted CRIU images of ranks, uploaded and fetched by agents.

An agent opens a TCP connection to the relay's port and sends ``STORE_PREAMBLE`` in plain
bytes; then TLS starts as on an agent connection (none with ``insecure_tcp``), then
``Hello(role="store", token=agent token)``, answered by ``Welcome(max_payload=STORE_MAX_CHUNK,
bulk=True)``. Then, one after the other, any number of::

    put:  agent CkptPut(token, ckpt, ..., bulk, mac_key), CkptChunk(ckpt)+payload ...,
          CkptEnd(ckpt, size, digest, mac)
          store CkptStored(ckpt, retained)      or Error(code, job, rank)
    get:  agent CkptGet(token, ckpt)
          store CkptInfo, CkptChunk(ckpt)+payload (1 MiB) ..., CkptEnd   or Error(code, job, rank)

``server`` tells the connections apart by their first byte; ``storesupervisor`` hands each
store connection to the relay's store process, a niced process of its own (``storeworker``),
which serves it in a thread (``storethread.StoreThread``: a blocking socket costs a third of
the CPU of trio's ``SSLStream`` per image), at most ``store_threads`` at once; what a session
needs of the relay's state it asks over the link (``storelink``), answered by this module's
``CheckpointStore`` methods in the relay's loop. A
refused put (``fenced``, ``stale_ckpt``, ``busy``, ``job_finished``, ``storage_error``) is
answered at once; the store then drops that image's chunks and its ``CkptEnd``, and the
connection goes on. A put whose bytes do not match ``CkptEnd`` gets ``corrupt`` after the end,
nothing is committed, and the connection goes on too (so does a get's ``not_found`` or
``fenced``). Errors about the connection itself (a bad token, a frame out of order, an image
over ``checkpoint_max_bytes``, ``store_idle_timeout`` without a frame) carry ``rank=-1`` and
close it.

Bulk payloads. The image is ciphertext already: every chunk is sealed with AES-256-GCM under
the job's checkpoint key, which the relay never has (``worker_agent.ckpt_image``). Sending it
through TLS again cost 0.2 s of CPU per 250 MB on each side on the 2-core test machine, a fifth
of a checkpoint's whole CPU (``benchmarks/checkpoint_costs.py``), for no secrecy gained. So the
store says ``Welcome(bulk=True)`` (setting ``store_bulk``), and a put with
``CkptPut(bulk=True)`` sends each ``CkptChunk``'s prefix and header through TLS and its payload
right after, on the TCP stream beneath TLS (TLS reads exactly one record at a time, so the two
never mix). What TLS still guarantees: the peer's identity, the tokens, every message, and each
payload's length and place; the payload bytes themselves are checked by the transport MAC
(Poly1305 under the one-time ``CkptPut.mac_key``, both sent through TLS, so nobody on the way
can forge it; ``protocol.ckptdigest``): bytes changed on the way get ``corrupt`` and nothing is
committed, as a broken TLS record would have ended the upload. The store also computes the
image's digest (its skeleton's, the same module) and refuses an image whose ``CkptEnd`` says
another. Gets stay inside TLS.

On disk, ``data_dir/jobs/<job>/<rank>/ckpt/``: ``<ckpt>.img`` (the bytes as uploaded),
``<ckpt>.json`` (the manifest: the commit point, written after the image), and
``<ckpt>.<random>.part`` while an upload runs. A restarted relay deletes parts and images
without a manifest.

After a commit the store keeps the newest ``checkpoint_keep`` images of the rank and reports
the image to the coordinator (``RelayCheckpoint``; ``registry`` posts the reports, retrying
while the coordinator is unreachable). Once accepted (``accepted`` in the manifest) the rank's
log is trimmed (``relay.trim``) to what the retained accepted images all have; a 409 answer
deletes the image. The coordinator may accept an image and forbid the trim
(``CheckpointAccepted.trim`` False, ``trim`` in the manifest): a job validated by replay
re-executes ranks from the beginning, so their logs stay whole while such an image is retained.
A relay without a coordinator (tests) counts every commit as accepted.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from vpool.protocol.api import RelayCheckpoint
from vpool.protocol.errors import ErrorCode
from vpool.protocol.relay_core import Refused, TrimPoint
from vpool.reasons import describe
from vpool.relay import log as logfiles
from vpool.relay import trim

if TYPE_CHECKING:
    from vpool.relay.hub import Hub

logger = logging.getLogger(__name__)

Key = tuple[int, int]
# The first bytes of a store connection, before TLS (shared with the agent's store client). A
# TLS ClientHello starts with 0x16 and an agent's plain frame with a small length: never "V".
STORE_PREAMBLE = b"VPSTORE\x01"
# Largest CkptChunk payload an agent may send (it sends 1 MiB ciphertext chunks).
STORE_MAX_CHUNK = 8 * 1024 * 1024
# Payload of the chunks the store sends.
READ_CHUNK = 1024 * 1024
IMAGE = ".img"
MANIFEST = ".json"
PART = ".part"


def ckpt_dir(data_dir: Path, job: int, rank: int) -> Path:
    return logfiles.box_dir(data_dir, job, rank) / "ckpt"


@dataclass
class Image:
    """A committed image and its manifest."""

    job: int
    rank: int
    ckpt: int
    incarnation: int
    size: int
    digest: bytes  # the image's digest (``protocol.ckptdigest``)
    received: dict[int, int]
    dets: int
    fingerprint: str
    meta: bytes
    accepted: bool = False
    # The coordinator let the rank's log be trimmed behind it (``CheckpointAccepted.trim``).
    trim: bool = True
    directory: Path = field(default=Path("."), repr=False)
    # Set once the coordinator's answer to its report is in (or the report was dropped).
    reported: trio.Event | None = field(default=None, repr=False, compare=False)

    @property
    def path(self) -> Path:
        return self.directory / f"{self.ckpt}{IMAGE}"

    @property
    def manifest(self) -> Path:
        return self.directory / f"{self.ckpt}{MANIFEST}"

    def to_json(self) -> bytes:
        body = {
            "job": self.job,
            "rank": self.rank,
            "ckpt": self.ckpt,
            "incarnation": self.incarnation,
            "size": self.size,
            "digest": self.digest.hex(),
            "received": {str(k): v for k, v in self.received.items()},
            "dets": self.dets,
            "fingerprint": self.fingerprint,
            "meta": base64.b64encode(self.meta).decode(),
            "accepted": self.accepted,
            "trim": self.trim,
        }
        return json.dumps(body).encode()

    @classmethod
    def from_json(cls, data: bytes, directory: Path) -> Image:
        raw: dict[str, Any] = json.loads(data)
        if "digest" not in raw and "sha256" in raw:
            raise ValueError(
                "its image was digested with SHA-256 (before BLAKE3): no restore takes it"
            )
        return cls(
            job=int(raw["job"]),
            rank=int(raw["rank"]),
            ckpt=int(raw["ckpt"]),
            incarnation=int(raw["incarnation"]),
            size=int(raw["size"]),
            digest=bytes.fromhex(raw["digest"]),
            received={int(k): int(v) for k, v in raw["received"].items()},
            dets=int(raw["dets"]),
            fingerprint=str(raw["fingerprint"]),
            meta=base64.b64decode(raw["meta"]),
            accepted=bool(raw["accepted"]),
            trim=bool(raw.get("trim", True)),  # manifests from before it: trimmed as accepted
            directory=directory,
        )


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(img: Image) -> None:
    tmp = img.directory / f"{img.ckpt}{MANIFEST}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, img.to_json())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, img.manifest)
    _fsync_dir(img.directory)


def report_settled(img: Image) -> None:
    """The report of ``img`` is answered or dropped: whoever waits for it goes on."""
    if img.reported is not None:
        img.reported.set()


def delete_image(img: Image) -> None:
    # The manifest first: an image file without one is an unfinished commit, swept at start.
    for path in (img.manifest, img.path):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def trim_target(images: list[Image]) -> tuple[dict[int, int], int] | None:
    """What every accepted image of a rank has: per source the lowest ``received``, and the
    lowest ``dets`` (images of different incarnations need not be ordered like their ids).
    None while one of them was accepted without a trim: the log stays whole."""
    done = [img for img in images if img.accepted]
    if not done or not all(img.trim for img in done):
        return None
    sources = {src for img in done for src in img.received}
    received = {src: min(img.received.get(src, 0) for img in done) for src in sources}
    return received, min(img.dets for img in done)


class CheckpointStore:
    """Images of every rank homed here, their retention and reports (module docstring)."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.images: dict[Key, dict[int, Image]] = {}
        self.nbytes = 0
        self.job_nbytes: Counter[int] = Counter()  # per job: what its images take here
        self.uploading: set[Key] = set()
        # Without a coordinator, commits count as accepted at once.
        self.reporting = bool(hub.settings.coordinator_url)
        self.reports: list[Image] = []
        self.reports_ready = trio.Event()
        from vpool.relay.storesupervisor import StoreSupervisor

        self.supervisor = StoreSupervisor(self)

    # -- index ------------------------------------------------------------------------------

    def load(self) -> None:
        """Index the images left by an earlier run, sweeping unfinished uploads and commits,
        and finish trims a kill interrupted (blocking; called from ``Hub.load``)."""
        jobs = self.hub.data_dir / "jobs"
        for directory in sorted(jobs.glob("*/*/ckpt")) if jobs.is_dir() else []:
            names = {p.name for p in directory.iterdir()}
            for name in sorted(names):
                path = directory / name
                stem = name.split(".", 1)[0]
                if name.endswith((PART, ".tmp")) or (
                    name.endswith(IMAGE) and f"{stem}{MANIFEST}" not in names
                ):
                    logger.warning("deleting unfinished checkpoint file %s", path)
                    path.unlink()
                    continue
                if not name.endswith(MANIFEST):
                    continue
                try:
                    img = Image.from_json(path.read_bytes(), directory)
                except (OSError, ValueError, KeyError) as exc:
                    logger.warning(
                        "deleting unreadable checkpoint manifest %s and its image: %s",
                        path,
                        describe(exc),
                    )
                    path.unlink()
                    (directory / f"{stem}{IMAGE}").unlink(missing_ok=True)
                    continue
                if f"{stem}{IMAGE}" not in names:
                    path.unlink()
                    continue
                self._add(img)
        for key, imgs in sorted(self.images.items()):
            for img in sorted(imgs.values(), key=lambda i: i.ckpt):
                if not img.accepted:
                    if self.reporting:
                        self.reports.append(img)
                    else:
                        img.accepted = True
            self._trim_now(key)
        # ``reports`` now lists the images to report again (a worker thread must not set the
        # trio Event; the reporting task looks at the list before waiting).

    def _add(self, img: Image) -> None:
        self.images.setdefault((img.job, img.rank), {})[img.ckpt] = img
        self.nbytes += img.size
        self.job_nbytes[img.job] += img.size

    def _remove(self, img: Image) -> bool:
        imgs = self.images.get((img.job, img.rank))
        if imgs is None or imgs.get(img.ckpt) is not img:
            return False
        del imgs[img.ckpt]
        if not imgs:
            del self.images[(img.job, img.rank)]
        self.nbytes -= img.size
        self.job_nbytes[img.job] -= img.size
        return True

    def retained(self, key: Key) -> list[int]:
        return sorted(self.images.get(key, {}), reverse=True)

    def forget_job(self, job: int) -> None:
        """The job is over (its directory is being deleted with the logs)."""
        for key in [k for k in self.images if k[0] == job]:
            self.nbytes -= sum(img.size for img in self.images.pop(key).values())
        self.job_nbytes.pop(job, None)
        for img in self.reports:
            if img.job == job:
                report_settled(img)
        self.reports = [img for img in self.reports if img.job != job]

    # -- commit, retention, reports, trims --------------------------------------------------

    async def commit(self, img: Image) -> list[Image]:
        """An image is durable: index it, apply retention, queue its report. Returns the
        images deleted by retention."""
        self._add(img)
        keep = max(1, self.hub.settings.checkpoint_keep)
        imgs = self.images[(img.job, img.rank)]
        old = [imgs[c] for c in sorted(imgs, reverse=True)[keep:]]
        for o in old:
            self._remove(o)
        if old:
            await self._io(lambda: [delete_image(o) for o in old])
        if self.reporting:
            img.reported = trio.Event()
            self.reports.append(img)
            self.reports_ready.set()
        else:
            img.accepted = True
            await self._trim((img.job, img.rank))
        return old

    def take_reports(self) -> list[tuple[Image, RelayCheckpoint]]:
        """The reports to post, in commit order (images deleted meanwhile left out)."""
        out: list[tuple[Image, RelayCheckpoint]] = []
        for img in self.reports:
            key = (img.job, img.rank)
            if self.images.get(key, {}).get(img.ckpt) is not img:
                report_settled(img)
                continue
            box = self.hub.boxes.get(key)
            report = RelayCheckpoint(
                name=self.hub.name,
                job=img.job,
                rank=img.rank,
                incarnation=img.incarnation,
                ckpt=img.ckpt,
                size=img.size,
                digest=img.digest.hex(),
                fingerprint=img.fingerprint,
                received=img.received,
                dets=img.dets,
                meta=img.meta,
                retained=self.retained(key),
                trimmed=bool(box is not None and box.trim),
            )
            out.append((img, report))
        self.reports = []
        self.reports_ready = trio.Event()
        return out

    async def accepted(self, img: Image, *, trim: bool = True) -> None:
        """The coordinator accepted the report of ``img``: trim the rank's log, unless its
        answer says not to (``trim`` False)."""
        if self.images.get((img.job, img.rank), {}).get(img.ckpt) is not img:
            return
        img.accepted = True
        img.trim = trim
        report_settled(img)  # before the trim: the put's CkptStored need not wait for it
        await self._io(lambda: write_manifest(img))
        await self._trim((img.job, img.rank))

    async def report_outcome(self, img: Image, wait: float) -> bool | None:
        """Wait (at most ``wait`` s) for the coordinator's answer to the report of a just
        committed ``img``: True accepted (or no coordinator), False refused or dropped, None
        no answer in time (the image stays committed; its report is still retried)."""
        if img.reported is None:
            return True
        with trio.move_on_after(wait):
            await img.reported.wait()
            return img.accepted
        return None

    async def refused(self, img: Image) -> None:
        """The coordinator answered 409 (stale incarnation, job over): delete the image."""
        if self._remove(img):
            logger.info("job %d rank %d: image %d refused by the coordinator", *_ids(img))
            await self._io(lambda: delete_image(img))

    def _point(self, key: Key) -> tuple[TrimPoint, Any] | None:
        box = self.hub.boxes.get(key)
        target = trim_target(list(self.images.get(key, {}).values()))
        if box is None or box.dead or target is None:
            return None
        point = box.trim.merged(*target)
        if point == box.trim:
            return None
        return point, box

    async def _trim(self, key: Key) -> None:
        found = self._point(key)
        if found is None:
            return
        point, box = found
        await self._io(lambda: trim.write_point(box.io.log.directory, point))
        # The box may have been trimmed further, or deleted, while the point was written.
        if not box.dead and point.merged(box.trim.received, box.trim.dets) == point:
            trim.apply(self.hub, box, point)

    def _trim_now(self, key: Key) -> None:
        found = self._point(key)
        if found is not None:
            point, box = found
            trim.write_point(box.io.log.directory, point)
            trim.apply(self.hub, box, point)

    async def _io(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.hub.io_limiter)

    # -- connections ------------------------------------------------------------------------

    async def signing_key(self) -> Ed25519PublicKey | None:
        """The key tokens are verified with, once the relay has it (``handshake_timeout``)."""
        with trio.move_on_after(self.hub.settings.handshake_timeout):
            await self.hub.key_ready.wait()
        return self.hub.signing_key

    def begin_put(self, key: Key, incarnation: int, ckpt: int) -> Refused | None:
        """Why image ``ckpt`` of incarnation ``incarnation`` of the rank may not be uploaded
        now, or None: then the rank is marked as uploading (``busy`` to others) until
        ``commit_put`` or the upload's end."""
        job, rank = key
        if job in self.hub.finished:
            return Refused(ErrorCode.JOB_FINISHED, f"job {job} is over", job=job, rank=rank)
        imgs = self.images.get(key, {})
        top = self.hub.core.image_replaced(key, incarnation, [i.incarnation for i in imgs.values()])
        if top is not None:
            return Refused(
                ErrorCode.FENCED,
                f"image {ckpt} of incarnation {incarnation} of rank {rank} of job "
                f"{job}: incarnation {top} replaced it",
                job=job,
                rank=rank,
            )
        if job in self.hub.quotas.refused:
            code, message = self.hub.quotas.refused[job]
            return Refused(code, message, job=job, rank=rank)
        if imgs and ckpt <= max(imgs):
            return Refused(
                ErrorCode.STALE_CHECKPOINT,
                f"image {ckpt} of rank {rank} of job {job} is not newer than image {max(imgs)}",
                job=job,
                rank=rank,
            )
        if key in self.uploading:
            return Refused(
                ErrorCode.BUSY,
                f"an image of rank {rank} of job {job} is being uploaded",
                job=job,
                rank=rank,
            )
        self.uploading.add(key)
        return None

    async def commit_put(self, img: Image) -> Refused | list[int]:
        """An uploaded image is durable on disk: commit it (``commit``) and return the images
        retained, or why it may not be (then the caller deletes it)."""
        job, rank = key = (img.job, img.rank)
        self.uploading.discard(key)
        if job in self.hub.finished:
            return Refused(ErrorCode.JOB_FINISHED, f"job {job} is over", job=job, rank=rank)
        if self.hub.core.image_replaced(key, img.incarnation, []) is not None:
            return Refused(
                ErrorCode.FENCED,
                f"incarnation {img.incarnation} of rank {rank} of job {job} was replaced while "
                "its image was uploaded",
                job=job,
                rank=rank,
            )
        keep = max(1, self.hub.settings.checkpoint_keep)
        dropped = sorted(self.images.get(key, {}).values(), key=lambda i: -i.ckpt)[keep - 1 :]
        why = self.hub.quotas.admit_image(
            job, img.size - sum(i.size for i in dropped), self.job_nbytes[job]
        )
        if why is not None:
            return Refused(why[0], why[1], job=job, rank=rank)
        await self.commit(img)
        return self.retained(key)

    def image(self, key: Key, ckpt: int) -> Image | None:
        return self.images.get(key, {}).get(ckpt)


def _ids(img: Image) -> tuple[int, int, int]:
    return img.job, img.rank, img.ckpt
