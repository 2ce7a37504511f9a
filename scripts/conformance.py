#!/usr/bin/env python3
"""Run mpi4py 4.1.2's own test suite against vpool's MPI runtime and write docs/conformance.md.

Each test module runs as ``vsdk mpiexec -n N -- test/main.py -v MODULE`` for every N asked for,
with a timeout (a hung run is killed, with its process group, and counted as hung). With
``--batch`` (and in the tests, tests/conformance) the modules of test/ run together, one
``main.py -v M1 M2 ...`` per N, each module still judged on its own lines (``run_batch``).
Each rank's unittest output goes to its own log file, so results of different ranks never
interleave: this
script re-runs itself inside every rank (``--rank-log DIR``) to redirect stdout/stderr before
running main.py unchanged. ``mpi4py.futures``' tests are in demo/futures: ``test_futures`` runs
``test_futures.py`` as a program, ``test_futures_shared`` as ``-m mpi4py.futures test_futures.py``
(the other ranks are the shared pool's workers, and only rank 0 reports).

vpool's MPI spawns processes (``MPI.Comm.Spawn``), and so do mpi4py.futures' spawning executors
(their workers are asked of the pool), so the suite runs with its spawn tests
(``MPI4PY_TEST_SPAWN`` unset): test_util_pool's ``mpi-spawn`` ones and test_futures.py's
``ProcessPool*`` classes too.

A test counts once however many ranks ran it: failed (or error) if it failed on any rank, skipped
and passed as rank 0 reports. Results are kept in .cache/conformance/results.json keyed by
(ranks, module), so runs of a few modules update the report without losing the others.

    scripts/conformance.py --core --check          # CI: the core modules at 1, 2 and 4 ranks
    scripts/conformance.py --modules test_p2p_obj --ranks 2
    scripts/conformance.py --modules futures,futures_shared --ranks 1 2 4
    scripts/conformance.py --all --ranks 2         # whole suite, for the comparison with MPICH

Exit status: 0, or 1 with ``--check`` when a core module has failures, errors or hangs.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "4.1.2"
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
SDIST = CACHE / "sdist" / f"mpi4py-{VERSION}"
RESULTS = CACHE / "conformance" / "results.json"
REPORT = ROOT / "docs" / "conformance.md"
VSDK = ROOT / ".venv" / "bin" / "vsdk"

# Test files outside test/: module -> (directory in the sdist, what each rank runs there,
# whether only rank 0 reports).
EXTRA = {
    "test_futures": ("demo/futures", ["test_futures.py", "-v"], False),
    "test_futures_shared": (
        "demo/futures",
        ["-m", "mpi4py.futures", "test_futures.py", "-v"],
        True,
    ),
}

NOTES: dict[str, str] = {}

CORE = [
    "test_p2p_obj",
    "test_p2p_buf",
    "test_request",
    "test_status",
    "test_msgzero",
    "test_environ",
    "test_errhandler",
    "test_exceptions",
    "test_cco_obj",
    "test_cco_buf",
    "test_cco_vec",
    "test_cco_nb_buf",
    "test_op",
    "test_comm",
    "test_group",
    "test_comm_topo",
    "test_futures",
    "test_futures_shared",
    "test_util_pool",
    "test_ulfm",
    "test_spawn",
    "test_comm_inter",
    "test_cco_obj_inter",
    "test_cco_buf_inter",
    "test_cco_vec_inter",
]

# Real MPICH (mpi4py 4.1.2's suite at 2 ranks), the yardstick of the whole-suite count.
MPICH_PASSED, MPICH_TOTAL = 1931, 2127

OUT_OF_SCOPE = [
    (
        "One-sided communication (RMA: `MPI.Win`, Put/Get/Accumulate)",
        "needs remote memory access between volunteer machines with no shared memory or RDMA; "
        "every byte goes through relays as a logged message",
    ),
    (
        "Parallel I/O (MPI-IO: `MPI.File`)",
        "ranks run in throw-away work directories on different machines; there is no shared "
        "file system to open a file collectively on",
    ),
    (
        "Joining running jobs (`Open_port`, `Comm.Accept`/`Connect`, name publishing, `Comm.Join`)",
        "every process of a job is started by the pool (its first ranks, and those they "
        "`Spawn`); a job cannot join another job or a process outside the pool, which would "
        "also be a way around the sandbox's lack of network",
    ),
    (
        "Sessions (MPI-4 `MPI.Session`, process sets) (for now)",
        "vpool provides the World model: every job starts with COMM_WORLD; `Session.Init` and "
        "communicators made from a session's process sets are not implemented yet",
    ),
]

_RAN = re.compile(r"^Ran (\d+) tests? in ")
_SUMMARY = re.compile(r"^(OK|FAILED)\b(?: \((.*)\))?\s*$")
_HEADER = re.compile(r"^(FAIL|ERROR): (\S+) \(([\w.]+)\)")
_SKIP = re.compile(r" \.\.\. skipped '(.*)'$")


# ---- inside a rank -----------------------------------------------------------------------


def rank_main(logdir: str, argv: list[str]) -> None:
    """Send this rank's stdout/stderr to its own log, then run main.py as a script."""
    path = os.path.join(logdir, f"rank-{os.environ.get('VPOOL_RANK', '0')}.log")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if argv[0] == "-m":
        sys.argv = argv[1:]  # runpy puts the module's file in sys.argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


