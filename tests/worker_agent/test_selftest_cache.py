"""The selftest's findings kept and reused (``selftest_cache``): reused only under the same key,
only from a file the agent alone could have written, and only when they were clean."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from vpool.worker_agent import cgroups, sandbox, sandboxed, selftest
from vpool.worker_agent.settings import AgentSettings

VIEW = sandbox.View(ro=("/usr", "/etc/ssl"), links=(("usr/bin", "/bin"),), etc_dir=Path("/x"))


def isolation(controllers: frozenset[str] = frozenset({"memory", "pids", "cpu"})):
    return sandboxed.Isolation(
        bwrap="/usr/bin/bwrap",
        view=VIEW,
        seccomp=b"filter",
        cgroup=cgroups.Support(version=1, controllers=controllers),
    )


LIMITS = sandboxed.RankLimits(memory=1 << 30, processes=64)
CLEAN = selftest.SelfTest(
    level="sandbox",
    probes={"ptrace": "EPERM", "other_processes": []},
    limits={"memory": 1 << 30, "pids": 64},
    checkpoints="ok",
    restored={"seccomp": "2"},
)


def key(**settings: Any) -> str:
    return selftest.cache_key(AgentSettings(**settings), isolation(), LIMITS, True)


def test_the_key_follows_what_the_findings_depend_on() -> None:
    base = key(work_dir="/a", name="agent-0")
    # Another agent of the same machine and settings: the same findings.
    assert key(work_dir="/b", name="agent-1", fingerprint_salt="x") == base
    # A setting that shapes the sandbox, or any setting not known to be harmless: another key.
    assert key(work_dir="/a", name="agent-0", rank_memory="1G") != base
    assert key(work_dir="/a", name="agent-0", checkpoint_zstd_level=3) != base
    settings = AgentSettings(work_dir="/a")
    assert selftest.cache_key(settings, isolation(), LIMITS, False) != base  # CRIU gone
    other_limits = dataclasses.replace(LIMITS, processes=32)
    assert selftest.cache_key(settings, isolation(), other_limits, True) != base
    no_cpu = isolation(frozenset({"memory", "pids"}))
    assert selftest.cache_key(settings, no_cpu, LIMITS, True) != base


def test_the_key_does_not_depend_on_the_order_of_a_set() -> None:
    # A frozenset's order follows the hash seed: two agents (or two starts) saw two orders.
    settings = AgentSettings()
    one = sandboxed.Isolation(
        bwrap="/usr/bin/bwrap",
        view=VIEW,
        seccomp=b"f",
        cgroup=cgroups.Support(1, frozenset(["memory", "pids", "cpu"])),
    )
    two = dataclasses.replace(one, cgroup=cgroups.Support(1, frozenset(["cpu", "pids", "memory"])))
    assert selftest.cache_key(settings, one, LIMITS, True) == selftest.cache_key(
        settings, two, LIMITS, True
    )


def test_kept_findings_come_back_as_they_were(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "selftest.json"
    selftest.store_cached(path, "k1", CLEAN)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert selftest.load_cached(path, "k1") == CLEAN
    assert selftest.load_cached(path, "k2") is None
    # The newest CACHE_ENTRIES keys are kept.
    for i in range(selftest.CACHE_ENTRIES):
        selftest.store_cached(path, f"n{i}", CLEAN)
    assert selftest.load_cached(path, "k1") is None
    assert selftest.load_cached(path, f"n{selftest.CACHE_ENTRIES - 1}") == CLEAN
    assert len(json.loads(path.read_text())) == selftest.CACHE_ENTRIES


def test_findings_are_not_taken_from_a_file_others_could_write(tmp_path: Path) -> None:
    path = tmp_path / "selftest.json"
    selftest.store_cached(path, "k", CLEAN)
    os.chmod(path, 0o666)
    assert selftest.load_cached(path, "k") is None
    os.chmod(path, 0o600)
    link = tmp_path / "link.json"
    link.symlink_to(path)
    assert selftest.load_cached(link, "k") is None
    assert selftest.load_cached(path, "k") == CLEAN


@pytest.mark.parametrize(
    "content", [b"", b"not json", b"[1, 2]", b'{"k": 3}', b'{"k": {"level": "x", "bogus": 1}}']
)
def test_a_damaged_file_means_probing_again(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "selftest.json"
    path.write_bytes(content)
    path.chmod(0o600)
    assert selftest.load_cached(path, "k") is None
    selftest.store_cached(path, "k", CLEAN)  # and is replaced by what the probe found
    assert selftest.load_cached(path, "k") == CLEAN


@pytest.mark.parametrize(
    ("found", "kept"),
    [
        (CLEAN, True),
        (dataclasses.replace(CLEAN, checkpoints="no usable CRIU"), True),
        (dataclasses.replace(CLEAN, level="sandbox-rlimits"), True),
        # A failure may be passing (a slow machine, a dump that timed out): probed again.
        (dataclasses.replace(CLEAN, checkpoints="failed: criu timed out"), False),
        (selftest.SelfTest(level="none", detail="probes not refused: ptrace"), False),
    ],
)
async def test_only_clean_findings_are_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, found: selftest.SelfTest, kept: bool
) -> None:
    runs: list[int] = []

    async def probe(*args: object, **kwargs: object) -> selftest.SelfTest:
        runs.append(1)
        return found

    monkeypatch.setattr(selftest, "run_selftest", probe)
    settings = AgentSettings(work_dir=str(tmp_path), selftest_cache=str(tmp_path / "c.json"))
    for _ in range(3):
        got = await selftest.run_cached(settings, isolation(), LIMITS, criu_ok=True)
        assert got == found
    assert len(runs) == (1 if kept else 3)
    # Without the setting, every start probes.
    runs.clear()
    off = dataclasses.replace(settings, selftest_cache="")
    await selftest.run_cached(off, isolation(), LIMITS, criu_ok=True)
    await selftest.run_cached(off, isolation(), LIMITS, criu_ok=True)
    assert len(runs) == 2
