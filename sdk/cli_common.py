"""What every ``vsdk`` command shares: the client settings, error reporting, JSON output."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import msgspec

from vpool.sdk.errors import VsdkError

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Settings:
    """Global options of ``vsdk``: where the client config is, and explicit overrides."""

    config: Path | None = None
    url: str | None = None
    token: str | None = None
    ca: Path | None = None
    quiet: bool = False

    def client(self) -> Any:
        from vpool.sdk.client import Client

        return Client.from_config(self.config, url=self.url, token=self.token, ca=self.ca)


pass_settings = click.make_pass_decorator(Settings, ensure=True)


class VsdkGroup(click.Group):
    """A group whose commands report ``VsdkError`` as one line on stderr and exit with the
    error's exit code (never a traceback)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except VsdkError as exc:
            error(str(exc))
            raise click.exceptions.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            click.echo("vsdk: interrupted", err=True)
            raise click.exceptions.Exit(130) from None
        except BrokenPipeError:
            # The reader of our stdout went away (e.g. `| head`): stop quietly, and point
            # stdout at /dev/null so the interpreter's final flush does not complain.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            raise click.exceptions.Exit(1) from None


def _quiet(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.ensure_object(Settings).quiet = True


def quiet_everywhere(group: click.Group) -> None:
    """Let ``-q/--quiet`` come after a subcommand too (``vsdk submit app.py -n 4 -q``), as
    well as before it, on every command of ``group`` and its subgroups."""
    for command in group.commands.values():
        if isinstance(command, click.Group):
            quiet_everywhere(command)
        names = {opt for p in command.params for opt in getattr(p, "opts", [])}
        if "-q" in names or "--quiet" in names:
            continue
        command.params.append(
            click.Option(
                ["-q", "--quiet"],
                is_flag=True,
                expose_value=False,
                is_eager=True,
                callback=_quiet,
                help="No progress messages on stderr.",
            )
        )


def error(message: str) -> None:
    click.echo(f"vsdk: error: {message}", err=True)


def note(settings: Settings, message: str) -> None:
    """Progress for people: always on stderr, so stdout stays machine-readable."""
    if not settings.quiet:
        click.echo(f"vsdk: {message}", err=True)


def exit_with(code: int) -> NoReturn:
    raise click.exceptions.Exit(code)


def print_json(value: Any) -> None:
    click.echo(msgspec.json.format(msgspec.json.encode(value), indent=2).decode())


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")(
        f
    )
