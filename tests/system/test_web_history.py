"""Utilisation and memory over time on a real daemon with simulated load (`gpuguard sim burn`):
the downsampled series the daemon keeps in its store, what its `use_history` answers, and the
SVG and tables the web's History page serves from them, in a real browser; and the usage and
history tables sorted by a click."""
from __future__ import annotations

import socket
import sqlite3
import time

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from test_web import LIVE_TIMEOUT, PASSWORD, log_in, seed_usage
from web_harness import set_password

from devtools.harness import wait_for
from gpuguard.core.use_history import GPU, LEVELS, TICKS, USER
from gpuguard.services.store import Store
from gpuguard.web.svg import line_points
from gpuguard.web.views import natural

pytestmark = pytest.mark.gate

GiB = 1 << 30
MINUTE, TEN = LEVELS[0], LEVELS[1]


def buckets(daemon, step: int, kind: str, key: int) -> dict[int, tuple]:
    """start -> (n, util_n, util_sum, util_peak, mem_sum, mem_peak) as the store keeps them."""
    with sqlite3.connect(f"file:{daemon.config.paths.state_dir / 'state.db'}?mode=ro", uri=True) as db:
        return {row[0]: row[1:] for row in db.execute(
            "SELECT start, n, util_n, util_sum, util_peak, mem_sum, mem_peak FROM use_buckets"
            " WHERE step = ? AND kind = ? AND key = ?", (step, kind, key))}


def series(reply: dict, kind: str, key: str) -> dict:
    found = {"gpus": "label", "users": "user"}
    return next(entry for entry in reply[kind] if str(entry[found[kind]]) == key)


