"""A real headless Chromium for browser tests: Debian's ``chromium`` driven by Debian's
``chromedriver`` through Selenium, trusting exactly one HTTPS certificate.

Trust is a pin, not a blanket ``--ignore-certificate-errors``: Chromium gets
``--ignore-certificate-errors-spki-list=<base64 sha256 of the certificate's SubjectPublicKeyInfo>``,
so a server presenting any other key still gets Chrome's "Privacy error" interstitial. Chromium
honours that flag only with a ``--user-data-dir``; chromedriver always passes one (a fresh
profile it makes under $TMPDIR and deletes at quit). We must not pass our own: given one,
chromedriver no longer opens ``data:,`` first, so Chromium's first tab is the new-tab page, which
with Debian's default search engine navigates to https://start.duckduckgo.com/ (a DNS lookup).

The rest keeps the browser on 127.0.0.1: no background networking, component updates, sync,
metrics uploads, translation, network time...; and since Chromium still asks Google for signin
accounts and a component at startup, ``--host-resolver-rules`` resolves every name but
127.0.0.1 and localhost to nothing inside the browser (no DNS query leaves it). It runs as root
in a container: ``--no-sandbox``, ``--headless=new``, ``--disable-dev-shm-usage``, with a
throwaway HOME and TMPDIR (so the profile, NSS db and caches) for every browser.

conftest.py loads this file by path (pytest runs with --import-mode=importlib); selenium is
imported lazily, so that a machine without it skips the browser tests instead of erroring.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cryptography import x509
from cryptography.hazmat.primitives import serialization

if TYPE_CHECKING:
    from selenium.webdriver.chrome.webdriver import WebDriver
    from selenium.webdriver.remote.webelement import WebElement

CHROMIUM = Path("/usr/bin/chromium")
# The Debian wrapper /usr/bin/chromium sources /etc/chromium.d (it exports Google API keys and adds
# --enable-remote-extensions); the real binary behind it takes only the flags given here.
CHROMIUM_BINARY = Path("/usr/lib/chromium/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
REPO = Path(__file__).resolve().parents[2]
WINDOW = (1400, 2000)

# Keep the browser quiet on the network: nothing but the server under test may be contacted.
QUIET_FLAGS = (
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-default-apps",
    "--disable-extensions",
    "--metrics-recording-only",
    "--disable-domain-reliability",
    "--disable-client-side-phishing-detection",
    "--disable-breakpad",
    "--no-pings",
    "--password-store=basic",
    "--use-mock-keychain",
    "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication,"
    "CertificateTransparencyComponentUpdater,InterestFeedContentSuggestions,"
    "NetworkTimeServiceQuerying",  # else: http://clients2.google.com/time/1/current
    # Chromium 156 still asks https://accounts.google.com/ListAccounts (signin) and
    # https://update.googleapis.com (an on-demand "Optimization Guide" component, despite
    # --disable-component-update) at startup, whatever the flags above: names other than the
    # loopback ones resolve to nothing, inside the browser, so no DNS query ever leaves it.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost",
)
# Running as root inside a container, without a display or a large /dev/shm.
CONTAINER_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-dev-shm-usage",
    "--disable-gpu",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
)


def missing_requirement() -> str | None:
    """Why the browser tests cannot run on this machine, or None if they can."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (path.is_file() and os.access(path, os.X_OK)):
            return f"{path} is missing (apt install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install 'selenium>=4.20')"
    return None


def spki_sha256_b64(cert_pem: Path) -> str:
    """The base64 SHA-256 of a PEM certificate's SubjectPublicKeyInfo (DER): the form
    ``--ignore-certificate-errors-spki-list`` takes."""
    cert = x509.load_pem_x509_certificate(cert_pem.read_bytes())
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return base64.b64encode(hashlib.sha256(spki).digest()).decode("ascii")


