"""Prometheus metrics, the node_exporter textfile and dcgm-exporter's job mapping.

The event loop publishes after each tick: it reads the store, the last sample and the gate,
builds one frozen Snapshot and replaces the reference (`Metrics.snapshot`). A scrape reads only
that snapshot: it never touches the store, NVML or the gate. The endpoint is aiohttp's HTTP
server on the daemon's event loop (no thread per connection, which let two clients holding
800 idle connections each take every descriptor and 1,487 threads): every connection counts in
the daemon's connection budget (admission.py, at most METRICS at once, never the descriptors
root's logins need) and lives at most CONNECTION_LIFETIME, so a slowloris holds a slot for
seconds, not for ever. The page is rendered at most once a second (scrapes in a loop cost the
loop nothing more). The files are written from a worker thread, each atomically (a temporary
file renamed over the old one).

Counters count from the daemon's start, as Prometheus expects (rate() handles restarts); the
watcher's actions are read from the events the store records, newer than the last id seen.
"""
from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuguard.config import MetricsConfig
from gpuguard.core import reporting
from gpuguard.core.model import EventKind, Gpu, GpuUse, Grant, Origin, Quota, Rule, unit_label, unit_parent
from gpuguard.core.rules import Kind
from gpuguard.core.sample import Sample
from gpuguard.daemon import admission
from gpuguard.logs import Throttle, event
from gpuguard.services.edges import GateMap, GpuSampler
from gpuguard.services.store import Store

# Watcher tick durations (seconds): a healthy tick takes milliseconds; past interval/2 it logs watcher_slow.
TICK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Event kinds (model.Event.kind) counted, the counter each goes to, and the label its `rule` becomes.
# Series of the rules that always exist are shown at 0 from the start, so rate() sees the first one.
EVENT_COUNTERS: dict[EventKind, tuple[str, str, str, tuple[str, ...]]] = {
    # kind: (metric, help, label for the event's rule, rules shown at 0)
    EventKind.WARNING: ("gpuguard_warnings", "Warnings given, by rule", "rule", (Rule.MEMORY, Rule.TIME, Rule.STRAY)),
    EventKind.KILL: ("gpuguard_kills", "Signals sent to stop processes, by rule and signal", "rule",
                     (Rule.MEMORY, Rule.TIME, Rule.STRAY)),
    EventKind.UNKILLABLE: ("gpuguard_unkillable", "Processes that survived SIGKILL, by rule", "rule", ()),
    EventKind.RELEASE: ("gpuguard_releases", "GPU grants released, by rule (user, logout, idle)", "rule",
                        (Rule.USER, Rule.LOGOUT, Rule.IDLE)),
    EventKind.REVOKE: ("gpuguard_revokes", "GPU grants revoked, by rule (admin, time)", "rule",
                       (Rule.ADMIN, Rule.TIME)),
    EventKind.GRANT: ("gpuguard_grants_given", "GPU grants made, by origin", "origin", tuple(Origin)),
}
SIGNALS = (Kind.TERM.signal, Kind.KILL.signal)  # the signal label of a kill event, from its action
CONNECTION_LIFETIME = 10.0  # seconds: a scrape takes milliseconds (Prometheus's own timeout is 10 s)
KEEPALIVE = 5.0             # seconds an idle connection is kept between requests (and before the first)
RENDER_EVERY = 1.0          # seconds a rendered page is served again
EVICT_AFTER = 1.0           # seconds a connection has lasted before a new one may take its place
LISTEN_BACKLOG = 128


@dataclass(frozen=True)
class Holding:
    user: str
    uid: int
    granted_at: float
    expires_at: float | None


@dataclass(frozen=True)
class GpuState:
    gpu: Gpu
    read: bool                   # the last sample read its processes
    use: GpuUse | None           # None: NVML did not answer for it
    holders: tuple[Holding, ...]
    user_memory: tuple[tuple[str, int], ...]  # (user, bytes NVML knows their processes use here)
    fractions: tuple[tuple[str, int | None], ...] = ()  # (user, bytes promised) of each shared grant here
    memory_promised: int = 0     # to those fractions in all
    memory_left: int | None = None  # to promise to more sharers (reporting.fractions); None: unknown


