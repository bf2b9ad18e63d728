"""The store's copies of what it reads often (grants, sessions, the queue, fair share, when units
were given back) are read once and follow its own writes (the daemon is its store's one writer),
always equal to what a fresh read returns; their versions move at each change and the changes they
log lead from a version to the next; the events a user keeps stay within the documented bound
although a user's old ones are pruned in steps."""
import random

from gpuguard.config import EventsConfig
from gpuguard.core.model import Event, Origin, Quota
from gpuguard.core.unit_numbers import slice_unit, unit_parent
from gpuguard.services.store import PRUNE_EVERY, Store, grant_key, queued_id

UNITS = [0, 1, 2, slice_unit(3, 1, 0), slice_unit(3, 2, 0)]
UIDS = [1001, 1002, 1003]


def _fresh(path) -> Store:
    return Store(path)


def test_the_grants_copy_follows_its_own_writes_as_a_fresh_read_sees_them(tmp_path):
    """Random adds (also over a held slot: INSERT OR REPLACE), removals and marks; after each,
    every view of the copy equals a new connection's read of the table, and the changes the store
    gives (grant_changes), applied to the grants before, are the grants after, grant for grant
    (by grant_key: a mark moves only last_active, and is no change of the grant)."""
    rng = random.Random(20)
    store = Store(tmp_path / "state.db")
    try:
        store.grants()  # read: from here on the copy is changed in place
        assert store.grant_changes() is None  # the first call: from here on the changes are kept
        followed = {grant_key(g) for g in store.grants_read()}
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
            changes = store.grant_changes()
            assert changes is not None
            for grant in changes.gone:
                followed.remove(grant_key(grant))
            for grant in changes.came:
                assert grant_key(grant) not in followed
                followed.add(grant_key(grant))
            assert followed == {grant_key(g) for g in store.grants_read()}
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


def test_the_grants_version_moves_at_each_change_and_nothing_a_caller_holds_changes(tmp_path):
    store = Store(tmp_path / "state.db")
    try:
        store.add_grants(1001, "alice", [0], 10.0, None)
        first, version = store.grants_read(), store.grants_version
        assert store.grants_version == version  # nothing changed
        store.mark_active([(1001, 0)], 50.0)
        assert store.grants_version > version and [g.last_active for g in store.grants_read()] == [50.0]
        assert [g.last_active for g in first] == [10.0]  # what a caller holds is never changed under it
        version = store.grants_version
        store.remove_grants(1001, None, 60.0)
        assert store.grants_version > version and store.grants_read() == ()
    finally:
        store.close()


def test_grant_changes_net_out(tmp_path):
    store = Store(tmp_path / "state.db")
    try:
        assert store.grant_changes() is None  # the first call
        store.add_grants(1001, "alice", [0, 1], 10.0, None)
        store.remove_grants(1001, [1], 20.0)  # came and went since the last call: in neither
        changes = store.grant_changes()
        assert changes is not None and changes.gone == [] and [g.unit for g in changes.came] == [0]
        store.mark_active([(1001, 0)], 50.0)  # the same grant, marked: no change
        assert not store.grant_changes()
        store.remove_grants(1001, None, 60.0)
        store.add_grants(1001, "alice", [0], 60.0, None)  # a new grant of the same GPU: one gone, one come
        changes = store.grant_changes()
        assert changes is not None and [g.granted_at for g in changes.gone] == [10.0]
        assert [g.granted_at for g in changes.came] == [60.0]
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


def test_a_retention_of_0_events_per_user_writes_none(tmp_path):
    """A replay's store keeps no history (nobody reads it): the events are not even built."""
    store = Store(tmp_path / "state.db", lambda: EventsConfig(max_age=None, per_user=0), durable=False)
    built: list[int] = []
    try:
        store.add_events(built.append(i) or _event(float(i), 1001, f"m{i}") for i in range(5))
        store.add_grants(1001, "u1001", [0], 1.0, None)
        assert store.event_count() == 0 and built == [] and [g.unit for g in store.grants(1001)] == [0]
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


def test_fair_share_as_read_follows_its_own_writes(tmp_path):
    store = Store(tmp_path / "state.db")
    try:
        assert store.fairshare() == {}
        store.set_fairshare(1001, 7200, 10)  # its own write: the copy follows, as the table holds it
        other = _fresh(store.path)
        try:
            assert store.fairshare() == other.fairshare() == {1001: (7200.0, 10.0)}
        finally:
            other.close()
        store.fairshare()[1003] = (1.0, 1.0)  # what a caller gets is its own
        assert 1003 not in store.fairshare()
    finally:
        store.close()


def _views(store: Store) -> dict[str, object]:
    """Everything the store serves from a kept copy, as one comparable value."""
    return {
        "grants": store.grants(), "grants_read": list(store.grants_read()),
        "grants_of": {uid: store.grants(uid) for uid in UIDS},
        "grants_on": {gpu: store.grants_on([gpu]) for gpu in (0, 1, 2, 3, 7)},
        "last_held": {uid: store.last_held(uid) for uid in UIDS}, "last_released": store.last_released(),
        "sessions": store.sessions(), "sessions_of": {uid: store.sessions(uid) for uid in UIDS},
        "ttys": {uid: store.ttys(uid) for uid in UIDS}, "users_logged_in": store.users_logged_in(),
        "caller_starts": store.caller_starts(),
        "queue": store.queue(), "queue_of": {uid: store.queue(uid) for uid in UIDS},
        "fairshare": store.fairshare(),
    }