def peak(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def test_the_daemon_keeps_downsampled_series_and_the_page_draws_them(start_daemon, web, browser, burns):
    daemon = start_daemon(web=web.prepare())
    alice, bob = daemon.add_member(), daemon.add_member()
    set_password(alice, PASSWORD)
    daemon.call("grant", user=alice.name, units=[0])
    daemon.call("grant", user=bob.name, units=[1])
    burns(daemon.config_path, 0, "3GiB", user=alice, util=70)
    burns(daemon.config_path, 1, "1GiB", user=bob, util=30)

    def seen(span: str) -> dict | None:
        reply = daemon.call("use_history", span=span)
        peaks = (peak(series(reply, "gpus", "0")["util_peak"]), peak(series(reply, "gpus", "1")["util_peak"]))
        return reply if peaks == (70, 30) else None
    hour = wait_for(lambda: seen("hour"))
    day = daemon.call("use_history", span="day")
    assert hour["step"] == 60 and len(hour["ticks"]) == 60 and day["step"] == 600 and len(day["ticks"]) == 144
    gpu0, alice_hour = series(hour, "gpus", "0"), series(hour, "users", alice.name)
    assert peak(alice_hour["util_peak"]) == 70 and peak(alice_hour["memory_peak"]) == 3 * GiB
    assert peak(series(hour, "users", bob.name)["util_peak"]) == 30
    assert peak(gpu0["memory_peak"]) == 3 * GiB and gpu0["memory_total"] > 3 * GiB
    # Alice alone on GPU 0 in every sample: her utilisation and memory are the GPU's, bucket by bucket.
    for i, util in enumerate(gpu0["util"]):
        if alice_hour["util"][i] is not None and hour["ticks"][i]:
            assert alice_hour["util"][i] == pytest.approx(util, abs=0.1), i
            assert alice_hour["memory"][i] == pytest.approx(gpu0["memory"][i], abs=1), i
    # The day's last bucket is the hour's minutes since its start, weighed by their samples.
    since = day["start"] + 600 * (len(day["ticks"]) - 1)
    minutes = [i for i in range(60) if hour["start"] + 60 * i >= since and hour["ticks"][i]]
    later = daemon.call("use_history", span="day")
    if later["start"] == day["start"]:  # no ten minutes closed between the two calls
        weighed = sum(gpu0["util"][i] * hour["ticks"][i] for i in minutes) / sum(hour["ticks"][i] for i in minutes)
        assert series(day, "gpus", "0")["util"][-1] == pytest.approx(weighed, abs=0.2)

    # Stopped: the minute counted so far is written; what the store keeps is what was answered.
    daemon.stop()
    gpu_rows, alice_rows = buckets(daemon, 60, GPU, 0), buckets(daemon, 60, USER, alice.uid)
    ticks = buckets(daemon, 60, TICKS, 0)
    assert max(row[3] for row in gpu_rows.values()) == 70.0 and max(row[5] for row in gpu_rows.values()) == 3.0 * GiB
    for start, row in alice_rows.items():
        assert row[2] == pytest.approx(gpu_rows[start][2]) and row[4] == pytest.approx(gpu_rows[start][4])
        assert gpu_rows[start][0] == ticks[start][0]  # every sample read GPU 0
    closed = [s for s in gpu_rows if s < MINUTE.start_of(time.time()) - 60]
    for start in closed:
        i = (start - hour["start"]) // 60
        if 0 <= i < 60 and hour["ticks"][i] == ticks[start][0]:  # that minute had ended when asked
            n, _, util_sum, *_ = gpu_rows[start]
            assert gpu0["util"][i] == pytest.approx(util_sum / n, abs=0.05)

    # Ten minutes of GPU 3 from before this daemon, written while it is stopped, as if no daemon
    # had summed anything yet: summed into the day's ring at its next start, the mean of its minutes.
    earlier = TEN.start_of(time.time()) - 1800
    store = Store(daemon.config.paths.state_dir / "state.db")
    try:
        rows = []
        for i in range(10):
            start = earlier + 60 * i
            rows.append((60, GPU, 3, MINUTE.slot(start), start, 6, 6, 6 * 10.0 * i, 10.0 * i, 6 * 2.0 * GiB,
                         2.0 * GiB, 80.0 * GiB))
            rows.append((60, TICKS, 0, MINUTE.slot(start), start, 6, 0, 0.0, None, 0.0, 0.0, 0.0))
        store.add_use_buckets(rows, prune=[(600, 2 ** 40), (3600, 2 ** 40)])  # the coarser rings emptied
    finally:
        store.close()
    daemon.start()
    summed = wait_for(lambda: buckets(daemon, 600, GPU, 3).get(earlier))
    assert summed == (60, 60, 60 * 45.0, 90.0, 60 * 2.0 * GiB, 2.0 * GiB)
    day = daemon.call("use_history", span="day")
    gpu3 = series(day, "gpus", "3")
    assert gpu3["util"][(earlier - day["start"]) // 600] == 45.0 and gpu3["util_peak"][(earlier - day["start"]) // 600] == 90.0

    # The page: every GPU, alice's own series and no one else's, values as the daemon gave them.
    site = web.start(daemon)
    log_in(browser, site.url, alice.name, PASSWORD)
    browser.get(site.url + "/history?span=day")
    figures = {f.get_attribute("data-key"): f for f in browser.find_elements(By.CSS_SELECTOR, "figure.trend")}
    assert set(figures) == {"0", "1", "2", "3", alice.name}
    assert bob.name not in browser.find_element(By.TAG_NAME, "main").text
    chart = figures["3"].find_element(By.CSS_SELECTOR, "svg.trend")
    label = browser.find_element(By.ID, chart.get_attribute("aria-labelledby")).text  # what a screen reader says
    assert label.startswith("GPU 3") and "peak 90%" in label and "(peak 2GiB)" in label
    assert "peak 70%" in figures["0"].find_element(By.CSS_SELECTOR, ".words").text
    server = socket.gethostname()
    browser.get(f"{site.url}/history?span=hour&server={server}&gpu=0")
    d = browser.find_element(By.CSS_SELECTOR, "svg.trend path.util").get_attribute("d")
    drawn = line_points(d)
    rows = browser.find_elements(By.CSS_SELECTOR, "table.trend-numbers tbody tr")
    assert len(rows) == 60
    peaks = []
    for x, row in enumerate(rows):
        cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
        if cells == ["not sampled"]:
            assert x not in drawn
            continue
        util = int(cells[0].rstrip("%"))
        assert drawn[x] == 100 - util, (x, cells)  # the line at each bucket is the table's number
        peaks.append((cells[1], cells[3]))
    assert ("70%", "3GiB") in peaks and all(p[0] in ("0%", "70%") for p in peaks)
    browser.get(f"{site.url}/history?span=hour&server={server}&user={bob.name}")
    assert browser.find_element(By.TAG_NAME, "h1").text == "Not found"  # bob's is not hers to see


def test_usage_and_history_tables_sort_by_a_click(start_daemon, web, browser, make_group, burns):
    admins = make_group()
    daemon = start_daemon(web=web.prepare(admin_group=admins))
    alice = daemon.add_member(groups=[admins])
    bob, carol = daemon.add_member(), daemon.add_member()
    set_password(alice, PASSWORD)
    seed_usage(daemon, [alice, bob, carol])  # granted: alice < bob < carol; busy share by day, the same for each
    daemon.call("grant", user=bob.name, units=[1])
    daemon.call("grant", user=carol.name, units=[2])
    burns(daemon.config_path, 2, "1GiB", user=carol, util=50)
    wait_for(lambda: any(u["user"] == carol.name and peak(u["util_peak"]) == 50
                         for u in daemon.call("use_history", span="hour")["users"]))
    site = web.start(daemon)
    log_in(browser, site.url, alice.name, PASSWORD)

    def labels(heading: str) -> list[str]:
        table = browser.find_element(By.XPATH, f"//h2[@id='{heading}']/following::table[1]")
        return [row.find_element(By.TAG_NAME, "th").get_attribute("textContent")
                for row in table.find_elements(By.CSS_SELECTOR, "tbody tr")]

    browser.get(site.url + "/usage")
    assert labels("by-user") == [carol.name, bob.name, alice.name]  # most GPU-hours first
    order = browser.find_element(By.XPATH, "//h2[@id='by-user']/following::p[@class='order'][1]")
    order.find_element(By.LINK_TEXT, "by name").click()
    until(browser, lambda: "sort=name" in browser.current_url)
    assert labels("by-user") == sorted([alice.name, bob.name, carol.name], key=natural)
    assert browser.find_element(By.XPATH, "//h2[@id='by-user']/following::details[1]").get_attribute("open")
    bars = [t.text for t in browser.find_elements(By.CSS_SELECTOR, "#by-user + p.order + svg text")]
    assert [b for b in bars if b in (alice.name, bob.name, carol.name)] == sorted([alice.name, bob.name, carol.name], key=natural)
    header = browser.find_element(By.XPATH, "//h2[@id='by-user']/following::table[1]//th[@scope='col'][2]/a")
    header.click()
    until(browser, lambda: "sort=granted" in browser.current_url)
    assert labels("by-user") == [carol.name, bob.name, alice.name]

    browser.get(site.url + "/history?span=hour")
    users = browser.find_element(By.XPATH, "//h2[text()='Users']/following::table[1]")
    names = [r.find_element(By.TAG_NAME, "th").text for r in users.find_elements(By.CSS_SELECTOR, "tbody tr")]
    assert names == [carol.name, bob.name]  # the busiest first (bob holds a GPU he does not use; alice none)
    users.find_element(By.LINK_TEXT, "name").click()
    until(browser, lambda: "usort=name" in browser.current_url)
    users = browser.find_element(By.XPATH, "//h2[text()='Users']/following::table[1]")
    assert users.find_element(By.CSS_SELECTOR, "th[aria-sort]").text == "name"
    names = [r.find_element(By.TAG_NAME, "th").text for r in users.find_elements(By.CSS_SELECTOR, "tbody tr")]
    assert names == sorted([carol.name, bob.name], key=natural)


def until(browser, predicate) -> None:
    WebDriverWait(browser, LIVE_TIMEOUT).until(lambda _: predicate())
