"""What a hostile user's flood costs the guard, and the release after logout on a busy host.

- watcher tick interval under a release flood (a member holding the node 9,000 times, 20
  `release` loops) and under a metrics slowloris (2 x 400 trickling connections), against the
  same daemon with no flood, measured in the same run: the watcher must keep within 2x its pace.
  Ticks are counted on the daemon's own histogram (gpuguard_watcher_tick_seconds_count).
- socket login (session_open + session_close, as the PAM module sends them) under a subuid flood
  from a real user namespace (20 uids x 40 connections reopened every 2 s), against no flood.
- a connect flood of the users' socket (one non-member: 120 processes x 64 connections, each
  opened again at once when refused), run in a CPU cgroup of the attacker's own as logind's
  user-UID.slice would be: another member's `gpuguard whoami` (the users' socket) within 3x of
  the same without the flood; a login through pam_gpuguard.so and through the pam_exec hook (both
  come in through root's door) within 1.5x of the same under the same 120 processes burning CPU
  without touching the socket (`spin`): what the flood costs beyond the CPU any user may burn.
  Without any load besides, a login is also shown (a row against no flood, target 3x: on two
  cores the attacker's processes take CPU from the login's own steps, and the NSS lookup each
  login makes in a thread waits for a core). Baselines are taken before and after the flood.
- logout (a section of its own): the time from the PAM module's close to the grant released (the
  reply comes first), at 10,000 host processes owned by root against the ~100 of an idle host,
  through the process index (a row whose scans walked /proc instead says so); and the watcher's
  tick interval under a fork flood (the index's events) against none.
The floods are devtools/floods.py, which the tests (tests/system/test_floods.py) run too.
"""
from __future__ import annotations

import os
import pwd
import secrets
import select
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

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
          env: dict[str, str] | None = None, sliced: bool = False) -> Iterator[None]:
    """A devtools/floods.py flood as user, until the block ends; sliced: in a CPU cgroup of its own,
    as systemd-logind puts a user's sessions in user-UID.slice apart from the daemon's system.slice."""
    account = pwd.getpwnam(user)
    if sliced:
        before = (*user_slice(bench, account.pw_uid), *before)
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


CPU_CGROUPS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/cpu"))


def user_slice(bench: Bench, uid: int) -> tuple[str, ...]:
    """argv that moves itself into a CPU cgroup of uid's own (removed at the end of the bench) and
    runs the rest: the cgroup v2 hierarchy where it has the cpu controller, else v1's cpu one."""
    for root in CPU_CGROUPS:
        controllers = root / "cgroup.controllers"
        if root == CPU_CGROUPS[0] and not (controllers.exists() and "cpu" in controllers.read_text().split()):
            continue
        if not (root / "cgroup.procs").exists():
            continue
        group = root / f"ggt-user-{uid}-{bench.tag}-{secrets.token_hex(3)}"
        group.mkdir()
        bench.stack.callback(group.rmdir)
        os.chown(group / "cgroup.procs", uid, -1)  # as logind delegates a user's slice: its own processes move in
        return ("sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh")
    raise SystemExit("bench: no CPU cgroup to put a user's flood in (cgroup v2 cpu controller or v1 cpu)")


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
    connect_flood_rows(bench)


CONNECT_FLOOD = (120, 64)
FLOODED_LOGINS = 30
FLOODED_WHOAMIS = 15


def connect_flood_rows(bench: Bench) -> None:
    import pam_bench  # its PAM loop times logins without a client's start-up

    config = bench.write_config("connect-flood")
    sock = str(configuration.load(config).paths.socket)
    module = REPO / "pam" / "pam_gpuguard.so"
    services = {
        "module": bench.pam_service("flood-module", f"session optional {module} quiet socket={sock}"),
        "hook": bench.pam_service("flood-hook", f"session optional pam_exec.so quiet {os.path.dirname(sys.executable)}"
                                                f"/gpuguard pam-hook --config {config}"),
    }
    user, bystander = bench.members[3], bench.members[4]
    account = pwd.getpwnam(bystander)

    def whoami() -> float:
        start = time.perf_counter()
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "gpuguard"), "--config", str(config), "whoami"],
                       user=account.pw_uid, group=account.pw_gid, extra_groups=[], cwd="/", check=True,
                       stdout=subprocess.DEVNULL)
        return time.perf_counter() - start

    def measure() -> dict[str, float]:
        times = {kind: statistics.median(pam_bench.pairs(bench, service, user, FLOODED_LOGINS // 3))
                 for kind, service in services.items()}
        times["whoami"] = statistics.median(whoami() for _ in range(FLOODED_WHOAMIS))
        return times

    with bench.daemon(config):
        before = measure()
        with flood(bench, bench.outsider, "connects", sock, *CONNECT_FLOOD, sliced=True):
            flooded = measure()
        with flood(bench, bench.outsider, "spin", CONNECT_FLOOD[0], sliced=True):
            spun = measure()
        after = measure()
    alone = {kind: (before[kind] + after[kind]) / 2 for kind in before}
    procs, connections = CONNECT_FLOOD
    what = f"under a connect flood ({procs} x {connections} connections)"
    spinning = f"{procs} processes burning CPU, same cgroup"
    row(f"pam module login+logout {what}", flooded["module"], spun["module"], 1.5, spinning)
    row(f"pam_exec hook login+logout {what}", flooded["hook"], spun["hook"], 1.5, spinning)
    row(f"pam module login+logout {what}, against no load", flooded["module"], alone["module"], 3.0,
        "no flood, same daemon")
    row(f"another member's `gpuguard whoami` {what}", flooded["whoami"], alone["whoami"], 3.0, "no flood, same daemon")


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
