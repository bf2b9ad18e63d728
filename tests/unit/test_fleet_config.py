"""The fleet's pure parts and its SQLite outbox: [fleet] in the config, `where`'s ranking with
data locality, and the outbox a heartbeat replays (no database here: tests/system has it)."""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from gpuguard import config, fleet
from gpuguard.config import OfflinePolicy
from gpuguard.core import config_warnings
from gpuguard.core.model import Grant, Origin
from gpuguard.fleet import ranking, schema
from gpuguard.fleet.outbox import Outbox
from gpuguard.fleet.schema import FleetError


def load(tmp_path: Path, text: str, quotas: str = "") -> config.Config:
    (tmp_path / "gpuguard.toml").write_text(text)
    (tmp_path / "quotas.toml").write_text(quotas)
    return config.load(tmp_path / "gpuguard.toml")


def test_no_fleet_section_is_a_single_server(tmp_path):
    assert load(tmp_path, "").fleet is None


def test_fleet_section_with_data_map_and_fleet_quota(tmp_path):
    loaded = load(tmp_path, '[fleet]\ndatabase = "host=db1,db2 target_session_attrs=read-write"\nnode = "gpu1"\n'
                            'rack = "r1"\noffline_policy = "budget"\n[fleet.data]\n"/data/imagenet/" = ["gpu3"]\n'
                            '"/data" = ["r2"]\n',
                  '[users.alice]\nfleet_gpus = 2\n[users.bob]\nfleet_gpus = "none"\n')
    fleet = loaded.fleet
    assert fleet is not None and fleet.node == "gpu1" and fleet.rack == "r1"
    assert fleet.offline_policy == OfflinePolicy.BUDGET and fleet.heartbeat == 10 and fleet.timeout == 0.5
    assert fleet.data == (("/data", ("r2",)), ("/data/imagenet", ("gpu3",)))
    assert loaded.quotas.users == {"alice": {"fleet_gpus": 2}, "bob": {"fleet_gpus": None}}
    assert loaded.renamed == ()


def test_the_old_names_cluster_and_cluster_gpus_are_read_for_a_release_with_a_warning(tmp_path):
    loaded = load(tmp_path, '[cluster]\ndatabase = "host=db1"\nnode = "gpu1"\n[cluster.data]\n"/data" = ["r2"]\n'
                            '[defaults]\ncluster_gpus = 3\n',
                  '[users.alice]\ncluster_gpus = 2\n')
    assert loaded.fleet is not None and loaded.fleet.node == "gpu1" and loaded.fleet.data == (("/data", ("r2",)),)
    assert loaded.defaults.fleet_gpus == 3 and loaded.quotas.users == {"alice": {"fleet_gpus": 2}}
    warned = config_warnings.warnings(loaded, lambda name: True, lambda name: True)
    assert [line for line in warned if "is now" in line] == [
        f"{tmp_path / 'gpuguard.toml'}: cluster is now fleet (the old name is read until the next release)",
        f"{tmp_path / 'gpuguard.toml'}: defaults.cluster_gpus is now defaults.fleet_gpus (the old name is read until "
        "the next release)",
        f"{tmp_path / 'quotas.toml'}: users.alice.cluster_gpus is now users.alice.fleet_gpus (the old name is read "
        "until the next release)"]


def test_an_old_and_a_new_name_together_are_refused(tmp_path):
    with pytest.raises(config.ConfigError, match="cluster and fleet: the same setting twice"):
        load(tmp_path, '[cluster]\ndatabase = "a"\n[fleet]\ndatabase = "b"\n')


@pytest.mark.parametrize(("text", "problem"), [
    ('[fleet]\nnode = "a"\n', "fleet.database: missing"),
    ('[fleet]\ndatabase = "x"\nlease = "5s"\n', "fleet.lease: must be at least twice"),
    ('[fleet]\ndatabase = "x"\noffline_policy = "open"\n', "fleet.offline_policy: must be one of local, budget"),
    ('[fleet]\ndatabase = "x"\n[fleet.data]\n"relative" = ["a"]\n', "fleet.data: expected an absolute path"),
    ('[fleet]\ndatabase = "x"\ntimeout = "10ms"\n', "fleet.timeout"),
    # the database keeps no longer a text (schema 9): every heartbeat would fail
    (f'[fleet]\ndatabase = "x"\nssh = "{"h" * 256}"\n', "fleet.ssh: at most 255 characters"),
    (f'[fleet]\ndatabase = "x"\nrack = "{"r" * 300}"\n', "fleet.rack: at most 255 characters"),
])
def test_bad_fleet_settings_are_refused_with_one_line(tmp_path, text, problem):
    with pytest.raises(config.ConfigError, match=problem):
        load(tmp_path, text)


