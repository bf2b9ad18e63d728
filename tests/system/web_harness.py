"""`gpuguard web` for the browser tests: its own account, PAM service and key, a headless Chromium.

- `web` (a WebStarter): `table = web.prepare(show_users=...)` makes the web's account (`ggt-*`, in the shadow group
  so pam_unix can check passwords, as the package's unit does), a PAM service file of its own
  (/etc/pam.d/ggt-*: pam_unix auth and account) and returns the `[web]` table to start the daemon
  with (so the daemon lets that account read every user's records); `web.start(daemon)` runs
  `gpuguard web` as that account on a free port of 127.0.0.1. Stopped and removed afterwards.
- `browser`: headless Chromium through chromedriver (Debian's packages); on a failed test it saves
  a screenshot and the page's HTML in build/test-artefacts/.
- `set_password(user, password)`: chpasswd.
- `FormClient(url, source)`: the login form posted from another loopback address (any user can
  bind 127.x.y.z), for the login delay's tests; `set_cookie(response, name)`: a cookie it set.
"""
from __future__ import annotations

import contextlib
import http.client
import os
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import BIN, REPO, TestUser, popen_as
from ssh_harness import PamStacks

ARTEFACTS = REPO / "build" / "test-artefacts"
START_TIMEOUT = 30.0
WEB_PAM = """\
auth     required pam_unix.so
account  required pam_unix.so
"""
WEB_PAM_NO_DELAY = WEB_PAM.replace("auth     required pam_unix.so", "auth     required pam_unix.so nodelay")


@dataclass
class RunningWeb:
    url: str
    account: TestUser
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free where the web will listen: one free on 127.0.0.1 may be taken on another address."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def set_password(user: TestUser, password: str) -> None:
    subprocess.run(["chpasswd"], input=f"{user.name}:{password}\n", text=True, check=True)


class WebStarter:
    """prepare() the account, PAM service and key directory (the `[web]` table to start the daemon
    with), then start(daemon) the web on them."""

    def __init__(self, sandbox: Path, make_user) -> None:
        self.sandbox = sandbox
        self.make_user = make_user
        self.stacks = PamStacks()
        self.started: list[RunningWeb] = []
        self.account: TestUser | None = None
        self.pam_env: Path | None = None

    def prepare(self, pam_env_log: bool = False, fail_delay: bool = True, **table) -> dict:
        """pam_env_log: the PAM stack also writes its environment (PAM_RHOST, PAM_USER...) at
        each authentication to self.pam_env, through pam_exec. fail_delay=False: pam_unix
        `nodelay`, no 2 s sleep after a wrong password (for tests of many failures, not of time)."""
        self.account = self.make_user(groups=["shadow"])
        key_dir = self.sandbox / "web"
        key_dir.mkdir(mode=0o700)
        os.chown(key_dir, self.account.uid, self.account.gid)
        lines = []
        if pam_env_log:
            self.pam_env = key_dir / "pam-env.log"
            lines.append(f"auth optional pam_exec.so quiet log={self.pam_env} /usr/bin/env")
        service = self.stacks.make(*lines, base=WEB_PAM if fail_delay else WEB_PAM_NO_DELAY)
        return {"user": self.account.name, "pam_service": service, "key_file": str(key_dir / "session.key"), **table}

    def start(self, daemon, descriptors: int | None = None, host: str = "127.0.0.1", scheme: str = "http") -> RunningWeb:
        """descriptors: its RLIMIT_NOFILE (prlimit), as a unit's LimitNOFILE sets it; host: where
        it listens (the url names it too); scheme https when [web] tls_cert is set."""
        assert self.account is not None, "prepare() first"
        port = free_port(host)
        log_path = self.sandbox / "web.log"
        limit = ["prlimit", f"--nofile={descriptors}", "--"] if descriptors else []
        with open(log_path, "ab") as log:
            proc = popen_as(self.account, [*limit, str(BIN / "gpuguard"), "--config", str(daemon.config_path), "web",
                                           "--listen", f"{host}:{port}"], stdout=log, stderr=log)
        running = RunningWeb(f"{scheme}://{host}:{port}", self.account, proc, log_path)
        self.started.append(running)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(running.url + "/static/style.css", timeout=2,
                                       context=ssl._create_unverified_context()).close()  # a test's own certificate
                return running
            time.sleep(0.2)
        raise AssertionError(f"gpuguard web did not start (status {proc.poll()}):\n{running.log()}")

    def stop_all(self) -> None:
        for running in self.started:
            running.proc.terminate()
            try:
                running.proc.wait(15)
            except subprocess.TimeoutExpired:
                running.proc.kill()
                running.proc.wait()
            print(f"--- gpuguard web log ---\n{running.log()}")
        self.stacks.remove_all()


class FormClient:
    """The login form, fetched and posted over HTTP from `source` (a loopback address)."""

    def __init__(self, url: str, source: str) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.host, self.port, self.source = parsed.hostname, parsed.port, source

    def request(self, method: str, path: str, body: str = "", headers: dict | None = None) -> http.client.HTTPResponse:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=30, source_address=(self.source, 0))
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        response.text = response.read().decode(errors="replace")
        connection.close()
        return response

    def log_in(self, user: str, password: str, headers: dict | None = None, cookies: str = "") -> http.client.HTTPResponse:
        """cookies: more for the POST ("name=value; ..."), as a browser keeps them (a device cookie)."""
        form = self.request("GET", "/login")
        cookie = form.getheader("Set-Cookie").split(";")[0]  # the pre-login cookie the token is bound to
        token = re.search(r'name=csrf value="([^"]+)"', form.text).group(1)
        body = urllib.parse.urlencode({"user": user, "password": password, "csrf": token})
        cookie = f"{cookie}; {cookies}" if cookies else cookie
        return self.request("POST", "/login", body, {"Cookie": cookie, **(headers or {}),
                                                     "Content-Type": "application/x-www-form-urlencoded"})


def set_cookie(response: http.client.HTTPResponse, name: str) -> str:
    """The `name=value` of the cookie `name` a response sets (AssertionError: none)."""
    for header in response.headers.get_all("Set-Cookie") or []:
        if header.startswith(name + "="):
            return header.split(";")[0]
    raise AssertionError(f"no cookie {name} set: {response.headers.get_all('Set-Cookie')}")


@pytest.fixture
def web(sandbox, make_user) -> Iterator[WebStarter]:
    starter = WebStarter(sandbox, make_user)
    try:
        yield starter
    finally:
        starter.stop_all()


@pytest.fixture
def browser(request) -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = Path(tempfile.mkdtemp(prefix="ggt-chromium-"))
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    # --no-sandbox: Chromium's sandbox refuses to start as root (the tests' user).
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,900", f"--user-data-dir={profile}"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    failed_before = request.session.testsfailed
    try:
        yield driver
    finally:
        if request.session.testsfailed > failed_before:  # the call failed (its report came before teardown)
            ARTEFACTS.mkdir(parents=True, exist_ok=True)
            name = request.node.name.replace("/", "_")
            driver.save_screenshot(str(ARTEFACTS / f"{name}.png"))
            (ARTEFACTS / f"{name}.html").write_text(driver.page_source)
            print(f"screenshot and page: {ARTEFACTS / name}.png, .html")
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
