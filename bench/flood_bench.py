"""What a hostile user's flood costs the guard, and the release after logout on a busy host.

- watcher tick interval under a release flood (a member holding the node 9,000 times, 20
  `release` loops) and under a metrics slowloris (2 x 400 trickling connections), against the
  same daemon with no flood, measured in the same run: the watcher must keep within 2x its pace.
  Ticks are counted on the daemon's own histogram (gpuguard_watcher_tick_seconds_count).
- socket login (session_open + session_close, as the PAM module sends them) under a subuid flood
  from a real user namespace (20 uids x 40 connections reopened every 2 s), against no flood.
- logout (a section of its own): the time from the PAM module's close to the grant released (the
  reply comes first), at 10,000 host processes owned by root against the ~100 of an idle host,
  through the process index (a row whose scans walked /proc instead says so); and the watcher's
  tick interval under a fork flood (the index's events) against none.
The floods are devtools/floods.py, which the tests (tests/system/test_floods.py) run too.
"""
from __future__ import annotations

import os
import pwd
import select
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from env import REPO, Bench, busy_host, host_processes
from prometheus_client.parser import text_string_to_metric_families
from rows import row

from devtools.harness import free_port
from gpuguard import client
from gpuguard import config as configuration
from gpuguard.daemon.metrics import RENDER_EVERY

FLOODS = REPO / "devtools" / "floods.py"
INTERVAL = 0.5
WINDOW = 8.0  # seconds over which ticks are counted
LOGINS = 40
LOGOUTS = 15
NAMESPACE = ("unshare", "--user", "--map-auto", "--setuid", "0", "--setgid", "0", "--")


@contextmanager
def flood(bench: Bench, user: str, kind: str, *args: object, before: tuple[str, ...] = (),
          env: dict[str, str] | None = None) -> Iterator[None]:
    account = pwd.getpwnam(user)
    proc = subprocess.Popen([*before, sys.executable, str(FLOODS), kind, *map(str, args)], user=account.pw_uid,
                            group=account.pw_gid, extra_groups=[], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd="/", start_new_session=True, env={**os.environ, **(env or {})})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        if not ready or proc.stdout.readline() != "ready\n":
            raise SystemExit(f"bench: the {kind} flood did not start: {proc.stderr.read() if proc.poll() else ''}")
        yield
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def ticks(port: int) -> float:
    """The daemon's tick count (after its first tick: before, the page has no gpuguard metrics)."""
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
                text = reply.read().decode()
        except OSError:  # refused while a slowloris holds every young slot: a scrape retries
            time.sleep(0.2)
            continue
        found = [s.value for family in text_string_to_metric_families(text) for s in family.samples
                 if s.name == "gpuguard_watcher_tick_seconds_count"]
        if found:
            return found[0]
        time.sleep(0.2)


def tick_interval(port: int) -> float:
    """Seconds per tick over about WINDOW between two scrapes, on the daemon's own count."""
    first, started = ticks(port), time.monotonic()
    time.sleep(WINDOW)
    last = ticks(port)  # a scrape refused under a slowloris retries: the window is what it took
    return (time.monotonic() - started) / max(1.0, last - first)


def login_logout(sock: str, user: str, caller: int) -> float:
    start = time.perf_counter()
    client.call(sock, "session_open", user=user, service="bench", rhost="", tty="", pid=caller)
    client.call(sock, "session_close", user=user, service="bench", pid=caller)
    return time.perf_counter() - start


def logout_release(sock: str, user: str, caller: int) -> float:
    """From the close to the grant gone (polled as root, every millisecond)."""
    client.call(sock, "session_open", user=user, service="bench", rhost="", tty="", pid=caller)
    start = time.perf_counter()
    client.call(sock, "session_close", user=user, service="bench", pid=caller)
    while client.call(sock, "whoami", user=user)["grants"]:
        time.sleep(0.001)
    return time.perf_counter() - start


