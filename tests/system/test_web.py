"""`gpuguard web` in a real browser (Debian's chromium and chromedriver, headless), on a real daemon.

The web runs as an account of its own, as in production; logins go through a real PAM stack
(pam_unix against /etc/shadow); grants are real daemon grants. Screenshots of failures land in
build/test-artefacts/ (web_harness.browser); the grid's screenshot there (web-now.png) is the
picture in docs/admin.md (Web view).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import math
import os
import re
import resource
import socket
import ssl
import subprocess
import time

import pytest
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException, WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from web_harness import ARTEFACTS, FormClient, set_password

from gpuguard.core.use_history import GPU, LEVELS, TICKS, USER
from gpuguard.services.store import Store, hour_of

pytestmark = pytest.mark.gate

GiB = 1 << 30
LIVE_TIMEOUT = 20.0  # seconds for the page to show a change: the script polls every 2 s
PASSWORD = "ggt correct horse 7"


def cell(driver, label: str):
    return driver.find_element(By.CSS_SELECTOR, f'.cell[data-unit="{label}"]')


def live(driver) -> WebDriverWait:
    """A wait on the live grid: a cell found may be replaced by the next update before it is read
    (stale), which is one more poll, not a failure."""
    return WebDriverWait(driver, LIVE_TIMEOUT, ignored_exceptions=(StaleElementReferenceException,))


def log_in(driver, url: str, user: str, password: str) -> None:
    driver.get(url + "/login")
    driver.find_element(By.NAME, "user").send_keys(user)
    driver.find_element(By.NAME, "password").send_keys(password)
    button = driver.find_element(By.CSS_SELECTOR, "form.login button")
    button.click()
    # The click only starts the POST (PAM's delay after a wrong password included): wait for the
    # page that answers it before anything reads the page.
    WebDriverWait(driver, LIVE_TIMEOUT).until(lambda _: gone(button))


def gone(element) -> bool:
    """staleness_of, also when Chrome is caught mid-navigation: then it answers "Node with given id
    does not belong to the document" (an unknown error), not a stale reference."""
    try:
        element.is_enabled()
    except StaleElementReferenceException:
        return True
    except WebDriverException as exc:
        if "does not belong to the document" in (exc.msg or ""):
            return True
        raise
    return False


def test_grid_shows_a_grant_live(start_daemon, web, browser, burns):
    daemon = start_daemon(web=web.prepare(), defaults={"gpu_memory": "4GiB"})
    alice, bob, carol = daemon.add_member(), daemon.add_member(), daemon.add_member()
    daemon.call("grant", user=bob.name, units=[1])
    daemon.call("grant", user=carol.name, units=[2])
    burns(daemon.config_path, 1, "2GiB", user=bob)
    burns(daemon.config_path, 2, "6GiB", user=carol)  # over carol's 4 GiB quota
    site = web.start(daemon)
    browser.get(site.url + "/")
    live(browser).until(lambda d: cell(d, "2").get_attribute("data-state") == "over")
    assert cell(browser, "0").get_attribute("data-state") == "free"
    assert cell(browser, "1").get_attribute("data-state") == "held"
    assert "1 proc" in cell(browser, "1").text and "of 4GiB" in cell(browser, "1").text
    assert len(browser.find_elements(By.CSS_SELECTOR, ".cell")) == 4
    browser.execute_script("window.ggtSamePage = true")  # gone if the page were loaded again

    daemon.call("grant", user=alice.name, units=[0])

    live(browser).until(lambda d: cell(d, "0").get_attribute("data-state") == "held")
    assert browser.execute_script("return window.ggtSamePage") is True
    assert alice.name in cell(browser, "0").find_element(By.CSS_SELECTOR, ".user").text
    assert cell(browser, "3").get_attribute("data-state") == "free"
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    browser.set_window_size(1040, 480)
    browser.save_screenshot(str(ARTEFACTS / "web-now.png"))  # the picture in docs/admin.md (docs/web.png)

    daemon.call("revoke", user=alice.name)
    live(browser).until(lambda d: cell(d, "0").get_attribute("data-state") == "free")


