"""enforcement.check_and_repair on the real kernel: a real gate, real nodes in a sandbox, real users,
and everything it must notice broken behind its back the way an admin or a tool would break it."""
from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from conftest import unique
from devtools.harness import gate_test_lock
from gpuguard.backends.gate import DeviceRange, Gate
from gpuguard.backends.mounts import cgroup2_root
from gpuguard.backends.posix_acl import acl_users
from gpuguard.enforcement import check_and_repair, node_users, wanted_entries
from gpuguard.model import Grant
from leftovers import detach_by_id
from probes import ALLOWED, FILE_DENIED, opens


def grant(user, minor: int) -> Grant:
    return Grant(user.uid, user.name, minor, granted_at=0.0, expires_at=None, last_active=0.0)


@pytest.fixture
def gate() -> Iterator[Gate]:
    name = unique()
    with gate_test_lock():
        with Gate(name, managed=[DeviceRange(195, 0, 253)]) as made:
            yield made
        Gate(name).detach()


def test_what_should_be_follows_the_store() -> None:
    class U:
        uid, name = 1001, "alice"
    grants = [grant(U, 1), Grant(1002, "bob", 1, 0.0, None, 0.0, shared=True)]
    assert wanted_entries(grants) == {(1001, (195, 1)), (1002, (195, 1))}
    assert node_users(grants, {0, 77}, [0, 1]) == {0: {77}, 1: {77, 1001, 1002}}
    assert node_users(grants, (), [0]) == {0: set()}  # GPUs not asked about are left out


@pytest.mark.gate
def test_everything_broken_behind_its_back_is_reported_and_repaired(gate, sandbox, make_user) -> None:
    alice, bob = make_user(), make_user()
    device_dir = sandbox / "dev"
    device_dir.mkdir(mode=0o755)
    nodes = {minor: device_dir / f"nvidia{minor}" for minor in (0, 1)}
    grants = [grant(alice, 1)]

    first = check_and_repair(gate, grants, [], device_dir, [0, 1])
    assert first == [f"gate {gate.name}: not loaded: no program or maps of this gate exist",
                     f"gate {gate.name}: map lacked grants the store has: uid {alice.uid} 195:1",
                     f"{nodes[0]}: missing or not the device", f"{nodes[1]}: missing or not the device"]
    assert check_and_repair(gate, grants, [], device_dir, [0, 1]) == []
    assert opens(alice, nodes) == {0: FILE_DENIED, 1: ALLOWED}

    # Behind its back: the program detached, the map edited, a node's mode and ACL changed by hand.
    detach_by_id(cgroup2_root(), gate.prog_id())
    gate.grant(bob.uid, (195, 0))
    gate.revoke(alice.uid, (195, 1))
    os.chmod(nodes[0], 0o666)
    subprocess.run(["setfacl", "-m", f"u:{bob.uid}:rw", str(nodes[1])], check=True)
    assert opens(bob, nodes) == {0: ALLOWED, 1: ALLOWED}

    assert check_and_repair(gate, grants, [], device_dir, [0, 1]) == [
        f"gate {gate.name}: not attached to the cgroup v2 root {cgroup2_root()}",
        f"gate {gate.name}: map held grants the store does not: uid {bob.uid} 195:0",
        f"gate {gate.name}: map lacked grants the store has: uid {alice.uid} 195:1",
        f"{nodes[0]}: mode 0666",
        f"{nodes[1]}: ACL users [{', '.join(map(str, sorted([alice.uid, bob.uid])))}] instead of [{alice.uid}]",
    ]
    assert opens(bob, nodes) == {0: FILE_DENIED, 1: FILE_DENIED}
    assert opens(alice, nodes) == {0: FILE_DENIED, 1: ALLOWED}
    assert acl_users(nodes[1]) == {alice.uid}
    assert check_and_repair(gate, grants, [], device_dir, [0, 1]) == []


@pytest.mark.gate
def test_exempt_uids_are_put_back_in_the_gate_and_on_the_nodes(gate, sandbox, make_user) -> None:
    carol = make_user()
    device_dir = sandbox / "dev"
    device_dir.mkdir(mode=0o755)
    check_and_repair(gate, [], [carol.uid], device_dir, [0])
    gate.set_exempt([])
    assert check_and_repair(gate, [], [carol.uid], device_dir, [0]) == [
        f"gate {gate.name}: exempt uids differed from the configured ones: [{carol.uid}]"]
    assert opens(carol, {0: device_dir / "nvidia0"}) == {0: ALLOWED}


def test_acl_mode_checks_the_nodes_only(sandbox, make_user) -> None:
    alice = make_user()
    device_dir = sandbox / "dev"
    device_dir.mkdir(mode=0o755)
    assert check_and_repair(None, [grant(alice, 0)], [], device_dir, [0]) == [
        f"{device_dir / 'nvidia0'}: missing or not the device"]
    assert acl_users(device_dir / "nvidia0") == {alice.uid}
