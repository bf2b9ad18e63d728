"""The sampler over simulated GPUs (reuse, failing GPUs, their log lines) and the one-scan node holders."""
from __future__ import annotations

import asyncio
import logging
import os
import stat
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import popen_as
from sim_helpers import GiB, set_fault

from gpuguard.backends.procfs import openers_of
from gpuguard.backends.sampler import Sampler, node_openers
from gpuguard.backends.sim_registry import register_process
from gpuguard.core.model import NVIDIA_MAJOR, GpuProcess


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_young_sample_is_reused_less_the_processes_that_exited(backend, device_dir) -> None:
    sampler = Sampler(backend)
    stays, leaves = subprocess.Popen(["sleep", "300"]), subprocess.Popen(["sleep", "300"])
    try:
        for proc in (stays, leaves):
            register_process(device_dir, proc.pid, 1, GiB, util=10)

        async def run():
            first = await sampler.take()
            leaves.kill()
            leaves.wait()
            again = await sampler.take(max_age=3600)  # young enough: no new NVML query
            fresh = await sampler.take(max_age=0)     # the tick and the watcher's confirming look
            both = await asyncio.gather(sampler.take(max_age=3600), sampler.take(max_age=3600))
            return first, again, fresh, both

        first, again, fresh, both = asyncio.run(run())
    finally:
        for proc in (stays, leaves):
            proc.kill()
            proc.wait()
    assert {p.pid for p in first.processes} == {stays.pid, leaves.pid}
    assert again.time == first.time and again.processes == (GpuProcess(stays.pid, 1, GiB),)
    assert again.uid_of(leaves.pid) is None
    assert fresh.time > first.time and both[0].time == both[1].time == fresh.time


def test_a_failing_gpu_is_unknown_and_logged_once_per_change(backend, device_dir, sleeper, caplog) -> None:
    register_process(device_dir, sleeper.pid, 2, GiB, util=100)
    sampler = Sampler(backend)

    def take():
        return asyncio.run(sampler.take_or_log("test", max_age=0))

    with caplog.at_level(logging.INFO, logger="gpuguard"):
        set_fault(device_dir, "NVML_ERROR_GPU_IS_LOST 2")
        samples = [take() for _ in range(3)]
        set_fault(device_dir, "NVML_ERROR_UNKNOWN 2")  # failing differently is a change too
        take()
        set_fault(device_dir, None)
        healed = take()
    lines = [r.getMessage() for r in caplog.records]
    failed = [line for line in lines if "event=gpu_failed" in line]
    assert len(failed) == 2 and "gpu=2" in failed[0] and "GPU is lost" in failed[0] and "Unknown" in failed[1]
    assert [line for line in lines if "event=gpu_recovered" in line] == ["event=gpu_recovered gpu=2"]
    sample = samples[0]
    assert not sample.ok(2) and sample.ok(1) and sample.processes == () and sample.busy_slots() == set()
    assert healed.ok(2) and healed.processes == (GpuProcess(sleeper.pid, 2, GiB),)


def test_nvml_failing_as_a_whole_is_logged_every_time(backend, device_dir, caplog) -> None:
    sampler = Sampler(backend)
    set_fault(device_dir, "NVML_ERROR_UNKNOWN")
    with caplog.at_level(logging.ERROR, logger="gpuguard"):
        assert asyncio.run(sampler.take_or_log("skipped", max_age=0)) is None
        assert asyncio.run(sampler.take_or_log("skipped", max_age=0)) is None
    assert caplog.text.count("event=sample_failed") == 2 and "action=skipped" in caplog.text


def test_holders_of_several_devices_in_one_scan(sandbox) -> None:
    # Private copies of /dev/full and /dev/null, held by one process; /dev/zero it does not hold.
    full, null = sandbox / "full", sandbox / "null"
    for path, dev in [(full, (1, 7)), (null, (1, 3))]:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(*dev))
    code = "import os, sys; fds = [os.open(p, os.O_RDWR) for p in sys.argv[1:]]; print('held', flush=True); input()"
    holder = subprocess.Popen([sys.executable, "-c", code, str(full), str(null)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        found = openers_of([(1, 7), (1, 3), (1, 5)])
        assert holder.pid in found[(1, 7)] and holder.pid in found[(1, 3)] and holder.pid not in found[(1, 5)]
    finally:
        holder.communicate("\n", timeout=30)
    assert holder.pid not in openers_of([(1, 7)])[(1, 7)]
    assert openers_of([]) == {} and node_openers([], {0}, lambda unit: [(NVIDIA_MAJOR, unit)]) == []


HOLD = ("import os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "if len(sys.argv) > 2: os.setresuid(int(sys.argv[2]), 0, 0)  # like a setuid-root program\n"
        "print('held', flush=True); input()")


def test_holders_of_given_owners_only_theirs_setuid_root_ones_too(sandbox, make_user) -> None:
    # /proc/<pid> belongs to the effective uid: a process of alice's running setuid-root is
    # root's by that test, and the owners' filter must still find it by its real uid.
    alice, bob = make_user(), make_user()
    node = sandbox / "full"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    node.chmod(0o666)  # past the umask
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    alices = [popen_as(alice, [sys.executable, "-c", HOLD, str(node)], **pipes),
              subprocess.Popen([sys.executable, "-c", HOLD, str(node), str(alice.uid)], **pipes)]
    others = [popen_as(bob, [sys.executable, "-c", HOLD, str(node)], **pipes),
              subprocess.Popen([sys.executable, "-c", HOLD, str(node)], **pipes)]  # root's own
    try:
        for proc in alices + others:
            assert proc.stdout.readline().strip() == "held"
        assert os.stat(f"/proc/{alices[1].pid}").st_uid == 0
        assert openers_of([(1, 7)], owners={alice.uid})[(1, 7)] == sorted(p.pid for p in alices)
        both = {alice.uid, bob.uid}
        assert openers_of([(1, 7)], owners=both)[(1, 7)] == sorted(p.pid for p in alices + others[:1])
        assert openers_of([(1, 7)], owners=set()) == {(1, 7): []}
    finally:
        for proc in alices + others:
            proc.communicate("\n", timeout=30)