def test_login_me_page_refusal_and_hostile_strings(start_daemon, web, browser):
    daemon = start_daemon(web=web.prepare())
    alice, bob = daemon.add_member(), daemon.add_member()
    set_password(alice, PASSWORD)
    hostile_host = "<script>window.ggtPwned=1</script>"
    hostile_tty = "<b id=ggt-bold>pts/1</b>"
    caller = daemon.caller()
    opened = daemon.call("session_open", user=alice.name, service="ggt-test", rhost=hostile_host,
                         tty=hostile_tty, pid=caller.pid, grant="always")
    (minor,) = opened["gpus"]
    assert daemon.open_session(bob)["gpus"] != [minor]  # bob's grant starts later: less usage than alice's
    site = web.start(daemon)

    # A wrong password is refused, and the name typed is shown back as text.
    log_in(browser, site.url, "<img src=x id=ggt-img>", "nope")
    assert "Wrong user name or password." in browser.find_element(By.CSS_SELECTOR, ".error").text
    assert browser.find_element(By.NAME, "user").get_attribute("value") == "<img src=x id=ggt-img>"
    assert not browser.find_elements(By.ID, "ggt-img")

    log_in(browser, site.url, alice.name, PASSWORD)
    assert browser.current_url == site.url + "/me"
    assert browser.find_element(By.TAG_NAME, "h1").text == "My GPUs"
    lines = browser.find_element(By.CSS_SELECTOR, "pre.lines").text
    assert f"export CUDA_VISIBLE_DEVICES={daemon.uuid(minor)}" in lines
    assert f"ssh {alice.name}@" in lines
    # What PAM was told by a hostile client is text on the page, not markup.
    assert browser.find_element(By.CSS_SELECTOR, "td.rhost").text == hostile_host
    assert browser.find_element(By.CSS_SELECTOR, "td.tty").text == hostile_tty
    assert not browser.find_elements(By.ID, "ggt-bold")
    assert browser.execute_script("return window.ggtPwned") is None

    # Her fair-share standing, as the daemon's own `fairshare` counts it: both hold a GPU, with
    # one share each; hers started first, so she has used more and is served after bob.
    standing = browser.find_element(By.CSS_SELECTOR, "section.fairshare")
    users = daemon.call("fairshare")["users"]  # asked after the page: her usage has only grown since
    assert [u["user"] for u in users] == [bob.name, alice.name]
    assert standing.find_element(By.CSS_SELECTOR, ".rank").text == "2nd of 2"
    hours = float(standing.find_element(By.CSS_SELECTOR, ".hours").text)
    (own,) = [u for u in users if u["user"] == alice.name]
    assert 0 <= hours <= own["usage"] / 3600 + 0.005  # her usage since, rounded to the page's 2 decimals
    assert standing.find_element(By.CSS_SELECTOR, ".share").text == "1"
    assert "a lower rank is served first" in standing.text and bob.name not in standing.text

    browser.get(f"{site.url}/users/{bob.name}")
    assert browser.find_element(By.TAG_NAME, "h1").text == "Refused"
    assert bob.name not in browser.find_element(By.TAG_NAME, "main").text.replace("Refused", "")

    browser.get(f"{site.url}/users/{alice.name}")
    assert browser.find_element(By.TAG_NAME, "h1").text == "My GPUs"


