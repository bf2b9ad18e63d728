"""The CLI's edges as a new user meets them (issue 38, 7), against a real daemon: options before or
after the command, one line with a guess for a typo, errors that name the option as typed and
the fix, a closed pipe, and env --json, gpus --csv, status --watch."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess

from conftest import popen_as
from sim_helpers import gpuguard, start_burn, stop_burn

from devtools.harness import wait_for
from gpuguard import __version__


def _daemon(start_daemon):
    """Two GPUs, two each, a memory quota that a burn can exceed, a watcher that waits an hour before it acts."""
    return start_daemon(count=2, gate=False, defaults={"gpus": 2, "gpu_memory": "1GiB"}, watcher={"grace": "1h"})


def _one_line(result: subprocess.CompletedProcess, code: int = 2) -> str:
    assert result.returncode == code, result
    assert result.stdout == "" and result.stderr.count("\n") == 1, result
    return result.stderr


def test_global_options_before_or_after_the_command(start_daemon):
    d = _daemon(start_daemon)
    alice = d.add_member()
    shown = d.cli_as(alice, "--help", "status")
    assert shown.returncode == 0 and shown.stdout.startswith("usage: gpuguard status"), shown
    assert "GPU 0" not in shown.stdout
    for argv in (["--version", "whoami"], ["whoami", "--version"]):
        assert d.cli_as(alice, *argv).stdout == f"gpuguard {__version__}\n", argv
    # --config after the command, as one adds it to a line typed already
    whoami = subprocess.run(gpuguard(None, "whoami", "--json", "--config", str(d.config_path)), capture_output=True,
                            text=True)
    assert whoami.returncode == 0 and json.loads(whoami.stdout)["user"] == "root", whoami


def test_a_typo_gets_one_line_with_a_guess(start_daemon):
    d = _daemon(start_daemon)
    alice = d.add_member()
    assert _one_line(d.cli_as(alice, "stauts")) == "gpuguard: no command 'stauts'; did you mean 'status'?\n"
    assert _one_line(d.cli_as(alice, "squeue")) == "gpuguard: no command 'squeue'; did you mean 'status'?\n"
    assert "did you mean '--json'?" in _one_line(d.cli_as(alice, "status", "--jsn"))
    assert "did you mean 'quota show'?" in _one_line(d.cli_as(alice, "quota", "shwo"))


def test_each_refusal_names_the_option_as_typed_and_the_fix(start_daemon, make_user):
    d = _daemon(start_daemon)
    alice = d.add_member()
    limit = _one_line(d.cli_as(alice, "events", "--limit", "-5"))
    assert "--limit: -5 is not a number of events: give 1 to 5000" in limit and "field" not in limit
    timeout = _one_line(d.cli_as(alice, "request", "--wait", "--timeout", "-5m"))
    assert "--timeout -5m: must be positive" in timeout
    idle = _one_line(d.cli("quota", "set", "--user", alice.name, "idle_timeout=0"))
    assert "write none for no limit" in idle and "0h" not in idle
    for argv in (["status", "-u", "ggt-nosuch"], ["quota", "show", "--user", "ggt-nosuch"]):
        line = _one_line(d.cli(*argv))
        assert f"{argv[-2]} ggt-nosuch: no user named ggt-nosuch" in line, argv
    outsider = make_user()  # not in the daemon's group: no GPUs, so no quota to show
    shown = d.cli_as(outsider, "whoami")
    assert shown.returncode == 0 and "not in" in shown.stdout and "quota:" not in shown.stdout, shown


def test_release_of_a_busy_gpu_says_what_to_do(start_daemon):
    d = _daemon(start_daemon)
    alice = d.add_member()
    (gpu,) = json.loads(d.cli_as(alice, "request", "--gpus", "1", "--json").stdout)["gpus"]
    burn = start_burn(d.config_path, gpu, user=alice)
    try:
        line = _one_line(d.cli_as(alice, "release"), code=1)
        assert line == (f"gpuguard: GPU {gpu} is still in use by your process {burn.pid}: end it (kill {burn.pid}) "
                        f"or let it finish, then gpuguard release --gpu {gpu}\n")
    finally:
        stop_burn(burn)


def test_whoami_shows_the_memory_used_against_the_quota(start_daemon):
    d = _daemon(start_daemon)
    alice = d.add_member()
    (gpu,) = json.loads(d.cli_as(alice, "request", "--gpus", "1", "--json").stdout)["gpus"]
    burn = start_burn(d.config_path, gpu, mem="2GiB", user=alice)
    try:
        shown = wait_for(lambda: "2GiB of 1GiB: OVER" in (out := d.cli_as(alice, "whoami").stdout) and out)
        assert shown, d.cli_as(alice, "whoami").stdout
    finally:
        stop_burn(burn)


def test_a_closed_pipe_ends_quietly(start_daemon):
    d = _daemon(start_daemon)
    for argv in (["status"], ["--help"], ["gpus", "--csv"]):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first write: `gpuguard status | head -0`
        try:
            ended = d.cli(*argv, capture_output=False, stdout=write, stderr=subprocess.PIPE)
        finally:
            os.close(write)
        assert (ended.returncode, ended.stderr) == (0, ""), argv


def test_env_json_gpus_csv_and_status_watch(start_daemon):
    d = _daemon(start_daemon)
    alice = d.add_member()
    (gpu,) = json.loads(d.cli_as(alice, "request", "--gpus", "1", "--json").stdout)["gpus"]
    env = json.loads(d.cli_as(alice, "env", "--json").stdout)
    assert env == {"cuda_visible_devices": d.uuid(gpu), "uuids": [d.uuid(gpu)], "exempt": False, "daemon": "up"}

    rows = list(csv.DictReader(d.cli_as(alice, "gpus", "--csv").stdout.splitlines()))
    assert [row["gpu"] for row in rows] == ["0", "1"]
    assert rows[gpu]["uuid"] == d.uuid(gpu) and int(rows[gpu]["memory_total_bytes"]) > 0

    watching = popen_as(alice, gpuguard(d.config_path, "status", "--watch", "1"), stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)
    try:
        frames = 0
        while frames < 2:  # a second draw: it redraws
            line = watching.stdout.readline()
            assert line, watching.stderr.read()
            frames += line.startswith("every 1s: gpuguard status")
        watching.send_signal(signal.SIGINT)
        assert watching.wait(30) == 0
        assert watching.stderr.read() == ""
    finally:
        watching.kill()
    refused = _one_line(d.cli_as(alice, "status", "--watch", "0"))
    assert "--watch: 0 is not a number of seconds: give 1 or more" in refused
