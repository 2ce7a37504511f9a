"""``python -m mpi4py [-m mod | -c cmd | path] args``: run a program, aborting the whole job
when it raises (as mpi4py's runner does, so one failing rank cannot leave others waiting)."""

from __future__ import annotations

import runpy
import sys
import traceback


def main() -> None:
    args = sys.argv[1:]
    if not args:
        sys.stderr.write("usage: python -m mpi4py [-m mod | -c cmd | path] [args]\n")
        sys.exit(1)
    from mpi4py import MPI

    try:
        if args[0] == "-m" and len(args) > 1:
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c" and len(args) > 1:
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    main()
