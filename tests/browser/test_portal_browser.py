"""The web portal in a real Chromium against a real local pool (3 agents, 2 relays).

A scientist signs in with her token, submits ``examples/pi.py`` on 4 ranks from the form,
watches the job page follow the run by itself (no reload): a rank the test SIGKILLs shows on
the timeline as lost and then restarted, and the output arrives; she downloads the results and
signs out. Another user sees none of her jobs on any page, and no page makes the browser fetch
anything from anywhere but the coordinator. Screenshots of the job page (with its fault) and of
an operator's pool page are kept under ``build/test-artifacts/browser/`` (``VPOOL_TEST_ARTIFACTS``).
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from browser_helpers import Browser, OpenBrowser

REPO = Path(__file__).resolve().parents[2]
PI = REPO / "examples" / "pi.py"
INTERVALS = "120000000"  # long enough (several seconds a rank) to kill a rank mid-run
DEADLINE = 120.0


def _integration() -> object:
    """``tests/integration/conftest.py`` as a module: its local pool helpers."""
    name = "integration_pool"
    if name not in sys.modules:
        path = REPO / "tests" / "integration" / "conftest.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    helpers = _integration()
    p = helpers.start_pool(tmp_path_factory.mktemp("portal") / "home")  # type: ignore[attr-defined]
    try:
        yield p
    finally:
        p.vsdk("local", "down", timeout=60)


def _local(pool: object) -> tuple[str, Path, Path]:
    """The pool's URL, the coordinator's certificate (pinned in the browser), its settings."""
    root = pool.home / "state" / "local-pool"  # type: ignore[attr-defined]
    url = json.loads((root / "pool.json").read_text())["url"]
    return url, root / "coordinator" / "cert.pem", root / "coordinator" / "config.toml"


def _add_user(pool: object, name: str, *flags: str) -> str:
    _, _, config = _local(pool)
    res = subprocess.run(
        [
            str(Path(sys.executable).parent / "vpool-coordinator"),
            "user",
            "add",
            name,
            *flags,
            "--config",
            str(config),
        ],
        env=pool.env,  # type: ignore[attr-defined]
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr.decode()
    return res.stdout.decode().split()[-1]


def _sign_in(b: Browser, url: str, token: str) -> None:
    from selenium.webdriver.common.by import By

    b.get(url + "/")
    b.wait_for("input#token")  # signed out, / is the sign-in page and nothing else
    assert urlsplit(b.driver.current_url).path == "/login"
    assert b.driver.find_elements(By.CSS_SELECTOR, "nav") == []
    b.driver.find_element(By.CSS_SELECTOR, "input#token").send_keys(token)
    b.driver.find_element(By.CSS_SELECTOR, "button#sign-in").click()
    try:
        b.wait_for("h1", text="Your jobs")
    except Exception:
        print(b.driver.current_url, b.driver.page_source[:3000])
        raise


def _submit_from_form(b: Browser, *, ranks: int, args: str) -> int:
    """Submit examples/pi.py from the form; the job's number, once its page shows."""
    from selenium.webdriver.common.by import By

    b.driver.find_element(By.LINK_TEXT, "Submit").click()
    b.wait_for("h1", text="Submit a job")
    b.driver.find_element(By.ID, "program").send_keys(str(PI))
    field = b.driver.find_element(By.ID, "ranks")
    field.clear()
    field.send_keys(str(ranks))
    b.driver.find_element(By.ID, "args").send_keys(args)
    b.driver.find_element(By.ID, "submit").click()
    page = b.wait_until(
        lambda d: re.fullmatch(r"/jobs/(\d+)", urlsplit(d.current_url).path), 30, "no job page"
    )
    b.wait_for("#job-state")
    return int(page.group(1))


def _ranks_on_timeline(b: Browser, rank: int) -> list[tuple[str, str]]:
    """(state, incarnation) of the timeline's segments of ``rank``, left to right."""
    return b.driver.execute_script(
        "return Array.from(document.querySelectorAll("
        "`svg.timeline rect.seg[data-rank='${arguments[0]}']`))"
        ".map(r => [r.dataset.state, r.dataset.incarnation || ''])",
        str(rank),
    )


def _all_on_origin(b: Browser, url: str) -> None:
    origin = urlsplit(url)
    urls = b.requested_urls()
    assert urls, "the browser requested nothing?"
    for u in urls:
        parts = urlsplit(u)
        assert (parts.scheme, parts.netloc) == (origin.scheme, origin.netloc) or parts.scheme in (
            "data",
            "blob",
        ), f"the page fetched {u} from outside the coordinator"