def test_hidden_names_the_queue_usage_and_an_admin(start_daemon, web, browser, make_group):
    admins = make_group()
    daemon = start_daemon(count=1, web=web.prepare(show_users=False, admin_group=admins))
    alice = daemon.add_member(groups=[admins])
    bob, carol = daemon.add_member(), daemon.add_member()
    set_password(alice, PASSWORD)
    assert daemon.open_session(bob)["gpus"] == [0]
    assert "queue" in daemon.open_session(carol)  # no GPU left: carol waits
    site = web.start(daemon)

    browser.get(site.url + "/")
    assert cell(browser, "0").find_element(By.CSS_SELECTOR, ".user").text == "another user"
    browser.get(site.url + "/queue")
    assert "another user" in browser.find_element(By.TAG_NAME, "table").text
    for name in (bob.name, carol.name):
        assert name not in browser.page_source

    log_in(browser, site.url, alice.name, PASSWORD)
    assert "(admin)" in browser.find_element(By.CSS_SELECTOR, "header .who").text
    browser.get(site.url + "/queue")
    row = browser.find_element(By.CSS_SELECTOR, "tbody tr").text
    assert carol.name in row and "first in line: wants 1 GPU, 0 free" in row
    browser.get(f"{site.url}/users/{bob.name}")
    assert browser.find_element(By.TAG_NAME, "h1").text == f"{bob.name}'s GPUs"
    browser.get(site.url + "/")
    assert cell(browser, "0").find_element(By.CSS_SELECTOR, ".user").text == bob.name

    browser.get(site.url + "/usage")
    charts = browser.find_elements(By.CSS_SELECTOR, "svg.chart")
    assert len(charts) == 4  # by user, GPU, server and day
    assert bob.name in charts[0].text
    table = browser.execute_async_script(
        "const done = arguments[0]; fetch('/usage.csv').then(r => r.text()).then(done)")
    lines = table.splitlines()
    assert lines[0] == "by,key,granted_hours,busy_hours,idle_hours,busy_share"
    assert any(line.startswith(f"user,{bob.name},") for line in lines)


SWEEP_WAIT = 60.0  # the web checks each login's account every 15 s; the open page asks every 2 s


def test_log_out_and_a_locked_account_end_the_login(start_daemon, web, browser):
    daemon = start_daemon(web=web.prepare(secure_cookies=True))  # as shipped: __Host- cookies, Secure
    alice = daemon.add_member()
    set_password(alice, PASSWORD)
    site = web.start(daemon)

    log_in(browser, site.url, alice.name, PASSWORD)
    assert browser.get_cookie("__Host-gpuguard")["secure"] is True
    assert browser.get_cookie("__Host-gpuguard-login") is None  # the pre-login cookie went with the login
    button = browser.find_element(By.CSS_SELECTOR, "header form.logout button")
    button.click()
    WebDriverWait(browser, LIVE_TIMEOUT).until(lambda _: gone(button))
    assert browser.find_element(By.CSS_SELECTOR, "header a[href='/login']").text == "Log in"
    assert browser.get_cookie("__Host-gpuguard") is None
    browser.get(site.url + "/me")
    assert browser.current_url == site.url + "/login"

    # Logged in again, the Now page open; the account is locked: the page goes to the login form.
    log_in(browser, site.url, alice.name, PASSWORD)
    browser.get(site.url + "/")
    assert alice.name in browser.find_element(By.CSS_SELECTOR, "header .who").text
    subprocess.run(["usermod", "-L", alice.name], check=True)
    WebDriverWait(browser, SWEEP_WAIT).until(lambda d: d.current_url == site.url + "/login")
    assert not browser.find_elements(By.CSS_SELECTOR, "header .who")
    assert f"user={alice.name}" in site.log() and "why=locked" in site.log()
    browser.get(site.url + "/me")
    assert browser.current_url == site.url + "/login"


def test_failed_logins_delay_that_client_not_the_user_elsewhere(start_daemon, web, browser):
    daemon = start_daemon(web=web.prepare(pam_env_log=True))  # no trusted_proxies
    alice = daemon.add_member()
    set_password(alice, PASSWORD)
    site = web.start(daemon)
    guesser = FormClient(site.url, source="127.0.0.2")
    forged = {"X-Forwarded-For": "10.9.9.9"}  # not believed: 127.0.0.2 is no trusted proxy

    # The guesser fails until told to wait 4 s or more (failures 4, 5, 6 wait 1, 2, 4 s).
    answers = []
    while True:
        reply = guesser.log_in(alice.name, "wrong guess", forged)
        answers.append(reply.status)
        assert reply.status in (401, 429), reply.text
        if reply.status == 429:
            wait = int(reply.getheader("Retry-After"))
            if wait >= 4:
                break
            time.sleep(wait)
    assert answers[:4] == [401] * 4 and answers.count(401) == 6
    # Even the right password waits, from the guesser's address, whatever it forwards.
    delayed = guesser.log_in(alice.name, PASSWORD, {"X-Forwarded-For": "10.9.9.10"})
    assert delayed.status == 429 and "try again in" in delayed.text

    # Alice herself, from another client (the browser, 127.0.0.1), logs in.
    log_in(browser, site.url, alice.name, PASSWORD)
    assert browser.current_url == site.url + "/me"

    failed = [line for line in site.log().splitlines() if "event=web_login_failed" in line]
    assert len(failed) == 6 and all(f"user={alice.name}" in line and "client=127.0.0.2" in line for line in failed)
    assert "failures=6" in failed[-1] and "delay=4" in failed[-1] and "level=warn" in failed[-1]
    assert "event=web_login_delayed" in site.log()
    # PAM was told the client: PAM_RHOST (pam_unix's own failure line names it).
    rhosts = re.findall(r"^PAM_RHOST=(.*)$", web.pam_env.read_text(), re.M)
    assert rhosts[:6] == ["127.0.0.2"] * 6 and rhosts[-1] == "127.0.0.1"


