"""`gpuguard daemon`: the real edges (kernel, NVML, NSS, terminals) handed to services.wiring.build, and the event loop.

Start: claim the socket path (refused while another daemon serves) -> GPU backend -> gate ->
the services (services.wiring.build, which opens the store; daemon.wiring.build, the operations
and the metrics on them) -> exemptions, the gate attached or found with
them -> the MIG layout followed -> reconcile the gate map and node ACLs from the store ->
watch the device directory -> serve the socket -> READY=1. Under systemd it also says what it
is doing (STATUS=) and pings the watchdog (WATCHDOG=1, WatchdogSec= in etc/gpuguard.service)
from the event loop, so a loop that hangs gets the daemon restarted. One asyncio loop in the main thread
runs the server, the metrics endpoint and a periodic tick; the store is touched only from that
thread, and blocking NVML and /proc work runs in threads of its own (backends.sampler.Sampler, scans.Scans).
Decisions that read state and
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
from typing import Any

from gpuguard import config as configuration
from gpuguard import fleet
from gpuguard.backends import (
    GateError,
    caps_major,
    coexist_nodes,
    devnodes,
    driver_minors,
    notify,
    nss,
    open_gate,
    open_gpu_backend,
    proc_events,
    procfs,
    slurm,
    systemd,
    visible_devices,
)
from gpuguard.backends.exits import ExitWatch
from gpuguard.backends.gate import Gate
from gpuguard.backends.gpu_nodes import AclNodes
from gpuguard.backends.node_watcher import NodeWatcher
from gpuguard.backends.nss import AccountLookup
from gpuguard.backends.owned import OwnedGpus
from gpuguard.backends.processes import HostProcesses
from gpuguard.backends.remote_notify import RemoteNotifier
from gpuguard.backends.sampler import Sampler, node_openers
from gpuguard.config import AccessMode, Config, GpuBackend
from gpuguard.core import coexist
from gpuguard.core.coexist import Owner
from gpuguard.core.messages import unit_list
from gpuguard.core.model import EventKind, Rule, unit_parent
from gpuguard.daemon import wiring as front
from gpuguard.daemon.server import Peer, Server
from gpuguard.logs import event
from gpuguard.services import wiring

DEADLINE_MARGIN = 0.001  # seconds past a wait's end: the tick's clock must read it as over
CHECK_EVERY = 30.0  # seconds between checks that the gate, its maps and the node ACLs are as the store says


class Daemon:
    def __init__(self, config: Config, gate_name: str = "gpuguard"):
        self.config = config
        self.gate_name = gate_name
        self._stop = asyncio.Event()
        self._reloading: asyncio.Task[None] | None = None  # what the last reload does to the services

    def current_config(self) -> Config:
        """What the services read the config through: a reload replaces self.config."""
        return self.config

    # --- life cycle

    def start(self) -> None:
        """Everything before serving; raises ServerError, StoreError, GpuError, GateError or OSError."""
        _raise_nofile()
        self.server = Server(self.config.paths.socket, self._handle, abandoned_on_hangup=frozenset({"wait"}))
        self.server.claim()  # a second daemon stops here, before it touches the gate or the nodes
        for line in self.config.renamed:  # old names in the admin's files, read for one release
            event(logging.WARNING, "config_renamed", detail=line)
        systemd.status("starting: opening the store and the GPUs")
        # Before anything is touched: on a Slurm node nobody has decided about, refusing is safe
        present = driver_minors(self.config)
        self.ownership = slurm.ownership(self.config.coexist, present)
        coexist.check_some_left(self.ownership, present)
        if self.config.access.mode == AccessMode.ACL:
            _refuse_stale_gate(self.gate_name)
        self._ensure_driver_nodes()  # NVML needs them to start
        self.backend = OwnedGpus(open_gpu_backend(self.config), self.ownership.foreign)
        for error in self.backend.unavailable:  # GPUs NVML cannot read at start: the others are still guarded
            event(logging.ERROR, "gpu_unavailable", error=error, action="left out until a restart")
        self.gate = open_gate(self.config, self.gate_name, self.ownership) if self.config.access.mode == AccessMode.GATE else None
        # Every GPU the driver has keeps a managed node, also one NVML cannot read now: left
        # alone, its node would stay as the driver made it (0666), open to all in acl mode.
        first_layout = self.backend.layout()
        remote = RemoteNotifier(lambda: self.config.notify)  # webhook and e-mail, beside the terminals
        sampler = self.sampler = Sampler(self.backend)
        # The users' pids for opener scans, from the kernel's process events; without it they walk /proc.
        index = self.process_index = proc_events.ProcessIndex()
        index.start()
        services = self.services = wiring.build(wiring.Edges(
            config=self.current_config, store_path=self.config.paths.state_dir / "state.db",
            sampler=sampler,
            units={gpu.unit: gpu for gpu in [*self.backend.gpus(), *first_layout.slices]},
            driver_minors=present - self.ownership.foreign.keys(), nodes=AclNodes(self.config.paths.device_dir),
            lookup=AccountLookup(), terminals=notify.Notifier(remote=remote), exits=ExitWatch(),
            find_openers=partial(node_openers, real_uids=procfs.RealUids(), pids_of=index.pids_of),
            processes=HostProcesses(),
            gate=self.gate,
            topology=self.backend.topology(), caps_major=caps_major(self.config),
            foreign=coexist.status_entries(self.backend.foreign_gpus(), self.ownership),
            visible_devices=visible_devices.VisibleDevicesFiles(visible_devices.directory_for(self.config.paths.socket)),
            fleet_db=fleet.database(self.config)))
        self.front = front.build(services, reload=self.reload, sync_nodes=self.sync_nodes, notices=remote.counts,
                                 connections=self.server.budget, collectors=(proc_events.IndexCollector(index),))
        self.store, self.grants = services.store, services.grants
        systemd.status("starting: attaching the gate and restoring grants")
        # NSS blocking here, at start only, before anything is served; a reload refreshes off the loop
        exempt = nss.exempt_uids((self.config.access, self.store.users_logged_in()))
        if self.gate:
            self.gate.attach(exempt)  # a new gate starts with its exempt map filled: no moment without it
        services.exempt.set(exempt)
        self._end_foreign_grants()
        # Grants on MIG slices the admin changed while no daemon ran end (their holders ended, their
        # users told) before the gate and the ACLs are rebuilt from the store.
        self.services.releases.follow_layout(first_layout, time.time())
        for repaired in self.grants.reconcile():  # what changed while no daemon ran
            event(logging.INFO, "reconcile", repaired=repaired)
        # Each holder's CUDA_VISIBLE_DEVICES for the PAM module, should it find no daemon at a login.
        self.grants.write_all_visible_devices()
        self.node_watchers = [NodeWatcher(self.config.paths.device_dir, self._node_changed)]
        caps_dir = self.config.paths.device_dir / "nvidia-caps"
        if caps_dir.is_dir():  # made by the reconcile when this machine has MIG slices
            self.node_watchers.append(NodeWatcher(caps_dir, self._node_changed, pattern="nvidia-cap*", uevents=False))
        self.front.metrics.start()  # bound now; served on the loop, a scrape reads the snapshot each tick publishes

    def _end_foreign_grants(self) -> None:
        """Grants made before their GPU became Slurm's or Kubernetes' end: the gate leaves its node alone now."""
        if self.ownership.foreign:
            event(logging.INFO, "coexist", owners=self.ownership.summary())
        for grant in self.store.grants():
            if (owner := self.ownership.owner(unit_parent(grant.unit))) != Owner.GPUGUARD:
                gpu = unit_parent(grant.unit)
                self.services.releases.take_back(grant.uid, [grant.unit], time.time(), kind=EventKind.REVOKE,
                                                 rule=Rule.COEXIST, message=f"GPU {gpu} belongs to {owner} now (coexist)")
        # Their nodes as their owner expects them (0666, no ACL), not as gpuguard left them: Slurm's jobs open them
        for node in coexist_nodes.hand_over(self.config, self.ownership):
            event(logging.WARNING, "coexist_node", repaired=node, owners=self.ownership.summary())

    async def _handle(self, request: dict[str, Any], peer: Peer) -> dict[str, Any]:
        if request["op"] in fleet.OPERATIONS:
            fleet_services = self.services.fleet
            return await (fleet_services.ops.handle if fleet_services else fleet.not_in_fleet)(request, peer)
        return await self.front.api.handle(request, peer)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self._reload_on_signal)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop.set)
        # The node watcher's callback touches the store, so it runs on this loop like everything else.
        for watcher in self.node_watchers:
            loop.add_reader(watcher.fileno(), watcher.process)
        await self.server.start()
        await self.front.metrics.serve()
        ticker = asyncio.create_task(self._ticker())
        watchdog = systemd.watchdog_period()
        pinger = asyncio.create_task(self._watchdog(watchdog)) if watchdog else None
        fleet_services = self.services.fleet
        heartbeat = asyncio.create_task(fleet_services.node.run()) if fleet_services else None
        systemd.notify("READY=1", f"STATUS={self._status_text()}")
        event(logging.INFO, "ready", socket=self.config.paths.socket, gpu=unit_list(self.grants.gpus),
              gate=self.gate_name if self.gate else "none (acl mode)", grants=len(self.store.grants()))
        try:
            await self._stop.wait()
        finally:
            systemd.notify("STOPPING=1", "STATUS=stopping; the gate stays attached")
            ticker.cancel()
            if pinger:
                pinger.cancel()
            if heartbeat:
                heartbeat.cancel()
            for watcher in self.node_watchers:
                loop.remove_reader(watcher.fileno())
            if self._reloading is not None:
                self._reloading.cancel()
            await self.server.close()
            self.close()
        event(logging.INFO, "stopped", gate="left attached" if self.gate else None)

    def close(self) -> None:
        self.front.close()
        self.services.close()
        self.process_index.close()  # edges: the daemon made them
        self.sampler.close()
        for watcher in self.node_watchers:
            watcher.close()
        self.backend.close()
        if self.gate:
            self.gate.close()  # our descriptors only: the program stays attached and pinned

    def reload(self) -> Config:
        """Load the config again; raises ConfigError and keeps the old one when it is broken."""
        new, old = configuration.load(self.config.source), self.config
        # The backend, the socket, the nodes and the gate were built from these: they need a restart.
        fixed = replace(new, paths=self.config.paths, gpu=self.config.gpu, metrics=self.config.metrics,
                        coexist=self.config.coexist, fleet=self.config.fleet,
                        access=replace(new.access, mode=self.config.access.mode))
        if fixed != new:
            event(logging.WARNING, "reload_partial",
                  reason="paths, gpu, metrics, coexist, fleet and access.mode change at restart")
        self.config = fixed
        # The exempt users, the MIG layout and what the new config does to grants given (former
        # members', lowered idle limits): one call into the services, off this call (NSS, NVML).
        self._reloading = asyncio.get_running_loop().create_task(self.services.reload(old, fixed, time.time()))
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
            devnodes.ensure_driver_nodes(self.config.paths.device_dir, sorted(driver_minors(self.config)),
                                         foreign=self.ownership.foreign.keys())

    # --- the tick

    async def _ticker(self) -> None:
        """A tick every interval, at a fixed rate (the time a tick takes does not add up), and
        one more when one of the watcher's moments comes between two ticks (DEADLINE_MARGIN after
        it: a wait's end, a time limit, an idle clock; Watcher.next_moment): a kill then lands
        within interval + grace + kill_wait, not an interval later per wait (next_wake says when).
        Enforcement is checked after the first tick CHECK_EVERY seconds after the last check."""
        loop = asyncio.get_running_loop()
        last = checked = loop.time()
        regular = last + self.config.watcher.interval
        while True:
            interval = self.config.watcher.interval
            at_deadline = None
            if (deadline := self.services.watcher.next_moment()) is not None:
                at_deadline = loop.time() + deadline - time.time() + DEADLINE_MARGIN
            wake = next_wake(last, regular, at_deadline, interval)
            await asyncio.sleep(max(0.0, wake - loop.time()))
            last = loop.time()
            if wake >= regular:  # a slow tick is followed by the next at once, not by a burst
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
            self.services.releases.follow_layout(sample.layout, time.time())
            self.services.logout.drop_dead_sessions()
            self.services.queue.drop_gone(self.services.logout.caller_alive)
            await self.services.logout.release_unused(sample)
            if self._reloading is not None:  # a reload's notices go first: its new limits act after them
                await asyncio.wait({self._reloading})
            await self.services.watcher.check(sample, time.time())
            self.services.queue.dispatch(time.time())  # a waiter past reserve_after may now hold what is free
            self.services.use_history.add(sample, {g.uid for g in self.services.store.grants_read()})
        await self.front.metrics.after_tick(time.monotonic() - started)

def next_wake(last: float, regular: float, deadline: float | None, interval: float) -> float:
    """When the next tick comes (loop time): the regular one, `interval` after the one before, or
    earlier at a wait's end (`deadline`); never closer than a quarter interval to the tick before
    (`last`), so a user's staggered strays cannot make NVML be polled in bursts. A wait that ends
    within a quarter interval after the regular tick delays that tick to its end: one sample for
    both, where the regular tick would come a moment too early for it and the next could come only
    a quarter interval later. A wait that ended before the last tick began was that tick's (or,
    if its sample failed, the regular ticks' to retry)."""
    if deadline is None or deadline <= last or deadline >= regular + interval / 4:
        return regular
    if deadline >= regular:
        return deadline
    return max(deadline, last + interval / 4)


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
