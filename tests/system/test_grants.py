"""The grant manager and the exempt set on their own: store, gate map and node ACLs kept in step.

The nodes are real (195:N in the sandbox, their ACLs read back from the kernel); the gate is a
stand-in map, so these run without attaching a BPF program.
"""
from __future__ import annotations

import asyncio
import sqlite3

import pytest
from sim_helpers import write_config

from gpuguard import config as gpuguard_config
from gpuguard.backends import accounts, posix_acl
from gpuguard.backends.gpu_nodes import AclNodes
from gpuguard.backends.nss import AccountLookup
from gpuguard.core.model import NVIDIA_MAJOR
from gpuguard.services.exempt import Exempt
from gpuguard.services.grants import Grants
from gpuguard.services.store import Store


class MapGate:
    """The gate's grant map (Gate.grant/revoke/entries), in memory."""

    def __init__(self) -> None:
        self.map: set[tuple[int, tuple[int, int]]] = set()

    def grant(self, uid: int, dev: tuple[int, int]) -> None:
        self.map.add((uid, dev))

    def revoke(self, uid: int, dev: tuple[int, int]) -> None:
        self.map.discard((uid, dev))

    def entries(self) -> set[tuple[int, tuple[int, int]]]:
        return set(self.map)


@pytest.fixture
def store(sandbox):
    store = Store(sandbox / "state" / "state.db")
    yield store
    store.close()


def test_a_failed_store_write_on_release_leaves_the_gate_open_as_the_store_says(sandbox, store, monkeypatch):
    gate = MapGate()
    grants = Grants(store, gate, AclNodes(sandbox / "dev"), minors=())
    grants.add(1001, "alice", [0, 1], 1.0, expires_at=None, shared=False, origin="session", message="test")
    assert gate.entries() == {(1001, (NVIDIA_MAJOR, 0)), (1001, (NVIDIA_MAJOR, 1))}

    def disk_error(*args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(store, "remove_grants", disk_error)
    with pytest.raises(sqlite3.OperationalError):
        grants.remove(1001, None, 2.0, kind="release", rule="user", message="test")
    assert [g.unit for g in store.grants(1001)] == [0, 1]
    assert gate.entries() == {(1001, (NVIDIA_MAJOR, 0)), (1001, (NVIDIA_MAJOR, 1))}  # nothing closed behind the store's back
    monkeypatch.undo()
    assert [g.unit for g in grants.remove(1001, [1], 3.0, kind="release", rule="user", message="test")] == [1]
    assert gate.entries() == {(1001, (NVIDIA_MAJOR, 0))}


def test_exempt_users_get_an_acl_entry_on_every_node_and_lose_it_with_the_exemption(sandbox, store):
    devices = sandbox / "dev"
    devices.mkdir()
    grants = Grants(store, None, AclNodes(devices), minors=[0, 1], exempt={0, 2001})
    grants.add(1001, "alice", [1], 1.0, expires_at=None, shared=False, origin="session", message="test")
    grants.reconcile()
    def acl(m: int) -> set[int]:
        return posix_acl.acl_users(grants.nodes.path((NVIDIA_MAJOR, m)))
    assert {m: acl(m) for m in (0, 1)} == {0: {2001}, 1: {1001, 2001}}  # never root's
    grants.set_exempt({0, 2002})
    assert {m: acl(m) for m in (0, 1)} == {0: {2002}, 1: {1001, 2002}}


def test_a_reload_keeps_exempt_the_logged_in_users_the_member_lists_miss(sandbox, store, make_group, make_user,
                                                                          monkeypatch):
    admins = make_group()
    ops, alice = make_user(groups=[admins]), make_user()
    config = gpuguard_config.load(write_config(sandbox, extra=f'\n[access]\nexempt_groups = ["{admins}"]\n'))
    grants = Grants(store, None, AclNodes(sandbox / "dev"), minors=())
    lookup = AccountLookup()
    exempt = Exempt(lambda: config.access, store, grants.set_exempt, lookup)
    # What SSSD/LDAP do with primary groups: the group's member list does not name ops.
    monkeypatch.setattr(accounts, "exempt_uids", lambda access: {0})
    opened = store.open_session(ops.uid, ops.name, "sshd", "", "", 1, 1.0)
    store.open_session(alice.uid, alice.name, "sshd", "", "", 1, 1.0)
    exempt.add(ops.uid)  # what a login of ops does: policy.is_exempt says yes
    asyncio.run(exempt.refresh())  # NSS in the lookups' pool, off the loop
    assert exempt.uids == {0, ops.uid} and grants.exempt == {ops.uid}
    store.close_session(ops.uid, opened.pid)
    asyncio.run(exempt.refresh())  # no session left to vouch for ops: the member lists decide again
    assert exempt.uids == {0}
    lookup.close()
