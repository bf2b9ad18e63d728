"""The watcher's edge, driven tick by tick: the confirming re-sample, NVML errors, failing actions.

A real Daemon, started in this process without serving (access.mode = acl, so no gate), with
its store, grant manager, simulated GPUs and sampler; `gpuguard sim burn` processes of a real
user. Watcher.check is called directly, with a chosen `now`, so these cases are exact instead
of racing a daemon's tick. The fault file fails a sample on purpose.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sim_helpers import set_fault, start_burn, stop_burn, write_config

from devtools.harness import no_gate_attached
from gpuguard import config as configuration
from gpuguard.core.model import NVIDIA_MAJOR
from gpuguard.core.sample import Sample
from gpuguard.daemon.main import Daemon


@pytest.fixture(autouse=True)
def without_gates() -> Iterator[None]:
    with no_gate_attached():  # test users open the simulated nodes themselves
        yield


@pytest.fixture
def daemon(sandbox: Path) -> Iterator[Daemon]:
    path = write_config(sandbox, count=4, extra=(
        '\n[access]\nmode = "acl"\n\n[defaults]\ngpu_memory = "4GiB"\n\n'
        '[watcher]\ninterval = "1s"\ngrace = "0s"\nkill_wait = "1s"\n'))
    d = Daemon(configuration.load(path), gate_name=sandbox.name)
    d.start()
    yield d
    d.close()


@pytest.fixture
def burns(daemon: Daemon, sandbox: Path) -> Iterator:
    started = []

    def start(minor: int, mem: str, user) -> object:
        started.append(start_burn(sandbox / "gpuguard.toml", minor, mem, user=user))
        return started[-1]

    yield start
    for proc in started:
        stop_burn(proc)


@pytest.fixture
def alice(daemon: Daemon, make_user):
    user = make_user()
    daemon.grants.add(user.uid, user.name, [1], time.time(), expires_at=None, shared=False, origin="admin",
                      message="test grant")
    return user


def sample(daemon: Daemon) -> Sample:
    return asyncio.run(daemon.sampler.take(max_age=0))


def check(daemon: Daemon, now: float, first: Sample | None = None) -> list:
    """One tick of the watcher on `first` (a new sample when None); the actions carried out."""
    async def tick():
        return await daemon.services.watcher.check(first or await daemon.sampler.take(max_age=0), now)
    return asyncio.run(tick())


def test_acts_only_when_the_confirming_sample_agrees(daemon, alice, burns):
    now = time.time()
    proc = burns(1, "6GiB", alice)
    over = sample(daemon)
    stop_burn(proc)  # gone before the second look: nothing to act on
    assert check(daemon, now, over) == []
    assert [e.kind for e in daemon.store.events(alice.uid)] == ["grant"]
    proc = burns(1, "6GiB", alice)
    assert [a.kind for a in check(daemon, now + 1)] == ["warn"]
    assert [a.kind for a in check(daemon, now + 2)] == ["term"]  # grace 0: the next tick
    assert proc.wait(timeout=10) == -signal.SIGTERM


def test_nvml_error_in_the_confirming_sample_means_no_action(daemon, alice, burns, caplog):
    burns(1, "6GiB", alice)
    over = sample(daemon)
    set_fault(daemon.config.paths.device_dir, "NVML_ERROR_GPU_IS_LOST")
    with caplog.at_level(logging.ERROR, logger="gpuguard"):
        assert check(daemon, time.time(), over) == []
    assert "event=sample_failed" in caplog.text and "GPU is lost" in caplog.text
    assert [e.kind for e in daemon.store.events(alice.uid)] == ["grant"]
    assert daemon.services.watcher.state.over == {}


def test_the_gpu_failing_in_the_confirming_sample_is_left_alone(daemon, alice, burns, caplog):
    burns(1, "6GiB", alice)
    over = sample(daemon)
    set_fault(daemon.config.paths.device_dir, "NVML_ERROR_GPU_IS_LOST 1")
    with caplog.at_level(logging.INFO, logger="gpuguard"):
        assert check(daemon, time.time(), over) == []
    assert "event=gpu_failed gpu=1" in caplog.text and "event=sample_failed" not in caplog.text
    assert [e.kind for e in daemon.store.events(alice.uid)] == ["grant"]


def test_a_failing_action_does_not_stop_the_others(daemon, alice, burns, caplog):
    daemon.grants.add(alice.uid, alice.name, [3], 0.0, expires_at=1.0, shared=False, origin="admin",
                      message="long expired")
    node = daemon.grants.nodes.path((NVIDIA_MAJOR, 3))
    node.unlink()
    node.mkdir()  # the node cannot be made again: the revoke fails when it rewrites the ACLs
    burns(1, "6GiB", alice)
    with caplog.at_level(logging.ERROR, logger="gpuguard"):
        done = check(daemon, time.time())
    assert [a.kind for a in done] == ["warn"]  # the memory warning went out; the revoke failed, logged
    assert "event=action_failed" in caplog.text and "action=revoke" in caplog.text
    node.rmdir()