def artifacts_dir() -> Path:
    """Where screenshots and chromedriver logs go: $VPOOL_TEST_ARTIFACTS, or
    <repo>/build/test-artifacts/browser/."""
    env = os.environ.get("VPOOL_TEST_ARTIFACTS")
    path = Path(env) if env else REPO / "build" / "test-artifacts" / "browser"
    path.mkdir(parents=True, exist_ok=True)
    return path


def chromium_args(cert_pem: Path) -> list[str]:
    """The command-line flags the browser is started with (chromedriver adds its own, among
    them --user-data-dir, --remote-debugging-port and the first URL ``data:,``)."""
    return [
        *CONTAINER_FLAGS,
        *QUIET_FLAGS,
        # Trust this one key, whatever signed it (with chromedriver's --user-data-dir).
        f"--ignore-certificate-errors-spki-list={spki_sha256_b64(cert_pem)}",
    ]


class OpenBrowser(Protocol):
    """The ``browser`` fixture: opens a headless Chromium trusting ``cert_pem``'s key."""

    def __call__(self, cert_pem: Path, *, downloads: Path | None = None) -> Browser: ...


class Browser:
    """A started headless Chromium (``driver``) with waits, screenshots, downloads and the list
    of every URL its pages requested."""

    def __init__(
        self, driver: WebDriver, *, downloads: Path, artifacts: Path, name: str, home: Path
    ) -> None:
        self.driver = driver
        self.downloads = downloads
        self.artifacts = artifacts
        self.name = name
        self.home = home  # the throwaway HOME and TMPDIR, holding chromedriver's profile
        self._requested: list[str] = []

    # -- navigation and waits --------------------------------------------------------------
    def get(self, url: str) -> None:
        self.driver.get(url)

    def wait_until(
        self, predicate: Callable[[WebDriver], Any], timeout: float = 30, message: str = ""
    ) -> Any:
        """Poll ``predicate(driver)`` until it is truthy (returned) or raise TimeoutException."""
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, timeout, poll_frequency=0.05).until(predicate, message)

    def wait_for(self, css: str, *, text: str | None = None, timeout: float = 30) -> WebElement:
        """The first visible element matching ``css`` (whose text contains ``text``, if given)."""
        from selenium.common.exceptions import StaleElementReferenceException
        from selenium.webdriver.common.by import By

        def found(driver: WebDriver) -> WebElement | None:
            try:
                for element in driver.find_elements(By.CSS_SELECTOR, css):
                    if element.is_displayed() and (text is None or text in element.text):
                        return element
            except StaleElementReferenceException:
                pass
            return None

        wanted = css if text is None else f"{css} containing {text!r}"
        return self.wait_until(found, timeout, f"no {wanted} within {timeout}s")  # type: ignore[no-any-return]

    # -- what the browser did ---------------------------------------------------------------
    def requested_urls(self) -> list[str]:
        """Every distinct URL this browser requested or navigated to so far (documents, styles,
        scripts, XHR/fetch, images, ..., from its start on, but for chromedriver's blank ``data:,``
        first page), in first-request order, from Chrome's performance log (accumulated here:
        reading the log empties it)."""
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            method, params = message.get("method"), message.get("params", {})
            if method == "Network.requestWillBeSent":
                url = params["request"]["url"]
            elif method == "Page.frameStartedNavigating":
                url = params["url"]  # also navigations that never sent a request
            else:
                continue
            if url == "data:,":  # chromedriver's first page, logged or not depending on timing
                continue
            if url not in self._requested:
                self._requested.append(url)
        return list(self._requested)

    def cookies(self) -> list[dict[str, Any]]:
        return self.driver.get_cookies()  # type: ignore[no-any-return]

    def screenshot(self, name: str) -> Path:
        """A PNG of the whole page (beyond the viewport) in the artefacts directory."""
        path = self.artifacts / f"{self.name}-{name}.png"
        try:
            shot = self.driver.execute_cdp_cmd(
                "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}
            )
            path.write_bytes(base64.b64decode(shot["data"]))
        except Exception:  # an old chromedriver without CDP: the viewport is 1400x2000 anyway
            path.write_bytes(self.driver.get_screenshot_as_png())
        return path

    def wait_for_download(self, suffix: str, timeout: float = 30) -> Path:
        """The finished download whose name ends with ``suffix`` (never a partial .crdownload)."""

        def finished(_driver: WebDriver) -> Path | None:
            if any(p.name.endswith(".crdownload") for p in self.downloads.iterdir()):
                return None
            for path in sorted(self.downloads.iterdir()):
                if path.name.endswith(suffix) and path.is_file():
                    return path
            return None

        return self.wait_until(finished, timeout, f"no *{suffix} in {self.downloads}")  # type: ignore[no-any-return]

    def quit(self) -> None:
        self.driver.quit()