def test_the_configs_bound_on_a_fleet_text_is_the_schemas():
    assert config.FLEET_TEXT_MAX == schema.TEXT_MAX


def test_a_negative_fleet_quota_is_refused(tmp_path):
    with pytest.raises(config.ConfigError, match="users.alice.fleet_gpus"):
        load(tmp_path, "", "[users.alice]\nfleet_gpus = -1\n")


def row(node: str, rack: str, minor: int | None, holders: tuple[str, ...] = (), last_seen: float = 100.0,
        queued: int = 0, owner: str = "gpuguard") -> dict:
    return {"node": node, "rack": rack, "ssh": f"{node}.lab", "version": "1", "first_seen": 0.0,
            "last_seen": last_seen, "heartbeat": 10.0, "lease": 30.0, "grace": 60.0, "minor": minor,
            "uuid": f"GPU-{node}-{minor}", "gpu_name": "H100", "memory_total": 1, "owner": owner, "holders": holders,
            "shared": False, "queued": queued, "queued_gpus": queued, "now": 101.0}


FLEET = ranking.nodes([
    row("gpu1", "r1", 0, ("alice",)), row("gpu1", "r1", 1),                      # 1 free, alice holds one
    row("gpu2", "r1", 0), row("gpu2", "r1", 1), row("gpu2", "r1", 2, queued=0),  # 3 free
    row("gpu3", "r2", 0), row("gpu3", "r2", 1, owner="slurm"),                   # 1 free: slurm's is not ours
    row("gpu4", "r2", 0, last_seen=50.0),                                        # lost: never recommended
    row("gpu5", "r2", None),                                                     # no GPUs
])


def test_nodes_group_rows_and_tell_lost_and_counted():
    by_name = {node.name: node for node in FLEET}
    assert [by_name[n].free for n in ("gpu1", "gpu2", "gpu3", "gpu4", "gpu5")] == [1, 3, 1, 1, 0]
    assert by_name["gpu4"].lost and by_name["gpu4"].counted  # lost 51 s: within lease 30 + grace 60
    assert ranking.held_by(FLEET, "alice") == 1


def test_where_prefers_what_the_user_may_take_then_locality_then_queue():
    holders = ranking.data_holders("/data/imagenet/train", [("/data", ("r2",)), ("/data/imagenet", ("gpu1",))])
    assert holders == ("gpu1",)
    ranked = ranking.rank(FLEET, "alice", fleet_gpus=None, wanted=1, holders=holders)
    assert [(c.node.name, c.locality) for c in ranked] == [("gpu1", 0), ("gpu2", 1), ("gpu3", 2), ("gpu5", 2)]
    assert ranked[0].ssh == "ssh gpu1.lab"
    # two GPUs: only gpu2 has them now, so it goes first whatever the locality
    assert ranking.rank(FLEET, "alice", None, 2, holders)[0].node.name == "gpu2"


def test_where_counts_the_fleet_quota():
    ranked = ranking.rank(FLEET, "alice", fleet_gpus=2, wanted=1, holders=None)
    assert {c.node.name: c.may_take for c in ranked} == {"gpu1": 1, "gpu2": 1, "gpu3": 1, "gpu5": 0}
    assert all(c.may_take == 0 for c in ranking.rank(FLEET, "alice", fleet_gpus=1, wanted=1, holders=None))


def test_where_counts_the_gpus_a_queue_waits_for_and_the_quota_on_one_server():
    # the issue's case: gpu1's one free GPU is the queue head's; gpu2 and gpu3 have 4 free each
    fleet = ranking.nodes([row("gpu1", "r1", 0, queued=1), row("gpu1", "r1", 1, ("bob",)),
                           *(row("gpu2", "r1", m) for m in range(4)), *(row("gpu3", "r2", m) for m in range(4))])
    ranked = ranking.rank(fleet, "alice", fleet_gpus=None, wanted=1, holders=None, per_node=2)
    assert [(c.node.name, c.may_take) for c in ranked] == [("gpu2", 2), ("gpu3", 2), ("gpu1", 0)]
    held = ranking.nodes([row("gpu2", "r1", 0, ("alice",)), *(row("gpu2", "r1", m) for m in range(1, 4))])
    assert ranking.rank(held, "alice", None, 1, None, per_node=2)[0].may_take == 1  # she holds one of her 2 there


def test_a_path_under_no_data_entry_is_not_mapped():
    assert ranking.data_holders("/scratch/x", [("/data", ("r2",))]) is None
    assert ranking.data_holders("/datasets", [("/data", ("r2",))]) is None  # a prefix of the name is not a parent


