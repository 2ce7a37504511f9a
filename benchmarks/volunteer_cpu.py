"""The volunteer's CPU against a busy rank, both pinned to one CPU (issue 35).

    .venv/bin/python benchmarks/volunteer_cpu.py [--seconds 3]

A "volunteer" process (a busy loop at normal priority, in the agent's cgroup, as any program
of the volunteer's would be outside it) and a "rank" (the same loop, in a rank's cgroup made
by ``cgroups.RankCgroup`` as the agent makes it, in the idle scheduling class as
``sandbox_init`` puts it) are pinned to the same CPU. Printed, as ratios against the volunteer
alone in the same invocation: the volunteer's share of the CPU with the rank beside it, as
the agent sets the groups up now (the rank's group and its parent at the lowest weight), and
as it did before issue 35 (the parent at the default weight: the rank got about a quarter of
the CPU). Needs root and a cgroup hierarchy with the cpu controller (else it says why).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from vpool.worker_agent import cgroups

BUSY = "import os\nos.sched_setaffinity(0, {%d})\n%swhile True:\n    pass\n"
IDLE = "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"


def _ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _busy(cpu: int, *, idle: bool, group: cgroups.RankCgroup | None) -> subprocess.Popen[bytes]:
    code = BUSY % (cpu, IDLE if idle else "")
    procs = group.procs_files() if group is not None else []

    def join() -> None:
        for path in procs:
            with open(path, "w") as f:
                f.write(str(os.getpid()))

    return subprocess.Popen([sys.executable, "-c", code], preexec_fn=join if procs else None)


def volunteer_share(seconds: float, cpu: int, *, rank: str) -> float:
    """The volunteer's CPU time over ``seconds`` of wall time (1.0: all of one CPU), beside a
    rank set up as ``rank`` says ("none", "now", "before")."""
    group = None
    if rank != "none":
        group = cgroups.RankCgroup.create(f"bench-{os.getpid()}-{rank}", cgroups.Limits())
        if rank == "before":  # the parent back at the default weight
            for path in group.procs_files():
                parent = Path(path).parent.parent
                for name, value in (("cpu.shares", "1024"), ("cpu.weight", "100")):
                    if (parent / name).exists():
                        (parent / name).write_text(value)
    procs = []
    try:
        if group is not None:
            procs.append(_busy(cpu, idle=True, group=group))
        volunteer = _busy(cpu, idle=False, group=None)
        procs.append(volunteer)
        time.sleep(0.5)  # both running (the measure starts after)
        start, t0 = _ticks(volunteer.pid), time.monotonic()
        time.sleep(seconds)
        used = (_ticks(volunteer.pid) - start) / os.sysconf("SC_CLK_TCK")
        return used / (time.monotonic() - t0)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        if group is not None:
            group.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    support = cgroups.probe()
    if os.geteuid() != 0 or "cpu" not in support.controllers:
        print(f"needs root and the cpu controller (here: {support.reason or 'not root'})")
        return
    cpu = max(os.sched_getaffinity(0))
    alone = volunteer_share(args.seconds, cpu, rank="none")
    print(f"volunteer alone on CPU {cpu}: {alone:.3f} of the CPU (the baseline)")
    for rank, what in (("now", "beside a busy rank"), ("before", "before issue 35")):
        share = volunteer_share(args.seconds, cpu, rank=rank)
        print(f"volunteer {what:<22} {share / alone:6.1%} of its CPU alone")


if __name__ == "__main__":
    main()
