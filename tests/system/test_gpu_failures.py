"""One failing GPU leaves the others guarded: a real daemon, real users, simulated GPUs that fail
one at a time through the fault file (`NVML_ERROR_GPU_IS_LOST 2`: only GPU 2 fails).

Every wait is a poll with a generous deadline; the tests never assert speed.
"""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from collections.abc import Iterator

import pytest
from probes import FILE_DENIED, open_result
from sim_helpers import set_fault, start_burn, stop_burn

from devtools.harness import wait_for

pytestmark = pytest.mark.gate

INTERVAL, GRACE, KILL_WAIT = 0.2, 1.0, 1.0
MARGIN = 20.0  # seconds of slack on a slow or busy machine
WATCHER = {"interval": f"{INTERVAL}s", "grace": f"{GRACE}s", "kill_wait": f"{KILL_WAIT}s"}
LOST = "NVML_ERROR_GPU_IS_LOST"


@pytest.fixture
def burns() -> Iterator:
    started: list[subprocess.Popen] = []

    def start(*args, **kwargs) -> subprocess.Popen:
        started.append(start_burn(*args, **kwargs))
        return started[-1]

    yield start
    for proc in started:
        stop_burn(proc)


def events(d, user, **match) -> list[dict]:
    return [e for e in d.whoami(user)["events"] if all(e.get(k) == v for k, v in match.items())]



def wait_ticks(d, ticks: int = 5) -> None:
    """Until the daemon's tick has sampled `ticks` intervals after now (status shows its sample's time)."""
    after = time.time() + ticks * INTERVAL
    assert wait_for(lambda: (d.call("status")["sampled_at"] or 0) > after, timeout=ticks * INTERVAL + MARGIN)


def test_a_failing_gpu_stops_no_enforcement_elsewhere(start_daemon, burns):
    d = start_daemon(defaults={"gpus": 1, "gpu_memory": "4GiB"}, watcher=WATCHER)
    alice, bob = d.add_member(), d.add_member()
    d.call("grant", user=alice.name, units=[1])
    d.call("grant", user=bob.name, units=[2])
    set_fault(d.device_dir, f"{LOST} 2")
    over_2 = burns(d.config_path, 2, "6GiB", user=bob)
    over_1 = burns(d.config_path, 1, "6GiB", user=alice)
    # GPU 1 is enforced as usual ...
    assert over_1.wait(timeout=INTERVAL + GRACE + KILL_WAIT + MARGIN) == -signal.SIGTERM
    assert [e["action"] for e in events(d, alice, pid=over_1.pid)] == ["warn", "term"]
    # ... and about GPU 2 nothing is decided: its burn was over quota just as long.
    wait_ticks(d)
    assert over_2.poll() is None and events(d, bob, pid=over_2.pid) == []
    assert d.log().count("event=gpu_failed") == 1  # once, not every tick
    assert "gpu=2" in d.log() and "event=sample_failed" not in d.log()
    status = {gpu["minor"]: gpu["processes"] for gpu in d.call("status")["gpus"]}
    assert status[2] is None and status[0] == 0  # unknown, never "no processes"
    set_fault(d.device_dir, None)
    assert over_2.wait(timeout=INTERVAL + GRACE + KILL_WAIT + MARGIN) == -signal.SIGTERM
    assert "event=gpu_recovered gpu=2" in d.log()


def test_no_logout_release_while_the_gpu_fails(start_daemon):
    d = start_daemon(defaults={"gpus": 1}, watcher=WATCHER)
    alice = d.add_member()
    opened = d.open_session(alice)
    [minor] = opened["gpus"]
    set_fault(d.device_dir, f"{LOST} {minor}")
    assert wait_for(lambda: "event=gpu_failed" in d.log(), timeout=MARGIN)  # no earlier sample is reused now
    closed = d.close_session(alice, opened["pid"])
    assert closed["release_pending"]
    wait_ticks(d)  # no process seen there is no evidence of none
    assert d.granted_minors(alice) == [minor]
    set_fault(d.device_dir, None)
    assert wait_for(lambda: d.granted_minors(alice) == [], timeout=MARGIN)
    assert [e["rule"] for e in events(d, alice, kind="release")] == ["logout"]


def test_a_gpu_lost_at_start_is_left_out(start_daemon):
    d = start_daemon(defaults={"gpus": 1})
    d.stop()
    set_fault(d.device_dir, f"{LOST} 2")
    d.start()  # starts: the other GPUs are still guarded
    assert [gpu["minor"] for gpu in d.call("status")["gpus"]] == [0, 1, 3]
    assert "event=gpu_unavailable" in d.log() and "GPU is lost" in d.log()
    assert d.open_session(d.add_member())["gpus"] != [2]


def test_a_gpu_lost_at_start_keeps_a_closed_node_in_acl_mode(start_daemon):
    """Without the gate, the node's mode is all that stands between users and a GPU NVML cannot read."""
    d = start_daemon(gate=False)
    d.stop()
    set_fault(d.device_dir, f"{LOST} 2")
    os.chmod(d.node(2), 0o666)  # as a driver (re)load would leave it
    d.start()
    assert [gpu["minor"] for gpu in d.call("status")["gpus"]] == [0, 1, 3]
    assert stat.S_IMODE(os.stat(d.node(2)).st_mode) == 0o660
    assert open_result(d.add_member(), d.node(2)) == FILE_DENIED