def test_outbox_keeps_rows_until_confirmed_and_never_reuses_a_seq(tmp_path):
    outbox = Outbox(tmp_path / "cluster.db")
    grant = Grant(1001, "alice", 3, granted_at=100.0, expires_at=None, last_active=100.0, origin=Origin.SESSION)
    outbox.add([grant], now=160.0)
    outbox.add([grant], now=260.0)
    pending = outbox.pending()
    assert [(r["username"], r["minor"], r["started"], r["ended"]) for r in pending] == [
        ("alice", 3, 100.0, 160.0), ("alice", 3, 100.0, 260.0)]
    outbox.confirm(pending[0]["seq"], 300.0)
    assert [r["seq"] for r in outbox.pending()] == [pending[1]["seq"]]
    outbox.confirm(pending[1]["seq"], 300.0)
    outbox.add([grant], now=300.0)
    assert outbox.pending()[0]["seq"] > pending[1]["seq"]  # a replayed row is never mistaken for a new one
    incarnation = outbox.incarnation
    outbox.close()
    again = Outbox(tmp_path / "cluster.db")
    assert again.incarnation == incarnation and again.count() == 1
    assert Outbox(tmp_path / "other.db").incarnation != incarnation  # a new state directory: a new incarnation


@pytest.mark.parametrize(("database", "expected"), [
    ("host=/run/postgresql dbname=gpuguard", []),
    ("host=localhost,127.0.0.1 dbname=gpuguard passfile=/etc/gpuguard/pgpass", []),
    ("host=db1,db2 dbname=gpuguard target_session_attrs=read-write", ["database: db1, db2 is not this host"]),
    ("postgresql://gpuguard@[::1]:5432,db2:5433/gpuguard", ["database: db2 is not this host"]),
    ("postgresql://gpuguard:secret@localhost/gpuguard", ["holds a password"]),
    ("hostaddr=10.0.0.21 password=secret", ["holds a password", "database: 10.0.0.21 is not this host"]),
])
def test_config_check_warns_of_a_password_and_of_hosts_the_unit_blocks(tmp_path, database, expected):
    loaded = load(tmp_path, f"[fleet]\ndatabase = {database!r}\nnode = \"gpu1\"\n")
    found = [line for line in config_warnings.warnings(loaded, lambda name: True, lambda name: True, lambda path: True)
             if line.startswith("fleet.")]
    assert len(found) == len(expected) and all(part in line for part, line in zip(expected, found, strict=True)), found


# What each released migration ran on the databases that applied it: a migration once released is
# never edited (schema.py's docstring), since those databases never run it again; change the
# schema with a new one. Add a new migration's hash here when it is released.
RELEASED = {1: "732edad6267a2444be99e0fe901fe494d811e62a02a93cb7ae41ba0ff65eb575",
            2: "78354ef790523c08290c9f709293b6a7a239a7897b480867b7972b9fb9c7fc4e",
            3: "0c75624256e5b104072c93a81b7e6a05cc5116f4ffd08dddd69741c7720bcf50",
            4: "c385a5147c4138db0ab628874fe78e192c814521718592be0fb93cccfa4c21f0",
            5: "418dbb35e4236f35be909504bb3cd954a8ef17e71520f8c35edb2c5ec5fe3501",
            6: "2aede6af531d752c9d2b44dcc89022bbe9aa9b09cc6b88138823f83dafd2601a",
            7: "95482496b0428350b98b130bf19fee30229d1c1d623d751b561595d9f4154ee1",
            8: "1f8e3977ee58ed6c49d224da2fbc64dcf10bbd00647550b24abdf8240984fb39",
            9: "31cadc62947bfe3ab9f76a8e2d26167a55bf5165e8248990cb40e51147a52e07"}


def test_released_migrations_are_never_edited():
    ran = {m.version: hashlib.sha256(m.sql.encode()).hexdigest() for m in schema.MIGRATIONS}
    assert {version: ran[version] for version in RELEASED} == RELEASED
    assert [m.version for m in schema.MIGRATIONS] == list(range(1, len(schema.MIGRATIONS) + 1))


def test_a_fleet_without_psycopg_says_what_to_install(tmp_path, monkeypatch):
    loaded = load(tmp_path, '[fleet]\ndatabase = "host=db1"\nnode = "gpu1"\n')
    monkeypatch.delitem(sys.modules, "gpuguard.fleet.fleetdb", raising=False)
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as on a host where the package was not installed
    with pytest.raises(FleetError, match=r"\[fleet\] is set, but psycopg cannot be loaded: install python3-psycopg"):
        fleet.database(loaded)
