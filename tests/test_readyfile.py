"""How a vpool process says it is ready: ``--ready-file`` and ``--ready-fd`` (vpool.readyfile),
in process and through the three commands' options."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from vpool.readyfile import Ready, ready_options

INFO = {"host": "127.0.0.1", "port": 4443, "pid": 12, "url": "https://127.0.0.1:4443"}


class Pipe:
    """A pipe whose ends the test may close, or hand to what closes them: the teardown closes
    only what is still its own (a number closed here may be reused by then)."""

    def __init__(self) -> None:
        self.read, self.write = os.pipe()
        self.open = {self.read, self.write}

    def given(self, fd: int) -> int:
        """``fd`` now belongs to what it is given to (it closes it)."""
        self.open.discard(fd)
        return fd

    def close(self, fd: int) -> None:
        os.close(self.given(fd))


@pytest.fixture
def pipe() -> Iterator[Pipe]:
    p = Pipe()
    yield p
    for fd in p.open:
        os.close(fd)


def test_announce_writes_the_file_and_one_line_to_the_pipe_then_closes_it(
    tmp_path: Path, pipe: Pipe
) -> None:
    read_end, write_end = pipe.read, pipe.write
    os.set_inheritable(write_end, True)  # as a launcher's pass_fds leaves it
    ready = Ready(tmp_path / "ready.json", pipe.given(write_end))
    assert not os.get_inheritable(write_end)  # not passed on to the ranks and helpers
    ready.announce(INFO)
    assert json.loads((tmp_path / "ready.json").read_text()) == INFO
    line = os.read(read_end, 65536)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == INFO
    assert os.read(read_end, 65536) == b""  # closed: the launcher sees the end
    ready.announce(INFO)  # a second announcement writes the file again, and no pipe
    ready.withdraw()
    assert not (tmp_path / "ready.json").exists()


def test_announce_goes_on_when_the_launcher_is_gone(pipe: Pipe) -> None:
    pipe.close(pipe.read)
    ready = Ready(fd=pipe.given(pipe.write))
    ready.announce(INFO)  # no BrokenPipeError: the process serves all the same
    assert ready.fd is None


def test_a_ready_fd_must_be_an_open_pipe(tmp_path: Path, pipe: Pipe) -> None:
    write_end = pipe.write
    pipe.close(write_end)
    with pytest.raises(ValueError, match=f"--ready-fd {write_end} is not an open file"):
        Ready(fd=write_end)
    with open(tmp_path / "f", "wb") as f:
        with pytest.raises(ValueError, match="is not a pipe or a socket"):
            Ready(fd=f.fileno())


def test_nothing_asked_nothing_written(tmp_path: Path) -> None:
    ready = Ready()
    ready.announce(INFO)
    ready.withdraw()
    assert list(tmp_path.iterdir()) == []


@click.command()
@ready_options("{host, port}")
@click.option("--port", type=int, default=0)
def _command(ready: Ready, port: int) -> None:
    ready.announce({"host": "127.0.0.1", "port": port})


def test_the_options_make_one_ready(tmp_path: Path, pipe: Pipe) -> None:
    path = tmp_path / "ready.json"
    res = CliRunner().invoke(
        _command,
        ["--ready-fd", str(pipe.given(pipe.write)), "--port", "7", "--ready-file", str(path)],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(path.read_text()) == json.loads(os.read(pipe.read, 4096))
    assert json.loads(path.read_text()) == {"host": "127.0.0.1", "port": 7}
    help_text = CliRunner().invoke(_command, ["--help"]).output
    assert "--ready-file" in help_text and "--ready-fd" in help_text


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("vpool.coordinator.cli", ["serve"]),
        ("vpool.relay.cli", []),
        ("vpool.worker_agent.cli", []),
    ],
)
def test_each_command_refuses_a_ready_fd_that_is_not_a_pipe(
    module: str, args: list[str], tmp_path: Path
) -> None:
    command = importlib.import_module(module).main
    with open(tmp_path / "not-a-pipe", "wb") as f:
        fd = f.fileno()
        res = CliRunner().invoke(command, [*args, "--ready-fd", str(fd)])
    assert res.exit_code == 2, res.output
    assert f"--ready-fd {fd} is not a pipe or a socket" in res.output
