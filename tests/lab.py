"""A real JupyterLab on 127.0.0.1 with a token, and Debian's chromium driven by Playwright.

Playwright's own browser download fails here, so it drives ``/usr/bin/chromium``; tests that
need them skip, saying why, where either is missing. Lab's own news and update checks are off
(this machine has no network, and their notices would cover the page in screenshots).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",  # (root, in a container)
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def needs_browser() -> None:
    """Skip the calling test where chromium, Playwright or JupyterLab is missing."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is not installed (Debian's chromium: make test installs it)")
    for module in ("playwright", "jupyterlab"):
        try:
            __import__(module)
        except ImportError:
            pytest.skip(f"{module} is not installed: pip install -e '.[test]'")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """``with Lab(folder) as lab:`` a JupyterLab serving ``folder``, ended on exit with its
    kernels (by its own handle)."""

    def __init__(self, root: str, env: dict | None = None) -> None:
        self.root = root
        self.env = env
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.home = os.path.join(root, ".lab")
        self.process: subprocess.Popen | None = None

    def url(self, path: str = "lab") -> str:
        return f"http://127.0.0.1:{self.port}/{path}?token={self.token}"

    def __enter__(self) -> Lab:
        settings = os.path.join(self.home, "settings", "@jupyterlab", "apputils-extension")
        os.makedirs(settings, exist_ok=True)
        with open(os.path.join(settings, "notification.jupyterlab-settings"), "w") as f:
            json.dump({"fetchNews": "false", "checkForUpdates": False}, f)
        self.log = open(os.path.join(self.home, "lab.log"), "w")  # noqa: SIM115
        for attempt in range(3):
            if attempt:  # (its port was taken between our choice and its bind: another)
                self.port = _free_port()
            self._start()
            if self._ready():
                return self
        self.__exit__()
        raise AssertionError(f"JupyterLab did not start: see {self.log.name}")

    def _start(self) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
                "--ip=127.0.0.1", f"--port={self.port}",
                # (a port taken: it ends, rather than serve on the next, where another
                # process, a rank's scheduler say, would answer our requests)
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.root}",
                f"--LabApp.user_settings_dir={os.path.join(self.home, 'settings')}",
                f"--LabApp.workspaces_dir={os.path.join(self.home, 'workspaces')}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )

    def _ready(self) -> bool:
        """Until it answers (True), or its process has ended (False)."""
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url("api/status"), timeout=2).close()
                return True
            except (OSError, http.client.HTTPException):  # (not yet; or another's port)
                if self.process.poll() is not None:
                    return False
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise AssertionError(f"JupyterLab did not start: see {self.log.name}") from None
                time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # (it shuts its kernels down first)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


@contextlib.contextmanager
def browser_page(width: int = 1200, height: int = 1000):
    """A page of a headless chromium of its own (a new profile each time)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(60_000)
            yield page
        finally:
            browser.close()


def serve_checkout_extension(data: str) -> None:
    """The checkout's own build of the extension (spmd/labextension) in the Jupyter data
    folder ``data``, found before any other: JupyterLab takes the first of a name on its path,
    and an environment's installed copy may be an older build."""
    import spmd

    os.makedirs(os.path.join(data, "labextensions"), exist_ok=True)
    os.symlink(os.path.join(os.path.dirname(spmd.__file__), "labextension"),
               os.path.join(data, "labextensions", "jupyter-spmd"))


def kernel_stacks(lab: Lab) -> str:
    """Every thread's stack in each of the Lab's kernels (``kill -USR2``: spmd.kernel.app),
    as they wrote them to the Lab's log: for a test whose kernel seems stuck."""
    import psutil

    for kernel in psutil.Process(lab.process.pid).children():
        with contextlib.suppress(psutil.Error):
            kernel.send_signal(signal.SIGUSR2)
    time.sleep(1.0)
    lab.log.flush()
    with open(lab.log.name, errors="replace") as f:
        return f.read()[-12000:]


def save_shot(page, folder: str, name: str, show=None) -> str:
    """A screenshot of the page, with the locator ``show`` scrolled into view first (the
    notebook scrolls inside the page, so a full-page shot would not reach it)."""
    if show is not None:
        show.scroll_into_view_if_needed()
    path = os.path.join(folder, f"{name}.png")
    page.screenshot(path=path)
    keep = os.environ.get("SPMD_SCREENSHOTS")  # a folder to copy them to (for the README)
    if keep:
        os.makedirs(keep, exist_ok=True)
        shutil.copy(path, keep)
    return path
