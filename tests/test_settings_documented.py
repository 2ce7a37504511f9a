"""Every setting of every component is declared with help text, loads from TOML and environment,
and docs/configuration.md is the current rendering of the tables (regenerate it with
`.venv/bin/python -m vpool.config > docs/configuration.md`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from vpool.config import SettingsError, all_tables, load_settings, render_docs

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_every_setting_has_help() -> None:
    tables = all_tables()
    assert len(tables) == 3
    for cls, _prefix in tables:
        fields = dataclasses.fields(cls)
        assert fields, cls
        for f in fields:
            assert len(f.metadata.get("help", "")) > 10, f"{cls.__name__}.{f.name} has no help"


def test_configuration_doc_is_current() -> None:
    assert DOC.read_text() == render_docs()


def test_layering_file_then_env_then_overrides(tmp_path: Path) -> None:
    for cls, prefix in all_tables():
        f = next(f for f in dataclasses.fields(cls) if f.type in ("str", str))
        path = tmp_path / "c.toml"
        path.write_text(f'{f.name} = "from-file"\n')
        assert getattr(load_settings(cls, prefix=prefix, file=path, env={}), f.name) == "from-file"
        env = {f"{prefix}_{f.name.upper()}": "from-env"}
        assert getattr(load_settings(cls, prefix=prefix, file=path, env=env), f.name) == "from-env"
        got = load_settings(cls, prefix=prefix, file=path, env=env, overrides={f.name: "cli"})
        assert getattr(got, f.name) == "cli"


def test_unknown_setting_is_an_error(tmp_path: Path) -> None:
    cls, prefix = all_tables()[0]
    path = tmp_path / "c.toml"
    path.write_text("no_such_setting = 1\n")
    with pytest.raises(SettingsError, match="no_such_setting"):
        load_settings(cls, prefix=prefix, file=path, env={})
