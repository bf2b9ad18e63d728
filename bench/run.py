"""gpuguard benchmarks: each measurement is printed as a ratio to a baseline measured in the same run.

Absolute times on a shared machine say little; ratios to a baseline that suffers the same noise
say whether gpuguard's own work stays small. Each row has a target ratio; the run exits 1 when a
row misses its target. Run as root (`sudo make bench`): the login rows start a real daemon on
simulated GPUs with a gate of its own, real users and real PAM stacks, all named `ggt-*` and
removed afterwards.

Rows:
- login, logout: session_open (a GPU granted) and session_close (released) through the daemon
  socket, medians over 200 of each, against a bare one-line JSON echo over a Unix socket (the
  floor for any request and reply).
- pam module: `pamtester open_session close_session` with pam_gpuguard.so in the stack, against
  the same stack with only pam_permit (the cost of a PAM client process is in both).
- pam_exec hook: the same with the pure-Python `gpuguard pam-hook` fallback, for comparison.
- allocate 4 of 8: the allocator's choice on an 8-GPU box with NVLink pairs, against the
  trivial "first four free" that ignores topology.
- watcher decide: the pure rules for 8 GPUs x 50 processes, against taking that sample from
  the simulated NVML (the decisions must cost little next to the sample itself).
- metrics snapshot per tick: what the tick adds on the event loop when metrics are on (store
  reads and the frozen snapshot a scrape reads), against the same sample.
- store grant: one grant plus its release (two synced SQLite transactions), against the same
  rows written and deleted with plain sqlite3 and the same pragmas.
- daemon memory: the daemon's resident memory after 200 logins, against a bare Python process
  that imported the same libraries.
"""
from __future__ import annotations

import os
import secrets
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from devtools.harness import bpffs_restored, start_daemon  # noqa: E402
from gpuguard import allocator, client, rules  # noqa: E402
from gpuguard import config as configuration  # noqa: E402
from gpuguard.backends.simulated import SimulatedBackend, register_process  # noqa: E402
from gpuguard.backends.procfs import ProcessIdentity  # noqa: E402
from gpuguard.config import MetricsConfig  # noqa: E402
from gpuguard.metrics import Metrics  # noqa: E402
from gpuguard.model import Grant, Quota  # noqa: E402
from gpuguard.sampling import Sample  # noqa: E402
from gpuguard.store import Store  # noqa: E402

PYTHON = sys.executable
ROWS: list[tuple[str, float, float, float]] = []  # name, ours (s), baseline (s), target ratio


def per_call(fn: Callable[[], object], calls: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean seconds per call."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def row(name: str, ours: float, baseline: float, target: float) -> None:
    ROWS.append((name, ours, baseline, target))


def bench_allocator() -> None:
    sim = configuration.SimulatedConfig(count=8)
    with tempfile.TemporaryDirectory(prefix="ggt-bench-") as tmp:
        backend = SimulatedBackend(sim, Path(tmp))
        try:
            gpus, topology = backend.gpus(), backend.topology()
        finally:
            backend.close()
    held = [Grant(2000, "other", 0, 0.0, None, 0.0)]
    ours = per_call(lambda: allocator.choose(gpus, topology, held, {}, 1000, 4), 200)
    baseline = per_call(lambda: [g.minor for g in gpus if g.minor not in {h.minor for h in held}][:4], 200)
    row("allocate 4 of 8", ours, baseline, 2000)


def bench_watcher_rules() -> None:
    sim = configuration.SimulatedConfig(count=8)
    with tempfile.TemporaryDirectory(prefix="ggt-bench-") as tmp:
        os.chmod(tmp, 0o755)
        backend = SimulatedBackend(sim, Path(tmp))
        sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(50)]
        try:
            for i, proc in enumerate(sleepers):
                register_process(Path(tmp), proc.pid, i % 8, (i + 1) << 28, 50)
            sample_time = per_call(backend.processes, 20)
            procs = backend.processes()
            gpus = {gpu.minor: gpu for gpu in backend.gpus()}
            use = backend.use()
        finally:
            for proc in sleepers:
                proc.kill()
                proc.wait()
            backend.close()
    grants = [Grant(1000 + m, f"u{m}", m, 0.0, 3600.0, 0.0) for m in range(8)]
    view = rules.View(
        procs=[rules.Proc(p.pid, 1000 + p.minor, p.pid, p.minor, p.used_memory) for p in procs],
        grants=grants, quotas={1000 + m: Quota(gpu_memory=8 << 30, max_time=3600) for m in range(8)},
        exempt=frozenset({0}))
    timing = rules.Timing(grace=30, kill_wait=10)
    decide_time = per_call(lambda: rules.decide(view, rules.State(), 100.0, timing), 200)
    row("watcher decide (8 GPUs x 50)", decide_time, sample_time, 0.5)

    # The metrics snapshot the tick builds on the event loop, against the same NVML sample.
    with tempfile.TemporaryDirectory(prefix="ggt-bench-") as tmp:
        store = Store(Path(tmp) / "state.db")
        for grant in grants:
            store.add_grants(grant.uid, grant.user, [grant.minor], 0.0, grant.expires_at)
        owners = {p.pid: ProcessIdentity(p.pid, 1000 + p.minor, p.pid) for p in procs}
        sampler = SimpleNamespace(last=Sample(100.0, tuple(procs), owners, frozenset(gpus), use=use), errors={})
        metrics = Metrics(MetricsConfig(), store, gpus, sampler, None, lambda uid: (str(uid), Quota()))
        publish_time = per_call(lambda: metrics.publish(0.01), 50)
        store.close()
    row("metrics snapshot per tick (8 GPUs x 50)", publish_time, sample_time, 0.5)


