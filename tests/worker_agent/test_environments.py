"""Job environments on an agent: built once per set of requirements with pip from a package
index (one on disk here, no network), kept and reused, bounded, and refused with the reason."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import trio

from vpool import requirements
from vpool.worker_agent.environments import DONE, EnvironmentRejected, Environments, measure
from vpool.worker_agent.settings import AgentSettings

_spec = importlib.util.spec_from_file_location(
    "wheelhouse", Path(__file__).parents[1] / "helpers" / "wheelhouse.py"
)
assert _spec is not None and _spec.loader is not None
wheelhouse = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wheelhouse)


@pytest.fixture
def index(tmp_path: Path) -> str:
    return str(
        wheelhouse.make_index(
            tmp_path / "index",
            {
                "vpooldemo": {"vpooldemo/__init__.py": "ANSWER = 42\n"},
                "vpoolbig": {"vpoolbig/__init__.py": "", "vpoolbig/blob.bin": b"x" * 200_000},
            },
        )
    )


@pytest.fixture
def envs(settings: AgentSettings, index: str) -> Environments:
    return Environments(dataclasses.replace(settings, package_index=index))


async def test_built_once_then_reused(envs: Environments) -> None:
    wanted = requirements.normalize(["vpooldemo==1.0"])
    key, site = await envs.acquire(wanted, "agent-x")
    assert key == requirements.key(wanted) and envs.built() == [key]
    # The rank's Python finds it (as its PYTHONPATH will say).
    out = await trio.run_process(
        [sys.executable, "-c", "import vpooldemo; print(vpooldemo.ANSWER)"],
        env={"PYTHONPATH": str(site)},
        capture_stdout=True,
        check=True,
    )
    assert out.stdout == b"42\n"
    stamp = (site.parent / DONE).stat().st_mtime_ns
    # Two more ranks of the same requirements, at once: no second build.
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(envs.acquire, wanted, "agent-x")
    assert (site.parent / DONE).read_text() and envs.in_use[key] == 3
    assert len(list(envs.root.iterdir())) == 1
    assert (site.parent / DONE).stat().st_mtime_ns >= stamp  # touched: recently used
    for _ in range(3):
        envs.release(key)
    assert key not in envs.in_use


async def test_a_missing_package_names_it_and_the_agent(envs: Environments) -> None:
    with pytest.raises(EnvironmentRejected) as failed:
        await envs.acquire(["vpoolnosuchpackage"], "agent-x")
    message = str(failed.value)
    assert "agent agent-x" in message and "vpoolnosuchpackage" in message
    assert envs.built() == [] and list(envs.root.iterdir()) == []  # nothing half-built kept


async def test_size_limits(envs: Environments) -> None:
    small = Environments(dataclasses.replace(envs.settings, env_max_size=100_000))
    with pytest.raises(EnvironmentRejected, match="more than its limit of"):
        await small.acquire(["vpoolbig"], "agent-x")
    # The cache keeps what fits; the least recently used unused environment goes first.
    tight = Environments(dataclasses.replace(envs.settings, env_cache_size=150_000))
    first, _ = await tight.acquire(["vpooldemo"], "agent-x")
    tight.release(first)
    big, _ = await tight.acquire(["vpoolbig"], "agent-x")
    assert tight.built() == [big]  # vpooldemo was evicted for it
    held, _ = await tight.acquire(["vpooldemo"], "agent-x")  # built again, in use now
    assert sorted(tight.built()) == sorted([big, held])  # big is in use too: both stay


def test_requirements_are_checked_and_normalized() -> None:
    assert requirements.parse_lines(
        "# numerics\nnumpy >= 1.26\n\nScipy\nnumpy>=1.26 # again\n"
    ) == [
        "Scipy",
        "numpy>=1.26",
    ]
    for bad, why in (
        ("-e git+https://x/y", "pip options"),
        ("foo @ https://evil/foo.whl", "names a URL"),
        ("not a requirement!", "is not a requirement"),
    ):
        with pytest.raises(requirements.RequirementsError, match=why):
            requirements.parse_lines(bad)
    assert requirements.key(["a", "b"]) == requirements.key(requirements.normalize(["b", "a"]))


async def test_the_digest_is_of_the_contents_not_of_the_build(envs: Environments) -> None:
    """Images made in an environment are restored where its digest matches: two agents that
    installed the same wheels must agree, though pip's compiled files (which hold the time of
    the build) differ; a changed module changes it."""
    key, site = await envs.acquire(["vpooldemo"], "agent-x")
    digest = envs.digest(key)
    assert len(digest) == 64
    (compiled,) = site.rglob("*.pyc")  # pip compiled the module: the case this is about
    compiled.write_bytes(compiled.read_bytes() + b"another build")
    assert measure(site)[1] == digest
    module = site / "vpooldemo" / "__init__.py"
    module.write_text(module.read_text() + "# changed\n")
    assert measure(site)[1] != digest
