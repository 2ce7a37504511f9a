"""What job environments cost (issue 18): building one cold, finding it warm, and starting a
job that needs one.

    .venv/bin/python benchmarks/environment_costs.py [--requirement REQ]... [--index URL]
        [--repeat 3] [--json FILE]

1. the agent's build (``worker_agent.environments``): ``--requirement``s (default: a wheel of
   about 8 MiB made here and served from an index on disk, so the figure does not depend on
   a network) installed cold, then found warm (median of ``--repeat``);
2. a job's wall time on a local pool (2 agents, 1 relay, served that index): 4 ranks that
   import the package and print one line, without requirements (the baseline), with them cold
   (first job: each agent builds), and warm (later jobs), medians and ratios to the baseline.

Give ``--requirement numpy==1.26.4 --index https://pypi.org/simple`` (say) to measure a real
package from a real index.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
from packaging.requirements import Requirement

from vpool import requirements
from vpool.worker_agent.environments import Environments
from vpool.worker_agent.settings import AgentSettings

HERE = Path(__file__).resolve().parent
VSDK = str(Path(sys.executable).parent / "vsdk")
PROGRAM = "from mpi4py import MPI\nimport {module}\nif MPI.COMM_WORLD.rank == 0:\n    print('ok')\n"


def _wheelhouse():  # type: ignore[no-untyped-def]
    path = HERE.parent / "tests" / "helpers" / "wheelhouse.py"
    spec = importlib.util.spec_from_file_location("wheelhouse", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def build_times(reqs: list[str], index: str, work: Path, repeat: int) -> tuple[float, float]:
    settings = AgentSettings(
        coordinator_url="https://unused.invalid", work_dir=str(work), package_index=index
    )
    envs = Environments(settings)
    start = time.perf_counter()
    key, _ = await envs.acquire(reqs, "bench")
    cold = time.perf_counter() - start
    envs.release(key)
    warm = []
    for _ in range(repeat):
        start = time.perf_counter()
        key, _ = await envs.acquire(reqs, "bench")
        warm.append(time.perf_counter() - start)
        envs.release(key)
    return cold, statistics.median(warm)


def vsdk(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [VSDK, *args],
        env=env,
        capture_output=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
        check=False,
    )


def job_time(env: dict[str, str], program: Path, reqs: Path | None) -> float:
    extra = ["--requirements", str(reqs)] if reqs else []
    start = time.perf_counter()
    res = vsdk(env, "submit", str(program), "-n", "4", *extra, "--wait")
    if res.returncode != 0:
        raise SystemExit(f"the job failed: {res.stderr.decode()[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requirement", action="append", default=[])
    ap.add_argument("--module", help="What the job imports (default: the requirement's name).")
    ap.add_argument("--index", default="")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="vpool-envbench-") as tmp_dir:
        tmp = Path(tmp_dir)
        index, module = a.index, a.module
        reqs = requirements.normalize(a.requirement or ["vpoolbench"])
        if not a.requirement:
            payload = os.urandom(8 << 20)  # incompressible, like compiled code
            index = _wheelhouse().make_index(
                tmp / "index",
                {"vpoolbench": {"vpoolbench/__init__.py": "", "vpoolbench/data.bin": payload}},
            )
            module = "vpoolbench"
        module = module or Requirement(reqs[0]).name.replace("-", "_")
        cold, warm = trio.run(build_times, reqs, index, tmp / "agent", a.repeat)
        print(f"environment {', '.join(reqs)}: cold build {cold:.2f} s, warm {warm * 1000:.1f} ms")

        env = {**os.environ, "VPOOL_HOME": str(tmp / "home")}
        up = ["local", "up", "--agents", "2", "--relays", "1"]
        if index:
            up += ["--package-index", index]
        res = vsdk(env, *up)
        if res.returncode != 0:
            raise SystemExit(res.stderr.decode())
        try:
            plain, needs = tmp / "plain.py", tmp / "needs.py"
            plain.write_text(PROGRAM.format(module="sys"))
            needs.write_text(PROGRAM.format(module=module))
            req_file = tmp / "requirements.txt"
            req_file.write_text("\n".join(reqs) + "\n")
            base = statistics.median(job_time(env, plain, None) for _ in range(a.repeat))
            first = job_time(env, needs, req_file)
            later = statistics.median(job_time(env, needs, req_file) for _ in range(a.repeat))
        finally:
            vsdk(env, "local", "down")
        print(f"job without requirements: {base:.2f} s")
        print(f"job with them, cold:      {first:.2f} s   ratio {first / base:.2f}")
        print(f"job with them, warm:      {later:.2f} s   ratio {later / base:.2f}")
        if a.json:
            a.json.write_text(
                json.dumps(
                    {
                        "build_cold_s": cold,
                        "build_warm_s": warm,
                        "job_plain_s": base,
                        "job_cold_s": first,
                        "job_warm_s": later,
                    },
                    indent=1,
                )
            )


if __name__ == "__main__":
    main()
