"""Grants.check_and_repair on the real kernel: a real gate, real nodes in a sandbox, real users, and
everything it must notice broken behind its back the way an admin or a tool would break it."""
from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import unique
from leftovers import detach_by_id
from probes import ALLOWED, FILE_DENIED, opens
from sim_helpers import write_config

from devtools.harness import gate_test_lock, no_gate_attached
from gpuguard import config as configuration
from gpuguard.backends.gate import DeviceRange, Gate
from gpuguard.backends.gpu_nodes import AclNodes
from gpuguard.backends.mounts import cgroup2_root
from gpuguard.backends.posix_acl import acl_users
from gpuguard.core.model import NVIDIA_MAJOR
from gpuguard.daemon.main import Daemon
from gpuguard.services.grants import Grants
from gpuguard.services.store import Store


@pytest.fixture
def store(sandbox: Path) -> Iterator[Store]:
    store = Store(sandbox / "state" / "state.db")
    yield store
    store.close()


@pytest.fixture
def device_dir(sandbox: Path) -> Path:
    path = sandbox / "dev"
    path.mkdir(mode=0o755)
    return path


@pytest.fixture
def gate() -> Iterator[Gate]:
    name = unique()
    with gate_test_lock():
        with Gate(name, managed=[DeviceRange(195, 0, 253)]) as made:
            yield made
        Gate(name).detach()


def grant(grants: Grants, user, minor: int) -> None:
    grants.store.add_grants(user.uid, user.name, [minor], 1.0, None, shared=False, origin="session")


@pytest.mark.gate
def test_everything_broken_behind_its_back_is_reported_and_repaired(gate, store, device_dir, make_user) -> None:
    alice, bob = make_user(), make_user()
    nodes = {minor: device_dir / f"nvidia{minor}" for minor in (0, 1)}
    grants = Grants(store, gate, AclNodes(device_dir), minors=[0, 1])
    grant(grants, alice, 1)  # in the store only: the gate and the nodes are not there yet

    assert grants.check_and_repair() == [
        f"gate {gate.name}: not loaded: no program or maps of this gate exist",
        f"gate {gate.name}: map lacked grants the store has: uid {alice.uid} 195:1",
        f"{nodes[0]}: missing or not the device", f"{nodes[1]}: missing or not the device"]
    assert grants.check_and_repair() == []
    assert opens(alice, nodes) == {0: FILE_DENIED, 1: ALLOWED}

    # Behind its back: the program detached, the map edited, a node's mode and ACL changed by hand.
    detach_by_id(cgroup2_root(), gate.prog_id())
    gate.grant(bob.uid, (195, 0))
    gate.revoke(alice.uid, (195, 1))
    os.chmod(nodes[0], 0o666)
    subprocess.run(["setfacl", "-m", f"u:{bob.uid}:rw", str(nodes[1])], check=True)
    assert opens(bob, nodes) == {0: ALLOWED, 1: ALLOWED}

    assert grants.check_and_repair() == [
        f"gate {gate.name}: not attached to the cgroup v2 root {cgroup2_root()}",
        f"gate {gate.name}: map held grants the store does not: uid {bob.uid} 195:0",
        f"gate {gate.name}: map lacked grants the store has: uid {alice.uid} 195:1",
        f"{nodes[0]}: mode 0666",
        f"{nodes[1]}: ACL users {sorted([alice.uid, bob.uid])} instead of [{alice.uid}]",
    ]
    assert opens(bob, nodes) == {0: FILE_DENIED, 1: FILE_DENIED}
    assert opens(alice, nodes) == {0: FILE_DENIED, 1: ALLOWED}
    assert acl_users(nodes[1]) == {alice.uid}
    assert grants.check_and_repair() == []


@pytest.mark.gate
def test_exempt_uids_are_put_back_in_the_gate_and_on_the_nodes(gate, store, device_dir, make_user) -> None:
    carol = make_user()
    grants = Grants(store, gate, AclNodes(device_dir), minors=[0], exempt={carol.uid})
    grants.check_and_repair()
    gate.set_exempt([])
    assert grants.check_and_repair() == [
        f"gate {gate.name}: exempt uids differed from the configured ones: [{carol.uid}]"]
    assert opens(carol, {0: device_dir / "nvidia0"}) == {0: ALLOWED}


def test_acl_mode_checks_the_nodes_only(store, device_dir, make_user) -> None:
    alice = make_user()
    grants = Grants(store, None, AclNodes(device_dir), minors=[0])
    grant(grants, alice, 0)
    assert grants.check_and_repair() == [f"{device_dir / 'nvidia0'}: missing or not the device"]
    assert acl_users(device_dir / "nvidia0") == {alice.uid}
    assert grants.check_and_repair() == []


def test_the_daemon_logs_what_its_periodic_check_repaired(sandbox, make_user, caplog) -> None:
    """Daemon.check_enforcement (run every CHECK_EVERY seconds by the ticker) on a real daemon
    started in this process (acl mode, so no gate): a node's ACL changed by hand is put back."""
    path = write_config(sandbox, count=2, extra='\n[access]\nmode = "acl"\n')
    daemon = Daemon(configuration.load(path), gate_name=sandbox.name)
    with no_gate_attached():
        daemon.start()
        try:
            alice = make_user()
            daemon.grants.add(alice.uid, alice.name, [1], 1.0, expires_at=None, shared=False, origin="admin",
                              message="test")
            node = daemon.grants.nodes.path((NVIDIA_MAJOR, 1))
            os.chmod(node, 0o666)
            with caplog.at_level(logging.INFO, logger="gpuguard"):
                daemon.check_enforcement()
            assert "event=repaired" in caplog.text and str(node) in caplog.text
            assert oct(os.stat(node).st_mode & 0o777) == oct(0o660) and acl_users(node) == {alice.uid}
            caplog.clear()
            daemon.check_enforcement()
            assert "event=repaired" not in caplog.text  # nothing left to repair
        finally:
            daemon.close()
