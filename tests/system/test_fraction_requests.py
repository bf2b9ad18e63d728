"""Fractions of a GPU end to end: `gpuguard request --memory`, a real daemon on simulated 80 GiB
GPUs, real users, the gate and the ACLs, the queue, and the watcher holding a fraction's process
to the memory it asked for."""
from __future__ import annotations

import json
import signal
import subprocess

import pytest
from conftest import popen_as
from probes import ALLOWED, FILE_DENIED, GATE_DENIED, bare_nodes, opens
from sim_helpers import GiB, gpuguard

from devtools.harness import wait_for

pytestmark = pytest.mark.gate

MARGIN = 30.0  # slack for a busy machine: every wait is a poll, nothing asserts speed
WATCHER = {"interval": "0.2s", "grace": "1s", "kill_wait": "1s"}


def request(d, user, *args: str) -> subprocess.CompletedProcess:
    return d.cli_as(user, "request", "--json", *args)


def granted(d, user, *args: str) -> dict:
    result = request(d, user, *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def opened(d, user, minor: int) -> tuple[str, str]:
    """What opening GPU `minor` gives the user: through the daemon's node, and a bare 0666 one (the gate alone)."""
    managed = opens(user, {minor: d.node(minor)})[minor]
    gate = opens(user, bare_nodes(d.sandbox / "bare", [minor]))[minor]
    return managed, gate


def test_two_fractions_share_a_gpu_a_third_waits_and_a_whole_request_goes_elsewhere(start_daemon):
    d = start_daemon(count=2, defaults={"gpus": 1})
    alice, bob, carol, dave = (d.add_member() for _ in range(4))

    first = granted(d, alice, "--memory", "30GiB")
    [gpu] = first["granted"]
    assert granted(d, bob, "--memory", "40GiB")["granted"] == [gpu]  # 70 of 80 GiB promised
    # A whole GPU never lands where fractions are: dave gets the other one.
    [other] = granted(d, dave, "--gpus", "1")["granted"]
    assert other != gpu
    for user in (alice, bob):
        assert opened(d, user, gpu) == (ALLOWED, ALLOWED)
        assert opened(d, user, other) == (FILE_DENIED, GATE_DENIED)
    assert opened(d, dave, gpu) == (FILE_DENIED, GATE_DENIED)
    # Both see one CUDA device, the GPU's UUID, as for a whole GPU.
    assert first["cuda_visible_devices"] == d.uuid(gpu)

    # 20 GiB more would promise 90 of 80 GiB, and the other GPU is dave's: no, now.
    refused = request(d, carol, "--memory", "20GiB")
    assert refused.returncode != 0 and "no GPU is free right now" in refused.stderr
    waiting = popen_as(carol, gpuguard(d.config_path, "request", "--json", "--memory", "20GiB", "--wait",
                                       "--timeout", "2m"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: [q["user"] for q in d.call("status")["queue"]] == [carol.name], timeout=MARGIN)
        assert d.cli_as(dave, "release").returncode == 0  # the whole GPU is free: carol's turn
        out, err = waiting.communicate(timeout=MARGIN)
    finally:
        waiting.kill()
        waiting.wait()
    assert waiting.returncode == 0, err
    assert json.loads(out)["gpus"] == [other]
    [grant] = d.grants(carol)
    assert (grant["minor"], grant["shared"], grant["memory"]) == (other, True, 20 * GiB)


def test_a_fraction_over_its_memory_is_warned_then_stopped(start_daemon, burns):
    d = start_daemon(count=1, defaults={"gpus": 1}, watcher=WATCHER)
    alice = d.add_member()
    [gpu] = granted(d, alice, "--memory", "20GiB")["granted"]
    within = burns(d.config_path, gpu, "16GiB", user=alice)
    over = burns(d.config_path, gpu, "8GiB", user=alice)  # 24 GiB of the 20 promised: the larger goes
    assert within.wait(timeout=MARGIN) == -signal.SIGTERM
    assert over.poll() is None  # 8 GiB alone fits: it runs on
    events = [e for e in d.whoami(alice)["events"] if e["rule"] == "memory"]
    assert [(e["kind"], e["action"]) for e in events] == [("warning", "warn"), ("kill", "term")]
    assert events[0]["numbers"]["quota"] == 20 * GiB and events[0]["numbers"]["used"] == 24 * GiB


def test_bad_fractions_get_one_line_and_nothing_changes(start_daemon):
    d = start_daemon(count=2, defaults={"gpus": 2, "max_fractions": 1, "max_fraction_memory": "40GiB"})
    alice = d.add_member()
    too_big = request(d, alice, "--memory", "60GiB")
    assert too_big.returncode == 1
    assert too_big.stderr.strip().endswith("a fraction here is 256MiB to 40GiB of one GPU's memory "
                                           "(your quota and the largest GPU; gpuguard whoami)")
    assert granted(d, alice, "--memory", "10GiB")["granted"]
    second = request(d, alice, "--memory", "10GiB")
    assert second.returncode == 1 and "you hold 1 fraction of a GPU already, your most" in second.stderr
    both = request(d, alice, "--memory", "10GiB", "--gpus", "1")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    unitless = request(d, alice, "--memory", "20")
    assert unitless.returncode == 2 and "did you mean 20GiB?" in unitless.stderr
    assert len(d.grants(alice)) == 1  # what she held stays, and nothing more
    whoami = d.cli_as(alice, "whoami")
    assert ", fractions at most 1 at once, at most 40GiB each" in whoami.stdout


def test_a_quota_fraction_is_what_a_login_and_gpuguard_run_ask_for(start_daemon):
    d = start_daemon(count=1, defaults={"gpus": 1, "fraction_memory": "24GiB"})
    alice, bob = d.add_member(), d.add_member()
    session = d.open_session(alice)
    assert session["gpus"] == [0]
    run = d.cli_as(bob, "run", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == d.uuid(0)  # bob ran beside alice on the same GPU
    [grant] = d.grants(alice)
    assert (grant["shared"], grant["memory"]) == (True, 24 * GiB)
    assert d.grants(bob) == []  # run gave its fraction back at the end
