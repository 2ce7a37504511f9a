"""Looks for another job's file (argv[1]: its path on the agent's machine) and processes."""

import json
import os
import sys

from mpi4py import MPI

MPI.COMM_WORLD.Barrier()


def exc_name(fn):
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__
    return "ok"


found = []
for top in os.listdir("/"):
    if top in ("proc", "sys", "dev"):
        continue
    for dirpath, _, files in os.walk("/" + top):
        found += [os.path.join(dirpath, n) for n in files if n == "keeper-secret.txt"]
mine = {1, os.getpid()}
others = [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) not in mine]
print(
    json.dumps(
        {
            "by_host_path": exc_name(lambda: open(sys.argv[1]).read()),
            "found_elsewhere": found,
            "other_processes": others,
        }
    )
)
