"""The daemon's tick on a busy host.

- watcher CPU per tick: the daemon's CPU time (all its threads, /proc/PID/task/*/schedstat) per
  tick at 5,000 host processes against 500, in two states: grants in use by logged-in users, and
  that plus a logged-out user whose process holds the node without a CUDA context (NVML does not
  list it: the release check finds it every tick).
- gpuguard's own part of a tick, 8 GPUs x 50 processes: the CPU time of the event loop's thread in
  Daemon.tick() in this process (the NVML sample runs in a thread of its own), against the simulated
  NVML sample measured in the same run.
- metrics snapshot per tick, on the same daemon: what the tick adds on the event loop when
  metrics are on (store reads, the gate's maps, the frozen snapshot a scrape reads), against
  the simulated NVML sample it follows.
- kill latency: 20 stray processes that ignore SIGTERM, from their registration to their death,
  p99 against interval + grace + kill_wait + five samples (first sighting, two deadline ticks,
  each confirmed by a re-sample), a sample timed in the same run with the strays registered.
"""
from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from env import Bench, busy_host
from rows import p99, per_call, row

from gpuguard import client
from gpuguard import config as configuration
from gpuguard.backends import accounts, open_gpu_backend, procfs
from gpuguard.backends import sampler as sampling
from gpuguard.backends.gate import Gate
from gpuguard.daemon.main import Daemon

INTERVAL, GRACE, KILL_WAIT = 0.5, 1.0, 1.0
WINDOW = 6.0  # seconds of daemon CPU per measurement
# A process that registers itself with the simulated NVML on a GPU (as a CUDA program would
# appear there), optionally ignoring SIGTERM, and sleeps.
GPU_PROCESS = """
import os, signal, sys, time
from pathlib import Path
from gpuguard.backends.sim_registry import register_process
if sys.argv[3] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
for _ in range(int(sys.argv[4])):
    if os.fork() == 0:
        break
register_process(Path(sys.argv[1]), os.getpid(), int(sys.argv[2]), 1 << 30, 50)
print("ready", flush=True)
time.sleep(600)
"""
HOLD_NODE = "import os, sys, time; os.open(sys.argv[1], os.O_PATH); print('held', flush=True); time.sleep(600)"


def gpu_processes(bench: Bench, stack: ExitStack, user: str, device_dir: Path, minor: int, count: int = 1,
                  ignore_term: bool = False) -> subprocess.Popen:
    """`count` processes of `user` on GPU `minor`; started when this returns."""
    proc = subprocess.Popen([sys.executable, "-I", "-c", GPU_PROCESS, str(device_dir), str(minor),
                             "ignore-term" if ignore_term else "plain", str(count - 1)],
                            user=bench.uid(user), stdout=subprocess.PIPE, text=True, cwd="/", process_group=0)
    stack.callback(_kill_group, proc)
    for _ in range(count):
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"bench: a simulated GPU process of {user} did not start")
    return proc


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill proc and, if it leads a process group (gpu_processes), the forks in it."""
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        proc.kill()
    proc.wait()


def cpu_seconds(pid: int) -> float:
    """CPU time of all of pid's threads (ns precision, unlike the clock ticks of /proc/PID/stat)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as schedstat:
                total += int(schedstat.read().split()[0])
        except OSError:
            continue  # a worker thread ended meanwhile
    return total / 1e9


def cpu_per_tick(pid: int) -> float:
    start = cpu_seconds(pid)
    time.sleep(WINDOW)
    return (cpu_seconds(pid) - start) / (WINDOW / INTERVAL)


def kill_latency(bench: Bench, config: Path, device_dir: Path) -> None:
    with ExitStack() as stack:
        strays = []
        for i, user in enumerate(bench.members):
            proc = gpu_processes(bench, stack, user, device_dir, i % 8, ignore_term=True)
            strays.append((proc, time.monotonic()))
        sample = sample_seconds(config)  # during the grace: the strays are registered
        latencies = []
        while strays:  # all watched at once: each death is timed when it happens
            for stray in [s for s in strays if s[0].poll() is not None]:
                latencies.append(time.monotonic() - stray[1])
                strays.remove(stray)
            time.sleep(0.01)
    bound = INTERVAL + GRACE + KILL_WAIT + 5 * sample
    row(f"kill latency, {len(latencies)} strays ignoring SIGTERM (p99)", p99(latencies), bound, 1.0,
        f"interval + grace + kill_wait + 5 samples of {sample * 1000:.0f} ms")


