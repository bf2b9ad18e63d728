"""Rows through real PAM stacks, timed by bench/pamloop.c (a C libpam loop: no client start-up in
the numbers), and through the daemon's socket.

- socket login / logout: session_open (a grant) and session_close, against a bare line echo.
- pam module: login+logout with pam_gpuguard.so against pam_exec running /bin/true (the cost of
  the smallest hook there is), on the host as it is (~100 processes) and with 5,000.
- pam_exec hook: `gpuguard pam-hook` against pam_exec running an empty `python3 -I -S`.
- login storm: 200 sessions of 20 users at once (8 GPUs, 5,000 processes), per-session p99,
  against the same storm through pam_permit plus one echo round trip per session; no failure
  and no GPU held by two users.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from env import REPO, Bench, busy_host, host_processes
from rows import p99, per_call, row

from gpuguard import client

ECHO_SERVER = """
import asyncio, sys
async def handle(reader, writer):
    await reader.readline()
    writer.write(b'{"v":1,"ok":true}\\n')
    await writer.drain()
    writer.close()
async def main():
    server = await asyncio.start_unix_server(handle, sys.argv[1])
    print("ready", flush=True)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""
ROUNDS = 5  # the compared stacks take turns, so drift on the shared machine hits both alike


def start_echo(bench: Bench) -> str:
    path = str(bench.base / "echo.sock")
    echo = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, path], stdout=subprocess.PIPE, text=True)
    bench.stack.callback(echo.wait)
    bench.stack.callback(echo.kill)
    echo.stdout.readline()
    return path


def echo_round_trip(path: str) -> None:
    client.call(path, "session_open", user="x", service="bench", rhost="", tty="", pid=1)


def pairs(bench: Bench, service: str, user: str, count: int) -> list[float]:
    """Seconds of each pam_open_session + pam_close_session."""
    result = subprocess.run([str(bench.helpers["pamloop"]), service, user, str(count)],
                            capture_output=True, text=True, check=True)
    return [int(line) / 1e9 for line in result.stdout.split()]


def compare(bench: Bench, services: dict[str, str], user: str, count: int) -> dict[str, float]:
    """Median login+logout of each service, measured in turns."""
    times: dict[str, list[float]] = {kind: [] for kind in services}
    for _ in range(ROUNDS):
        for kind, service in services.items():
            times[kind] += pairs(bench, service, user, count)
    return {kind: statistics.median(values) for kind, values in times.items()}


def socket_rows(bench: Bench, sock: str, echo: str, daemon_pid: int) -> None:
    caller = subprocess.Popen(["sleep", "600"])  # stands in for sshd's [priv] process
    bench.stack.callback(caller.wait)
    bench.stack.callback(caller.kill)
    opens: list[float] = []
    closes: list[float] = []
    for _ in range(50):
        for user in bench.members[:4]:
            start = time.perf_counter()
            client.call(sock, "session_open", user=user, service="bench", rhost="", tty="", pid=caller.pid)
            opens.append(time.perf_counter() - start)
            start = time.perf_counter()
            client.call(sock, "session_close", user=user, service="bench", pid=caller.pid)
            closes.append(time.perf_counter() - start)
            # The release runs after the reply, in the background: not in the next login's time.
            while client.call(sock, "whoami", user=user)["grants"]:
                time.sleep(0.001)
    baseline = per_call(lambda: echo_round_trip(echo), 200)
    row("socket login: session_open with a grant", statistics.median(opens), baseline, 25, "line echo")
    row("socket logout: session_close (release after the reply)", statistics.median(closes), baseline, 25,
        "line echo")
    bare = subprocess.Popen([sys.executable, "-c", "import gpuguard.daemon.main, time; print(flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE)
    bare.stdout.readline()
    row("daemon memory after 200 logins", rss_kib(daemon_pid), rss_kib(bare.pid), 2,
        "python importing the same", unit="KiB")
    bare.kill()
    bare.wait()


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def pam_rows(bench: Bench, sock: str, config: Path, echo: str, log: Path) -> None:
    module = REPO / "pam" / "pam_gpuguard.so"
    stacks = {
        "true": bench.pam_service("true", "session optional pam_exec.so quiet /bin/true"),
        "module": bench.pam_service("module", f"session optional {module} quiet socket={sock}"),
    }
    user = bench.members[0]
    small_host = host_processes()
    small = compare(bench, stacks, user, 40)
    row(f"pam module login+logout, {small_host} processes", small["module"], small["true"], 1.0,
        "pam_exec /bin/true")
    hooks = {
        "python": bench.pam_service("python", f"session optional pam_exec.so quiet {sys.executable} -I -S -c pass"),
        "hook": bench.pam_service("hook", f"session optional pam_exec.so quiet {Path(sys.executable).parent}"
                                          f"/gpuguard pam-hook --config {config}"),
    }
    fallback = compare(bench, hooks, user, 12)
    row("pam_exec hook `gpuguard pam-hook` login+logout", fallback["hook"], fallback["python"], 3,
        "pam_exec python3 -I -S")
    with busy_host(bench, 5000) as busy:
        big = compare(bench, stacks, user, 40)
        row(f"pam module login+logout, {busy} processes", big["module"], big["true"], 1.0, "pam_exec /bin/true")
        row(f"pam module login+logout, {busy} vs {small_host} processes", big["module"], small["module"], 1.2,
            f"the same at {small_host}")
        storm(bench, stacks["module"], sock, echo, log, busy)


def storm(bench: Bench, module_service: str, sock: str, echo: str, log: Path, processes: int) -> None:
    permit = bench.pam_service("permit", "")
    before = log.read_text().count("session_open_failed")
    ours, ok_codes, sessions, holders = _storm(bench, module_service, None, lambda: client.call(sock, "status"))
    baseline, _, _, _ = _storm(bench, permit, echo, None)
    checks = []
    if not ok_codes:
        checks.append("a pamloop failed")
    if sessions != 200:
        checks.append(f"{sessions} of 200 sessions recorded")
    if failed := log.read_text().count("session_open_failed") - before:
        checks.append(f"{failed} session_open failures")
    if twice := [m for m, users in holders.items() if len(users) > 1]:
        checks.append(f"GPU {twice} held twice")
    row(f"login storm 200 sessions/20 users/8 GPUs, {processes} processes (p99)", p99(ours), p99(baseline), 10,
        "pam_permit + echo", failed_checks=checks)


def _storm(bench: Bench, service: str, echo: str | None, status) -> tuple[list[float], bool, int, dict]:
    """All 20 users open 10 sessions each at once; the open latencies, whether every pamloop
    succeeded, and (with `status`) the sessions the daemon recorded and each GPU's holders."""
    argv = [str(bench.helpers["pamloop"]), "--hold", service]
    loops = [subprocess.Popen([*argv, user, "10", *([echo] if echo else [])], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for user in bench.members]
    latencies: list[float] = []
    for loop in loops:
        for line in loop.stdout:
            if line.strip() == "opened":
                break
            latencies.append(int(line) / 1e9)
    sessions, holders = 0, {}
    if status:
        reply = status()
        sessions = len(reply["sessions"])
        holders = {g["minor"]: [h["user"] for h in g["holders"] if not h["shared"]] for g in reply["gpus"]}
    for loop in loops:
        loop.stdin.close()
    codes = [loop.wait(120) for loop in loops]
    for loop in loops:
        loop.stdout.close()
    return latencies, all(code == 0 for code in codes), sessions, holders
