"""Sticky GPUs: a user who comes back gets the GPUs they held last when those are free, so the
CUDA_VISIBLE_DEVICES of the shells that outlived their login (tmux, screen) stays right; `gpuguard
env` prints the current value, and `whoami` says when the caller's is stale."""
from __future__ import annotations

import os

import pytest

from devtools.harness import wait_for

pytestmark = pytest.mark.gate


def test_a_returning_user_gets_the_gpu_held_last(gg_daemon) -> None:
    d = gg_daemon
    alice, bob = d.add_member(), d.add_member()
    first = d.open_session(alice)
    (minor,) = first["gpus"]
    d.close_session(alice, first["pid"])
    assert wait_for(lambda: d.grants(alice) == [])  # released: no session, no process
    # Least recently released alone would steer alice away from the GPU she just gave back.
    assert d.open_session(alice)["gpus"] == [minor]
    assert d.open_session(bob)["gpus"] != [minor]


def test_env_prints_the_current_value_and_whoami_flags_a_stale_one(gg_daemon) -> None:
    d = gg_daemon
    alice = d.add_member()
    (minor,) = d.open_session(alice)["gpus"]
    current = d.uuid(minor)
    env = d.cli_as(alice, "env")
    assert env.returncode == 0 and env.stdout == f"export CUDA_VISIBLE_DEVICES={current}\n", env

    stale = "GPU-00000000-0000-0000-0000-000000000000"
    whoami = d.cli_as(alice, "whoami", env={**os.environ, "CUDA_VISIBLE_DEVICES": stale})
    assert whoami.returncode == 0
    assert (f"your shell's CUDA_VISIBLE_DEVICES={stale} is stale: your GPUs are {current}; "
            'run eval "$(gpuguard env)"') in whoami.stdout
    fresh = d.cli_as(alice, "whoami", env={**os.environ, "CUDA_VISIBLE_DEVICES": current})
    assert "stale" not in fresh.stdout
