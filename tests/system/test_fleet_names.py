"""Node names are unique in the fleet (gpuguard.fleet.identity, schema 4's heartbeat_v3 and
reserve_v2), on a real PostgreSQL: a second install under a live node's name is refused and
writes nothing, the holder hears of it, a holder silent past lease + grace is taken over, two
installs starting together under one new name end with one holder, and nodes of the release
before are told apart by their outbox. Then two real daemons under one name beside the fleet's
three: the second is offline with one line naming both, the first keeps its grants, and no user
gets past a fleet quota."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import unique
from daemon_fixture import RunningDaemon
from test_fleet_daemons import DaemonFleet, daemon_fleet, member
from test_fleet_db import heartbeat_doc, reserve_doc, rows

from devtools.harness import wait_for
from gpuguard.fleet.fleetdb import FleetDb


@pytest.fixture
def fleet(postgres, make_group, make_user) -> Iterator[DaemonFleet]:
    with daemon_fleet(postgres, make_group(), make_user) as nodes:
        yield nodes


def beat(db: FleetDb, install: str, host: str, grants: list[dict] | None = None, incarnation: str = "inc1",
         lease: float = 30.0, grace: float = 60.0, function: str = "heartbeat_v3") -> dict:
    doc = {**heartbeat_doc(db.node, grants=grants, lease=lease, grace=grace), "host": host, "install": install,
           "incarnation": incarnation}
    if function != "heartbeat_v3":  # a node of the release before: schema 3, no host or install
        doc = {key: value for key, value in doc.items() if key not in ("host", "install")} | {"schema": 3}
    return db.call(function, doc)


def grant(minor: int, user: str = "u1") -> dict:
    return {"minor": minor, "username": user, "uid": 1001, "granted_at": time.time() - 5, "expires_at": None,
            "shared": False, "origin": "session"}


def reserve(db: FleetDb, install: str, user: str, minors: list[int], quota: int | None,
            incarnation: str = "inc1") -> dict:
    return db.reserve({**reserve_doc(db.node, user, minors, quota), "install": install, "incarnation": incarnation})


def test_a_second_install_under_a_live_nodes_name_is_refused_and_the_holder_keeps_its_rows(postgres):
    holder, clone, other = (FleetDb(postgres.conninfo, name) for name in ("gpu1", "gpu1", "gpu2"))
    assert "refused" not in beat(holder, "m1/k1", "hosta", grants=[grant(0)])
    assert "refused" not in beat(other, "m2/k2", "hostb")
    # the clone (same name, another install) sends its own truth: no grants
    answer = beat(clone, "m1/k9", "hosta-clone")
    assert answer["refused"]["host"] == "hosta" and answer["refused"]["install"] == "m1/k1", answer
    assert rows(postgres.conninfo, "SELECT node, minor, username FROM gpuguard.grants") == [("gpu1", 0, "u1")]
    assert rows(postgres.conninfo, "SELECT host, identity FROM gpuguard.nodes WHERE name = 'gpu1'") == [
        ("hosta", "m1/k1")]
    # nor may it check a grant under that name: u1 holds their fleet quota of 1 on the holder
    assert "refused" in reserve(clone, "m1/k9", "u2", [1], None)
    assert reserve(other, "m2/k2", "u1", [0], 1)["granted"] == []
    assert rows(postgres.conninfo, "SELECT node, minor, username FROM gpuguard.grants") == [("gpu1", 0, "u1")]
    # the holder's next heartbeat says who tried, and it goes on
    answer = beat(holder, "m1/k1", "hosta", grants=[grant(0)])
    assert answer["clash"]["host"] == "hosta-clone" and answer["clash"]["install"] == "m1/k9", answer
    assert reserve(holder, "m1/k1", "u2", [1], None)["granted"] == [1]


def test_a_holder_silent_past_lease_and_grace_is_taken_over(postgres):
    holder, new = FleetDb(postgres.conninfo, "gpu1"), FleetDb(postgres.conninfo, "gpu1")
    assert "refused" not in beat(holder, "m1/k1", "hosta", grants=[grant(0)], lease=0.2, grace=0.2)
    time.sleep(0.5)  # silent past lease + grace: the host was reinstalled, its state directory made anew
    answer = beat(new, "m1/k2", "hosta")
    assert answer["took_over"]["install"] == "m1/k1" and "refused" not in answer, answer
    assert rows(postgres.conninfo, "SELECT count(*) FROM gpuguard.grants") == [(0,)]  # its mirror replaced
    assert beat(holder, "m1/k1", "hosta")["refused"]["install"] == "m1/k2"  # the old install, back: refused


def test_two_installs_starting_together_under_one_new_name_end_with_one_holder(postgres):
    for round_ in range(8):
        name = f"race{round_}"
        start = threading.Barrier(2)
        answers: dict[str, dict] = {}

        def start_as(install: str, name: str = name, start: threading.Barrier = start,
                     answers: dict[str, dict] = answers) -> None:
            db = FleetDb(postgres.conninfo, name)
            db.call("heartbeat_v3", {**heartbeat_doc("node0"), "node": f"{name}-{install}"})  # connected first
            start.wait()
            answers[install] = beat(db, install, install)

        threads = [threading.Thread(target=start_as, args=(install,)) for install in ("m/a", "m/b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        accepted = [install for install, answer in answers.items() if "refused" not in answer]
        assert len(accepted) == 1, answers
        assert rows(postgres.conninfo, "SELECT identity FROM gpuguard.nodes WHERE name = %s", name) == [
            (accepted[0],)]


def test_nodes_of_the_release_before_are_told_apart_by_their_outbox(postgres):
    upgraded, old = FleetDb(postgres.conninfo, "gpu1"), FleetDb(postgres.conninfo, "gpu2")
    # gpu1's row as the release before wrote it, then the same node upgraded (its outbox kept): its name
    assert "refused" not in beat(upgraded, "", "", incarnation="inc-a", function="heartbeat_v2")
    assert "refused" not in beat(upgraded, "m1/k1", "hosta", incarnation="inc-a")
    # gpu2 is run by a node of the release before; a new install under its name is refused, naming its outbox
    beat(old, "", "", incarnation="inc-b", function="heartbeat_v2")
    refused = beat(FleetDb(postgres.conninfo, "gpu2"), "m3/k3", "hostc", incarnation="inc-c")["refused"]
    assert refused["install"] == "inc-b" and refused["host"] == "", refused
    # and an old node that writes under a name a new one holds (it cannot be refused) is noticed by it
    beat(FleetDb(postgres.conninfo, "gpu1"), "", "", incarnation="inc-z", function="heartbeat_v2")
    assert beat(upgraded, "m1/k1", "hosta", incarnation="inc-a")["refused"]["install"] == "inc-z"


def test_two_daemons_under_one_name_the_second_is_refused_and_the_first_keeps_its_grants(fleet: DaemonFleet):
    alice, bob = member(fleet), member(fleet)
    quotas = {"users": {alice.name: {"fleet_gpus": 1}}}
    fleet.start(quotas=quotas)
    gpu1 = fleet.nodes["gpu1"]
    assert len(fleet.login("gpu1", alice)["gpus"]) == 1
    # a server made from gpu1's image, its name left as it was: acl mode (gpu1 holds this machine's gate)
    sandbox = Path("/tmp") / unique()
    sandbox.mkdir(mode=0o755)
    fleet.sandboxes.append(sandbox)
    clone = fleet.nodes["gpu1-clone"] = RunningDaemon(sandbox, fleet.group, fleet.make_user)
    clone.write_config(count=2, gate=False, quotas=quotas, defaults={"gpus": 2},
                       fleet={"database": fleet.postgres.conninfo, "node": "gpu1", "rack": "r1", "heartbeat": "1s",
                              "lease": "2s", "grace": "2s"})
    clone.start()
    # its first heartbeat has been answered (taken, before schema 4; refused now), then a few more, 1 s apart,
    # each with the clone's own truth (no grants): none may replace gpu1's
    assert wait_for(lambda: (s := clone.call("fleet_status"))["online"] or s["offline_reason"], 30)
    time.sleep(3)
    assert [row for row in fleet.held_in_database() if row[0] == "gpu1"] == [("gpu1", alice.name, 0)]
    # elsewhere alice's fleet quota of 1 still holds; logins go on on the clone (its offline policy)
    assert fleet.login("gpu3", alice)["gpus"] == [] and fleet.login("gpu2", alice)["gpus"] == []
    assert fleet.login("gpu1-clone", bob)["gpus"]
    assert rows(fleet.postgres.conninfo, "SELECT node, minor FROM gpuguard.grants WHERE username = %s",
                alice.name) == [("gpu1", 0)]

    # the clone is offline, with one line naming both, in its log, doctor and status --fleet
    status = clone.call("fleet_status")
    assert not status["online"], status
    holder, refused, reason = gpu1.call("fleet_status")["identity"], status["identity"], status["offline_reason"]
    assert holder != refused
    assert reason.startswith("name taken: fleet node gpu1 is held by " + holder), reason
    assert f"refused here on {refused}" in reason, reason
    assert "event=fleet_name_taken" in clone.log() and reason in clone.log(), clone.log()
    doctor = clone.cli("doctor")
    assert any(line.startswith("FAIL") and "fleet" in line and "name taken" in line
               for line in doctor.stdout.splitlines()), doctor.stdout
    assert "name taken: fleet node gpu1" in clone.cli("status", "--fleet").stdout
    # the holder hears of it: its log, doctor (a warning: it goes on) and status --fleet
    clash = wait_for(lambda: gpu1.call("fleet_status")["name_clash"])
    assert clash and refused in clash and holder in clash, clash
    assert "event=fleet_name_clash" in gpu1.log()
    doctor = gpu1.cli("doctor")
    assert any(line.startswith("warn") and "fleet" in line and refused in line
               for line in doctor.stdout.splitlines()), doctor.stdout
    assert f"warning: name clash: {refused}" in gpu1.cli("status", "--fleet").stdout


def test_the_fleets_daemons_still_write_with_an_older_nodes_row_in_place(fleet: DaemonFleet):
    """A row left by a node of the release before (no install) under a name nobody runs any more:
    the fleet starts beside it, and a daemon under that name takes it over once it is lost."""
    old = FleetDb(fleet.postgres.conninfo, "gpu3")
    beat(old, "", "", incarnation="inc-old", lease=0.5, grace=0.5, function="heartbeat_v2")
    time.sleep(1.2)  # lost past lease + grace
    fleet.start(quotas={})
    assert wait_for(lambda: "event=fleet_name_taken_over" in fleet.nodes["gpu3"].log()), fleet.nodes["gpu3"].log()