def sample_seconds(config: Path) -> float:
    """A sample as the daemon takes it (MIG layout, processes, their owners, use), median of 5."""
    with open_gpu_backend(configuration.load(config)) as backend:
        identities = procfs.IdentityCache()
        return per_call(lambda: sampling._take(backend, identities), 1)


def watcher_rows(bench: Bench) -> None:
    config = bench.write_config("watcher", interval=f"{INTERVAL}s", grace=f"{GRACE}s", kill_wait=f"{KILL_WAIT}s")
    paths = configuration.load(config).paths
    sock, device_dir = str(paths.socket), paths.device_dir
    with bench.daemon(config) as daemon, ExitStack() as stack:
        kill_latency(bench, config, device_dir)
        caller = subprocess.Popen(["sleep", "600"])
        stack.callback(_kill_group, caller)
        for user in bench.members[:7]:  # in use: a login and processes on its GPU (one GPU left)
            (minor,) = client.call(sock, "session_open", user=user, service="bench", rhost="", tty="",
                                   pid=caller.pid)["gpus"]
            gpu_processes(bench, stack, user, device_dir, minor, count=4)
        in_use = {size: 0.0 for size in (500, 5000)}
        for size in in_use:
            with busy_host(bench, size):
                in_use[size] = cpu_per_tick(daemon.pid)
        row("watcher CPU per tick, grants in use: 5,000 vs 500 processes", in_use[5000], in_use[500], 1.2,
            "the same at 500")
        # A logged-out user whose process holds the node without a CUDA context keeps the grant.
        leaver = bench.members[7]
        (minor,) = client.call(sock, "session_open", user=leaver, service="bench", rhost="", tty="",
                               pid=caller.pid)["gpus"]
        holder = subprocess.Popen([sys.executable, "-I", "-S", "-c", HOLD_NODE, str(device_dir / f"nvidia{minor}")],
                                  user=bench.uid(leaver), stdout=subprocess.PIPE, text=True, cwd="/")
        stack.callback(_kill_group, holder)
        holder.stdout.readline()
        client.call(sock, "session_close", user=leaver, service="bench", pid=caller.pid)
        held = {size: 0.0 for size in (500, 5000)}
        for size in held:
            with busy_host(bench, size):
                held[size] = cpu_per_tick(daemon.pid)
        kept = client.call(sock, "whoami", user=leaver)["grants"]
        row("watcher CPU per tick, + node held after logout: 5,000 vs 500", held[5000], held[500], 1.2,
            "the same at 500", failed_checks=[] if kept else ["the held grant was released"])


def own_tick_rows(bench: Bench) -> None:
    """Daemon.tick() in this process, 8 GPUs x 50 processes of 8 users holding grants; then its
    metrics snapshot."""
    config_path = bench.write_config("tick", interval="1s")
    config = configuration.load(config_path)
    gate = f"ggt-bench-{bench.tag}-tick"
    daemon = Daemon(config, gate)
    with ExitStack() as stack:
        stack.callback(lambda: Gate(gate).detach())
        daemon.start()
        stack.callback(daemon.close)
        for minor, user in enumerate(bench.members[:8]):
            account = accounts.by_name(user)
            daemon.grants.add(account.uid, account.name, [minor], time.time(), expires_at=None, shared=False,
                              origin="request", message="bench")
            gpu_processes(bench, stack, user, config.paths.device_dir, minor, count=50)
        nvml = _time_calls(daemon.backend, "query_processes")
        ticks = 20

        async def run() -> float:
            await daemon.tick()  # the first builds the watcher's state
            nvml.clear()
            start = time.thread_time()  # this thread's: the sample runs in the NVML thread
            for _ in range(ticks):
                await daemon.tick()
            return time.thread_time() - start

        own = asyncio.run(run()) / ticks
        sample = statistics.median(nvml)
        snapshot = per_call(lambda: daemon.front.metrics.publish(0.01), 20)  # what after_tick adds when metrics are on
    row("gpuguard's own part of a tick (loop CPU), 8 GPUs x 50 processes", own, sample, 0.25,
        "the simulated NVML sample")
    row("metrics snapshot per tick, 8 GPUs x 50 processes", snapshot, sample, 0.5, "the simulated NVML sample")


def _time_calls(obj: object, name: str) -> list[float]:
    """Wrap obj.name to record the seconds of each call."""
    spent: list[float] = []
    method = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    setattr(obj, name, timed)
    return spent
