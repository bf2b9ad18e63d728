"""The metrics' snapshot and families, built from the services the daemon passes (fakes): no daemon, no HTTP."""
from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from fakes import GROUP, gpu
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.config import MetricsConfig
from gpuguard.core.model import GpuUse
from gpuguard.daemon.metrics import GpuState, Holding, Metrics, job_mapping, write_job_mapping


def exposition(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_gpu_nvml_cannot_read_is_down_and_counted_and_the_others_keep_their_numbers(world):
    alice = world.lookup.add("alice", 1001, GROUP)
    (unit,) = world.login(alice)["gpus"]
    sample = world.sampler.set([(500, 1001, unit, 3 << 30)], units={0, 1, 2, 3} - {3})
    world.sampler.last = replace(sample, use={unit: GpuUse(3 << 30, 80 << 30, 40)})
    world.sampler.errors = {"3": 2}
    metrics = Metrics(MetricsConfig(), world.store, world.grants.gpus, world.sampler, None,
                      world.services.accounts.of)
    metrics.publish(0.02)
    m = exposition(metrics)
    key = frozenset({"gpu": str(unit), "uuid": f"GPU-{unit:04d}"}.items())
    assert m[("gpuguard_gpu_utilization_ratio", key)] == 0.4
    assert m[("gpuguard_user_gpu_memory_used_bytes", key | {("user", "alice")})] == 3 << 30
    assert m[("gpuguard_gpu_up", frozenset({"gpu": "3", "uuid": "GPU-0003"}.items()))] == 0
    assert m[("gpuguard_nvml_errors_total", frozenset({"gpu": "3"}.items()))] == 2
    assert m[("gpuguard_watcher_tick_seconds_bucket", frozenset({"le": "0.025"}.items()))] == 1
    assert m[("gpuguard_watcher_tick_seconds_bucket", frozenset({"le": "0.01"}.items()))] == 0
    assert not [name for name, _ in m if name.startswith("gpuguard_gate")]  # acl mode: no gate to report


def test_counters_count_events_recorded_after_the_start_only(world):
    alice = world.lookup.add("alice", 1001, GROUP)
    world.login(alice)  # a grant event before the metrics start: not counted
    metrics = Metrics(MetricsConfig(), world.store, world.grants.gpus, world.sampler, None,
                      world.services.accounts.of)
    world.call("release", uid=1001)
    world.login(alice, pid=4343)
    metrics.publish(0.01)
    metrics.publish(0.01)  # a second publish adds nothing new
    m = exposition(metrics)
    assert m[("gpuguard_releases_total", frozenset({"rule": "user"}.items()))] == 1
    assert m[("gpuguard_grants_given_total", frozenset({"origin": "session"}.items()))] == 1
    assert m[("gpuguard_watcher_tick_seconds_count", frozenset())] == 2


def test_files_are_written_only_when_configured(world, tmp_path: Path):
    textfile = tmp_path / "tf" / "gpuguard.prom"
    metrics = Metrics(MetricsConfig(textfile=textfile), world.store, world.grants.gpus, world.sampler, None,
                      world.services.accounts.of)
    asyncio.run(metrics.after_tick(0.01))
    assert "gpuguard_grants 0.0" in textfile.read_text()
    idle = Metrics(MetricsConfig(), world.store, world.grants.gpus, world.sampler, None,
                      world.services.accounts.of)
    asyncio.run(idle.after_tick(0.01))
    assert idle.snapshot is None  # nothing configured: no work each tick


def test_the_job_mapping_names_each_held_gpu_by_index_and_drops_released_ones(tmp_path: Path):
    held = GpuState(replace(gpu(2), index=5), True, None,
                    (Holding("alice", 1001, 0.0, None), Holding("bob", 1002, 0.0, None)), ())
    free = GpuState(gpu(3), True, None, (), ())
    files = job_mapping([held, free])
    assert files == {"5": "alice\nbob\n"}  # dcgm-exporter's format: one job id per line, file named by GPU id
    (tmp_path / "3").write_text("carol\n")  # released since the last write
    (tmp_path / "notes").write_text("an admin's file")
    write_job_mapping(tmp_path, files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["5", "notes"]
    assert (tmp_path / "5").read_text() == "alice\nbob\n"


def test_the_queue_is_exported_with_its_size_and_oldest_wait(world):
    metrics = Metrics(MetricsConfig(), world.store, world.grants.gpus, world.sampler, None,
                      world.services.accounts.of)
    metrics.publish(0.01)
    m = exposition(metrics)
    assert [m[(name, frozenset())] for name in ("gpuguard_queue_requests", "gpuguard_queue_gpus",
                                                "gpuguard_queue_oldest_wait_seconds")] == [0, 0, 0]
    for uid in range(1001, 1006):  # four GPUs: the fifth login waits
        world.login(world.lookup.add(f"user{uid}", uid, GROUP), pid=uid)
    (waiting,) = world.store.queue()
    metrics.publish(0.01)
    m = exposition(metrics)
    assert m[("gpuguard_queue_requests", frozenset())] == 1 and m[("gpuguard_queue_gpus", frozenset())] == 1
    assert m[("gpuguard_queue_oldest_wait_seconds", frozenset())] == metrics.snapshot.time - waiting.waiter.since