def test_a_non_member_is_told_whom_to_ask_and_nothing_else(start_daemon, web, browser, make_user):
    daemon = start_daemon(web=web.prepare(contact="gpu-admins@lab.example"))
    outsider = make_user()  # an account of the server, not in the GPU group
    set_password(outsider, PASSWORD)
    site = web.start(daemon)

    log_in(browser, site.url, outsider.name, PASSWORD)
    assert browser.find_element(By.TAG_NAME, "h1").text == "Not in the GPU group"
    main = browser.find_element(By.TAG_NAME, "main").text
    assert f"{outsider.name} is not in {daemon.group}" in main and "ask gpu-admins@lab.example" in main
    for offered in ("Quota", "gpuguard request", "fair", "rank", "Place"):
        assert offered not in main
    assert not browser.find_elements(By.CSS_SELECTOR, "header .who")
    browser.get(site.url + "/me")
    assert browser.current_url == site.url + "/login"
    assert f"event=web_login_refused user={outsider.name}" in site.log()


IDLE_CONNECTIONS = 1100  # past the web's 1,024 descriptors of a default limit
JUNK_LOGINS = 5000
PAGE_LOADS = 10


def test_idle_connections_and_junk_logins_do_not_starve_the_page(start_daemon, web, browser):
    daemon = start_daemon(web=web.prepare())
    alice = daemon.add_member()
    set_password(alice, PASSWORD)
    site = web.start(daemon, descriptors=1024)  # the default limit: 768 connections, 256 descriptors spare
    guesser = FormClient(site.url, source="127.0.0.2")
    assert [guesser.log_in(alice.name, "wrong guess").status for _ in range(3)] == [401] * 3  # its free tries
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, IDLE_CONNECTIONS + 1024), hard))
    port = int(site.url.rsplit(":", 1)[1])
    idle = []

    def junk(worker: int) -> int:
        """Failed logins with names of 100 characters, each address its own, as fast as they go."""
        answered = 0
        for n in range(JUNK_LOGINS // 5):
            if n % 10 == 0:
                client = FormClient(site.url, source=f"127.3.{worker}.{n // 10 + 1}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                answered += client.log_in(f"ggt-junk-{worker}-{n}".ljust(100, "x"), "guess").status in (401, 403)
        return answered

    try:
        for i in range(IDLE_CONNECTIONS):  # from 1,100 loopback addresses: half a request each, then silence
            idler = socket.socket()
            idle.append(idler)
            idler.bind((f"127.2.{i // 250}.{i % 250 + 1}", 0))
            with contextlib.suppress(OSError):
                idler.connect(("127.0.0.1", port))
                idler.send(b"GET / HTTP/1.1\r\nHost: x\r\n")
        browser.set_page_load_timeout(10)
        failed_loads = 0
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            flood = [pool.submit(junk, worker) for worker in range(5)]
            for _ in range(PAGE_LOADS):
                try:
                    browser.get(site.url + "/")
                    assert len(browser.find_elements(By.CSS_SELECTOR, ".cell")) == 4
                except TimeoutException:
                    failed_loads += 1
            junk_answered = sum(f.result() for f in flood)
    finally:
        for idler in idle:
            idler.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    print(f"page loads failed {failed_loads} of {PAGE_LOADS}; junk logins answered {junk_answered} of {JUNK_LOGINS}")
    assert failed_loads == 0
    malformed = FormClient(site.url, source="127.0.0.4")
    for _ in range(50):  # aiohttp refuses a request of 200 headers: one counted line, not a traceback each
        assert malformed.request("GET", "/", headers={f"X-Junk-{n}": "x" for n in range(200)}).status == 400
    assert site.proc.poll() is None
    assert "event=web_request_malformed count=1" in site.log()
    assert "event=web_connection_closed" in site.log() and "why=pushed_out" in site.log()
    assert "Traceback" not in site.log()
    # The guesser's record outlived the flood: its 4th failure delays it, even with the right password.
    assert guesser.log_in(alice.name, "wrong guess").status == 401
    assert guesser.log_in(alice.name, PASSWORD).status == 429


def test_a_stopped_daemon_is_said_whole_and_a_stale_page_says_how_old(start_daemon, web, browser):
    daemon = start_daemon(web=web.prepare())
    site = web.start(daemon)
    browser.get(site.url + "/queue")
    assert "Nobody waits for a GPU." in browser.find_element(By.ID, "live").text

    daemon.stop()
    live(browser).until(lambda d: "not reachable" in d.find_element(By.ID, "live").text)  # its next refresh
    browser.get(site.url + "/queue")
    live_text = browser.find_element(By.ID, "live").text
    assert f"not read: gpuguard daemon not reachable at {daemon.socket}" in live_text
    assert "Nobody waits" not in live_text  # nothing said of a queue that was not read
    browser.get(site.url + "/")
    assert "not read: gpuguard daemon not reachable" in browser.find_element(By.CSS_SELECTOR, "section.server").text
    assert re.search(r"as of \d\d:\d\d:\d\d", browser.find_element(By.CSS_SELECTOR, ".stamp").text)

    site.proc.terminate()  # the web itself gone: the open page keeps what it shows, and says since when
    site.proc.wait(15)
    banner = WebDriverWait(browser, LIVE_TIMEOUT).until(
        lambda d: d.find_element(By.CSS_SELECTOR, ".stale-banner").is_displayed()
        and d.find_element(By.CSS_SELECTOR, ".stale-banner"))
    assert re.fullmatch(r"Not updated for \d+ s: the web server does not answer\. What is shown may have changed\.",
                        banner.text)
    assert "stale" in browser.find_element(By.ID, "live").get_attribute("class")
    assert banner.value_of_css_property("background-color") != "rgba(0, 0, 0, 0)"  # styled, not bare text


def test_the_usage_page_spends_the_users_own_report_budget(start_daemon, web, browser):
    daemon = start_daemon(web=web.prepare())
    alice = daemon.add_member()
    set_password(alice, PASSWORD)
    site = web.start(daemon)
    log_in(browser, site.url, alice.name, PASSWORD)
    statuses = browser.execute_async_script("""
        const done = arguments[0];
        const days = [...Array(12).keys()].map(n => `2026-0${1 + n % 9}-1${n % 10}`);
        (async () => {
          const statuses = [];
          for (const day of days) statuses.push((await fetch(`/usage?since=${day}`)).status);
          done(statuses);
        })();""")
    assert statuses[0] == 200 and 503 in statuses  # 12 pages of 3 reports, one after another: past a burst of 5
    # the same budget as alice's own reports: hers from the socket is refused too, right after
    refused = daemon.cli_as(alice, "report")
    assert refused.returncode != 0 and "too many reports at once" in refused.stderr
    browser.get(site.url + "/usage?since=2026-01-10")  # asked before: from the web's 30 s cache, not refused
    assert browser.find_element(By.TAG_NAME, "h1").text == "GPU usage"


PAGES = {"now": "/", "queue": "/queue", "me": "/me", "usage": "/usage", "history": "/history"}
PHONE = {"width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": True}


def seed_usage(daemon, users) -> None:
    """A fortnight of GPU-hours for each user, written while the daemon is stopped."""
    daemon.stop()
    store = Store(daemon.config.paths.state_dir / "state.db")
    try:
        now = time.time()
        for day in range(14):
            for n, user in enumerate(users):
                hour = hour_of(now - day * 86400 - 3 * 3600)
                store.add_usage(user.uid, user.name, n % 2, hour, granted=3600.0 * (n + 1) / 2,
                                busy=1800.0 * (n + 1) / 2 * (day % 3 + 1) / 3)
    finally:
        store.close()
    daemon.start()


def seed_history(daemon, users) -> None:
    """A day of utilisation and memory in ten minutes (GPU 0 and users[0] swinging, GPU 1 and
    users[1] busy for the last twelve hours), written while the daemon is stopped."""
    ten = LEVELS[1]
    daemon.stop()
    store = Store(daemon.config.paths.state_dir / "state.db")
    try:
        rows = []
        last = ten.start_of(time.time()) - ten.step
        for i in range(ten.length - 1):
            start = last - ten.step * (ten.length - 2 - i)
            swing = 50 + 40 * math.sin(i / 9)
            late = i >= ten.length // 2
            for kind, key, util, memory, total in (
                    (GPU, 0, swing, (20 + 10 * math.sin(i / 14)) * GiB, 80 * GiB),
                    (GPU, 1, 80.0 if late else 0.0, 30 * GiB if late else 0, 80 * GiB),
                    (USER, users[0].uid, swing, (20 + 10 * math.sin(i / 14)) * GiB, 0),
                    (USER, users[1].uid, 80.0 if late else 0.0, 30 * GiB if late else 0, 0)):
                rows.append((ten.step, kind, key, ten.slot(start), start, 60, 60, 60 * util, min(100.0, util + 8),
                             60 * memory, memory, total))
            rows.append((ten.step, TICKS, 0, ten.slot(start), start, 60, 0, 0.0, None, 0.0, 0.0, 0.0))
        store.add_use_buckets(rows)
    finally:
        store.close()
    daemon.start()


def test_every_page_fits_a_phone_has_dark_mode_a_404_and_an_icon(start_daemon, web, browser, burns, make_group):
    """Also makes the pictures of docs/ from this seeded lab: build/test-artefacts/web-PAGE-desktop.png,
    -phone.png and -dark.png for each page (copied to docs/ as they are when the pages change)."""
    admins = make_group()
    daemon = start_daemon(count=2, web=web.prepare(admin_group=admins), defaults={"gpu_memory": "4GiB"})
    alice = daemon.add_member(groups=[admins])
    bob, carol = daemon.add_member(), daemon.add_member()
    set_password(alice, PASSWORD)
    seed_usage(daemon, [alice, bob, carol])
    seed_history(daemon, [alice, bob])
    assert daemon.open_session(alice)["gpus"] == [0]
    assert daemon.open_session(bob)["gpus"] == [1]
    burns(daemon.config_path, 1, "2GiB", user=bob)
    assert "queue" in daemon.open_session(carol)
    site = web.start(daemon)
    log_in(browser, site.url, alice.name, PASSWORD)
    ARTEFACTS.mkdir(parents=True, exist_ok=True)

    def visit(path: str, picture: str) -> None:
        browser.get(site.url + path)
        WebDriverWait(browser, LIVE_TIMEOUT).until(lambda d: d.execute_script("return document.readyState") == "complete")
        wide, shown = browser.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
        assert wide <= shown, f"{path} is {wide} px wide on a {shown} px screen"
        browser.save_screenshot(str(ARTEFACTS / f"web-{picture}.png"))

    for name, path in PAGES.items():
        visit(path, f"{name}-desktop")
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", PHONE)
    for name, path in PAGES.items():
        visit(path, f"{name}-phone")
    assert browser.find_element(By.CSS_SELECTOR, "header form.logout button").is_displayed()
    browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
    for name, path in PAGES.items():
        visit(path, f"{name}-dark")
        background = browser.execute_script("return getComputedStyle(document.body).backgroundColor")
        red, green, blue = (int(v) for v in re.findall(r"\d+", background)[:3])
        assert max(red, green, blue) < 60, f"{path} background {background} under prefers-color-scheme: dark"
    browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})

    # The charts' numbers are a table a screen reader reaches.
    browser.get(site.url + "/usage")
    chart = browser.find_element(By.CSS_SELECTOR, "svg.chart")
    assert "the numbers are in the table below" in chart.get_attribute("aria-label")
    rows = browser.find_elements(By.CSS_SELECTOR, "details.numbers table tbody tr")
    assert any(bob.name in row.get_attribute("textContent") for row in rows)

    # An unknown path: the site's own page, 404; the icon is there.
    browser.get(site.url + "/no/such/page")
    assert browser.find_element(By.TAG_NAME, "h1").text == "Not found"
    assert browser.find_element(By.CSS_SELECTOR, "header nav")
    answers = browser.execute_async_script("""
        const done = arguments[0];
        Promise.all(["/no/such/page", "/favicon.ico"].map(p => fetch(p).then(r => [r.status, r.headers.get("Content-Type")])))
            .then(done);""")
    assert answers[0][0] == 404 and answers[1][0] == 200 and answers[1][1].startswith("image/svg+xml")