@dataclass(frozen=True)
class Snapshot:
    time: float
    gpus: tuple[GpuState, ...]
    grants: int
    sessions: int
    events: Mapping[tuple[str, str, str], int]  # (kind, rule, action) -> count since start
    nvml_errors: Mapping[str, int]             # GPU minor -> failed reads; "all": samples no GPU answered
    tick_buckets: tuple[int, ...]              # counts per TICK_BUCKETS bucket (not cumulative), then +Inf
    tick_sum: float
    gate_attached: bool | None                 # None: access.mode = acl, no gate
    gate_grants: int | None
    gate_exempt: int | None
    queue_requests: int = 0                    # requests waiting
    queue_units: int = 0                       # GPUs (or MIG slices) they ask for
    queue_oldest: float | None = None          # when the longest-waiting one joined; None: nobody waits
    notices: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (channel, outcome) -> remote notices
    drained: frozenset[int] = frozenset()      # GPUs (minors) given to nobody new
    endpoint_refused: int = 0                  # connections the metrics endpoint refused over its caps


@dataclass
class _Ticks:
    """The tick-duration histogram's running totals (loop side)."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(TICK_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.buckets[next((i for i, bound in enumerate(TICK_BUCKETS) if seconds <= bound), len(TICK_BUCKETS))] += 1
        self.total += seconds


def gpu_states(gpus: Iterable[Gpu], sample: Sample | None, grants: Iterable[Grant],
               name_of: Callable[[int], str]) -> tuple[GpuState, ...]:
    """Per GPU: its numbers from the sample, its holders, each user's known memory there, its fractions."""
    grants = list(grants)
    states = []
    for gpu in sorted(gpus, key=lambda g: g.unit):
        holders = tuple(Holding(g.user, g.uid, g.granted_at, g.expires_at) for g in grants if g.unit == gpu.unit)
        names = {h.uid: h.user for h in holders}  # a grant names its user; others (strays) by the watcher's lookup
        memory: Counter[str] = Counter()
        if sample is not None:
            for process in sample.processes:
                uid = sample.uid_of(process.pid)
                if process.unit == gpu.unit and uid is not None and process.used_memory is not None:
                    memory[names.get(uid) or name_of(uid)] += process.used_memory
        shares = reporting.fractions(gpu, grants)
        states.append(GpuState(gpu, sample is not None and sample.ok(gpu.unit),
                               sample.use.get(gpu.unit) if sample else None, holders, tuple(sorted(memory.items())),
                               tuple((f["user"], f["memory"]) for f in shares["fractions"]), shares["memory_promised"],
                               shares["memory_left"]))
    return tuple(states)


class SnapshotCollector(Collector):
    """A prometheus-client collector over whatever snapshot `source.snapshot` holds when scraped."""

    def __init__(self, source: Metrics):
        self.source = source

    def collect(self) -> Iterator[Metric]:
        snapshot = self.source.snapshot  # one read of the reference: the rest is that immutable object
        if snapshot is not None:
            yield from families(snapshot)


