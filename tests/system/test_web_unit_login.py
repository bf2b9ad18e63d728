"""A web login under the shipped units' settings: gpuguard web without the shadow group, its
passwords checked (and its sweep's locked and expired accounts read) by the root helper of
gpuguard-web-login.socket.

This machine's PID 1 is no systemd, so the units' settings that decide whether a password can be
checked are applied as systemd would: the web as its own account with no supplementary group,
NoNewPrivileges and an empty capability bounding set (setpriv; etc/gpuguard-web.service says so,
checked here); the helper as root with no capability and NoNewPrivileges, one process per
connection on /run/gpuguard-web-login.sock, mode 0666 (systemd-socket-activate --accept --inetd,
as the socket unit's Accept=yes hands each connection to a process as its stdin and stdout).
Found this way, and checked first: the web's account cannot check another user's password by
itself, with or without NoNewPrivileges (unix_chkpwd checks only its caller's own), so without
the helper no login could work.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BIN, PYTHON, REPO
from deb_lock import package_lock
from ssh_harness import PamStacks
from test_shipped_files import setting, unit_sections
from web_harness import START_TIMEOUT, WEB_PAM, FormClient, free_port, set_password

from devtools.harness import wait_for
from gpuguard.web.login_helper import LOGIN_SOCKET

WEB_UNIT = unit_sections(REPO / "etc/gpuguard-web.service")
HELPER_UNIT = unit_sections(REPO / "etc/gpuguard-web-login@.service")
SOCKET_UNIT = unit_sections(REPO / "etc/gpuguard-web-login.socket")
PASSWORD = "ggt-Correct-Horse-9"
# systemd's NoNewPrivileges= and CapabilityBoundingSet= (empty), for a process setpriv starts.
CONFINED = ["setpriv", "--no-new-privs", "--bounding-set", "-all", "--"]

pytestmark = pytest.mark.skipif(shutil.which("systemd-socket-activate") is None or shutil.which("pamtester") is None,
                                reason="needs systemd-socket-activate (systemd) and pamtester")


def test_the_units_are_what_this_test_applies() -> None:
    assert not [value for key, value in WEB_UNIT["Service"] if key == "SupplementaryGroups"]
    assert setting(WEB_UNIT, "Service", "DynamicUser") == "yes"
    assert setting(WEB_UNIT, "Service", "NoNewPrivileges") == "yes"
    assert setting(WEB_UNIT, "Service", "CapabilityBoundingSet") == ""
    assert "gpuguard-web-login.socket" in setting(WEB_UNIT, "Unit", "Wants")
    assert not [value for key, value in HELPER_UNIT["Service"] if key in ("User", "DynamicUser", "Group")]  # root
    assert setting(HELPER_UNIT, "Service", "NoNewPrivileges") == "yes"
    assert setting(HELPER_UNIT, "Service", "CapabilityBoundingSet") == ""
    assert setting(HELPER_UNIT, "Service", "StandardInput") == "socket"
    assert setting(SOCKET_UNIT, "Socket", "ListenStream") == str(LOGIN_SOCKET)
    assert setting(SOCKET_UNIT, "Socket", "Accept") == "yes"
    assert setting(SOCKET_UNIT, "Socket", "SocketMode") == "0666"


def pam_check_as(caller, service: str, user: str, password: str, confined: bool) -> bool:
    argv = [*(CONFINED if confined else []), "pamtester", service, user, "authenticate", "acct_mgmt"]
    result = subprocess.run(["setpriv", "--reuid", str(caller.uid), "--regid", str(caller.gid), "--clear-groups",
                             *argv], input=password + "\n", capture_output=True, text=True, timeout=60)
    return result.returncode == 0


@pytest.fixture
def helper(sandbox) -> Iterator[Path]:
    """The login helper on LOGIN_SOCKET as the socket unit runs it; yields the path of the config it
    reads at each connection (for the test to link to the daemon's)."""
    with package_lock():  # the socket's path is the machine's own
        if LOGIN_SOCKET.exists():
            pytest.skip(f"{LOGIN_SOCKET} exists: a real gpuguard web runs here")
        config_path = sandbox / "helper-config.toml"
        log = open(sandbox / "helper.log", "ab")  # closed below, after the process
        proc = subprocess.Popen(["systemd-socket-activate", "--accept", "--inetd", "-l", str(LOGIN_SOCKET),
                                 "-E", f"GPUGUARD_CONFIG={config_path}", *CONFINED, PYTHON, "-I", "-m",
                                 "gpuguard.web.login_helper"], stdout=log, stderr=log)
        try:
            assert wait_for(LOGIN_SOCKET.exists, timeout=10), (sandbox / "helper.log").read_text()
            os.chmod(LOGIN_SOCKET, 0o666)  # SocketMode=
            yield config_path
        finally:
            proc.terminate()
            proc.wait(15)
            log.close()
            LOGIN_SOCKET.unlink(missing_ok=True)
            print(f"--- helper log ---\n{(sandbox / 'helper.log').read_text(errors='replace')}")


def start_web(daemon, account, sandbox: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    log = open(sandbox / "web.log", "ab")  # the process's, as long as it runs
    proc = subprocess.Popen(["setpriv", "--reuid", str(account.uid), "--regid", str(account.gid), "--clear-groups",
                             *CONFINED, str(BIN / "gpuguard"), "--config", str(daemon.config_path), "web",
                             "--listen", f"127.0.0.1:{port}"], stdout=log, stderr=log, cwd="/")
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(url + "/static/style.css", timeout=2).close()
            return url, proc
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"gpuguard web did not start: {(sandbox / 'web.log').read_text()}")


def test_a_web_login_works_without_the_shadow_group(start_daemon, make_user, sandbox, helper) -> None:
    account = make_user()  # the web's account: no shadow group, as DynamicUser= makes it
    stacks = PamStacks()
    try:
        service = stacks.make(base=WEB_PAM)
        key_dir = sandbox / "web"
        key_dir.mkdir(mode=0o700)
        os.chown(key_dir, account.uid, account.gid)
        daemon = start_daemon(web={"user": account.name, "pam_service": service,
                                   "key_file": str(key_dir / "session.key")})
        helper.symlink_to(daemon.config_path)
        alice = daemon.add_member()
        set_password(alice, PASSWORD)

        # Why the helper: under the web's settings its account cannot check alice's password itself,
        # with or without NoNewPrivileges (alice can check her own, but not under NoNewPrivileges).
        assert not pam_check_as(account, service, alice.name, PASSWORD, confined=True)
        assert not pam_check_as(account, service, alice.name, PASSWORD, confined=False)
        assert pam_check_as(alice, service, alice.name, PASSWORD, confined=False)
        assert not pam_check_as(alice, service, alice.name, PASSWORD, confined=True)

        url, proc = start_web(daemon, account, sandbox)
        try:
            with open(f"/proc/{proc.pid}/status") as status:
                fields = dict(line.rstrip("\n").split(":\t", 1) for line in status if ":\t" in line)
            assert fields["Groups"].split() == [] and fields["NoNewPrivs"].strip() == "1", fields
            client = FormClient(url, source="127.0.0.1")
            wrong = client.log_in(alice.name, "not her password")
            assert wrong.status == 401 and "Wrong user name or password." in wrong.text
            right = client.log_in(alice.name, PASSWORD)
            assert right.status == 303 and right.getheader("Location") == "/me", (right.status, right.text)
        finally:
            proc.terminate()
            proc.wait(15)
            print(f"--- web log ---\n{(sandbox / 'web.log').read_text(errors='replace')}")

        # The sweep's question (who is locked or expired in /etc/shadow) goes to the helper too.
        subprocess.run(["usermod", "-L", alice.name], check=True)
        sweep = subprocess.run(["setpriv", "--reuid", str(account.uid), "--regid", str(account.gid), "--clear-groups",
                                *CONFINED, PYTHON, "-c", "from gpuguard.web import wiring; "
                                f"print(wiring.ended([{alice.name!r}]))"], capture_output=True, text=True,
                               timeout=60, cwd="/")
        assert sweep.stdout.strip() == str({alice.name: "locked"}), sweep.stderr

        # Anyone but the web's account is told "no", even with the right password, and asks PAM nothing.
        intruder = make_user()
        probe = ("import sys; from pathlib import Path; from gpuguard.web.login_helper import ask; "
                 f"sys.exit(0 if ask({alice.name!r}, {PASSWORD!r}, 'ggt') else 1)")
        asked = subprocess.run(["setpriv", "--reuid", str(intruder.uid), "--regid", str(intruder.gid),
                                "--clear-groups", PYTHON, "-c", probe], capture_output=True, text=True, timeout=60,
                               cwd="/")
        assert asked.returncode == 1, asked.stderr
        assert f"uid={intruder.uid}" in (sandbox / "helper.log").read_text()
    finally:
        stacks.remove_all()
