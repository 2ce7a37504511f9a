"""A rank-like process for benchmarks/sandbox_costs.py: holds MB of memory, forks a clone the
way a rank's checkpoint does, prints its pid, and waits; the clone, once restored (its parent
changed), writes "restored" to OUT and exits.

    python clone_probe.py OUT MB
"""

import os
import sys
import time

out, mb = sys.argv[1], int(sys.argv[2])
data = bytearray(os.urandom(1024)) * (mb * 1024)  # touched: every page is in the image
parent = os.getpid()
pid = os.fork()
if pid:
    print(pid, flush=True)
    time.sleep(600)  # until the benchmark kills it
    sys.exit(0)
os.setpgid(0, 0)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
while os.getppid() == parent:
    time.sleep(0.001)
with open(out, "w") as f:
    f.write(f"restored {len(data)}")
os._exit(0)
