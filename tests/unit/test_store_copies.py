"""The store's copies of what it reads often (grants, when units were given back) follow its own
writes without reading the table again, and always equal what a fresh read returns; the events a
user keeps stay within the documented bound although a user's old ones are pruned in steps."""
import random

from gpuguard.config import EventsConfig
from gpuguard.model import Event, Origin
from gpuguard.store import PRUNE_EVERY, Store
from gpuguard.unit_numbers import slice_unit, unit_parent

UNITS = [0, 1, 2, slice_unit(3, 1, 0), slice_unit(3, 2, 0)]
UIDS = [1001, 1002, 1003]


def _fresh(path) -> Store:
    return Store(path, durable=False)


def test_the_grants_copy_follows_its_own_writes_as_a_fresh_read_sees_them(tmp_path):
    """Random adds (also over a held slot: INSERT OR REPLACE), removals and marks; after each,
    every view of the copy equals a new connection's read of the table."""
    rng = random.Random(20)
    store = Store(tmp_path / "state.db", durable=False)
    try:
        store.grants()  # read: from here on the copy is changed in place
        for step in range(200):
            now = 100.0 + step
            op = rng.choice(["add", "remove", "mark"])
            uid = rng.choice(UIDS)
            if op == "add":
                units = rng.sample(UNITS, rng.randint(1, 2))
                shared = rng.random() < 0.3
                store.add_grants(uid, f"u{uid}", units, now, rng.choice([None, now + 3600]), shared=shared,
                                 origin=rng.choice(list(Origin)), uuids={units[0]: f"GPU-{units[0]}"},
                                 memory=rng.choice([None, 40 << 30]))
            elif op == "remove":
                store.remove_grants(uid, rng.choice([None, rng.sample(UNITS, 2)]), now)
            else:
                store.mark_active([(uid, rng.choice(UNITS)), (rng.choice(UIDS), rng.choice(UNITS))], now)
            other = _fresh(store.path)
            try:
                assert store.grants() == other.grants()
                assert list(store.grants_read()) == other.grants()
                for u in UIDS:
                    assert store.grants(u) == other.grants(u)
                for gpus in ([0], [3], [1, 3], [7]):
                    assert store.grants_on(gpus) == [g for g in other.grants() if unit_parent(g.unit) in gpus]
                for u in UIDS:
                    assert store.last_held(u) == other.last_held(u)
                assert store.last_released() == other.last_released()
            finally:
                other.close()
    finally:
        store.close()


def test_the_grants_read_is_one_object_until_a_change(tmp_path):
    store = Store(tmp_path / "state.db", durable=False)
    try:
        store.add_grants(1001, "alice", [0], 10.0, None)
        first = store.grants_read()
        assert store.grants_read() is first  # nothing changed: the same object
        store.mark_active([(1001, 0)], 50.0)
        marked = store.grants_read()
        assert marked is not first and [g.last_active for g in marked] == [50.0]
        assert [g.last_active for g in first] == [10.0]  # what a caller holds is never changed under it
        other = _fresh(store.path)
        try:
            other.remove_grants(1001, None, 60.0)  # another connection's write: read again
        finally:
            other.close()
        assert store.grants_read() == ()
    finally:
        store.close()


def _event(time: float, uid: int | None, message: str) -> Event:
    return Event(time=time, uid=uid, user=f"u{uid}", kind="grant", message=message)


def test_a_users_events_stay_within_per_user_and_a_tenth_of_it(tmp_path):
    per_user = 40
    step = per_user // PRUNE_EVERY
    store = Store(tmp_path / "state.db", lambda: EventsConfig(max_age=None, per_user=per_user), durable=False)
    try:
        counts = []
        for i in range(300):
            store.add_event(_event(float(i), 1001, f"m{i}"))
            kept = [e.message for e in store.events(1001, limit=10_000)]
            assert kept[-min(per_user, i + 1):] == [f"m{j}" for j in range(max(0, i + 1 - per_user), i + 1)]
            counts.append(len(kept))
        assert max(counts) == per_user + step - 1  # the bound is reached, never passed
        assert counts[-1] >= per_user
    finally:
        store.close()


def test_the_first_event_of_a_user_after_opening_prunes_what_an_earlier_run_left(tmp_path):
    path = tmp_path / "state.db"
    generous = Store(path, lambda: EventsConfig(max_age=None, per_user=1000), durable=False)
    for i in range(30):
        generous.add_event(_event(float(i), 1001, f"m{i}"))
    generous.close()
    store = Store(path, lambda: EventsConfig(max_age=None, per_user=20), durable=False)
    try:
        store.add_event(_event(30.0, 1001, "m30"))
        assert [e.message for e in store.events(1001)] == [f"m{i}" for i in range(11, 31)]
    finally:
        store.close()


def test_fair_share_as_read_follows_its_own_writes_and_another_connections(tmp_path):
    store = Store(tmp_path / "state.db", durable=False)
    other = _fresh(store.path)
    try:
        assert store.fairshare() == {}
        store.set_fairshare(1001, 7200, 10)  # its own write: the copy follows, as the table holds it
        assert store.fairshare() == other.fairshare() == {1001: (7200.0, 10.0)}
        other.set_fairshare(1002, 60.0, 20.0)  # another connection's: read again
        assert store.fairshare() == {1001: (7200.0, 10.0), 1002: (60.0, 20.0)}
        store.fairshare()[1003] = (1.0, 1.0)  # what a caller gets is its own
        assert 1003 not in store.fairshare()
    finally:
        other.close()
        store.close()
