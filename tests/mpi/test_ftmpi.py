"""FT-MPI's failure modes end to end (``vsdk mpiexec --on-failure blank|shrink|rebuild``): real
rank processes, the last ranks SIGKILL themselves, and the survivors recover with
``MPI.COMM_WORLD.Dup()`` (``programs/ftmpi_failures.py`` says what each scenario does), and
``examples/ftmpi_modes.py`` gives the fault-free answer whoever dies."""

from __future__ import annotations

from pathlib import Path

import pytest

from .failing_runs import expected_total, mpiexec

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = Path(__file__).resolve().parent / "programs" / "ftmpi_failures.py"
EXAMPLE = ROOT / "examples" / "ftmpi_modes.py"
MODES = ["blank", "shrink", "rebuild"]


pytestmark = pytest.mark.large


def _world(mode: str, n: int, lost: int) -> tuple[list[int], str]:
    """The ranks that print, and the facts each prints, once the last ``lost`` ranks of ``n``
    failed and the world was rebuilt in ``mode``."""
    live = list(range(n)) if mode == "rebuild" else list(range(n - lost))
    size = n - lost if mode == "shrink" else n
    facts = f"size={size} live={live} sum={sum(live)} ring={sum(r + 1 for r in live)} first=0"
    if mode == "blank":
        facts += f" hole={n - lost} send_raises=True"
    return live, facts


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("scenario", "lost", "extra", "n"),
    [
        ("detected", 1, "later=True ", 4),
        ("world", 1, "world_is_rebuilt=True ", 4),
        ("twice", 2, "", 3),  # down to one live rank but in rebuild mode
        ("twice", 2, "", 4),
        ("during", 2, "", 4),
    ],
)
async def test_the_world_is_rebuilt_by_the_mode(
    mode: str, scenario: str, lost: int, extra: str, n: int
) -> None:
    code, out, err = await mpiexec(n, mode, str(PROGRAM), scenario)
    assert code == 0, f"exit {code}\n{out}\n{err}"
    ranks, facts = _world(mode, n, lost)
    done = sorted(line for line in out.splitlines() if line.startswith(f"{scenario} ok "))
    want = []
    for r in ranks:
        who = "replacement " if mode == "rebuild" and r >= n - lost else ""
        want.append(f"{scenario} ok {r} {who or extra}{facts}")
    assert done == sorted(want), f"{out}\n{err}"
    for r in range(n - lost, n):
        assert f"rank {r} was killed by signal SIGKILL: declared failed" in err, err
    if scenario == "twice":  # the first recovery, seen by every rank alive then
        first = [line for line in out.splitlines() if line.startswith("twice first ")]
        _, facts1 = _world(mode, n, 1)
        assert {line.split(" ", 3)[3] for line in first} == {facts1}, out
        assert len(first) == (n if mode == "rebuild" else n - 1), out


async def test_an_ordinary_spawn_in_a_rebuild_job_starts_no_replacement() -> None:
    code, out, err = await mpiexec(3, "rebuild", str(PROGRAM), "spawn")
    assert code == 0, f"exit {code}\n{out}\n{err}"
    assert sorted(out.splitlines()) == [f"spawn ok {r} child=size1" for r in range(3)], err


@pytest.mark.parametrize(
    ("mode", "deaths"),
    [
        ("shrink", []),  # no failure: the same in every mode
        *[
            (mode, deaths)
            for mode in MODES
            for deaths in (["--die", "1:3"], ["--die", "0:2", "--die", "3:0"])
        ],
    ],
)
async def test_example_ftmpi_modes_gives_the_same_answer(mode: str, deaths: list[str]) -> None:
    code, out, err = await mpiexec(4, mode, str(EXAMPLE), "20000", "10", *deaths)
    assert code == 0, f"exit {code}\n{out}\n{err}"
    assert (
        out == f"ftmpi_modes: n=20000 iterations=10 total={expected_total(EXAMPLE, 20000, 10)}\n"
    ), err
    assert err.count("declared failed") == len(deaths) // 2, err
    if mode == "rebuild":
        assert err.count("replacement started") == len(deaths) // 2, err