def families(s: Snapshot) -> Iterator[Metric]:
    """The metric families of one snapshot (pure)."""
    gpu_labels = ["gpu", "uuid"]

    def per_gpu(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=gpu_labels + (labels or []))

    info = per_gpu("gpuguard_gpu_info", "GPU inventory (value 1); index is NVML's, gpu the minor of /dev/nvidiaN "
                   "or, for a MIG slice, GPU/gi<G>/ci<C> with its profile", ["index", "name", "pci_bus_id", "profile"])
    up = per_gpu("gpuguard_gpu_up", "1 when the last sample read the GPU's processes, 0 on an NVML error")
    used = per_gpu("gpuguard_gpu_memory_used_bytes", "GPU memory in use, all processes")
    total = per_gpu("gpuguard_gpu_memory_total_bytes", "GPU memory in all")
    util = per_gpu("gpuguard_gpu_utilization_ratio", "Share of the last sample period a kernel ran (0-1)")
    holder = per_gpu("gpuguard_gpu_holder", "A grant of the GPU to a user (value 1)", ["user", "uid"])
    age = per_gpu("gpuguard_grant_age_seconds", "How long the user has held the GPU", ["user"])
    left = per_gpu("gpuguard_grant_remaining_seconds", "Time left on a grant with a time limit", ["user"])
    user_memory = per_gpu("gpuguard_user_gpu_memory_used_bytes",
                          "GPU memory NVML reports for the user's processes on the GPU", ["user"])
    drained = per_gpu("gpuguard_gpu_drained", "1 while the GPU is drained (given to nobody new), else 0")
    fractions = per_gpu("gpuguard_gpu_fractions", "Shared grants on the GPU (fractions of it), 0 when none")
    promised = per_gpu("gpuguard_gpu_memory_promised_bytes", "GPU memory promised to its fractions in all")
    unpromised = per_gpu("gpuguard_gpu_memory_left_bytes", "GPU memory left to promise to more sharers "
                         "(0 while held whole; absent while a sharer's promise is unknown)")
    fraction = per_gpu("gpuguard_grant_memory_promised_bytes", "GPU memory promised to the user's fraction of the GPU",
                       ["user"])
    for state in s.gpus:
        gpu = state.gpu
        key = [unit_label(gpu.unit), gpu.uuid]
        info.add_metric(key + [str(gpu.index), gpu.name, gpu.pci_bus_id, gpu.slice.profile if gpu.slice else ""], 1)
        up.add_metric(key, 1 if state.read else 0)
        drained.add_metric(key, 1 if unit_parent(gpu.unit) in s.drained else 0)
        if state.use is not None:
            used.add_metric(key, state.use.memory_used)
            total.add_metric(key, state.use.memory_total)
            if state.use.utilization is not None:
                util.add_metric(key, state.use.utilization / 100)
        for h in state.holders:
            holder.add_metric(key + [h.user, str(h.uid)], 1)
            age.add_metric(key + [h.user], max(0.0, s.time - h.granted_at))
            if h.expires_at is not None:
                left.add_metric(key + [h.user], max(0.0, h.expires_at - s.time))
        for user, memory in state.user_memory:
            user_memory.add_metric(key + [user], memory)
        fractions.add_metric(key, len(state.fractions))
        promised.add_metric(key, state.memory_promised)
        if state.memory_left is not None:
            unpromised.add_metric(key, state.memory_left)
        for user, share in state.fractions:
            if share is not None:
                fraction.add_metric(key + [user], share)
    yield from (info, up, used, total, util, holder, age, left, user_memory, drained, fractions, promised, unpromised,
                fraction)

    yield GaugeMetricFamily("gpuguard_grants", "GPU grants in force (one per user and GPU)", value=s.grants)
    yield GaugeMetricFamily("gpuguard_sessions", "Open PAM sessions the daemon knows of", value=s.sessions)
    yield GaugeMetricFamily("gpuguard_queue_requests", "Requests waiting in the queue for GPUs", value=s.queue_requests)
    yield GaugeMetricFamily("gpuguard_queue_gpus", "GPUs (or MIG slices) the waiting requests ask for",
                            value=s.queue_units)
    yield GaugeMetricFamily("gpuguard_queue_oldest_wait_seconds", "How long the longest-waiting request has waited "
                            "(0 when nobody waits)", value=0.0 if s.queue_oldest is None else max(0.0, s.time - s.queue_oldest))
    yield from _event_families(s.events)
    notices = CounterMetricFamily("gpuguard_notices", "Notices to webhooks and e-mail, by channel and outcome "
                                  "(sent, failed, dropped over the per-user rate or a full queue)",
                                  labels=["channel", "outcome"])
    for (channel, outcome), count in sorted(s.notices.items()):
        notices.add_metric([channel, outcome], count)
    yield notices

    errors = CounterMetricFamily("gpuguard_nvml_errors", "NVML process queries that failed, by GPU", labels=["gpu"])
    for minor, count in sorted(s.nvml_errors.items()):
        if minor != "all":
            errors.add_metric([minor], count)
    yield errors
    yield CounterMetricFamily("gpuguard_metrics_connections_refused", "Connections the metrics endpoint closed "
                              "unread, over its cap or the daemon's connection budget", value=s.endpoint_refused)
    yield CounterMetricFamily("gpuguard_nvml_sample_failures", "Samples in which no GPU answered NVML",
                              value=s.nvml_errors.get("all", 0))
    cumulative, running = [], 0
    for bound, count in zip([*map(str, TICK_BUCKETS), "+Inf"], s.tick_buckets, strict=True):
        running += count
        cumulative.append((bound, running))
    yield HistogramMetricFamily("gpuguard_watcher_tick_seconds", "Duration of the watcher's tick (sample, decide, act)",
                                buckets=cumulative, sum_value=s.tick_sum)
    if s.gate_attached is not None:
        yield GaugeMetricFamily("gpuguard_gate_attached", "1 while the BPF device gate is attached to the cgroup root",
                                value=1 if s.gate_attached else 0)
        entries = GaugeMetricFamily("gpuguard_gate_map_entries",
                                    "Entries in the gate's BPF maps: grants, and exempt uids (root passes always)",
                                    labels=["map"])
        entries.add_metric(["grants"], s.gate_grants or 0)
        entries.add_metric(["exempt"], s.gate_exempt or 0)
        yield entries
    yield GaugeMetricFamily("gpuguard_last_tick_timestamp_seconds",
                            "When these numbers were taken (a stale textfile shows here)", value=s.time)


