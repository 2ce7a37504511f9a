"""``vsdk`` commands: help texts, output streaming, JSON, exit codes, error lines."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from vpool.protocol.api import JobEvent
from vpool.sdk.cli import cli


def all_commands(group: click.Group = cli, prefix: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    yield prefix
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from all_commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name)


COMMANDS = list(all_commands())


def test_the_promised_commands_exist() -> None:
    for cmd in [
        "submit",
        "status",
        "logs",
        "wait",
        "cancel",
        "jobs",
        "results",
        "login",
        "mpiexec",
        "local",
    ]:
        assert (cmd,) in COMMANDS
    for sub in ["up", "down", "status"]:
        assert ("local", sub) in COMMANDS


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "vsdk")
def test_every_command_has_help_with_an_example(command: tuple[str, ...]) -> None:
    res = CliRunner().invoke(cli, [*command, "--help"])
    assert res.exit_code == 0, res.output
    assert "Example" in res.output
    assert f"vsdk {' '.join(command)}".strip() in res.output


def run(*args: str, input: bytes | None = None):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, list(args), input=input)


@pytest.fixture
def app(tmp_path: Path) -> Path:
    (tmp_path / "app.py").write_text("print('hi')\n")
    return tmp_path / "app.py"


def test_submit_prints_the_job_id_only(coord: Any, app: Path) -> None:
    res = run("submit", str(app), "-n", "3", "--", "--size", "10")
    assert res.exit_code == 0, res.stderr
    assert res.stdout == "1\n"
    assert "job 1 submitted" in res.stderr
    assert coord.jobs[1].submit.args == ["--size", "10"]
    res = run("submit", str(app), "-n", "3", "--json")
    assert json.loads(res.stdout)["id"] == 2


def test_submit_wait_streams_whole_lines_like_mpiexec(coord: Any, app: Path) -> None:
    coord.script(
        chunks=[
            (0, "stdout", b"hel"),
            (1, "stdout", b"one\ntw"),
            (0, "stdout", b"lo\nwor"),
            (1, "stderr", b"warn"),
            (1, "stdout", b"o\n"),
            (0, "stdout", b"ld\n"),
            (1, "stderr", b"ing\n"),
            (2, "stdout", b"no newline"),
        ]
    )
    res = run("submit", str(app), "-n", "3", "--wait")
    assert res.exit_code == 0, res.stderr
    assert res.stdout == "one\nhello\ntwo\nworld\nno newline"
    assert "warning\n" in res.stderr
    assert res.stderr.index("job 1 submitted") < res.stderr.index("warning")


def test_submit_wait_with_labels(coord: Any, app: Path) -> None:
    coord.script(chunks=[(0, "stdout", b"a\nb\n"), (1, "stdout", b"c\n")])
    res = run("submit", str(app), "-n", "2", "--wait", "--label")
    assert res.stdout == "[0] a\n[0] b\n[1] c\n"


@pytest.mark.parametrize(
    ("state", "code", "reason", "exit_code"),
    [
        ("succeeded", 0, "", 0),
        ("failed", 7, "rank 2 exited with code 7", 7),
        ("failed", None, "rank 3 lost: agent agent-1 stopped heartbeating", 3),
        ("cancelled", None, "cancelled by alice", 4),
    ],
)
def test_submit_wait_and_wait_exit_codes(
    coord: Any, app: Path, state: str, code: int | None, reason: str, exit_code: int
) -> None:
    coord.script(state=state, exit_code=code, reason=reason, chunks=[(0, "stdout", b"out\n")])
    res = run("submit", str(app), "-n", "4", "--wait")
    assert res.exit_code == exit_code, res.stderr
    assert res.stdout == "out\n"
    if reason:
        assert reason in res.stderr
    res = run("wait", "1")
    assert res.exit_code == exit_code
    assert res.stdout == ""
    res = run("wait", "1", "--json")
    assert json.loads(res.stdout)["state"] == state


def test_status_human_and_json(coord: Any, app: Path) -> None:
    coord.script(state="failed", exit_code=2, reason="rank 1 exited with code 2")
    run("submit", str(app), "-n", "2")
    res = run("status", "1")
    assert res.exit_code == 0
    assert "state: failed  exit code: 2" in res.stdout
    assert "reason: rank 1 exited with code 2" in res.stdout
    assert "RANK" in res.stdout and "events:" in res.stdout
    # Agents by name in the rank table, as the events name them; ids only in --json.
    assert "laptop-1" in res.stdout and "a-1" not in res.stdout.split("events:")[0]
    detail = json.loads(run("status", "1", "--json").stdout)
    assert detail["job"]["exit_code"] == 2 and len(detail["ranks"]) == 2


def test_status_says_which_image_a_rank_was_restored_from(coord: Any, app: Path) -> None:
    taken = 1_795_000_000_250  # a checkpoint id: when it was taken, in ms
    coord.script(restored_from={1: taken})
    run("submit", str(app), "-n", "2")
    res = run("status", "1")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("RANK"))
    assert lines[head].split()[-2:] == ["RESTORED", "FROM"]
    assert lines[head + 1].split()[-1] == "-"
    stamp = time.strftime("%H:%M:%S", time.localtime(taken / 1000))
    assert lines[head + 2].endswith(f"image of {stamp}")
    detail = json.loads(run("status", "1", "--json").stdout)
    assert [r["restored_from"] for r in detail["ranks"]] == [-1, taken]


def test_status_shows_fault_events_as_a_table(coord: Any, app: Path) -> None:
    events = [
        JobEvent(time=1001.25, kind="rank_lost", rank=1, message="rank 1 lost: agent a-1 died"),
        JobEvent(
            time=1001.5, kind="rank_restarted", rank=1, message="rank 1 incarnation 2 on agent a-2"
        ),
        JobEvent(
            time=1002.0,
            kind="rank_replaying",
            rank=1,
            message="rank 1 incarnation 2 replays 4 determinants",
        ),
        JobEvent(time=1002.0, kind="relay_down", message="relay relay-0 stopped\nheartbeating"),
    ]
    coord.script(events=events)
    run("submit", str(app), "-n", "2")
    res = run("status", "1")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    table = lines[lines.index("events:") + 1 :]
    assert table[0].split() == ["TIME", "EVENT", "RANK", "MESSAGE"]
    assert len(table) == 1 + 2 + len(events)  # header, submitted, ours, the end
    column = table[0].index("MESSAGE")
    lost = table[2]
    assert lost.startswith(time.strftime("%Y-%m-%d %H:%M:%S.250", time.localtime(1001.25)))
    assert lost.split()[2:5] == ["rank_lost", "1", "rank"]
    assert lost[column:] == "rank 1 lost: agent a-1 died"
    assert table[3][column:] == "rank 1 incarnation 2 on agent a-2"
    assert table[5].split()[3] == "-" and table[5].endswith("relay relay-0 stopped heartbeating")
    detail = json.loads(run("status", "1", "--json").stdout)
    kinds = [e["kind"] for e in detail["events"]]
    assert kinds[1:5] == ["rank_lost", "rank_restarted", "rank_replaying", "relay_down"]
    assert detail["events"][1] == {
        "time": 1001.25,
        "kind": "rank_lost",
        "message": "rank 1 lost: agent a-1 died",
        "rank": 1,
        "id": 0,  # the fake coordinator numbers no events
    }


def test_logs_with_rank_filter(coord: Any, app: Path) -> None:
    coord.script(
        chunks=[
            (0, "stdout", b"zero\n"),
            (1, "stdout", b"one\n"),
            (1, "stderr", b"err1\n"),
            (0, "stdout", b"zero again\n"),
        ]
    )
    run("submit", str(app), "-n", "2")
    res = run("logs", "1")
    assert res.stdout == "zero\none\nzero again\n"
    assert res.stderr == "err1\n"
    assert run("logs", "1", "--rank", "1").stdout == "one\n"
    assert run("logs", "1", "--follow", "--rank", "0").stdout == "zero\nzero again\n"


def test_jobs_cancel_results(coord: Any, app: Path, tmp_path: Path) -> None:
    assert run("jobs").stderr == "no jobs\n"
    run("submit", str(app), "-n", "2", "--name", "first")
    res = run("jobs")
    assert "first" in res.stdout and "ID" in res.stdout
    assert json.loads(run("jobs", "--json").stdout)[0]["name"] == "first"
    assert run("cancel", "1").stdout == "job 1 cancelled\n"
    assert run("wait", "1").exit_code == 4
    import sys

    coord.results_zip = sys.modules["sdk_fakecoord"].zip_of({"out.txt": b"x"})
    res = run("results", "1", str(tmp_path / "res"))
    assert res.exit_code == 0 and (tmp_path / "res" / "out.txt").read_bytes() == b"x"


def test_errors_are_one_line_with_meaningful_codes(coord: Any, app: Path) -> None:
    res = run("status", "99")
    assert res.exit_code == 1
    assert res.stderr.startswith("vsdk: error: job 99 does not exist")
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    res = run("submit", str(app.parent / "missing.py"), "-n", "2")
    assert res.exit_code == 1 and "does not exist" in res.stderr
    assert run("submit", str(app)).exit_code == 2  # --ranks is required
    assert run("submit", str(app), "-n", "0").exit_code == 2
    assert run("status", "notanumber").exit_code == 2


@pytest.mark.medium
def test_auth_and_connection_errors_exit_5(home: Path, app: Path) -> None:
    res = run("--url", "http://127.0.0.1:9", "--token", "t", "jobs")
    assert res.exit_code == 5
    assert "cannot reach the coordinator" in res.stderr


def test_no_config_is_a_clear_error(home: Path) -> None:
    res = run("jobs")
    assert res.exit_code == 1
    assert "vsdk login" in res.stderr and "Traceback" not in res.stderr


def test_mpiexec_passes_the_program_and_args(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    calls = []
    fake = types.ModuleType("vpool.sdk.mpiexec")
    fake.run = lambda n, argv, stdin=None, on_failure="", universe=0: (
        calls.append((n, argv, stdin, on_failure, universe)) or 6
    )  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "vpool.sdk.mpiexec", fake)
    import vpool.sdk

    monkeypatch.setattr(vpool.sdk, "mpiexec", fake, raising=False)
    res = run("mpiexec", "-n", "4", "python", "app.py", "-x", "--y")
    assert res.exit_code == 6
    # A leading `python` stays: mpiexec.rank_command runs it under vpool's interpreter.
    assert calls == [(4, ["python", "app.py", "-x", "--y"], None, "transparent", 0)]
    res = run("mpiexec", "-n", "2", "--", "app.py")
    assert calls[-1] == (2, ["app.py"], None, "transparent", 0)
    res = run("mpiexec", "-n", "2", "--on-failure", "ulfm", "--", "app.py")
    assert calls[-1] == (2, ["app.py"], None, "ulfm", 0)
    res = run("mpiexec", "-n", "2", "--universe", "9", "--", "app.py")
    assert calls[-1] == (2, ["app.py"], None, "transparent", 9)


def test_config_shows_the_token_only_when_asked(home: Path) -> None:
    from vpool.sdk import clientconfig

    clientconfig.save(clientconfig.ClientConfig(url="https://pool:8443", token="vpt_secret"), None)
    shown = json.loads(run("config").stdout)
    assert shown["url"] == "https://pool:8443" and shown["token"] == "set"
    assert json.loads(run("config", "--show-token").stdout)["token"] == "vpt_secret"


def test_submit_wait_says_why_the_job_waits_and_when_ranks_restart(coord: Any, app: Path) -> None:
    coord.script(
        chunks=[(0, "stdout", b"done\n")],
        progress=[
            ("queued", "needs 3 slots; 2 are free now (6 run other ranks)", False, 0, 0),
            ("queued", "needs 3 slots; 2 are free now (6 run other ranks)", False, 0, 0),
            ("running", "", False, 0, 3),
            ("running", "", False, 1, 2),
            ("running", "", False, 1, 3),
        ],
    )
    res = run("submit", str(app), "-n", "3", "--wait")
    assert res.exit_code == 0, res.stderr
    assert res.stdout == "done\n"
    lines = res.stderr.splitlines()
    waits = [line for line in lines if "waits:" in line]
    assert waits == ["vsdk: job 1 waits: needs 3 slots; 2 are free now (6 run other ranks)"]
    assert "vsdk: job 1: a lost rank was restarted (1 restart so far)" in lines
    assert [line for line in lines if "running" in line and "rank" in line] == [
        "vsdk: job 1: 3 of 3 ranks running",
        "vsdk: job 1: 2 of 3 ranks running",
        "vsdk: job 1: 3 of 3 ranks running",
    ]
    assert lines.index(waits[0]) < lines.index("vsdk: job 1 running")


def test_submit_validate_asks_for_it_and_says_what_validation_does(coord: Any, app: Path) -> None:
    coord.script(
        chunks=[(0, "stdout", b"pi\n")],
        progress=[("running", "", False, 0, 2)] + [("running", "", False, 0, 1)] * 3,
        validation=["", "validating rank(s) 0, 1", "validating rank(s) 0, 1", "validating: x"],
    )
    res = run("submit", str(app), "-n", "2", "--validate", "--wait")
    assert res.exit_code == 0, res.stderr
    assert res.stdout == "pi\n"
    assert [job.submit.validate for job in coord.jobs.values()] == [True]
    said = [line for line in res.stderr.splitlines() if "validat" in line]
    assert said == [
        "vsdk: job 1 submitted (2 ranks, validated by replay (output shown once validated))",
        "vsdk: job 1: validating rank(s) 0, 1",
        "vsdk: job 1: validating: x",
    ]
    res = run("submit", str(app), "-n", "2", "--validate", "--no-fault-tolerance")
    assert res.exit_code == 2 and "--validate replays the logs" in res.stderr


def test_a_job_the_pool_can_never_run_is_said_even_quietly(coord: Any, app: Path) -> None:
    coord.script(
        progress=[
            ("queued", "needs 30 slots; the agents that may run it have 24 in all", True, 0, 0)
        ]
    )
    res = run("-q", "submit", str(app), "-n", "30", "--wait")
    assert "the pool as it is can never run it" in res.stderr


def test_status_says_why_a_job_waits(coord: Any, app: Path) -> None:
    import msgspec

    coord.script(state="queued", exit_code=None)
    assert run("submit", str(app), "-n", "30").exit_code == 0
    job = coord.jobs[1]
    job.info = msgspec.structs.replace(
        job.info,
        waiting="needs 30 slots; the agents that may run it have 24 in all",
        never_fits=True,
    )
    res = run("status", "1")
    assert res.exit_code == 0, res.stderr
    assert (
        "waiting: needs 30 slots; the agents that may run it have 24 in all  "
        "(the pool as it is can never run it)" in res.stdout.splitlines()
    )


def test_wait_json_prints_the_job_on_timeout(coord: Any, app: Path) -> None:
    coord.script(state="running", exit_code=None)
    assert run("submit", str(app), "-n", "2").exit_code == 0
    res = run("wait", "1", "--timeout", "0.1", "--json")
    assert res.exit_code == 1
    assert json.loads(res.stdout)["state"] == "running"
    assert "did not end within 0.1 s" in res.stderr


def test_quiet_works_after_the_subcommand_too(coord: Any, app: Path) -> None:
    coord.script(chunks=[(0, "stdout", b"out\n")])
    for args in (
        ["-q", "submit", str(app), "-n", "2", "--wait"],
        ["submit", str(app), "-n", "2", "--wait", "-q"],
        ["submit", "-q", str(app), "-n", "2", "--wait"],
    ):
        res = run(*args)
        assert res.exit_code == 0 and res.stdout == "out\n", args
        assert res.stderr == "", args
    loud = run("submit", str(app), "-n", "2", "--wait")
    assert "submitted" in loud.stderr


def test_cancel_of_an_ended_job_is_an_error(coord: Any, app: Path) -> None:
    assert run("submit", str(app), "-n", "1", "--wait").exit_code == 0
    res = run("cancel", "1")
    assert res.exit_code == 1
    assert "already ended (succeeded)" in res.stderr


def test_results_of_a_running_job_say_they_are_partial(
    coord: Any, app: Path, tmp_path: Path
) -> None:
    coord.script(state="running", exit_code=None)
    coord.results_zip = sys.modules["sdk_fakecoord"].zip_of({"rank-0/stdout": b"so far"})
    assert run("submit", str(app), "-n", "2").exit_code == 0
    res = run("results", "1", str(tmp_path / "out"))
    assert res.exit_code == 0, res.stderr
    assert "job 1 is running: these are its results so far" in res.stderr
    done = run("results", "1", str(tmp_path / "out2"), "-q")
    assert "results so far" in done.stderr  # said even with -q: the files are incomplete


def test_stdin_dash_reads_vsdk_stdin(coord: Any, app: Path) -> None:
    assert run("submit", str(app), "-n", "2", "--stdin", "-", input=b"42\n").exit_code == 0
    sub = coord.jobs[1].submit
    assert sub.stdin is not None and coord.blobs[sub.stdin] == b"42\n"


def test_submit_a_project_and_a_program_with_local_modules(coord: Any, tmp_path: Path) -> None:
    import io
    import zipfile

    proj = tmp_path / "proj"
    (proj / "lib").mkdir(parents=True)
    (proj / "main.py").write_text("import lib.physics\n")
    (proj / "lib" / "__init__.py").write_text("")
    (proj / "lib" / "physics.py").write_text("")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "grid.csv").write_text("1\n")
    res = run(
        "submit", str(proj), "--entry", "main.py", "-n", "2", "--input", str(tmp_path / "data")
    )
    assert res.exit_code == 0, res.stderr
    sub = coord.jobs[1].submit
    with zipfile.ZipFile(io.BytesIO(coord.blobs[sub.bundle])) as zf:
        assert sorted(zf.namelist()) == [
            "data/grid.csv",
            "lib/__init__.py",
            "lib/physics.py",
            "main.py",
        ]
    assert sub.entry == "main.py" and sub.name == "proj"

    (tmp_path / "app.py").write_text("import helper\n")
    (tmp_path / "helper.py").write_text("")
    res = run("submit", str(tmp_path / "app.py"), "-n", "1")
    assert "packed the local modules app.py imports: helper.py" in res.stderr


def test_requirements_from_a_file_and_from_pyproject(coord: Any, tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "__main__.py").write_text("import astropy\n")
    (proj / "pyproject.toml").write_text(
        '[project]\nname = "p"\nversion = "0"\ndependencies = ["astropy>=6", "numpy"]\n'
    )
    (tmp_path / "req.txt").write_text("# more\nscipy==1.11.4\nnumpy\n")
    res = run("submit", str(proj), "-n", "2", "--requirements", str(tmp_path / "req.txt"))
    assert res.exit_code == 0, res.stderr
    assert coord.jobs[1].submit.requirements == ["astropy>=6", "numpy", "scipy==1.11.4"]
    (tmp_path / "bad.txt").write_text("-e git+https://example.invalid/x\n")
    res = run("submit", str(proj), "-n", "2", "--requirements", str(tmp_path / "bad.txt"))
    assert res.exit_code == 1 and "line 1: pip options" in res.stderr