def _write(store: Store, rng: random.Random, now: float) -> None:
    """One write of a random kind, each kind of write the store has a copy for."""
    uid = rng.choice(UIDS)
    op = rng.choice(["add", "remove", "mark", "open", "close", "drop", "join", "regrow", "leave", "charge"])
    if op == "add":
        store.add_grants(uid, f"u{uid}", rng.sample(UNITS, rng.randint(1, 2)), now, rng.choice([None, now + 60]),
                         shared=rng.random() < 0.3, origin=rng.choice(list(Origin)), memory=rng.choice([None, 1 << 30]))
    elif op == "remove":
        store.remove_grants(uid, rng.choice([None, rng.sample(UNITS, 2)]), now)
    elif op == "mark":
        store.mark_active([(uid, rng.choice(UNITS)), (rng.choice(UIDS), rng.choice(UNITS))], now)
    elif op == "open":
        store.open_session(uid, f"u{uid}", "sshd", "", rng.choice(["pts/1", "pts/2", ""]), rng.choice([500, 600]), now,
                           caller_start=rng.choice([None, 77]))
    elif op == "close":
        store.close_session(uid, rng.choice([500, 600]))
    elif op == "drop":
        store.remove_sessions(rng.sample([s.id for s in store.sessions()] + [10_000], 1))
    elif op == "join":
        store.join_queue(uid, f"u{uid}", rng.randint(1, 2), now,
                         Quota(gpus=2, max_time=rng.choice([None, 3600]), slice_profiles=("1g.10gb",)),
                         rng.choice(list(Origin)), pid=rng.choice([None, 42]), pid_start=rng.choice([None, 9]),
                         counted=rng.sample(UNITS, rng.randint(0, 2)))
    elif op == "regrow" and (rows := store.queue()):
        row = rng.choice(rows)
        store.regrow_queued(row, row.waiter.gpus + 1, row.counted[1:])
    elif op == "leave":
        store.leave_queue(rng.sample([q.waiter.id for q in store.queue()] + [10_000], 1))
    else:
        store.set_fairshare(uid, rng.random() * 1000, now)


def test_every_copy_equals_a_fresh_read_after_each_kind_of_write(tmp_path):
    """Random writes of every kind; after each, every view of the store equals what a new
    connection reads, and the queue's logged changes, applied to the rows before, are the rows
    after. The copies are read before the writes start, so that each kind of write meets a kept copy."""
    rng = random.Random(2026)
    store = Store(tmp_path / "state.db")
    try:
        _views(store)
        rows, version = {q.waiter.id: q for q in store.queue_read()}, store.queue_version
        for step in range(400):
            _write(store, rng, 100.0 + step)
            fresh = _fresh(store.path)
            try:
                assert _views(store) == _views(fresh), f"step {step}"
            finally:
                fresh.close()
            changes = store.queue_changes(version)
            assert changes is not None
            for before, after in changes:
                if before is not None:
                    assert rows.pop(before.waiter.id) == before
                if after is not None:
                    rows[after.waiter.id] = after
            assert sorted(rows.values(), key=queued_id) == list(store.queue_read()), f"step {step}"
            assert store.queue_changes(store.queue_version) == []
            version = store.queue_version
    finally:
        store.close()


def _retention_model(per_user: int, max_age: float):
    """The documented retention, one event at a time, in plain Python: each event drops those older
    than max_age; a user's first event and then every per_user // PRUNE_EVERY-th of theirs drops
    their events beyond the newest per_user. Returns add(event) and kept() (messages, oldest first)."""
    every = per_user // PRUNE_EVERY
    rows: list[Event] = []
    since: dict[int | None, int] = {}

    def add(event: Event) -> None:
        rows.append(event)
        rows[:] = [e for e in rows if e.time >= event.time - max_age]
        since[event.uid] = since.get(event.uid, every - 1) + 1
        if since[event.uid] == every:
            theirs = [e for e in rows if e.uid == event.uid]
            dropped = {id(e) for e in theirs[:-per_user]}
            rows[:] = [e for e in rows if id(e) not in dropped]
            since[event.uid] = 0

    return add, lambda: [e.message for e in rows]


def test_events_added_together_leave_what_the_retention_rule_leaves_one_event_at_a_time(tmp_path):
    """add_events (a grant's units, one time) against the rule applied at each event: the same
    events after every batch, with a user's prune due inside a batch, at its end, or not at all.
    alice has more events in max_age than per_user (her bound cuts), bob and the system fewer (the
    age cuts)."""
    rng = random.Random(7)
    store = Store(tmp_path / "state.db", lambda: EventsConfig(max_age=10.0, per_user=20), durable=False)
    add, kept = _retention_model(per_user=20, max_age=10.0)
    try:
        for step in range(150):
            batch = [_event(float(step), rng.choice([1001] * 6 + [1002, None]), f"m{step}.{i}")
                     for i in range(rng.randint(1, 7))]
            store.add_events(batch)
            for event in batch:
                add(event)
            assert [e.message for e in store.events(limit=10_000)] == kept(), f"step {step}"
        alice, bob = store.events(1001, limit=10_000), store.events(1002, limit=10_000)
        assert 20 <= len(alice) <= 20 + 20 // PRUNE_EVERY - 1 and alice[0].time > 149 - 10.0
        assert 0 < len(bob) < 20 and bob[0].time >= 149 - 10.0
    finally:
        store.close()
