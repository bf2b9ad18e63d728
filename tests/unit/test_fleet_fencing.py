"""Fencing (gpuguard.fleet.fencing) and the outbox's rows sent again to a database that lacks them: the pure
decision, the memory file and the outbox's SQLite, no database server."""
from __future__ import annotations

from gpuguard.core.model import Grant, Origin
from gpuguard.fleet import fencing
from gpuguard.fleet.fencing import Lineage, LineageMemory
from gpuguard.fleet.outbox import KEEP_CONFIRMED, Outbox

WROTE = Lineage("7716186205356215317", 2)


def test_a_node_writes_to_its_database_or_a_later_leader_of_it_only():
    assert fencing.refusal(None, Lineage("1", 1)) is None  # the first database it meets
    assert fencing.refusal(WROTE, WROTE) is None
    assert fencing.refusal(WROTE, Lineage(WROTE.system_identifier, 3)) is None  # promoted since: a later leader
    old = fencing.refusal(WROTE, Lineage(WROTE.system_identifier, 1))
    assert old is not None and "old leader (timeline 1" in old and "timeline 2" in old
    other = fencing.refusal(WROTE, Lineage("42", 5))
    assert other is not None and "another one (system 42" in other


def test_the_timeline_is_read_from_the_wal_file_name():
    assert fencing.timeline_of("000000010000000000000001") == 1
    assert fencing.timeline_of("0000001A0000000000000003") == 26


def test_the_memory_is_kept_per_connection_string_and_survives_a_new_process(tmp_path):
    path = tmp_path / "fleet-lineage.json"
    memory = LineageMemory(path, "host=db1 dbname=gpuguard password=secret")
    assert memory.remembered() is None
    memory.remember(WROTE)
    assert LineageMemory(path, "host=db1 dbname=gpuguard password=secret").remembered() == WROTE
    assert "secret" not in path.read_text()
    assert LineageMemory(path, "host=db2 dbname=gpuguard").remembered() is None  # moved on purpose: afresh
    path.write_text("{not json")
    assert memory.remembered() is None


def grant(user: str) -> Grant:
    return Grant(1001, user, 3, granted_at=100.0, expires_at=None, last_active=100.0, origin=Origin.SESSION)


def test_confirmed_rows_a_database_lacks_are_sent_again(tmp_path):
    outbox = Outbox(tmp_path / "fleet.db")
    assert outbox.kept_from() is None  # nothing kept: a new connection asks nothing
    outbox.add([grant("alice"), grant("bob")], now=160.0)
    first = outbox.pending()
    assert outbox.kept_from() == first[0]["seq"]  # pending rows count: a heartbeat may carry them
    outbox.confirm(first[-1]["seq"], 200.0)
    assert outbox.pending() == [] and outbox.count() == 0 and outbox.kept_from() == first[0]["seq"]
    outbox.add([grant("carol")], now=260.0)  # not sent yet: stays pending whatever the database has
    assert outbox.resend_absent([r["seq"] for r in first]) == 0  # a database with both: nothing to send
    assert outbox.resend_absent([first[1]["seq"]]) == 1  # a promoted replica that lacks alice's row
    assert [r["username"] for r in outbox.pending()] == ["alice", "carol"]
    outbox.confirm(outbox.pending()[-1]["seq"], 300.0)
    assert outbox.resend_absent([]) == 3 and outbox.count() == 3  # a database with none of them


def test_confirmed_rows_are_kept_for_a_day_only(tmp_path):
    outbox = Outbox(tmp_path / "fleet.db")
    outbox.add([grant("alice")], now=160.0)
    outbox.confirm(outbox.pending()[-1]["seq"], 200.0)
    outbox.add([grant("bob")], now=200.0 + KEEP_CONFIRMED)
    outbox.confirm(outbox.pending()[-1]["seq"], 201.0 + KEEP_CONFIRMED)  # alice's row, a day old, goes
    assert outbox.resend_absent([]) == 1 and [r["username"] for r in outbox.pending()] == ["bob"]