def _event_families(counts: Mapping[tuple[str, str, str], int]) -> Iterator[Metric]:
    for kind, (name, doc, label, always) in EVENT_COUNTERS.items():
        labels = [label, "signal"] if kind == EventKind.KILL else [label]
        family = CounterMetricFamily(name, doc, labels=labels)
        values: Counter[tuple[str, ...]] = Counter()
        for rule in always:
            for signal in (SIGNALS if kind == EventKind.KILL else [None]):
                values[(rule, signal) if signal else (rule,)] += 0
        for (event_kind, rule, action), count in counts.items():
            if event_kind == kind:
                sent = (Kind(action).signal if action in (Kind.TERM, Kind.KILL) else None) or action
                values[(rule, sent) if kind == EventKind.KILL else (rule,)] += count
        for key, count in sorted(values.items()):
            family.add_metric(list(key), count)
        yield family


def job_mapping(states: Iterable[GpuState]) -> dict[str, str]:
    """dcgm-exporter's HPC job mapping: one file per GPU, named by the GPU id dcgm-exporter uses
    (NVML's index), holding one job id per line; here the job is the holder's user name, so DCGM
    metrics get an `hpc_job` label naming who holds the GPU (for a GPU in MIG mode, the holders
    of its slices). Free GPUs have no file."""
    users: dict[str, list[str]] = {}  # the slices of a GPU in MIG mode share its index: one file for all
    for state in states:
        users.setdefault(str(state.gpu.index), []).extend(h.user for h in state.holders)
    return {index: "".join(f"{user}\n" for user in names) for index, names in users.items() if names}


