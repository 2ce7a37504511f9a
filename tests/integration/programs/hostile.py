"""Acts a hostile program tries, each reported by what happened (test_sandbox.py).

argv: the agent's identity key path, the agent's pid, the coordinator's port."""

import ctypes
import errno
import json
import os
import socket
import sys

from mpi4py import MPI

libc = ctypes.CDLL(None, use_errno=True)


def outcome(fn):
    try:
        fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, "") if exc.errno else type(exc).__name__
    return "ok"


def exc_name(fn):
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__
    return "ok"


def syscall(name, *args):
    def call():
        if getattr(libc, name)(*args) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))

    return call


def connect(host, port):
    def call():
        with socket.create_connection((host, port), timeout=2):
            pass

    return call


identity, agent_pid, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
comm = MPI.COMM_WORLD
environ_has_secret = False
for entry in os.listdir("/proc"):
    if entry.isdigit():
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                entries = f.read().split(b"\0")
            environ_has_secret |= any(e.startswith(b"VPOOL_RANK_SECRET=") for e in entries)
        except OSError:
            pass
with open("/tmp/probe", "w") as f:
    f.write("x")
tmp = os.statvfs("/tmp")
seen = {
    "rank": comm.rank,
    "identity": exc_name(lambda: open(identity, "rb").read()),
    "shadow": exc_name(lambda: open("/etc/shadow", "rb").read()),
    "pool_home": exc_name(lambda: os.listdir(identity.rsplit("/state/", 1)[0])),
    "pids": sorted(int(e) for e in os.listdir("/proc") if e.isdigit()),
    "kill_agent": exc_name(lambda: os.kill(agent_pid, 0)),
    "secret_in_environ": environ_has_secret,
    "secret_file_left": os.path.exists("/vpool/rank/.vpool-secret"),
    "connect_coordinator": outcome(connect("127.0.0.1", port)),
    "connect_outside": outcome(connect("192.0.2.1", 80)),
    "write_usr": outcome(lambda: open("/usr/vpool-probe", "w")),
    "write_work": outcome(lambda: open("probe.txt", "w").write("x")),
    "unshare_user": outcome(syscall("unshare", 0x10000000)),
    "ptrace": outcome(syscall("ptrace", 0, 0, 0, 0)),
    "mount": outcome(syscall("mount", b"none", b"/tmp", b"tmpfs", 0, None)),
    "netlink": outcome(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)),
    "caps": open("/proc/self/status").read().split("CapEff:")[1].split()[0],
    "no_new_privs": open("/proc/self/status").read().split("NoNewPrivs:")[1].split()[0],
    "tmp_is_private": tmp.f_blocks * tmp.f_frsize <= 1024**3,
}
for rank in range(comm.size):
    if rank == comm.rank:
        print(json.dumps(seen), flush=True)
    comm.Barrier()
