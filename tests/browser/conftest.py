"""Fixtures of the browser tests: ``browser``, a factory of real headless Chromiums (see
``browser_helpers.py`` next to this file; pytest runs with --import-mode=importlib, so it is
registered here by path before any test module imports it).

    def test_portal(browser, tmp_path):
        b = browser(pool_dir / "ca.pem", downloads=tmp_path / "dl")
        b.get("https://127.0.0.1:8443/")
        b.wait_for("h1", text="Pool")

A machine without /usr/bin/chromium, /usr/bin/chromedriver or selenium skips these tests.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


def _load_helpers(name: str) -> None:
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_load_helpers("browser_helpers")
from browser_helpers import (  # noqa: E402
    Browser,
    OpenBrowser,
    close_browser,
    missing_requirement,
    start_browser,
)


@pytest.fixture
def browser(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenBrowser]:
    """``browser(cert_pem, *, downloads=None) -> Browser``: a fresh headless Chromium trusting
    the key of the PEM certificate ``cert_pem`` (pinned, nothing else is trusted), saving
    downloads into ``downloads`` (default ``tmp_path / "downloads"``). Every browser it opened is
    quit at teardown. Skips the test if Chromium, chromedriver or selenium is missing."""
    reason = missing_requirement()
    if reason is not None:
        pytest.skip(reason)
    opened: list[Browser] = []
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)[:80]

    def open_browser(cert_pem: Path, *, downloads: Path | None = None) -> Browser:
        name = base if not opened else f"{base}-{len(opened) + 1}"
        b = start_browser(Path(cert_pem), downloads=downloads or tmp_path / "downloads", name=name)
        opened.append(b)
        return b

    yield open_browser
    errors: list[BaseException] = []
    for b in reversed(opened):
        try:
            close_browser(b)
        except Exception as err:
            errors.append(err)
    if errors:
        raise errors[0]