@pytest.mark.slow
def test_scientist_submits_watches_a_fault_and_downloads(
    pool: object, browser: OpenBrowser, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    url, cert, _ = _local(pool)
    token = _add_user(pool, "alice")
    b = browser(cert, downloads=tmp_path / "downloads")
    _sign_in(b, url, token)

    job = _submit_from_form(b, ranks=4, args=INTERVALS)
    b.driver.execute_script("window.vpoolNoReload = true")  # gone if the page reloads

    # Kill rank 1 once the page shows it running; the page then shows it lost and replaced.
    b.wait_until(lambda d: ["running", "1"] in _ranks_on_timeline(b, 1), 30, "rank 1 never ran")

    def rank_1_pid(_: object) -> int | None:
        found = [p for j, r, p in pool.rank_processes() if (j, r) == (job, 1)]  # type: ignore[attr-defined]
        return found[0] if found else None

    os.kill(b.wait_until(rank_1_pid, 30, "no process of rank 1"), signal.SIGKILL)

    def lost_then_restarted(_: object) -> bool:
        segs = _ranks_on_timeline(b, 1)
        states = [s for s, _ in segs]
        if "lost" not in states:
            return False
        after = states[states.index("lost") + 1 :]
        return any(s in ("starting", "replaying", "restored", "running") for s in after)

    b.wait_until(lost_then_restarted, DEADLINE, "rank 1 not shown lost and restarted")
    b.wait_for("svg.timeline .mark-fault")
    b.wait_until(
        lambda d: (
            "replay" in " ".join(s for s, _ in _ranks_on_timeline(b, 1))
            or "restored" in [s for s, _ in _ranks_on_timeline(b, 1)]
        ),
        DEADLINE,
        "rank 1's replacement never ran",
    )
    shot = b.screenshot("job-page-with-a-fault")
    assert shot.stat().st_size > 10_000

    # The output arrives by itself, and the job ends, all without a reload.
    b.wait_for("#output", text="pi is approximately 3.14159265", timeout=DEADLINE)
    b.wait_until(
        lambda d: d.find_element(By.ID, "job").get_attribute("data-state") == "succeeded",
        DEADLINE,
        "the job did not succeed",
    )
    assert b.driver.execute_script("return window.vpoolNoReload === true")
    events = b.driver.find_element(By.ID, "events").text
    assert "rank_lost" in events and "rank_restarted" in events
    output = b.driver.find_element(By.ID, "output").text
    assert (
        output.count("pi is approximately") == 1
        and f"({INTERVALS} intervals over 4 ranks)" in output
    )
    b.screenshot("job-page-ended")

    # Results.
    b.driver.find_element(By.ID, "results").click()
    zipped = b.wait_for_download(".zip", timeout=60)
    with zipfile.ZipFile(io.BytesIO(zipped.read_bytes())) as zf:
        text = b"".join(zf.read(n) for n in zf.namelist())
    assert b"pi is approximately 3.14159265" in text

    # Nothing came from outside the coordinator.
    _all_on_origin(b, url)

    # Sign out: back to the sign-in page; the job page now wants a session.
    b.driver.find_element(By.ID, "sign-out").click()
    b.wait_for("input#token")
    b.get(f"{url}/jobs/{job}")
    b.wait_for("input#token")
    assert urlsplit(b.driver.current_url).path == "/login"
    assert "pi is approximately" not in b.driver.page_source


@pytest.mark.slow
def test_another_user_sees_none_of_the_first_users_jobs(
    pool: object, browser: OpenBrowser, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    url, cert, _ = _local(pool)
    carol = browser(cert, downloads=tmp_path / "carol")
    _sign_in(carol, url, _add_user(pool, "carol"))
    job = _submit_from_form(carol, ranks=2, args="1000")
    carol.wait_until(
        lambda d: d.find_element(By.ID, "job").get_attribute("data-state") == "succeeded",
        DEADLINE,
        "carol's job did not succeed",
    )
    carol.wait_for("#output", text="pi is approximately")

    dave = browser(cert, downloads=tmp_path / "dave")
    _sign_in(dave, url, _add_user(pool, "dave"))
    assert f"/jobs/{job}" not in dave.driver.page_source
    for path in (
        "/jobs",
        "/jobs?all=true",
        "/jobs?q=pi",
        f"/jobs/{job}",
        f"/jobs/{job}?rank=0",
        f"/jobs/{job}/live",
        f"/jobs/{job}/results",
        "/pool",
        "/account",
    ):
        dave.get(url + path)
        dave.wait_for("body")
        source = dave.driver.page_source
        for secret in ("pi is approximately", "pi.py", "carol", f'href="/jobs/{job}"'):
            assert secret not in source, (path, secret)
    dave.get(f"{url}/jobs/{job}")
    dave.wait_for("h1", text=f"no job {job}")
    assert list((tmp_path / "dave").glob("*")) == []  # the results link gave no file
    _all_on_origin(dave, url)


@pytest.mark.slow
def test_operator_pool_page(pool: object, browser: OpenBrowser) -> None:
    from selenium.webdriver.common.by import By

    url, cert, _ = _local(pool)
    b = browser(cert)
    _sign_in(b, url, _add_user(pool, "ops", "--operator"))
    b.driver.find_element(By.LINK_TEXT, "Pool").click()
    b.wait_for("table#agents")
    agents = b.driver.find_element(By.ID, "agents").text
    assert agents.count("alive") == 3 and "sandbox" in agents
    relays = b.driver.find_element(By.ID, "relays").text
    assert relays.count("alive") == 2
    shot = b.screenshot("pool-page")
    assert shot.stat().st_size > 10_000
    _all_on_origin(b, url)
