"""Run an mpi4py program with its ranks as threads of this process (``fakempi/mpi4py``)."""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
import threading
from pathlib import Path

FAKE = Path(__file__).parent / "fakempi"


class _RankStdout(io.TextIOBase):
    """sys.stdout for every thread: each rank writes into its own buffer."""

    def __init__(self, buffers: dict[int, io.StringIO], local: threading.local) -> None:
        self.buffers, self.local = buffers, local

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return self.buffers[self.local.rank].write(text)


def run_ranks(program: Path, size: int, args: list[str] | None = None) -> dict[int, str]:
    """Run ``program`` on ``size`` thread ranks; return each rank's stdout."""
    saved_mods = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "mpi4py"}
    for k in saved_mods:
        del sys.modules[k]
    sys.path.insert(0, str(FAKE))
    saved_argv = sys.argv
    try:
        from mpi4py import MPI  # the fake

        MPI.world = MPI.World(size)
        outs = {r: io.StringIO() for r in range(size)}
        errors: dict[int, BaseException] = {}
        router = _RankStdout(outs, MPI._local)

        def rank_main(rank: int) -> None:
            MPI._local.rank = rank
            try:
                runpy.run_path(str(program), run_name="__main__")
            except SystemExit as exc:
                if exc.code not in (None, 0):
                    errors[rank] = exc
            except BaseException as exc:
                errors[rank] = exc

        sys.argv = [str(program), *(args or [])]
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
        with contextlib.redirect_stdout(router):
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        if errors:
            rank, exc = sorted(errors.items())[0]
            raise AssertionError(f"rank {rank} failed: {exc!r}") from exc
        return {r: buf.getvalue() for r, buf in outs.items()}
    finally:
        sys.argv = saved_argv
        sys.path.remove(str(FAKE))
        for k in [k for k in sys.modules if k.split(".")[0] == "mpi4py"]:
            del sys.modules[k]
        sys.modules.update(saved_mods)
