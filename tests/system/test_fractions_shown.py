"""A shared GPU's fractions are seen everywhere: two sharers promised 30 GiB and 40 GiB of one
simulated 80 GiB GPU show, with 10 GiB left, in `status`, `gpus` (a user's, from the daemon, and
root's, from NVML), each one's `whoami`, a Prometheus scrape and the web's grid; a whole grant on
the other GPU leaves nothing to promise there."""
from __future__ import annotations

import json

import pytest
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from sim_helpers import GiB
from test_metrics import scrape, value  # a real scrape, parsed by prometheus-client's own parser

from devtools.harness import free_port, wait_for

pytestmark = pytest.mark.gate


def two_sharers(start_daemon, make_group, **tables):
    """A daemon on two GPUs: carol holds GPU 1 whole, then alice (30 GiB) and bob (40 GiB) share GPU 0."""
    thirty, whole = make_group(), make_group()
    d = start_daemon(count=2, defaults={"sharing": True, "gpu_memory": "40GiB", "max_sharers": 8},
                     quotas={"groups": {thirty: {"gpu_memory": "30GiB"}, whole: {"sharing": False}}}, **tables)
    alice, bob, carol = d.add_member([thirty]), d.add_member(), d.add_member([whole])
    d.call("grant", user=carol.name, units=[1])
    for user in (alice, bob):
        reply = d.call_as(user, "request")
        assert reply["ok"] and reply["granted"] == [0], reply
    return d, alice, bob, carol


def test_status_gpus_whoami_and_metrics_show_both_fractions_and_10_gib_left(start_daemon, make_group):
    port = free_port()
    d, alice, bob, carol = two_sharers(start_daemon, make_group, metrics={"listen": f"127.0.0.1:{port}"})
    shares = [{"user": alice.name, "uid": alice.uid, "memory": 30 * GiB},
              {"user": bob.name, "uid": bob.uid, "memory": 40 * GiB}]

    status = json.loads(d.cli_as(carol, "status", "--json").stdout)
    shared, held = status["gpus"]
    assert (shared["fractions"], shared["memory_promised"], shared["memory_left"]) == (shares, 70 * GiB, 10 * GiB)
    assert (held["fractions"], held["memory_promised"], held["memory_left"]) == ([], 0, 0)  # held whole
    assert [(h["user"], h["shared"], h["memory"]) for h in shared["holders"]] == [
        (alice.name, True, 30 * GiB), (bob.name, True, 40 * GiB)]
    lines = d.cli_as(carol, "status").stdout.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("GPU 0 ")))
    assert lines[start + 1].strip() == (f"shared: {alice.name} 30GiB, {bob.name} 40GiB; "
                                        "70GiB of 80GiB promised, 10GiB left")
    assert "of 30GiB fraction" in lines[start + 2] and "of 40GiB fraction" in lines[start + 3]
    after = lines.index(next(line for line in lines if line.startswith("GPU 1 ")))
    assert "shared:" not in lines[after + 1] and "quota" in lines[after + 1]  # a whole grant shows as before

    for found in (json.loads(d.cli_as(carol, "gpus", "--json").stdout), json.loads(d.cli("gpus", "--json").stdout)):
        gpu0, gpu1 = found["gpus"]  # a user's from the daemon; root's from NVML, fractions from the daemon
        assert (gpu0["fractions"], gpu0["memory_promised"], gpu0["memory_left"]) == (shares, 70 * GiB, 10 * GiB)
        assert (gpu1["fractions"], gpu1["memory_left"]) == ([], 0)
    header, row0, row1 = d.cli_as(carol, "gpus").stdout.splitlines()[:3]
    assert header.split()[:7] == ["GPU", "INDEX", "NAME", "MEMORY", "USED", "TOTAL", "LEFT"]
    assert header.split()[-1] == "SHARED" and "10GiB" in row0.split()
    assert row0.endswith(f"{alice.name} 30GiB, {bob.name} 40GiB") and row1.endswith(" -")

    for user, mine, other, theirs in ((alice, "30GiB", bob, "40GiB"), (bob, "40GiB", alice, "30GiB")):
        shown = d.cli_as(user, "whoami")
        assert shown.returncode == 0, shown.stderr
        (line,) = [line for line in shown.stdout.splitlines() if line.startswith("GPU 0")]  # "GPU 0 (nvidia-smi 1):"
        assert line.endswith(f": {mine} of 80GiB, shared with {other.name} ({theirs}); 10GiB left"), shown.stdout
        assert f"export CUDA_VISIBLE_DEVICES={d.uuid(0)}" in shown.stdout  # the GPU's UUID, as for a whole grant
        (grant,) = json.loads(d.cli_as(user, "whoami", "--json").stdout)["grants"]
        assert (grant["uuid"], grant["memory_total"], grant["memory_left"]) == (d.uuid(0), 80 * GiB, 10 * GiB)
        assert [f["user"] for f in grant["shared_with"]] == [other.name]
    (whole,) = json.loads(d.cli_as(carol, "whoami", "--json").stdout)["grants"]
    assert whole["shared_with"] == [] and not whole["shared"]

    s = wait_for(lambda: (m := scrape(port)) and value(m, "gpuguard_gpu_fractions", gpu="0") == 2 and m)
    assert value(s, "gpuguard_gpu_memory_promised_bytes", gpu="0", uuid=d.uuid(0)) == 70 * GiB
    assert value(s, "gpuguard_gpu_memory_left_bytes", gpu="0") == 10 * GiB
    assert value(s, "gpuguard_grant_memory_promised_bytes", gpu="0", user=alice.name) == 30 * GiB
    assert value(s, "gpuguard_grant_memory_promised_bytes", gpu="0", user=bob.name) == 40 * GiB
    assert value(s, "gpuguard_gpu_fractions", gpu="1") == 0 and value(s, "gpuguard_gpu_memory_left_bytes", gpu="1") == 0
    assert value(s, "gpuguard_grant_memory_promised_bytes", gpu="1", user=carol.name) is None

    assert d.cli_as(bob, "release").returncode == 0  # bob's promise freed: 50 GiB left, one fraction
    s = wait_for(lambda: (m := scrape(port)) and value(m, "gpuguard_gpu_fractions", gpu="0") == 1 and m)
    assert value(s, "gpuguard_gpu_memory_left_bytes", gpu="0") == 50 * GiB
    assert "shared, nobody else on it yet; 50GiB left" in d.cli_as(alice, "whoami").stdout


def test_the_grid_shows_each_fraction_and_the_memory_left(start_daemon, make_group, web, browser):
    d, alice, bob, carol = two_sharers(start_daemon, make_group, web=web.prepare())
    site = web.start(d)
    browser.get(site.url + "/")

    def cell(label: str) -> str:
        return browser.find_element(By.CSS_SELECTOR, f'.cell[data-unit="{label}"]').text

    WebDriverWait(browser, 20, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda _: "fractions" in cell("0"))
    shared = cell("0")
    assert "2 fractions: 70GiB promised, 10GiB left" in shared
    assert alice.name in shared and "of 30GiB fraction" in shared
    assert bob.name in shared and "of 40GiB fraction" in shared
    whole = cell("1")
    assert carol.name in whole and "fraction" not in whole
