"""Real processes: a local pool started with `vsdk local up` in a private VPOOL_HOME."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Pool:
    home: Path
    env: dict[str, str]

    def vsdk(self, *args: str, timeout: float = 180, stdin: bytes | None = None):
        return subprocess.run(
            [str(BIN / "vsdk"), *args],
            env=self.env,
            capture_output=True,
            timeout=timeout,
            input=stdin,
            check=False,
        )

    def pids(self) -> list[dict]:
        return json.loads((self.home / "state" / "local-pool" / "pids.json").read_text())

    def pid_of(self, prefix: str) -> int:
        return next(p["pid"] for p in self.pids() if p["name"].startswith(prefix))

    def rank_pids(self) -> dict[int, int]:
        """MPI rank -> pid (as this test sees it) of the rank processes of the newest running
        job, found among the agents' descendants: ``python PROGRAM`` in a sandbox, not the
        sandbox's bwrap or init, and not a checkpoint clone (stdout on /dev/null)."""
        found: dict[int, dict[int, int]] = {}
        for p in self.pids():
            if not p["name"].startswith("agent"):
                continue
            todo = [p["pid"]]
            while todo:
                for child in _children(todo.pop()):
                    todo.append(child)
                    env, argv = _environ(child), _cmdline(child)
                    if b"VPOOL_RANK" not in env or len(argv) < 2 or not argv[1].endswith(b".py"):
                        continue
                    try:
                        if os.readlink(f"/proc/{child}/fd/1") == "/dev/null":
                            continue
                    except OSError:
                        continue
                    job = found.setdefault(int(env[b"VPOOL_JOB"]), {})
                    job.setdefault(int(env[b"VPOOL_RANK"]), child)
        return found[max(found)] if found else {}

    def logs(self) -> str:
        out = []
        for log in sorted((self.home / "state" / "local-pool" / "logs").glob("*.log")):
            out.append(f"----- {log.name}\n{log.read_text(errors='replace')[-4000:]}")
        return "\n".join(out)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def _environ(pid: int) -> dict[bytes, bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return {}


def _cmdline(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def start_pool(tmp: Path, agents: int = 3, relays: int = 2) -> Pool:
    env = {**os.environ, "VPOOL_HOME": str(tmp)}
    pool = Pool(tmp, env)
    res = pool.vsdk("local", "up", "--agents", str(agents), "--relays", str(relays), timeout=120)
    if res.returncode != 0:
        raise AssertionError(
            f"local up failed: {res.stderr.decode()}\n{pool.logs() if tmp.exists() else ''}"
        )
    return pool


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    p = start_pool(tmp_path_factory.mktemp("pool"))
    try:
        yield p
    finally:
        p.vsdk("local", "down", timeout=60)


@pytest.fixture
def fresh_pool(tmp_path: Path) -> Iterator[Pool]:
    p = start_pool(tmp_path / "home")
    try:
        yield p
    finally:
        p.vsdk("local", "down", timeout=60)


@pytest.fixture
def pool4(tmp_path: Path) -> Iterator[Pool]:
    """A fresh pool of 4 agents and 2 relays (the fault-tolerance tests kill parts of it)."""
    p = start_pool(tmp_path / "home", agents=4, relays=2)
    try:
        yield p
    finally:
        p.vsdk("local", "down", timeout=60)
