"""``python -m mpi4py [options] <pyfile | -m mod | -c cmd | -> [arg] ...``, as mpi4py's runner.

The program runs through ``runpy``. An exception it does not handle is printed by the interpreter
as usual, then, at exit, the whole job is aborted with status 1 (a ``SystemExit`` with a non-zero
code aborts with that code; ``KeyboardInterrupt`` with 130), so one failing rank cannot leave the
others waiting. Options: ``-rc key=value,...`` sets ``mpi4py.rc``; ``--version``, ``--prefix``,
``--mpi-std-version``, ``--mpi-lib-version``, ``--mpi-library``, ``-h`` print and exit.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any, NoReturn

_PACKAGE = __name__.rpartition(".")[0] or "mpi4py"


def run_command_line(args: list[str] | None = None) -> None:
    """Run ``[pyfile | -m mod | -c cmd | -] [arg] ...`` with ``sys.argv`` set as Python would."""
    import runpy

    sys.argv[:] = args if args is not None else sys.argv[1:]
    if sys.argv[0] in ("-", "-c"):
        if sys.argv[0] == "-":
            source, filename = sys.stdin.read(), "<stdin>"
        else:
            source, filename = sys.argv.pop(1), "<string>"
        code = compile(source, filename, "exec", 0, True)
        # As mpi4py does: a temporary __main__ module, so the program's functions and classes
        # can be pickled by reference (lower-case sends) as in `python -c`.
        runpy._run_module_code(code, None, "__main__", script_name=sys.argv[0])  # type: ignore[attr-defined]
    elif sys.argv[0] == "-m":
        del sys.argv[0]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        if not sys.flags.isolated:
            # As `python app.py` would: the script's directory first on the path.
            sys.path[0] = os.path.realpath(os.path.dirname(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")


def set_abort_status(status: Any) -> None:
    """Abort the job with ``status`` at interpreter exit (after the traceback is printed), if
    MPI is running and the status is an error."""
    if isinstance(status, SystemExit):
        status = status.code
    elif isinstance(status, KeyboardInterrupt):
        status = 128 + 2  # SIGINT
    if not isinstance(status, int):
        status = 0 if status is None else 1
    mpi = sys.modules.get(f"{_PACKAGE}.MPI")
    if mpi is not None and status:
        # Registered after MPI's own exit handler, so it runs first (atexit is LIFO).
        atexit.register(_abort, mpi, status)


def _abort(mpi: Any, status: int) -> None:
    if mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(status)


def _usage(error: str = "") -> NoReturn:
    python = os.path.basename(sys.executable)
    lines = [
        f"usage: {python} -m {_PACKAGE} [options] <pyfile> [arg] ...",
        f"   or: {python} -m {_PACKAGE} [options] -m <mod> [arg] ...",
        f"   or: {python} -m {_PACKAGE} [options] -c <cmd> [arg] ...",
        f"   or: {python} -m {_PACKAGE} [options] - [arg] ...",
    ]
    if error:
        print(
            error,
            *lines,
            f"Try `{python} -m {_PACKAGE} -h` for more information.",
            sep="\n",
            file=sys.stderr,
        )
        sys.exit(1)
    print(
        *lines,
        "options:",
        "  --prefix             show install path and exit",
        "  --version            show version number and exit",
        "  --mpi-library        show MPI library path and exit",
        "  --mpi-std-version    show MPI standard version and exit",
        "  --mpi-lib-version    show MPI library version and exit",
        "  -h|--help            show this help message and exit",
        "  -rc <key=value,...>  set 'mpi4py.rc.key=value'",
        sep="\n",
    )
    sys.exit(0)


def _uninitialized_mpi() -> Any:
    from mpi4py import rc

    rc.initialize = rc.finalize = False
    from mpi4py import MPI

    return MPI


def _show(what: str) -> NoReturn:
    if what == "prefix":
        print(os.path.dirname(os.path.abspath(__file__)))
    elif what == "version":
        from mpi4py import __version__

        print(f"{_PACKAGE} {__version__}")
    elif what == "mpi-library":
        print(_uninitialized_mpi().__file__)
    elif what == "mpi-std-version":
        mpi = _uninitialized_mpi()
        version = f"{mpi.VERSION}.{mpi.SUBVERSION}"
        runtime = ".".join(map(str, mpi.Get_version()))
        print(f"MPI {version}" + (f" (runtime: MPI {runtime})" if runtime != version else ""))
    else:
        print(_uninitialized_mpi().Get_library_version())
    sys.exit(0)


_SHOW = {"prefix", "version", "mpi-library", "mpi-std-version", "mpi-lib-version"}


def parse_command_line(args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """(rc settings, the program's command line) from the runner's arguments."""
    from ast import literal_eval

    rc_args: dict[str, Any] = {}
    args = list(args)
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c", "-"):
        opt = args.pop(0)
        if opt.startswith("--rc="):
            opt, value = "-rc", opt[len("--rc=") :]
        elif opt in ("-rc", "--rc"):
            if not args or args[0].startswith("-"):
                _usage(f"Argument expected for option: {opt}")
            opt, value = "-rc", args.pop(0)
        if opt in ("-h", "-help", "--help"):
            _usage()
        if opt.lstrip("-") in _SHOW:
            _show(opt.lstrip("-"))
        if opt != "-rc":
            _usage(f"Unknown option: {opt}")
        for entry in value.split(","):
            key, _, val = entry.partition("=")
            if not key or not val:
                _usage(f"Cannot parse rc option: {entry}")
            try:
                rc_args[key] = literal_eval(val)
            except (ValueError, SyntaxError):
                rc_args[key] = val
    if not args:
        _usage("No path specified for execution")
    if args[0] in ("-m", "-c") and len(args) < 2:
        _usage(f"Argument expected for option: {args[0]}")
    return rc_args, args


def main() -> None:
    """Entry point of ``python -m mpi4py`` and ``python -m mpi4py.run``."""
    rc_args, args = parse_command_line(sys.argv[1:])
    if rc_args:
        from mpi4py import rc

        rc(**rc_args)
    try:
        run_command_line(args)
    except (SystemExit, KeyboardInterrupt) as exc:
        set_abort_status(exc)
        raise
    except BaseException:
        set_abort_status(1)
        raise


if __name__ == "__main__":
    main()
