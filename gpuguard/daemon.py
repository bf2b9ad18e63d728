"""`gpuguard daemon`: the composition root and the event loop.

Start: claim the socket path (refused while another daemon serves) -> store -> GPU backend ->
gate (attach or find) -> exemptions -> reconcile the gate map and node ACLs from the store ->
watch the device directory -> serve the socket -> READY=1. Under systemd it also says what it
is doing (STATUS=) and pings the watchdog (WATCHDOG=1, WatchdogSec= in etc/gpuguard.service)
from the event loop, so a loop that hangs gets the daemon restarted. One asyncio loop in the main thread
runs the server and a periodic tick; the store is touched only from that thread, and blocking
NVML and /proc work runs in worker threads (asyncio.to_thread). Decisions that read state and
then change it never await in between, so concurrent requests cannot interleave inside one.

SIGHUP reloads the config (a broken one is logged and the old one stays); SIGTERM stops
cleanly and leaves the gate attached, so GPU access stays closed while no daemon runs.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import signal
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from gpuguard import config as configuration
from gpuguard import policy, sampling
from gpuguard.api import Api
from gpuguard.backends import (
    GateError,
    accounts,
    caps_major,
    devnodes,
    driver_minors,
    notify,
    open_gate,
    open_gpu_backend,
    proc_events,
    procfs,
    systemd,
)
from gpuguard.backends.exits import ExitWatch
from gpuguard.backends.gate import Gate
from gpuguard.backends.gpu_nodes import AclNodes
from gpuguard.backends.node_watcher import NodeWatcher
from gpuguard.config import AccessMode, Config, GpuBackend
from gpuguard.exempt import Exempt
from gpuguard.grants import Grants
from gpuguard.holders import HolderEnder
from gpuguard.logout import LogoutRelease
from gpuguard.logs import event
from gpuguard.lookups import AccountLookup, LookupTimeout
from gpuguard.messages import layout_message, unit_list
from gpuguard.metrics import Metrics
from gpuguard.model import Origin
from gpuguard.queueing import Queue
from gpuguard.scans import Scans
from gpuguard.server import Server
from gpuguard.store import Store
from gpuguard.watcher import Watcher

if TYPE_CHECKING:
    from gpuguard.backends.nvml import MigLayout

DEADLINE_MARGIN = 0.001  # seconds past a wait's end: the tick's clock must read it as over
CHECK_EVERY = 30.0  # seconds between checks that the gate, its maps and the node ACLs are as the store says


class Daemon:
    def __init__(self, config: Config, gate_name: str = "gpuguard"):
        self.config = config
        self.gate_name = gate_name
        self._stop = asyncio.Event()
        self._layout_read: asyncio.Task | None = None  # the MIG layout read a reload asked for

    def current_config(self) -> Config:
        """What the services read the config through: a reload replaces self.config."""
        return self.config

    # --- life cycle

    def start(self) -> None:
        """Everything before serving; raises ServerError, StoreError, GpuError, GateError or OSError."""
        _raise_nofile()
        self.server = Server(self.config.paths.socket, self._handle, abandoned_on_hangup=frozenset({"wait"}))
        self.server.claim()  # a second daemon stops here, before it touches the gate or the nodes
        systemd.status("starting: opening the store and the GPUs")
        if self.config.access.mode == AccessMode.ACL:
            _refuse_stale_gate(self.gate_name)
        self.store = Store(self.config.paths.state_dir / "state.db", self.config.events)
        self._ensure_driver_nodes()  # NVML needs them to start
        self.backend = open_gpu_backend(self.config)
        self.sampler = sampling.Sampler(self.backend)
        for error in self.backend.unavailable:  # GPUs NVML cannot read at start: the others are still guarded
            event(logging.ERROR, "gpu_unavailable", error=error, action="left out until a restart")
        self.gate = open_gate(self.config, self.gate_name) if self.config.access.mode == AccessMode.GATE else None
        # Every GPU the driver has keeps a managed node, also one NVML cannot read now: left
        # alone, its node would stay as the driver made it (0666), open to all in acl mode.
        first_layout = self.backend.layout()
        gpus = {gpu.minor: gpu for gpu in [*self.backend.gpus(), *first_layout.slices]}
        self.grants = Grants(self.store, self.gate, AclNodes(self.config.paths.device_dir), driver_minors(self.config),
                             gpus=gpus, topology=self.backend.topology(), caps_major=caps_major(self.config))
        systemd.status("starting: attaching the gate and restoring grants")
        self.exempt = Exempt(lambda: self.config.access, self.store, self._apply_exempt)
        exempt = self.exempt.compute()
        if self.gate:
            self.gate.attach(exempt)  # a new gate starts with its exempt map filled: no moment without it
        self.exempt.set(exempt)
        self.lookup = AccountLookup()
        self.notifier = notify.Notifier()
        self.processes = proc_events.ProcessIndex()  # users' pids for holder scans; without it they walk /proc
        self.processes.start()
        self.scans = Scans(partial(sampling.node_holders, devices_of=self.grants.holder_devices,
                                   real_uids=procfs.RealUids(), pids_of=self.processes.pids_of))
        self.holders = HolderEnder(self.scans, self.sampler, self.exempt, self.store,
                                   lambda: self.config.watcher.kill_wait, is_member=self._is_member)
        self.grants.holders = self.holders
        self.logout = LogoutRelease(self.store, self.grants, self.scans, ExitWatch())
        self.queue = Queue(self.current_config, self.store, self.grants)
        self.watcher = Watcher(self.current_config, self.store, self.grants, self.exempt, self.sampler,
                               self.lookup, self.notifier, demand=self.queue.demand)
        self.api = Api(self.current_config, self.store, self.grants, self.exempt, self.sampler, self.lookup,
                       self.logout, self.holders, self.gate, reload=self.reload, sync_nodes=self.sync_nodes,
                       account_of=self.watcher.account_of, flush_usage=self.watcher.flush_usage,
                       queue=self.queue, notifier=self.notifier)
        self.metrics = Metrics(self.config.metrics, self.store, self.grants.gpus, self.sampler, self.gate,
                               self.watcher.account_of, self.server.budget,
                               collectors=[proc_events.IndexCollector(self.processes)])
        # Grants on MIG slices the admin changed while no daemon ran end (their holders ended, their
        # users told) before the gate and the ACLs are rebuilt from the store.
        self.follow_layout(first_layout)
        for repaired in self.grants.reconcile():  # what changed while no daemon ran
            event(logging.INFO, "reconcile", repaired=repaired)
        self.node_watchers = [NodeWatcher(self.config.paths.device_dir, self._node_changed)]
        caps_dir = self.config.paths.device_dir / "nvidia-caps"
        if caps_dir.is_dir():  # made by the reconcile when this machine has MIG slices
            self.node_watchers.append(NodeWatcher(caps_dir, self._node_changed, pattern="nvidia-cap*", uevents=False))
        self.metrics.start()  # bound now; served on the loop, a scrape reads the snapshot each tick publishes

    async def _is_member(self, uid: int) -> bool | None:
        """Whether uid is in the GPU group now; None when NSS cannot say (HolderEnder then reports)."""
        try:
            account = await self.lookup.by_uid(uid)
        except (accounts.NssFailure, LookupTimeout):
            return None
        except accounts.UnknownUser:  # no account: a user namespace's uid, or deleted
            return False
        return policy.is_member(account.groups, self.config.access)

    async def _handle(self, request: dict, peer) -> dict:
        return await self.api.handle(request, peer)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self._reload_on_signal)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop.set)
        # The node watcher's callback touches the store, so it runs on this loop like everything else.
        for watcher in self.node_watchers:
            loop.add_reader(watcher.fileno(), watcher.process)
        await self.server.start()
        await self.metrics.serve()
        ticker = asyncio.create_task(self._ticker())
        watchdog = systemd.watchdog_period()
        pinger = asyncio.create_task(self._watchdog(watchdog)) if watchdog else None
        systemd.notify("READY=1", f"STATUS={self._status_text()}")
        event(logging.INFO, "ready", socket=self.config.paths.socket, gpus=unit_list(self.grants.gpus),
              gate=self.gate_name if self.gate else "none (acl mode)", grants=len(self.store.grants()))
        try:
            await self._stop.wait()
        finally:
            systemd.notify("STOPPING=1", "STATUS=stopping; the gate stays attached")
            ticker.cancel()
            if pinger:
                pinger.cancel()
            for watcher in self.node_watchers:
                loop.remove_reader(watcher.fileno())
            if self._layout_read is not None:
                self._layout_read.cancel()
            await self.server.close()
            self.close()
        event(logging.INFO, "stopped", gate="left attached" if self.gate else None)

    def close(self) -> None:
        self.metrics.close()
        self.logout.close()
        self.holders.close()
        self.scans.close()
        self.processes.close()
        self.sampler.close()
        self.watcher.close()
        self.notifier.close()
        self.lookup.close()
        for watcher in self.node_watchers:
            watcher.close()
        self.backend.close()
        self.store.close()
        if self.gate:
            self.gate.close()  # our descriptors only: the program stays attached and pinned

    def reload(self) -> Config:
        """Load the config again; raises ConfigError and keeps the old one when it is broken."""
        new = configuration.load(self.config.source)
        # The backend, the socket, the nodes and the gate were built from these: they need a restart.
        fixed = replace(new, paths=self.config.paths, gpu=self.config.gpu, metrics=self.config.metrics,
                        access=replace(new.access, mode=self.config.access.mode))
        if fixed != new:
            event(logging.WARNING, "reload_partial", reason="paths, gpu, metrics and access.mode change at restart")
        self.config = fixed
        self.store.retention = fixed.events
        self.exempt.refresh()
        # The MIG layout is read again at once, through the sampler: NVML is used from one thread at a time.
        self._layout_read = asyncio.get_running_loop().create_task(self.read_layout())
        self.sync_nodes()
        event(logging.INFO, "reload", source=new.source, users=len(new.quotas.users), groups=len(new.quotas.groups))
        systemd.status(self._status_text())
        return fixed

    def _status_text(self) -> str:
        gate = f"gate {self.gate_name}" if self.gate else "acl mode, no gate"
        return (f"serving {len(self.grants.gpus)} GPUs, {len(self.store.grants())} grants, "
                f"{gate}; config {self.config.source}")

    async def _watchdog(self, period: float) -> None:
        """WATCHDOG=1 from the event loop itself: if the loop stops turning, the pings stop."""
        while True:
            systemd.notify("WATCHDOG=1")
            await asyncio.sleep(period)

    def _reload_on_signal(self) -> None:
        try:
            self.reload()
        except configuration.ConfigError as exc:
            event(logging.ERROR, "reload_failed", error=str(exc), kept="previous config")

    def _apply_exempt(self, uids: frozenset[int]) -> None:
        if self.gate:
            self.gate.set_exempt(uids)
        self.grants.set_exempt(uids)  # exempt users need ACL entries too: the nodes are 0660 root:root

    # --- device nodes

    def sync_nodes(self) -> None:
        """Make missing driver nodes and re-apply every GPU node's mode and ACL from the store.
        The reply to a driver (re)load: needs no config reload, so a config mid-edit blocks nothing."""
        self._ensure_driver_nodes()
        self.grants.node_changed(None)

    def _node_changed(self, path: Path | None) -> None:
        """NodeWatcher callback: None (driver loaded, GPU bound, events lost) means all nodes."""
        if path is None:
            self.sync_nodes()
        else:
            self.grants.node_changed(path)

    def _ensure_driver_nodes(self) -> None:
        # With NVreg_ModifyDeviceFiles=0 (etc/modprobe.d/gpuguard.conf) nothing else makes them,
        # nvidia-uvm included, whose module usually loads after boot.
        if self.config.gpu.backend == GpuBackend.NVML:
            devnodes.ensure_driver_nodes(self.config.paths.device_dir, sorted(driver_minors(self.config)))

    # --- the tick

    async def _ticker(self) -> None:
        """A tick every interval, at a fixed rate (the time a tick takes does not add up), and
        one more when a wait of the watcher's ends between two ticks (DEADLINE_MARGIN after it):
        a kill then lands within interval + grace + kill_wait, not an interval later per wait.
        Never closer than a quarter interval to the tick before, so NVML is not polled in bursts.
        Enforcement is checked after the first tick CHECK_EVERY seconds after the last check."""
        loop = asyncio.get_running_loop()
        last = checked = loop.time()
        regular = last + self.config.watcher.interval
        while True:
            interval = self.config.watcher.interval
            wake = regular
            if (deadline := self.watcher.next_deadline(time.time())) is not None:
                at_deadline = loop.time() + deadline - time.time() + DEADLINE_MARGIN
                wake = min(regular, max(at_deadline, last + interval / 4))
            await asyncio.sleep(max(0.0, wake - loop.time()))
            last = loop.time()
            if wake == regular:  # a slow tick is followed by the next at once, not by a burst
                regular = max(regular + interval, last)
            try:
                await self.tick()
            except Exception:
                event(logging.ERROR, "tick_failed", exc_info=True)  # the next tick tries again
            if last - checked >= CHECK_EVERY:  # by the clock: the ticks at a wait's end come on top
                checked = last
                self.check_enforcement()

    def check_enforcement(self) -> None:
        """Enforcement that checks and repairs itself, as fail2ban re-checks its actions: the gate
        attached and current, its maps equal to the store, every node's owner, mode and ACL.
        Someone (a careless admin, a driver reload, another tool) may have changed any of them."""
        try:
            for line in self.grants.check_and_repair():
                event(logging.WARNING, "repaired", what=line)
        except (GateError, OSError) as exc:
            event(logging.ERROR, "repair_failed", error=str(exc).splitlines()[0], action="retried next check")

    async def tick(self) -> None:
        started = time.monotonic()
        sample = await self.sampler.take_or_log("skipped this tick", max_age=0)  # the tick paces NVML polling
        if sample is not None:
            self.follow_layout(sample.layout)
            self.drop_dead_sessions()
            self.drop_gone_waiters()
            await self.logout.release_unused(sample)
            await self.watcher.check(sample, time.time())
            self.queue.dispatch(time.time())  # a waiter past reserve_after may now hold what is free
        await self.metrics.after_tick(time.monotonic() - started)

    async def read_layout(self) -> None:
        sample = await self.sampler.take_or_log("MIG layout read at the next tick", max_age=0)
        if sample is not None:
            self.follow_layout(sample.layout)

    def follow_layout(self, seen: MigLayout | None) -> None:
        """Follow the admin's MIG layout (`nvidia-smi mig ...`), read at each sample and on reload:
        the grants a change ends are revoked (Grants.update_layout) and their users told why."""
        if seen is None:
            return
        ended: dict[tuple[int, str], list[str]] = {}
        for grant, why in self.grants.update_layout(seen, time.time()).items():
            ended.setdefault((grant.uid, grant.user), []).append(why)
        for (uid, user), whys in ended.items():
            if uid not in self.exempt.uids:
                self.notifier.tell(user, uid, layout_message(whys), [s.tty for s in self.store.sessions(uid)])

    def drop_gone_waiters(self) -> None:
        """Queued requests nobody waits for: a login's whose user has no session left, a request's
        whose client is gone (also one that died while no daemon ran)."""
        logged_in = {s.uid for s in self.store.sessions()}
        gone = self.queue.gone(logged_in, lambda pid, start: pid is not None and _caller_alive(pid, start))
        if gone:
            self.queue.leave(q.waiter.id for q in gone)
            for queued in gone:
                event(logging.INFO, "queue_left", user=queued.waiter.user, ticket=queued.waiter.id,
                      reason="no session left" if queued.origin == Origin.SESSION else "client gone")

    def drop_dead_sessions(self) -> None:
        """Sessions whose PAM caller is gone without a close_session (crash, kill -9, lost message)."""
        starts = self.store.caller_starts()
        gone = [s for s in self.store.sessions() if not _caller_alive(s.pid, starts.get(s.id))]
        if gone:
            self.store.remove_sessions(s.id for s in gone)
            for session in gone:
                event(logging.INFO, "session_gone", user=session.user, session=session.id, pid=session.pid)


def _caller_alive(pid: int, start: int | None) -> bool:
    """The caller lives while a process with its pid and start time does. Start times count
    clock ticks since boot, so a stepped wall clock (chrony at boot) changes nothing. A session
    from before the store kept start times has none: then any process with the pid will do."""
    identity = procfs.process_identity(pid)
    return identity is not None and (start is None or identity.start_time == start)


def _refuse_stale_gate(name: str) -> None:
    """In acl mode a gate left attached from gate mode would go on enforcing grants nobody updates."""
    try:
        with Gate(name) as gate:
            attached = gate.is_attached()
    except (GateError, OSError):
        return  # no BPF or no cgroup v2 here: then no gate can be attached either
    if attached:
        raise GateError(f"gate {name} is still attached from gate mode: run gpuguard gate detach, "
                        "or set access.mode = gate")


def _raise_nofile() -> None:
    """Many clients at once (a burst of logins) each hold a descriptor for a moment."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(config: Config, gate_name: str) -> None:
    """Start and serve until SIGTERM; start-up failures raise with their cause."""
    async def main() -> None:
        daemon = Daemon(config, gate_name)
        daemon.start()
        await daemon.serve()

    asyncio.run(main())