def flood_rows(bench: Bench) -> None:
    port = free_port()
    config = bench.write_config("floods", interval=f"{INTERVAL}s",
                                extra=f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    paths = configuration.load(config).paths
    sock = str(paths.socket)
    with bench.daemon(config), ExitStack() as stack:
        caller = subprocess.Popen(["sleep", "3600"])
        stack.callback(caller.kill)
        quiet = tick_interval(port)
        holder = bench.members[0]
        (minor,) = client.call(sock, "session_open", user=holder, service="bench", rhost="", tty="",
                               pid=caller.pid)["gpus"]
        counts = bench.base / "floods" / "releases"
        counts.touch()
        counts.chmod(0o666)
        with flood(bench, holder, "fds", paths.device_dir / f"nvidia{minor}", 3, 3000), \
                flood(bench, holder, "release", sock, 20, env={"FLOOD_COUNTS": str(counts)}):
            flooded = tick_interval(port)
        row("watcher tick interval under a release flood (20 loops, node held 9,000 times)", flooded, quiet, 2.0,
            "no flood, same daemon")
        with flood(bench, bench.outsider, "slowloris", port, 400), flood(bench, bench.members[1], "slowloris", port, 400):
            flooded = tick_interval(port)
        row("watcher tick interval under a metrics slowloris (2 x 400 connections)", flooded, quiet, 2.0,
            "no flood, same daemon")
        client.call(sock, "session_close", user=holder, service="bench", pid=caller.pid)
        user = bench.members[2]
        alone = statistics.median(login_logout(sock, user, caller.pid) for _ in range(LOGINS))
        with flood(bench, bench.outsider, "subuids", sock, 20, 40, before=NAMESPACE):
            flooded = statistics.median(login_logout(sock, user, caller.pid) for _ in range(LOGINS))
        row("socket login+logout under a subuid flood (20 uids x 40 connections)", flooded, alone, 3.0,
            "no flood, same daemon")


def index_counts(port: int) -> dict[str, float]:
    """The daemon's process index metrics (gpuguard_process_index_*) and its CPU seconds."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("gpuguard_process_index") or s.name == "process_cpu_seconds_total"}


def logout_rows(bench: Bench) -> None:
    """The release after logout on an idle host and with 10,000 root-owned processes; checked to have
    gone through the process index (no /proc walk: gpuguard_process_index_fallback_walks_total)."""
    port = free_port()
    config = bench.write_config("logout", interval=f"{INTERVAL}s",
                                extra=f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    sock = str(configuration.load(config).paths.socket)
    with bench.daemon(config), ExitStack() as stack:
        caller = subprocess.Popen(["sleep", "3600"])
        stack.callback(caller.kill)
        quiet = tick_interval(port)
        time.sleep(2 * RENDER_EVERY)
        before = index_counts(port)
        with flood(bench, bench.outsider, "forks", 2):
            started = time.monotonic()
            flooded = tick_interval(port)
            time.sleep(2 * RENDER_EVERY)
            after = index_counts(port)
            took = time.monotonic() - started
        events = after["gpuguard_process_index_events_total"] - before["gpuguard_process_index_events_total"]
        cpu = after["process_cpu_seconds_total"] - before["process_cpu_seconds_total"]
        print(f"bench: fork flood: {events / took:,.0f} process events/s applied, daemon CPU {cpu / took:.0%}, "
              f"losses {after['gpuguard_process_index_losses_total']:.0f}", flush=True)
        row("watcher tick interval under a fork flood (2 loops)", flooded, quiet, 2.0, "no flood, same daemon")
        user = bench.members[3]
        idle = host_processes()
        small = statistics.median(logout_release(sock, user, caller.pid) for _ in range(LOGOUTS))
        with busy_host(bench, 10_000, root=True) as reached:
            time.sleep(2 * RENDER_EVERY)  # the page is rendered at most once a second
            before = index_counts(port)
            large = statistics.median(logout_release(sock, user, caller.pid) for _ in range(LOGOUTS))
            time.sleep(2 * RENDER_EVERY)
            after = index_counts(port)
        walks = after["gpuguard_process_index_fallback_walks_total"] - before["gpuguard_process_index_fallback_walks_total"]
        print(f"bench: process index {after}", flush=True)
        row(f"logout: close to grant released, {reached:,} vs {idle} processes (root's)", large, small, 1.5,
            f"the same at {idle}", failed_checks=[f"{walks:.0f} scans walked /proc"] if walks else [])
