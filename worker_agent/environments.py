"""The environments jobs need (``Lease.requirements``), built once per agent and kept.

A job that declares requirements (``vsdk submit --requirements``, or its project's
``pyproject.toml``) gets them installed here before its rank starts: ``pip install --target``
into ``<work>/envs/<key>/site``, keyed by the requirements (``vpool.requirements.key``), so
every rank and every later job with the same requirements uses the same directory. The rank
sees it read-only at ``/vpool/env`` in its sandbox, after vpool's ``mpi4py`` on its
``PYTHONPATH``.

- **No job code runs while building**: wheels only (``--only-binary=:all:``), so no package's
  build scripts run; pip ignores the volunteer's user configuration and installs nothing
  outside the environment's directory.
- **Network**: pip reaches the package index (``package_index``, else pip's configuration)
  during the build only; the rank itself has no network.
- **Bounded**: an environment larger than ``env_max_size`` is refused; beyond
  ``env_cache_size`` the least recently used environments no rank uses are deleted.
- **Failures end the job once**, naming the package and this agent (``EnvironmentRejected``,
  a ``BundleRejected``): the same requirements would fail the same way elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import trio

from vpool import requirements as reqs
from vpool.sizes import format_size
from vpool.worker_agent import criu
from vpool.worker_agent.errors import BundleRejected
from vpool.worker_agent.settings import AgentSettings

log = logging.getLogger("vpool.agent")

DONE = "environment.json"  # written last: an environment without it is not finished


class EnvironmentRejected(BundleRejected):
    """The job's environment cannot be built (no such package, no wheel for this machine,
    too big): the job ends with this reason."""


class Environments:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.root = settings.work_path / "envs"
        self._locks: dict[str, trio.Lock] = {}
        self.in_use: Counter[str] = Counter()

    def built(self) -> list[str]:
        """Keys of the finished environments here (for heartbeats)."""
        try:
            return sorted(p.name for p in self.root.iterdir() if (p / DONE).is_file())
        except FileNotFoundError:
            return []

    async def acquire(self, requirements: list[str], agent: str) -> tuple[str, Path]:
        """The key and ``site`` directory of the environment of ``requirements``, built if
        need be; the caller ``release``s it when its rank ends."""
        key = reqs.key(requirements)
        lock = self._locks.setdefault(key, trio.Lock())
        async with lock:  # ranks of one job arriving together build it once
            place = self.root / key
            if not (place / DONE).is_file():
                await self._build(key, requirements, agent)
            self.in_use[key] += 1
        await trio.to_thread.run_sync(_touch, place / DONE)
        return key, place / "site"

    def digest(self, key: str) -> str:
        """The contents digest of a built environment ("" if unknown)."""
        try:
            meta = json.loads((self.root / key / DONE).read_text())
        except (OSError, ValueError):
            return ""
        return str(meta.get("digest", ""))

    def fingerprints(self, base: str) -> list[str]:
        """The fingerprints images made in the environments built here carry (``base``:
        this agent's fingerprint; none without one)."""
        if not base:
            return []
        return [criu.with_environment(base, d) for k in self.built() if (d := self.digest(k))]

    def release(self, key: str) -> None:
        self.in_use[key] -= 1
        if self.in_use[key] <= 0:
            del self.in_use[key]

    async def _build(self, key: str, requirements: list[str], agent: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = Path(await trio.to_thread.run_sync(lambda: tempfile.mkdtemp(dir=self.root)))
        started = time.monotonic()
        try:
            (tmp / "requirements.txt").write_text("\n".join(requirements) + "\n")
            cmd = [
                self.settings.python_path or sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-input",
                "--no-warn-script-location",
                "--only-binary=:all:",
                "--target",
                str(tmp / "site"),
                "-r",
                str(tmp / "requirements.txt"),
            ]
            if self.settings.package_index:
                cmd[4:4] = ["--index-url", self.settings.package_index]
            env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
            env.update(PIP_USER="0", PYTHONNOUSERSITE="1")
            if self.settings.package_index:
                env["PIP_CONFIG_FILE"] = os.devnull  # the agent's index, and no other
            log.info("building the environment %s: %s", key, ", ".join(requirements))
            with trio.move_on_after(self.settings.env_build_timeout) as timer:
                done = await trio.run_process(
                    cmd, capture_stdout=True, capture_stderr=True, check=False, env=env
                )
            if timer.cancelled_caught:
                raise EnvironmentRejected(
                    f"installing {', '.join(requirements)} on agent {agent} took more than "
                    f"{self.settings.env_build_timeout:g} s"
                )
            if done.returncode != 0:
                raise EnvironmentRejected(
                    f"the job's requirements could not be installed on agent {agent}: "
                    f"{_pip_error(done.stderr.decode(errors='replace'))}"
                )
            size, digest = await trio.to_thread.run_sync(measure, tmp / "site")
            if size > self.settings.env_max_size:
                raise EnvironmentRejected(
                    f"the job's environment is {format_size(size)} on agent {agent}, more than "
                    f"its limit of {format_size(self.settings.env_max_size)}"
                )
            meta = {
                "requirements": requirements,
                "size": size,
                "digest": digest,
                "built": time.time(),
            }
            (tmp / DONE).write_text(json.dumps(meta))
            await trio.to_thread.run_sync(os.replace, tmp, self.root / key)
            log.info(
                "environment %s built: %s in %.1f s",
                key,
                format_size(size),
                time.monotonic() - started,
            )
        finally:
            await trio.to_thread.run_sync(lambda: shutil.rmtree(tmp, ignore_errors=True))
        await trio.to_thread.run_sync(self._evict, key)

    def _evict(self, keep: str) -> None:
        """Delete the least recently used environments beyond ``env_cache_size`` (never one
        in use, nor ``keep``)."""
        found = []
        for place in self.root.iterdir():
            done = place / DONE
            if not done.is_file():
                continue
            meta = json.loads(done.read_text())
            found.append((done.stat().st_mtime, place.name, int(meta.get("size", 0))))
        total = sum(size for _, _, size in found)
        for _, name, size in sorted(found):
            if total <= self.settings.env_cache_size:
                break
            if name == keep or self.in_use.get(name):
                continue
            shutil.rmtree(self.root / name, ignore_errors=True)
            total -= size
            log.info("environment %s deleted (the cache is full)", name)


def _touch(path: Path) -> None:
    path.touch()


def measure(root: Path) -> tuple[int, str]:
    """(bytes, digest of the contents) of an environment: its files' paths and contents, so
    that two agents that installed the same wheels have the same digest."""
    total, digest = 0, hashlib.sha256()
    for current, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = Path(current) / name
            if path.is_symlink() or not path.is_file():
                continue
            data = path.read_bytes()
            total += len(data)
            if name.endswith((".pyc", ".pyo")):
                continue  # compiled here: they hold the build's timestamps, not the contents
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(hashlib.sha256(data).digest())
    return total, digest.hexdigest()


def _pip_error(stderr: str) -> str:
    """pip's own words of why (its ERROR lines), short."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    text = " ".join(errors or lines[-3:]) or "pip failed without a message"
    return text[:600]