# ---- the sdist ---------------------------------------------------------------------------


def ensure_sdist() -> Path:
    if (SDIST / "test" / "main.py").is_file():
        return SDIST
    SDIST.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                # Only mpi4py as source: its build requirements (Cython...) as wheels, which
                # pip installs to read its metadata, instead of compiling Cython for minutes.
                "--no-binary",
                "mpi4py",
                "--no-deps",
                "--dest",
                tmp,
                f"mpi4py=={VERSION}",
            ],
            check=True,
        )
        archive = next(Path(tmp).glob(f"mpi4py-{VERSION}.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(SDIST.parent, filter="data")
    return SDIST


def all_modules(sdist: Path) -> list[str]:
    return sorted([*(p.stem for p in (sdist / "test").glob("test_*.py")), *EXTRA])


# ---- running one module ------------------------------------------------------------------


def run_module(sdist: Path, module: str, ranks: int, timeout: float) -> dict:
    if module in EXTRA:
        directory, program, root_reports = EXTRA[module]
        cwd = sdist / directory
    else:
        cwd, program, root_reports = (
            sdist / "test",
            [str(sdist / "test" / "main.py"), "-v", module],
            False,
        )
    run = _launch(cwd, program, ranks, timeout)
    logs, hung = run["logs"], run["hung"]
    if root_reports:
        # The workers print nothing of their own; one that failed shows in the exit status.
        logs = logs[:1]
    result = parse(logs, hung)
    if (
        root_reports
        and run["exit_code"]
        and not hung
        and not (result["failed"] or result["errors"])
    ):
        result["errors"] += 1
    result.update(
        module=module,
        ranks=ranks,
        seconds=round(run["elapsed"], 1),
        exit_code=run["exit_code"],
        launcher=run["out"][-2000:],
    )
    return result


def _launch(cwd: Path, program: list[str], ranks: int, timeout: float) -> dict:
    """``vsdk mpiexec -n RANKS`` of ``program`` in ``cwd``: every rank's log (``rank_main``),
    whether it hung (killed at ``timeout``, with its process group), its exit code, what the
    launcher printed and the seconds it took."""
    with tempfile.TemporaryDirectory(prefix="conformance-") as logdir:
        cmd = [
            str(VSDK),
            "mpiexec",
            "-n",
            str(ranks),
            "--",
            str(Path(__file__).resolve()),
            "--rank-log",
            logdir,
            *program,
        ]
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env={k: v for k, v in os.environ.items() if k != "MPI4PY_TEST_SPAWN"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a hang is killed with its ranks
        )
        hung = False
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            hung = True
            _kill_group(proc)
            out, _ = proc.communicate()
        elapsed = time.monotonic() - start
        logs = [
            (Path(logdir) / f"rank-{r}.log").read_text(errors="replace")
            if (Path(logdir) / f"rank-{r}.log").exists()
            else ""
            for r in range(ranks)
        ]
    return {
        "logs": logs,
        "hung": hung,
        "exit_code": proc.returncode,
        "out": out.decode(errors="replace"),
        "elapsed": elapsed,
    }


def run_batch(sdist: Path, modules: list[str], ranks: int, timeout: float) -> dict[str, dict]:
    """The results of ``modules`` at ``ranks`` ranks, from as few runs as can be: every module of
    test/ in one ``main.py -v M1 M2 ...`` (how mpi4py's suite runs by itself: one start of the
    job instead of one per module), the EXTRA ones one at a time (programs of their own).
    Each module's verdict is its own, as ``run_module`` gives it (``split_modules``); where
    the batch stopped (a crash, or a hang) that module is said to have crashed or hung, and
    the modules after it run again, each on its own. ``timeout`` is per module; the batch gets
    three modules' worth (it is there for a hang, not for slowness)."""
    together = [m for m in modules if m not in EXTRA]
    results: dict[str, dict] = {}
    if len(together) > 1:
        program = [str(sdist / "test" / "main.py"), "-v", *together]
        run = _launch(sdist / "test", program, ranks, timeout * 3)
        parts, stopped = split_modules(run["logs"], together)
        for module, logs in parts.items():
            result = parse(logs, run["hung"] and module == stopped)
            result.update(
                module=module,
                ranks=ranks,
                seconds=round(run["elapsed"] / len(parts), 1),
                exit_code=run["exit_code"],
                launcher=run["out"][-2000:],
                batch=len(together),
            )
            results[module] = result
    for module in modules:
        if module not in results:
            results[module] = run_module(sdist, module, ranks, timeout)
    return results


_RESULT = re.compile(r"^\w+ \((test_\w+)\.[\w.]+\)")  # "testX (test_mod.Case.testX) ..."
_HEADER_OF = re.compile(r"^(?:FAIL|ERROR): \S+ \((test_\w+)\.")


def split_modules(logs: list[str], modules: list[str]) -> tuple[dict[str, list[str]], str | None]:
    """Each module's part of a batch's rank logs (``modules`` in the order they ran), written
    as a run of that module alone would have it for ``parse``: its result lines, the headers of
    its failures, and unittest's closing summary on each rank that got past the module (to the
    next one, or to the end). Also the module where the batch stopped, if it stopped early:
    the first one a rank's log ends in without that summary (it crashed or hung there; a rank
    that wrote nothing stopped in the first). That module's part has no summary on that rank;
    the modules after it are left out (the batch never got to them: run them alone)."""
    order = {m: i for i, m in enumerate(modules)}
    parts = {m: [[] for _ in logs] for m in modules}
    done = {m: [False] * len(logs) for m in modules}
    stops = []
    for rank, text in enumerate(logs):
        lines = text.splitlines()
        current: str | None = None
        for line in lines:
            result, header = _RESULT.match(line), _HEADER_OF.match(line)
            if result and result.group(1) in order:
                if result.group(1) != current:
                    if current is not None:
                        done[current][rank] = True
                    current = result.group(1)
                parts[current][rank].append(line)
            elif header and header.group(1) in order:
                parts[header.group(1)][rank].append(line)
            elif current is not None and " ... " in line:
                parts[current][rank].append(line)  # the status after a test's docstring
        if _summary(lines) is not None:
            if current is not None:
                done[current][rank] = True
        else:
            stops.append(order[current] if current is not None else 0)
    stopped = modules[min(stops)] if stops else None
    out: dict[str, list[str]] = {}
    for module in modules[: order[stopped] + 1 if stopped is not None else len(modules)]:
        texts = []
        for rank, lines in enumerate(parts[module]):
            text = "\n".join(lines)
            if done[module][rank]:
                ran = sum(1 for line in lines if _RESULT.match(line))
                skipped = sum(1 for line in lines if _SKIP.search(line))
                text += f"\n\nRan {ran} tests in 0.000s\n\nOK (skipped={skipped})\n"
            texts.append(text)
        out[module] = texts
    return out, stopped


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def parse(logs: list[str], hung: bool) -> dict:
    """Counts of one module from every rank's unittest output (see the module docstring)."""
    failed: set[str] = set()
    errored: set[str] = set()
    crashed: list[int] = []
    running: dict[int, str] = {}
    ran = skipped = 0
    skip_reasons: dict[str, int] = {}
    for rank, text in enumerate(logs):
        lines = text.splitlines()
        for line in lines:
            m = _HEADER.match(line)
            if m:
                name = m.group(3)
                (failed if m.group(1) == "FAIL" else errored).add(name)
        summary = _summary(lines)
        if summary is None:
            crashed.append(rank)
            last = _last_started(text)
            if last:
                running[rank] = last
        if rank == 0:
            if summary is not None:
                ran, skipped = summary
            else:
                ran = len(re.findall(r" \.\.\. (?:ok|FAIL|ERROR|skipped|expected)", text))
            for line in lines:
                m = _SKIP.search(line)
                if m:
                    skip_reasons[m.group(1)] = skip_reasons.get(m.group(1), 0) + 1
            if summary is None:
                skipped = sum(skip_reasons.values())
    errored -= failed
    # Failing on another rank only is still one failing test of the ran ones.
    n_bad = len(failed) + len(errored)
    crash_error = 1 if crashed and not hung and not n_bad else 0
    return {
        "tests": ran,
        "passed": max(ran - skipped - n_bad, 0),
        "failed": len(failed),
        "errors": len(errored) + crash_error,
        "skipped": skipped,
        "hung": 1 if hung else 0,
        "failed_tests": sorted(failed),
        "error_tests": sorted(errored),
        "running_at_end": {str(k): v for k, v in running.items()},
        "crashed_ranks": crashed if not hung else [],
        "skip_reasons": skip_reasons,
    }


def _summary(lines: list[str]) -> tuple[int, int] | None:
    ran = None
    for i, line in enumerate(lines):
        m = _RAN.match(line)
        if m:
            ran = int(m.group(1))
            for follow in lines[i + 1 : i + 4]:
                s = _SUMMARY.match(follow)
                if s:
                    skipped = re.search(r"skipped=(\d+)", s.group(2) or "")
                    return ran, int(skipped.group(1)) if skipped else 0
    return None


def _last_started(text: str) -> str:
    found = re.findall(r"^(\w+ \([\w.]+\)) \.\.\. ", text, re.M)
    return found[-1] if found else ""


# ---- the report --------------------------------------------------------------------------


def load_results() -> dict:
    if RESULTS.exists():
        return json.loads(RESULTS.read_text())
    return {}


def save_result(key: str, result: dict, *, fresh: bool = False) -> dict:
    """Add one run's result to the file and return all of them. Runs of this script at the same
    time (other modules) each add theirs: the file is read again under a lock, never overwritten
    from a copy read earlier."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = {} if fresh else load_results()
        results[key] = result
        tmp = RESULTS.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
        os.replace(tmp, RESULTS)
    return results


COLS = ("tests", "passed", "failed", "errors", "skipped", "hung")


def write_report(results: dict, path: Path) -> None:
    by_ranks: dict[int, list[dict]] = {}
    for r in results.values():
        by_ranks.setdefault(r["ranks"], []).append(r)
    out = [
        "# mpi4py conformance",
        "",
        f"mpi4py {VERSION}'s own test suite (`test/main.py -v MODULE`) run against vpool's MPI",
        "runtime with `vsdk mpiexec -n N`, one module per run. Generated by",
        "`scripts/conformance.py`; do not edit by hand. A test counts once: failed if it failed",
        "on any rank; skips and passes as rank 0 reports them. *hung* means the run was killed",
        "at its timeout. `test_futures` is demo/futures/test_futures.py run as a program,",
        "`test_futures_shared` the same as `-m mpi4py.futures test_futures.py`. The suite runs",
        "with its spawn tests (mpi4py.futures' spawning executors ask the pool for workers).",
        "",
    ]
    whole = by_ranks.get(2, [])
    if whole:
        tot = {c: sum(r[c] for r in whole) for c in COLS}
        out += [
            "## At 2 ranks, next to MPICH (whole suite once run with `--all --ranks 2`)",
            "",
            "| runtime | modules | passed | of tests | failed | errors | skipped | hung |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            f"| vpool | {len(whole)} | {tot['passed']} | {tot['tests']} | {tot['failed']} | "
            f"{tot['errors']} | {tot['skipped']} | {tot['hung']} |",
            f"| MPICH (reference) | all | {MPICH_PASSED:,} | {MPICH_TOTAL:,} | | | | |",
            "",
        ]
        if len(whole) < 60:
            out += [f"Only {len(whole)} modules were run at 2 ranks so far: partial.", ""]
    for n in sorted(by_ranks):
        rows = sorted(by_ranks[n], key=lambda r: r["module"])
        out += [
            f"## {n} rank{'s' if n > 1 else ''}",
            "",
            "| module | core | tests | passed | failed | errors | skipped | hung | seconds |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            core = "yes" if r["module"] in CORE else ""
            out.append(
                f"| {r['module']} | {core} | "
                + " | ".join(str(r[c]) for c in COLS)
                + f" | {r['seconds']} |"
            )
        tot = {c: sum(r[c] for r in rows) for c in COLS}
        out.append("| **total** | | " + " | ".join(f"**{tot[c]}**" for c in COLS) + " | |")
        out.append("")
        bad = [r for r in rows if r["failed"] or r["errors"] or r["hung"]]
        if bad:
            out += ["Not passing:", ""]
            for r in bad:
                names = r["failed_tests"] + r["error_tests"]
                what = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
                if r["hung"]:
                    what += f" hung in {r['running_at_end'] or 'start-up'}"
                if r.get("crashed_ranks") and not names:
                    what += f" ranks {r['crashed_ranks']} ended without a summary"
                out.append(f"- {r['module']}: {what}")
            out.append("")
    notes = [
        (m, NOTES[m]) for m in sorted(NOTES) if any(r["module"] == m for r in results.values())
    ]
    if notes:
        out += ["Notes:", ""]
        out += [f"- {m}: {note}." for m, note in notes]
        out.append("")
    out += [
        "## Out of scope",
        "",
        "These features are not provided; the runtime raises `NotImplementedError` for them,",
        "which the suite turns into skips where it supports that.",
        "",
    ]
    for feature, why in OUT_OF_SCOPE:
        out.append(f"- **{feature}**: {why}.")
    reasons: dict[str, int] = {}
    for r in results.values():
        if r["ranks"] == 2:
            for k, v in r["skip_reasons"].items():
                reasons[k] = reasons.get(k, 0) + v
    if reasons:
        out += ["", "Skip reasons reported by the suite at 2 ranks (count of tests):", ""]
        for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]):
            out.append(f"- {v} x `{k}`")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out) + "\n")


# ---- command line ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-log"]:
        rank_main(argv[1], argv[2:])
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--ranks", nargs="+", default=["1,2,4"], help="rank counts, comma- or space-separated"
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--modules",
        nargs="+",
        help="test modules, comma- or space-separated (test_ prefix optional); "
        "test_futures and test_futures_shared are demo/futures/test_futures.py",
    )
    which.add_argument("--core", action="store_true", help="the core modules")
    which.add_argument("--all", action="store_true", help="every module of the suite")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per module run")
    parser.add_argument(
        "--batch",
        action="store_true",
        help="run test/'s modules together, one run per rank count (run_batch), not one each",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if a core module fails")
    parser.add_argument("--report", type=Path, default=REPORT, help="markdown output")
    parser.add_argument("--fresh", action="store_true", help="forget earlier results")
    opts = parser.parse_args(argv)

    sdist = ensure_sdist()
    if opts.all:
        modules = all_modules(sdist)
    elif opts.modules:
        names = [m for arg in opts.modules for m in arg.split(",") if m]
        modules = [m if m.startswith("test_") else f"test_{m}" for m in names]
    else:
        modules = CORE
    rank_counts = [int(n) for arg in opts.ranks for n in arg.split(",") if n]
    results = {} if opts.fresh else load_results()
    fresh = opts.fresh
    bad = []
    for n in rank_counts:
        batch = run_batch(sdist, modules, n, opts.timeout) if opts.batch else {}
        for module in modules:
            r = batch[module] if opts.batch else run_module(sdist, module, n, opts.timeout)
            results = save_result(f"{n}:{module}", r, fresh=fresh)
            fresh = False
            flag = "ok" if not (r["failed"] or r["errors"] or r["hung"]) else "NOT OK"
            print(
                f"{n} ranks {module:24} {flag:6} "
                + " ".join(f"{c}={r[c]}" for c in COLS)
                + f" ({r['seconds']}s)",
                flush=True,
            )
            if flag != "ok":
                for name in r["failed_tests"] + r["error_tests"]:
                    print(f"    {name}", flush=True)
                if r["hung"]:
                    print(f"    hung in {r['running_at_end']}", flush=True)
                if module in CORE:
                    bad.append((n, module))
    write_report(results, opts.report)
    if opts.check and bad:
        print(f"core modules not passing: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