def bench_store() -> None:
    with tempfile.TemporaryDirectory(prefix="ggt-bench-") as tmp:
        store = Store(Path(tmp) / "state.db")

        def cycle() -> None:
            store.add_grants(1000, "alice", [3], now=1.0, expires_at=None)
            store.remove_grants(1000, [3], now=2.0)

        ours = per_call(cycle, 100)
        store.close()
        raw = sqlite3.connect(Path(tmp) / "raw.db", isolation_level=None)
        raw.execute("PRAGMA journal_mode=WAL")
        raw.execute("PRAGMA synchronous=FULL")
        raw.execute("CREATE TABLE g (uid INTEGER, minor INTEGER, PRIMARY KEY (uid, minor))")

        def raw_cycle() -> None:
            raw.execute("BEGIN IMMEDIATE")
            raw.execute("INSERT INTO g VALUES (1000, 3)")
            raw.execute("COMMIT")
            raw.execute("BEGIN IMMEDIATE")
            raw.execute("DELETE FROM g WHERE uid = 1000 AND minor = 3")
            raw.execute("COMMIT")

        baseline = per_call(raw_cycle, 100)
        raw.close()
    row("store grant + release", ours, baseline, 3)


ECHO_SERVER = """
import asyncio, sys
async def handle(reader, writer):
    line = await reader.readline()
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


def echo_round_trip(path: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        sock.sendall(b'{"v":1,"op":"session_open","user":"x","service":"sshd","rhost":"","tty":"","pid":1}\n')
        sock.recv(4096)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def pamtester_time(service: str, user: str, runs: int) -> float:
    def once() -> None:
        subprocess.run(["pamtester", service, user, "open_session", "close_session"], check=True,
                       capture_output=True)
    return per_call(once, runs, repeats=3)


def bench_daemon(stack: ExitStack) -> None:
    tag = secrets.token_hex(3)
    base = Path(f"/tmp/ggt-bench-{tag}")
    base.mkdir(mode=0o755)
    stack.callback(shutil.rmtree, base, ignore_errors=True)
    group = f"ggt-bench-{tag}"
    subprocess.run(["groupadd", group], check=True)
    stack.callback(subprocess.run, ["groupdel", group], check=False)
    users = []
    for i in range(4):
        name = f"ggt-b{i}-{tag}"
        subprocess.run(["useradd", "--no-create-home", "--groups", group, name], check=True)
        stack.callback(subprocess.run, ["userdel", "--force", name], check=False, capture_output=True)
        users.append(name)

    config_path = base / "gpuguard.toml"
    config_path.write_text(
        f'[access]\ngroup = "{group}"\n[watcher]\ninterval = "2s"\n'
        f'[paths]\nstate_dir = "{base}/state"\nsocket = "{base}/run/gpuguard.sock"\ndevice_dir = "{base}/dev"\n'
        f'[gpu]\nbackend = "simulated"\n[gpu.simulated]\ncount = 8\n')
    config_path.chmod(0o644)
    gate_name = f"ggt-bench-{tag}"
    daemon = start_daemon(stack, config_path, gate_name)
    sock = str(base / "run" / "gpuguard.sock")

    caller = subprocess.Popen(["sleep", "infinity"])  # stands in for sshd's [priv] process
    stack.callback(caller.kill)

    opens: list[float] = []
    closes: list[float] = []

    def login() -> None:
        for user in users:
            start = time.perf_counter()
            client.call(sock, "session_open", user=user, service="bench", rhost="", tty="pts/0",  # a terminal: grants
                        pid=caller.pid)
            opens.append(time.perf_counter() - start)
            start = time.perf_counter()
            client.call(sock, "session_close", user=user, service="bench", pid=caller.pid)
            closes.append(time.perf_counter() - start)

    for _ in range(50):
        login()  # 200 logins and logouts, each granting and releasing a GPU
    echo_path = str(base / "echo.sock")
    echo = subprocess.Popen([PYTHON, "-c", ECHO_SERVER, echo_path], stdout=subprocess.PIPE, text=True)
    stack.callback(echo.kill)
    echo.stdout.readline()
    baseline = per_call(lambda: echo_round_trip(echo_path), 200)
    row("login: session_open with a grant", statistics.median(opens), baseline, 25)
    # Logout releases the GPU only once no process holds it: that takes a GPU sample and a
    # scan of every process's open files, so it grows with the number of processes.
    row("logout: session_close with release", statistics.median(closes), baseline, 200)

    bare = subprocess.Popen([PYTHON, "-c", "import gpuguard.daemon, time; print(flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE)
    stack.callback(bare.kill)
    bare.stdout.readline()
    row("daemon memory after 200 logins", rss_kib(daemon.pid), rss_kib(bare.pid), 2)

    module = REPO / "pam" / "pam_gpuguard.so"
    if shutil.which("pamtester") and module.exists():
        services = {
            "permit": "",
            "module": f"session optional {module} quiet socket={sock}\n",
            "exec": f"session optional pam_exec.so quiet {REPO}/.venv/bin/gpuguard --config {config_path} pam-hook\n",
        }
        times = {}
        for kind, extra in services.items():
            service = f"ggt-bench-{kind}-{tag}"
            path = Path("/etc/pam.d") / service
            path.write_text("auth required pam_permit.so\naccount required pam_permit.so\n"
                            f"session required pam_permit.so\n{extra}")
            stack.callback(path.unlink, missing_ok=True)
            times[kind] = pamtester_time(service, users[0], 20)
        row("pam module login+logout (pamtester)", times["module"], times["permit"], 15)
        row("pam_exec hook login+logout (pamtester)", times["exec"], times["permit"], 100)
    else:
        print("bench: pamtester or pam/pam_gpuguard.so missing: PAM rows skipped (run make pam)")


def main() -> int:
    if os.geteuid() != 0:
        print("bench: run as root (sudo make bench): the login rows use a real daemon, gate and PAM")
        return 2
    bench_allocator()
    bench_watcher_rules()
    bench_store()
    with ExitStack() as stack:
        stack.enter_context(bpffs_restored())
        bench_daemon(stack)
    width = max(len(name) for name, *_ in ROWS)
    print(f"{'benchmark':<{width}}  {'ours':>12}  {'baseline':>12}  {'ratio':>8}  {'target':>8}")
    missed = 0
    for name, ours, baseline, target in ROWS:
        ratio = ours / baseline
        unit = "KiB" if "memory" in name else "ms"
        scale = 1 if unit == "KiB" else 1000  # memory rows are in KiB already
        verdict = "" if ratio <= target else "  MISSED"
        missed += ratio > target
        digits = 0 if unit == "KiB" else 3
        print(f"{name:<{width}}  {ours * scale:>9.{digits}f} {unit:>3}  {baseline * scale:>9.{digits}f} {unit:>3}  "
              f"{ratio:>8.2f}  {'<=' + format(target, 'g'):>8}{verdict}")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
