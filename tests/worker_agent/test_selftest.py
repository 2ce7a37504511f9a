"""``vpool-agent selftest``: the real probes, from a real sandboxed test rank."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vpool.worker_agent import cgroups, selftest

AGENT = Path(sys.executable).parent / "vpool-agent"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed")


def run_selftest(tmp_path: Path, **env: str) -> tuple[int, dict]:
    res = subprocess.run(
        [
            str(AGENT),
            "--work-dir",
            str(tmp_path / "work"),
            "--identity-dir",
            str(tmp_path / "id"),
            "selftest",
            "--json",
        ],
        capture_output=True,
        timeout=120,
        check=False,
        env={**os.environ, **{f"VPOOL_AGENT_{k.upper()}": v for k, v in env.items()}},
    )
    assert res.stdout, res.stderr.decode()
    return res.returncode, json.loads(res.stdout)


@needs_bwrap
@pytest.mark.large
def test_every_hostile_probe_is_refused(tmp_path: Path) -> None:
    code, found = run_selftest(tmp_path)
    assert code == 0, found
    assert found["level"] in ("sandbox", "sandbox-rlimits"), found
    assert found["failed"] == [], found
    probes = found["probes"]
    for name, (what, ok) in selftest.EXPECTED.items():
        if name == "keyctl" and name not in probes:
            continue  # an architecture whose keyctl number the probe does not know
        assert ok(probes[name]), f"{what}: {probes[name]!r}"
    assert probes["read_identity_key"] == "FileNotFoundError"
    assert probes["other_processes"] == []
    assert probes["connect_outside"] == "ENETUNREACH"
    assert probes["tmp_bytes"] == 256 * 1024**2
    support = cgroups.probe()
    if support.version and {"memory", "pids"} <= support.controllers:
        assert found["level"] == "sandbox"
        assert found["limits"]["pids"] == 64
        assert found["limits"]["memory"] > 0
    else:
        assert found["level"] == "sandbox-rlimits", found


@needs_bwrap
@pytest.mark.large
def test_a_sandboxed_rank_is_as_confined_after_a_restore(tmp_path: Path) -> None:
    code, found = run_selftest(tmp_path, criu=shutil.which("criu") or "criu")
    assert code == 0, found
    if found["checkpoints"] in ("no usable CRIU",):
        pytest.skip("no usable CRIU here: checkpoints of sandboxed ranks cannot be tried")
    assert found["checkpoints"] == "ok", found
    assert found["restored"] == {
        "capabilities": "0000000000000000",
        "bounding_set": "0000000000000000"
        if os.getuid() == 0
        else found["restored"]["bounding_set"],
        "no_new_privs": "1",
        "seccomp": "2",
    }


@pytest.mark.large
def test_no_sandbox_is_level_none(tmp_path: Path) -> None:
    code, found = run_selftest(tmp_path, sandbox="off")
    assert code == 1
    assert found["level"] == "none"
    assert "off" in found["detail"]


def test_a_probe_not_refused_makes_the_level_none() -> None:
    good = {name: None for name in selftest.EXPECTED}
    good.update(
        read_identity_key="FileNotFoundError",
        read_agent_files="PermissionError",
        read_shadow="FileNotFoundError",
        other_processes=[],
        signal_agent="ProcessLookupError",
        secret_in_environ=False,
        connect_coordinator="ECONNREFUSED",
        connect_outside="ENETUNREACH",
        write_system="EROFS",
        write_work="ok",
        new_user_namespace="EPERM",
        ptrace="EPERM",
        mount="EPERM",
        keyctl="EPERM",
        netlink_socket="EAFNOSUPPORT",
        write_root="EROFS",
        write_kernel_settings="EROFS",
        write_sysrq="ENOENT",
        host_boot_id=False,
        capabilities="0000000000000000",
        bounding_set="0000000000000000",
        no_new_privs="1",
        seccomp="2",
    )
    full = cgroups.Support(1, frozenset({"memory", "pids", "cpu"}))
    assert selftest.judge(good, full) == ("sandbox", "", [])
    level, detail, _ = selftest.judge(good, cgroups.Support(0, frozenset(), "no cgroupfs"))
    assert (level, detail) == ("sandbox-rlimits", "no cgroup: no cgroupfs")
    wrong = [("connect_outside", "ok"), ("other_processes", [57]), ("seccomp", "0")]
    wrong += [("write_root", "ok"), ("write_kernel_settings", "ok"), ("host_boot_id", True)]
    for name, value in wrong:
        level, detail, failed = selftest.judge({**good, name: value}, full)
        assert (level, failed) == ("none", [name]), detail
    missing = {k: v for k, v in good.items() if k != "ptrace"}
    assert selftest.judge(missing, full)[0] == "none"