def write_job_mapping(directory: Path, files: Mapping[str, str]) -> None:
    """Make `directory` hold exactly these files, each replaced atomically (blocking: run off the loop)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = directory / name
        try:
            if path.read_text() == text:
                continue
        except FileNotFoundError:
            pass
        temporary = directory / f".{name}.gpuguard-tmp"  # a dot file: not a GPU id dcgm-exporter would read
        temporary.write_text(text)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    for entry in directory.iterdir():
        if entry.name.isdigit() and entry.name not in files:
            entry.unlink(missing_ok=True)  # the GPU was released


class _Refusal(asyncio.Protocol):
    """A connection refused before aiohttp makes a request handler for it: closed at once, nothing
    read. (A handler whose connection is aborted in its own connection_made loses it before its
    task starts, and the task's assertion was logged as loop_error, once per refusal.)"""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.Transport, transport).abort()


class _Endpoint(web.Server):
    """aiohttp's low-level server with every connection admitted by the budget and given a deadline.
    When the endpoint's own cap is full, a new connection takes the place of the oldest if that
    one has lasted EVICT_AFTER (a scrape is over in milliseconds: what lasts is idle or trickling),
    and is refused otherwise: counted in `refusals`, logged through `refused` (throttled)."""

    def __init__(self, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]], budget: admission.Budget,
                 refused: Callable[[str], None]) -> None:
        super().__init__(handler, keepalive_timeout=KEEPALIVE, access_log=None)
        self.budget = budget
        self.refused = refused
        self.refusals = 0
        # handler -> (transport, its deadline, when admitted), in order of arrival
        self._admitted: dict[object, tuple[asyncio.Transport, asyncio.TimerHandle, float]] = {}

    def __call__(self) -> web.RequestHandler | _Refusal:  # type: ignore[override]  # the loop takes any protocol
        """The protocol of a connection just accepted (the loop calls connection_made next): a request
        handler if it is admitted, its slot taken, else a refusal."""
        if (refusal := self._admit()) is not None:
            self.refusals += 1
            self.refused(refusal)
            return _Refusal()
        return super().__call__()

    def _admit(self) -> str | None:
        """Make room for one connection (its slot in the budget taken), or say why there is none."""
        if len(self._admitted) < self.budget.metrics:
            return self.budget.take(admission.METRICS_KEY)
        oldest, (dropped, deadline, since) = next(iter(self._admitted.items()))
        if self._loop.time() - since < EVICT_AFTER:
            return f"more than {self.budget.metrics} connections at once to the metrics endpoint"
        del self._admitted[oldest]  # its slot in the budget passes to the new one
        deadline.cancel()
        dropped.abort()
        return None

    def connection_made(self, handler: web.RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self._admitted[handler] = (transport, self._loop.call_later(CONNECTION_LIFETIME, transport.abort),
                                   self._loop.time())

    def connection_lost(self, handler: web.RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        admitted = self._admitted.pop(handler, None)
        if admitted is not None:
            admitted[1].cancel()
            self.budget.give_back(admission.METRICS_KEY)


class Metrics:
    """The loop side: publishes a snapshot per tick and feeds the endpoint and the files."""

    def __init__(self, settings: MetricsConfig, store: Store, gpus: Mapping[int, Gpu], sampler: GpuSampler,
                 gate: GateMap | None,
                 account_of: Callable[[int], tuple[str, Quota]],
                 notices: Callable[[], Mapping[tuple[str, str], int]] = dict,
                 drained: Callable[[], Iterable[int]] = tuple, budget: admission.Budget | None = None,
                 collectors: Iterable[Collector] = ()) -> None:
        self.settings = settings
        self.drained = drained  # the drained GPUs' minors (Grants.drained)
        self.notices = notices  # remote notices sent, failed and dropped (remote_notify), thread-safe
        self.account_of = account_of  # user names as the watcher last resolved them (no NSS on the loop)
        self.store = store
        self.gpus = gpus
        self.sampler = sampler
        self.gate = gate
        self.snapshot: Snapshot | None = None
        self._ticks = _Ticks()
        self._events: Counter[tuple[str, str, str]] = Counter()
        self._last_event_id = store.last_event_id()  # counted from the start on
        self.registry = CollectorRegistry(auto_describe=True)  # the textfile's: gpuguard's own metrics only
        self.registry.register(SnapshotCollector(self))
        # Connections, shared with the socket's (the daemon passes its budget).
        self.budget = budget or admission.Budget.for_descriptors(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self.throttle = Throttle("endpoint")  # refused connections: a few lines a minute, then a count
        self._listening: socket.socket | None = None
        self._endpoint: _Endpoint | None = None
        self._server: asyncio.AbstractServer | None = None
        self._served = CollectorRegistry(auto_describe=True)
        self._served.register(SnapshotCollector(self))
        ProcessCollector(registry=self._served)  # the daemon's own memory, CPU and descriptors
        for collector in collectors:  # the services' own (e.g. the process index's), read as they are
            self.registry.register(collector)
            self._served.register(collector)
        self._page: tuple[float, bytes] = (-RENDER_EVERY, b"")  # (time.monotonic() rendered, the page)

    @property
    def enabled(self) -> bool:
        s = self.settings
        return bool(s.listen or s.textfile or s.dcgm_job_mapping_dir)

    def start(self) -> None:
        """Bind the /metrics address when configured (raises OSError when it cannot be bound);
        serve() serves it on the loop."""
        if self.settings.listen is None:
            return
        address, port = self.settings.listen
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        listening = socket.socket(family, socket.SOCK_STREAM)
        try:
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listening.bind((address, port))
            listening.listen(LISTEN_BACKLOG)
        except OSError as exc:
            listening.close()
            raise OSError(exc.errno, f"metrics.listen {address}:{port}: {exc.strerror}") from None
        listening.setblocking(False)
        self._listening = listening
        event(logging.INFO, "metrics_listening", address=address, port=port)

    async def serve(self) -> None:
        if self._listening is None:
            return
        self._endpoint = _Endpoint(self._scrape, self.budget, self._refused)
        self._server = await asyncio.get_running_loop().create_server(self._endpoint, sock=self._listening)

    def _refused(self, reason: str) -> None:
        self.throttle.event("metrics", logging.WARNING, "refused", reason=reason)

    async def _scrape(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path != "/metrics" and request.path != "/":
            return web.Response(status=404, text="gpuguard serves /metrics\n")
        rendered, page = self._page
        if time.monotonic() - rendered >= RENDER_EVERY:
            self._page = (time.monotonic(), page := generate_latest(self._served))
        return web.Response(body=page, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def publish(self, tick_seconds: float) -> Snapshot:
        """Build this tick's snapshot on the loop thread (reads only local state and the store)."""
        self._ticks.observe(tick_seconds)
        self._last_event_id, counts = self.store.event_counts_since(self._last_event_id)
        for kind, rule, action, count in counts:
            self._events[(kind, rule, action)] += count
        gate = self.gate
        attached = gate.is_attached() if gate else None
        entries = gate.entries() if gate and attached else set()
        waiting = [queued.waiter for queued in self.store.queue()]
        self.snapshot = Snapshot(
            time=time.time(), gpus=gpu_states(self.gpus.values(), self.sampler.last, self.store.grants(),
                                           lambda uid: self.account_of(uid)[0]),
            grants=len(self.store.grants()), sessions=len(self.store.sessions()), events=dict(self._events),
            nvml_errors=dict(self.sampler.errors), tick_buckets=tuple(self._ticks.buckets), tick_sum=self._ticks.total,
            gate_attached=attached, gate_grants=len(entries) if gate else None,
            gate_exempt=len(gate.exempt() - {0}) if gate and attached else (0 if gate else None),
            queue_requests=len(waiting), queue_units=sum(w.gpus for w in waiting),
            queue_oldest=min((w.since for w in waiting), default=None), notices=self.notices(),
            drained=frozenset(self.drained()), endpoint_refused=self._endpoint.refusals if self._endpoint else 0)
        return self.snapshot

    async def after_tick(self, tick_seconds: float) -> None:
        """Publish, then write the configured files off the loop; a failing write is logged, never raised."""
        if not self.enabled:
            return
        self.throttle.flush()
        snapshot = self.publish(tick_seconds)
        try:
            await asyncio.to_thread(self._write_files, snapshot)
        except OSError as exc:
            event(logging.ERROR, "metrics_write_failed", error=str(exc))

    def _write_files(self, snapshot: Snapshot) -> None:
        if self.settings.textfile is not None:
            self.settings.textfile.parent.mkdir(parents=True, exist_ok=True)
            write_to_textfile(str(self.settings.textfile), self.registry)
        if self.settings.dcgm_job_mapping_dir is not None:
            write_job_mapping(self.settings.dcgm_job_mapping_dir, job_mapping(snapshot.gpus))

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._endpoint is not None:
            for handler in self._endpoint.connections:
                handler.force_close()
        if self._listening is not None:
            self._listening.close()