def chrome_options(cert_pem: Path, *, downloads: Path) -> Any:
    """The ``selenium.webdriver.ChromeOptions`` of a browser trusting ``cert_pem``'s key."""
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM_BINARY if CHROMIUM_BINARY.is_file() else CHROMIUM)
    for arg in chromium_args(cert_pem):
        options.add_argument(arg)
    options.add_experimental_option("excludeSwitches", ["enable-automation", "enable-logging"])
    options.add_experimental_option(
        "prefs",
        {
            "download.default_directory": str(downloads),
            "download.prompt_for_download": False,
            "download.directory_upgrade": True,
            "safebrowsing.enabled": False,
        },
    )
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    return options


def start_browser(cert_pem: Path, *, downloads: Path, name: str = "browser") -> Browser:
    """A fresh headless Chromium trusting ``cert_pem``'s key, downloading into ``downloads``.
    The caller must ``close_browser()`` it (the ``browser`` fixture does). Call
    ``missing_requirement()`` first."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    downloads.mkdir(parents=True, exist_ok=True)
    artifacts = artifacts_dir()
    options = chrome_options(cert_pem, downloads=downloads)
    # chromedriver and Chromium see a throwaway HOME and TMPDIR (chromedriver makes the profile
    # there), no proxy settings, and none of the Google API keys Debian's /usr/bin/chromium
    # wrapper would export.
    home = Path(tempfile.mkdtemp(prefix="vpool-chromium-"))
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.lower().endswith("_proxy") and not key.startswith("GOOGLE_")
    }
    env.update(HOME=str(home), TMPDIR=str(home))
    env.update(XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"))
    try:
        service = Service(
            executable_path=str(CHROMEDRIVER),
            env=env,
            log_output=str(artifacts / f"{name}-chromedriver.log"),
        )
        driver = webdriver.Chrome(options=options, service=service)
    except BaseException:
        shutil.rmtree(home, ignore_errors=True)
        raise
    browser = Browser(driver, downloads=downloads, artifacts=artifacts, name=name, home=home)
    try:
        driver.set_page_load_timeout(30)
        # The download prefs suffice for Chromium 156 --headless=new; older headless modes
        # ignore them and take only this.
        driver.execute_cdp_cmd(
            "Browser.setDownloadBehavior",
            {"behavior": "allow", "downloadPath": str(downloads), "eventsEnabled": False},
        )
    except BaseException:
        close_browser(browser)
        raise
    return browser


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie awaiting its reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def close_browser(browser: Browser, timeout: float = 10) -> None:
    """Quit chromedriver and the Chromium it started, wait (up to ``timeout``) until that
    Chromium has exited, killing it if it outlives the deadline; remove the throwaway HOME."""
    pid = browser.driver.capabilities.get("goog:processID")
    try:
        browser.quit()
    finally:
        # quit() returns once chromedriver has asked Chromium to close; its processes wind down
        # afterwards, and would otherwise still be writing the profile being removed below.
        if isinstance(pid, int):
            deadline = time.monotonic() + timeout
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(browser.home, ignore_errors=True)
