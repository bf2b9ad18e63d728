"""Metrics: a real daemon with the endpoint on a free loopback port, scraped over HTTP and parsed
with prometheus-client's own parser; the textfile and dcgm-exporter's job mapping it writes."""
from __future__ import annotations

import signal
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sim_helpers import GiB, start_burn, stop_burn

from devtools.harness import free_port, wait_for
from gpuguard.daemon import admission

Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    """{(sample name, labels): value} of an exposition; fails on anything the parser refuses."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of the one sample with this name and these labels among its labels (None: absent)."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) <= 1, f"{name} {labels}: {len(found)} samples"
    return found[0] if found else None


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        return parse(reply.read().decode())


@pytest.mark.gate
def test_a_scrape_shows_holders_memory_watcher_actions_and_the_gate(start_daemon, sandbox):
    port = free_port()
    textfile, mapping = sandbox / "textfile" / "gpuguard.prom", sandbox / "dcgm-jobs"
    d = start_daemon(defaults={"gpus": 1, "gpu_memory": "4GiB"},
                     watcher={"interval": "0.2s", "grace": "1s", "kill_wait": "1s"},
                     metrics={"listen": f"127.0.0.1:{port}", "textfile": str(textfile),
                              "dcgm_job_mapping_dir": str(mapping)})
    alice = d.add_member()
    (minor,) = d.open_session(alice)["gpus"]
    held = start_burn(d.config_path, minor, "2GiB", user=alice)
    try:
        s = wait_for(lambda: (m := scrape(port)) and
                     value(m, "gpuguard_user_gpu_memory_used_bytes", gpu=str(minor), user=alice.name) and m)
        assert value(s, "gpuguard_user_gpu_memory_used_bytes", gpu=str(minor), user=alice.name) == 2 * GiB
        assert value(s, "gpuguard_gpu_memory_used_bytes", gpu=str(minor)) == 2 * GiB
        assert value(s, "gpuguard_gpu_memory_total_bytes", gpu=str(minor)) == 80 * GiB
        assert value(s, "gpuguard_gpu_holder", gpu=str(minor), user=alice.name, uid=str(alice.uid)) == 1
        assert value(s, "gpuguard_grant_age_seconds", gpu=str(minor), user=alice.name) >= 0
        assert value(s, "gpuguard_gpu_up", gpu=str(minor)) == 1
        assert value(s, "gpuguard_grants") == 1 and value(s, "gpuguard_sessions") == 1
        assert value(s, "gpuguard_queue_requests") == 0 and value(s, "gpuguard_queue_oldest_wait_seconds") == 0
        assert value(s, "gpuguard_gate_attached") == 1
        assert value(s, "gpuguard_gate_map_entries", map="grants") == 1
        assert value(s, "gpuguard_watcher_tick_seconds_count") >= 1
        assert value(s, "gpuguard_kills_total", rule="memory", signal="SIGTERM") == 0  # shown before the first
        assert value(s, "process_resident_memory_bytes") > 0  # the daemon's own, on the endpoint only

        over = start_burn(d.config_path, minor, "6GiB", user=alice)  # 8GiB in all: the newest is stopped
        assert over.wait(timeout=30) == -signal.SIGTERM
        s = wait_for(lambda: (m := scrape(port)) and
                     value(m, "gpuguard_kills_total", rule="memory", signal="SIGTERM") and m)
        assert value(s, "gpuguard_warnings_total", rule="memory") == 1
        assert value(s, "gpuguard_kills_total", rule="memory", signal="SIGTERM") == 1
        assert value(s, "gpuguard_kills_total", rule="memory", signal="SIGKILL") == 0
    finally:
        stop_burn(held)

    d.call("revoke", user=alice.name)
    s = wait_for(lambda: (m := scrape(port)) and value(m, "gpuguard_revokes_total", rule="admin") and m)
    assert value(s, "gpuguard_gpu_holder", gpu=str(minor)) is None and value(s, "gpuguard_grants") == 0
    assert value(s, "gpuguard_grants_given_total", origin="session") == 1

    # The textfile has the same gpuguard metrics (and no process_* ones, which node_exporter has itself).
    written = wait_for(lambda: textfile.exists() and (f := parse(textfile.read_text())) and
                       value(f, "gpuguard_revokes_total", rule="admin") and f)
    assert value(written, "gpuguard_grants") == 0 and value(written, "process_resident_memory_bytes") is None
    assert not [p for p in textfile.parent.iterdir() if p != textfile]  # no temporary file left behind
    assert wait_for(lambda: not any(mapping.iterdir())), "the released GPU's job mapping file stays"


@pytest.mark.gate
def test_a_refused_metrics_address_stops_the_start_with_its_cause(start_daemon):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AssertionError, match=rf"metrics.listen 127.0.0.1:{port}: Address already in use"):
            start_daemon(metrics={"listen": f"127.0.0.1:{port}"})


@pytest.mark.gate
def test_connections_over_the_cap_are_refused_quietly_and_counted(start_daemon):
    """Connections past the endpoint's cap are closed before aiohttp makes a request handler for
    them (one made and closed at once failed an assertion in its task, logged as loop_error with a
    traceback for each), and the refusals are one counter."""
    port = free_port()
    d = start_daemon(metrics={"listen": f"127.0.0.1:{port}"})
    scrape(port)  # serving
    held: list[socket.socket] = []

    def refused_some() -> bool:  # idle connections in a burst: past the cap, all young, so refused
        for _ in range(admission.METRICS * 2):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        return "event=refused" in d.log()
    try:
        assert wait_for(refused_some, timeout=30), d.log()[-3000:]
    finally:
        for connection in held:
            connection.close()
    counted = wait_for(lambda: (m := _scrape_or_none(port)) and
                       value(m, "gpuguard_metrics_connections_refused_total") and m, timeout=30)
    assert counted, d.log()[-3000:]
    assert 1 <= value(counted, "gpuguard_metrics_connections_refused_total") <= len(held)
    assert "loop_error" not in d.log() and "Traceback" not in d.log(), d.log()[-3000:]


def _scrape_or_none(port: int) -> Samples | None:
    try:
        return scrape(port)
    except OSError:  # refused while the closed connections' slots are still taken
        return None
