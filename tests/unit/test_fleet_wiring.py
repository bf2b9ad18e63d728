"""A fleet's node as wiring.build composes it, over a fake fleet database (tests/unit/fakes.py
FakeFleetDb) that records the calls in the order they reach it: the grant-time check through
Grants, a release as a step of Releases.take_back before the queue is served, and the heartbeat's
mirror of the GPUs with their owners ([coexist]). The real database: tests/system/test_cluster_*."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from fakes import GROUP, FakeFleetDb, World, gpu

from devtools.harness import wait_for
from gpuguard.config import AccessConfig, Config, FleetConfig, PathsConfig
from gpuguard.core import coexist
from gpuguard.core.coexist import Owner, Ownership
from gpuguard.core.model import Quota
from gpuguard.daemon.server import Peer


def fleet_world(tmp_path: Path, foreign: list[dict] | None = None, fleet_gpus: int | None = None,
                db: FakeFleetDb | None = None) -> World:
    config = Config(access=AccessConfig(group=GROUP), defaults=Quota(gpus=4, fleet_gpus=fleet_gpus),
                    paths=PathsConfig(state_dir=tmp_path), fleet=FleetConfig(database="host=/nonexistent", node="n1"))
    return World(tmp_path, config=config, fleet_db=db or FakeFleetDb(), foreign=foreign or [])


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[World]:
    world = fleet_world(tmp_path)
    yield world
    world.services.close()


def online(world: World) -> FakeFleetDb:
    assert world.services.fleet is not None and world.fleet_db is not None
    assert asyncio.run(world.services.fleet.node.beat())
    return world.fleet_db


def test_a_single_server_has_no_fleet(world):
    assert world.services.fleet is None and world.grants.admit is None


def test_the_fleet_quota_makes_a_login_grant_smaller(tmp_path):
    fleet = fleet_world(tmp_path, fleet_gpus=2)
    try:
        db = online(fleet)
        db.allow["alice"] = 1  # she holds 1 of her 2 elsewhere
        alice = fleet.lookup.add("alice", 1001, GROUP)
        assert fleet.login(alice)["gpus"] == [0]  # the local quota allows 4
        assert db.calls[-1] == ("reserve", ("alice", (0, 1, 2, 3)))
    finally:
        fleet.services.close()


def test_a_login_without_a_fleet_quota_asks_the_database_nothing_its_grant_goes_with_a_heartbeat(fleet):
    db = online(fleet)
    node = fleet.services.fleet.node if fleet.services.fleet else None
    assert node is not None
    alice = fleet.lookup.add("alice", 1001, GROUP)
    assert fleet.login(alice)["gpus"] == [0, 1, 2, 3]
    assert [kind for kind, _ in db.calls] == ["heartbeat"] and node.online  # no round trip of its own
    assert node._kick.is_set()  # the heartbeat loop sends one soon (FleetNode.run: MIN_GAP after the last)
    assert asyncio.run(node.beat())
    assert [(g["minor"], g["username"]) for g in db.calls[-1][1]["grants"]] == [(m, "alice") for m in range(4)]


class GatedFleetDb(FakeFleetDb):
    """A database whose heartbeats after the first wait for `go`: one on its way, for as long as a test needs."""

    def __init__(self) -> None:
        super().__init__()
        self.on_its_way, self.go = threading.Event(), threading.Event()

    def heartbeat(self, doc: dict, kept_from: int | None = None) -> dict:
        if any(kind == "heartbeat" for kind, _ in self.calls):
            self.on_its_way.set()
            assert self.go.wait(30)
        return super().heartbeat(doc, kept_from)


def test_a_grant_made_while_a_heartbeat_is_on_its_way_goes_with_the_next_one_soon(tmp_path):
    db = GatedFleetDb()
    config = Config(access=AccessConfig(group=GROUP), defaults=Quota(gpus=4), paths=PathsConfig(state_dir=tmp_path),
                    fleet=FleetConfig(database="host=/nonexistent", node="n1", heartbeat=60.0, lease=180.0))
    fleet = World(tmp_path, config=config, fleet_db=db)
    node = fleet.services.fleet.node if fleet.services.fleet else None
    assert node is not None
    alice = fleet.lookup.add("alice", 1001, GROUP)

    async def scenario() -> list[list[str]]:
        beating = asyncio.create_task(node.run())
        await asyncio.to_thread(wait_for, lambda: db.calls)  # online: the first heartbeat
        node.kick()  # a second, whose snapshot has no grant yet...
        assert await asyncio.to_thread(db.on_its_way.wait, 30)
        # ...when alice logs in (no fleet quota: no check), asking for a heartbeat
        login = {"op": "session_open", "user": "alice", "pid": 4242, "service": "sshd", "tty": "pts/1"}
        assert (await fleet.api.handle(login, Peer(pid=1, uid=0, gid=0)))["gpus"] == [0, 1, 2, 3]
        db.go.set()
        # the next heartbeat comes MIN_GAP later, not a whole `heartbeat` (60 s) later
        assert await asyncio.to_thread(wait_for, lambda: len(db.calls) >= 3, 20), db.calls
        beating.cancel()
        return [[g["username"] for g in doc["grants"]] for kind, doc in db.calls if kind == "heartbeat"]
    try:
        assert asyncio.run(scenario()) == [[], [], [alice.name] * 4]
    finally:
        fleet.services.close()


def test_a_stopping_node_sends_what_its_last_heartbeat_lacked(tmp_path):
    fleet = fleet_world(tmp_path)
    db = online(fleet)
    alice = fleet.lookup.add("alice", 1001, GROUP)
    assert fleet.login(alice)["gpus"] == [0, 1, 2, 3]  # no check: its grant waits for a heartbeat
    fleet.services.close()
    assert wait_for(lambda: db.calls[-1] == ("close", None))
    kind, last = db.calls[-2]
    assert kind == "heartbeat" and [g["username"] for g in last["grants"]] == ["alice"] * 4


def test_a_release_leaves_the_fleet_database_before_the_queue_hands_the_gpus_on(tmp_path):
    """Releases.take_back tells the fleet after the charge and before the queue is served: the
    database forgets alice's GPUs before bob's grant-time check asks for them (FleetDb.reserve
    sends the releases it keeps first), and her usage waits in the outbox for the next heartbeat."""
    fleet = fleet_world(tmp_path, fleet_gpus=4)
    try:
        db = online(fleet)
        alice, bob = fleet.lookup.add("alice", 1001, GROUP), fleet.lookup.add("bob", 1002, GROUP)
        assert fleet.login(alice)["gpus"] == [0, 1, 2, 3]
        assert fleet.login(bob, pid=4343)["gpus"] == []  # queued
        assert fleet.call("release", uid=1001)["ok"]
        assert fleet.held(1002) == [0, 1, 2, 3]
        assert [kind for kind, _ in db.calls] == ["heartbeat", "reserve", "release", "reserve"]
        assert db.calls[2] == ("release", [(m, "alice") for m in range(4)])
        assert db.calls[3] == ("reserve", ("bob", (0, 1, 2, 3)))
        assert fleet.services.fleet is not None
        pending = fleet.services.fleet.node.outbox.pending()
        assert sorted((row["username"], row["minor"]) for row in pending) == [("alice", m) for m in range(4)]
    finally:
        fleet.services.close()


def test_the_heartbeat_mirrors_slurms_gpu_with_its_owner(tmp_path):
    slurms = replace(gpu(4), uuid="GPU-slurm-4")
    world = fleet_world(tmp_path, coexist.status_entries([slurms], Ownership(foreign={4: Owner.SLURM})))
    try:
        db = online(world)
        doc = db.calls[0][1]
        owners = {gpu["minor"]: (gpu["owner"], gpu["uuid"]) for gpu in doc["gpus"]}
        assert owners == {**{m: ("gpuguard", world.grants.gpus[m].uuid) for m in range(4)},
                          4: ("slurm", "GPU-slurm-4")}
        assert world.grants.gpus.keys() == {0, 1, 2, 3}  # Slurm's GPU is mirrored, never handed out
    finally:
        world.services.close()