def own_address() -> str | None:
    """An address of this host that is not loopback (the route to a documentation network's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def test_plain_http_by_another_name_says_why_and_tls_serves_the_login(start_daemon, web, browser, sandbox):
    address = own_address()
    if address is None:
        pytest.skip("this host has no address but loopback")
    cert, key = sandbox / "web" / "web.crt", sandbox / "web" / "web.key"
    table = web.prepare()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ggt-web",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    for path in (cert, key):
        os.chown(path, web.account.uid, web.account.gid)
    daemon = start_daemon(web=table)
    plain = web.start(daemon, host=address)
    browser.get(plain.url + "/login")
    assert browser.find_element(By.TAG_NAME, "h1").text == "Log in needs HTTPS"
    assert f"ssh -L 9448:localhost:{plain.url.rsplit(':', 1)[1]}" in browser.find_element(By.TAG_NAME, "main").text
    assert not browser.find_elements(By.NAME, "password")
    plain.proc.terminate()
    plain.proc.wait(15)

    text = daemon.config_path.read_text()  # the web reads it at its start; the daemon has no use for these keys
    assert "[web]\n" in text
    daemon.config_path.write_text(text.replace("[web]\n", f'[web]\ntls_cert = "{cert}"\ntls_key = "{key}"\n', 1))
    secure = web.start(daemon, host=address, scheme="https")
    host, port = address, int(secure.url.rsplit(":", 1)[1])
    connection = http.client.HTTPSConnection(host, port, timeout=30, context=ssl._create_unverified_context())
    connection.request("GET", "/login")
    reply = connection.getresponse()
    assert reply.status == 200 and 'type=password name=password' in reply.read().decode()
    cookie = reply.getheader("Set-Cookie")
    assert cookie.startswith("__Host-gpuguard-login=") and "Secure" in cookie
    connection.close()
    assert "https=True" in secure.log()


def test_my_processes_on_the_me_page_follow_live(start_daemon, web, browser, burns):
    daemon = start_daemon(count=2, web=web.prepare())
    alice, bob = daemon.add_member(), daemon.add_member()
    set_password(alice, PASSWORD)
    daemon.call("grant", user=alice.name, units=[0])
    daemon.call("grant", user=bob.name, units=[1])
    burns(daemon.config_path, 0, "2GiB", user=alice)
    burns(daemon.config_path, 1, "1GiB", user=bob)
    site = web.start(daemon)
    log_in(browser, site.url, alice.name, PASSWORD)

    def rows(d):
        return d.find_elements(By.CSS_SELECTOR, "section.procs tbody tr")
    live(browser).until(lambda d: len(rows(d)) == 1)
    browser.execute_script("window.ggtSamePage = true")
    cells = rows(browser)[0].find_elements(By.TAG_NAME, "td")
    assert [cells[1].text, cells[4].text] == ["0", "2GiB"]  # hers, not bob's on GPU 1
    burns(daemon.config_path, 0, "1GiB", user=alice)
    live(browser).until(lambda d: len(rows(d)) == 2)
    assert browser.execute_script("return window.ggtSamePage") is True  # refreshed in place
    assert bob.name not in browser.find_element(By.CSS_SELECTOR, "section.procs").text
