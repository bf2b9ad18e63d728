"""The watcher's edge without a daemon: confirming re-sample, NVML errors, failing actions, speed.

A stand-in daemon (real store, scripted GPU backend, real processes of a uid) drives
Watcher.check directly, so these cases are exact instead of racing a daemon's tick.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from gpuguard import config as configuration, sampling
from gpuguard.backends import GpuError
from gpuguard.model import GpuProcess, Quota
from gpuguard.store import Store
from gpuguard.watcher import Watcher

GiB = 1 << 30
UID = 54321  # needs no account: an unknown user gets the default quota


class Backend:
    """processes() answers from a script: each call pops the next answer (an exception is raised)."""

    def __init__(self) -> None:
        self.answers: list = []
        self.calls = 0

    def processes(self) -> list[GpuProcess]:
        self.calls += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


class Grants:
    def __init__(self) -> None:
        self.removed: list = []

    def remove(self, uid, minors, now, **kwargs):
        self.removed.append((uid, list(minors), kwargs))
        return [object()]


@pytest.fixture
def daemon(tmp_path):
    store = Store(tmp_path / "state.db")
    config = replace(configuration.Config(), defaults=Quota(gpu_memory=4 * GiB),
                     watcher=configuration.WatcherConfig(interval=1.0, grace=0.0, kill_wait=1.0))
    d = SimpleNamespace(config=config, store=store, backend=Backend(), grants=Grants(), exempt={0})
    store.add_grants(UID, str(UID), [0], time.time(), None)
    yield d
    store.close()


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "600"], user=UID)
    time.sleep(0.1)
    yield proc
    proc.kill()
    proc.wait()


def check(watcher: Watcher, now: float):
    async def run():
        sample = await sampling.take(watcher.daemon.backend)
        return await watcher.check(sample, now)
    return asyncio.run(run())


def test_acts_only_when_the_confirming_sample_agrees(daemon, sleeper):
    over = [GpuProcess(sleeper.pid, 0, 5 * GiB)]
    watcher = Watcher(daemon)
    daemon.backend.answers = [over, []]  # the second look finds nothing: a glitch, not a user over quota
    assert check(watcher, 1000.0) == []
    assert daemon.store.events() == [] and daemon.backend.calls == 2
    daemon.backend.answers = [over]
    assert [a.kind for a in check(watcher, 1001.0)] == ["warn"]
    assert [a.kind for a in check(watcher, 1002.0)] == ["term"]  # grace 0: the next tick
    assert sleeper.wait(timeout=10) == -signal.SIGTERM
    watcher.notifier.close()


def test_nvml_error_in_the_confirming_sample_means_no_action(daemon, sleeper, caplog):
    watcher = Watcher(daemon)
    daemon.backend.answers = [[GpuProcess(sleeper.pid, 0, 5 * GiB)], GpuError("NVML failed: GPU is lost")]
    with caplog.at_level(logging.ERROR, logger="gpuguard"):
        assert check(watcher, 1000.0) == []
    assert "event=sample_failed" in caplog.text and "GPU is lost" in caplog.text
    assert daemon.store.events() == [] and watcher.state.over == {}
    watcher.notifier.close()


def test_a_failing_action_does_not_stop_the_others(daemon, sleeper, caplog):
    daemon.store.add_grants(UID, str(UID), [1], 0.0, expires_at=1.0)  # long expired
    daemon.grants.remove = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("gate says no"))
    daemon.backend.answers = [[GpuProcess(sleeper.pid, 0, 5 * GiB)]]
    watcher = Watcher(daemon)
    with caplog.at_level(logging.ERROR, logger="gpuguard"):
        done = check(watcher, 1000.0)
    assert [a.kind for a in done] == ["warn"]  # the memory warning went out; the revoke failed, logged
    assert "event=action_failed" in caplog.text and "gate says no" in caplog.text
    watcher.notifier.close()


def test_check_time_for_8_gpus_with_50_processes_each(daemon):
    """Not a speed assertion: prints the numbers for the report and checks it scales sanely."""
    procs = [subprocess.Popen(["sleep", "600"], user=UID) for _ in range(400)]
    try:
        time.sleep(0.5)
        daemon.config = replace(daemon.config, defaults=Quota(gpu_memory=80 * GiB))
        daemon.store.add_grants(UID, str(UID), range(8), time.time(), None)
        daemon.backend.answers = [[GpuProcess(p.pid, i % 8, GiB) for i, p in enumerate(procs)]]
        watcher = Watcher(daemon)

        async def run():
            took, sampled = [], []
            for tick in range(10):
                started = time.perf_counter()
                sample = await sampling.take(daemon.backend)
                sampled.append(time.perf_counter() - started)
                started = time.perf_counter()
                assert await watcher.check(sample, 1000.0 + tick) == []
                took.append(time.perf_counter() - started)
            return sorted(sampled)[5], sorted(took)[5]

        sample_s, check_s = asyncio.run(run())
        print(f"8 GPUs x 50 processes: sample {sample_s * 1e3:.1f} ms (worker thread), "
              f"check {check_s * 1e3:.2f} ms (event loop), medians of 10")
        assert check_s < 1.0
        watcher.notifier.close()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
