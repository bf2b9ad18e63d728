"""admission.Budget: who may hold a connection, decided without any I/O."""
from __future__ import annotations

import asyncio

from gpuguard.daemon import admission
from gpuguard.daemon.admission import METRICS_KEY, NO_ACCOUNT_KEY, ROOT, AccountKinds, Budget, pending_key, subuids_key, uid_key


def test_a_uid_is_capped_whether_its_connections_wait_for_nss_or_not():
    budget = Budget(limit=1000, per_uid=3)
    assert budget.take(pending_key(1001)) is None
    assert budget.take(uid_key(1001)) is None
    assert budget.take(uid_key(1001)) is None
    assert budget.take(uid_key(1001)) == "more than 3 connections at once from your user"
    assert budget.take(pending_key(1001)) == "more than 3 connections at once from your user"
    assert budget.take(uid_key(1002)) is None  # another user is not


def test_uids_without_an_account_share_one_cap():
    budget = Budget(limit=1000, no_account=2)
    assert budget.take(NO_ACCOUNT_KEY) is None and budget.take(NO_ACCOUNT_KEY) is None
    assert "without an account" in budget.take(NO_ACCOUNT_KEY)
    budget.give_back(NO_ACCOUNT_KEY)
    assert budget.take(NO_ACCOUNT_KEY) is None


def test_each_owners_subuids_have_a_cap_of_their_own():
    budget = Budget(limit=1000, no_account=2)
    assert budget.take(subuids_key("mallory")) is None and budget.take(subuids_key("mallory")) is None
    assert budget.take(subuids_key("mallory")) == "more than 2 connections at once from your user namespaces' uids"
    assert budget.take(subuids_key("alice")) is None  # another owner's namespace is not
    assert budget.take(NO_ACCOUNT_KEY) is None  # nor uids in no range
    budget.give_back(subuids_key("mallory"))
    assert budget.take(subuids_key("mallory")) is None


def test_the_global_limit_binds_everyone_but_root():
    budget = Budget(limit=3, metrics=10)
    for uid in (1, 2, 3):
        assert budget.take(uid_key(uid)) is None
    assert "too many connections" in budget.take(uid_key(4))
    assert "too many connections" in budget.take(METRICS_KEY)
    assert all(budget.take(ROOT) is None for _ in range(100))  # logins
    budget.give_back(uid_key(2))
    assert budget.take(METRICS_KEY) is None


def test_pending_connections_of_all_uids_together_are_capped():
    budget = Budget(limit=1000, pending=2)
    assert budget.take(pending_key(1)) is None and budget.take(pending_key(2)) is None
    assert "not looked up yet" in budget.take(pending_key(3))
    budget.give_back(pending_key(1))
    assert budget.take(pending_key(3)) is None


def test_the_budget_keeps_a_reserve_of_descriptors():
    small, large = Budget.for_descriptors(1024, in_use=40), Budget.for_descriptors(1 << 20)
    assert small.limit == 1024 - 40 - 256  # a quarter
    assert Budget.for_descriptors(256).limit == 256 - admission.RESERVE_MIN  # at least RESERVE_MIN
    assert large.limit == (1 << 20) - (1 << 18)


def test_account_kinds_asks_once_per_uid_and_remembers():
    asked = []

    def has_account(uid: int) -> bool:
        asked.append(uid)
        return uid < 100000

    async def main() -> list:
        kinds = AccountKinds(has_account)
        try:
            answers = await asyncio.gather(*(kinds.ask(uid) for uid in (1000, 1000, 1000, 200000, 200000)))
            return [*answers, kinds.remembered(1000), kinds.remembered(200000), kinds.remembered(5)]
        finally:
            kinds.close()

    assert asyncio.run(main()) == [True, True, True, False, False, True, False, None]
    assert sorted(asked) == [1000, 200000]


def test_account_kinds_does_not_remember_a_failure_of_nss():
    from gpuguard.core.errors import NssFailure

    def failing(uid: int) -> bool:
        raise NssFailure("cannot look up uid 5: NSS failed (Too many open files)")

    async def main() -> tuple:
        kinds = AccountKinds(failing)
        try:
            return await kinds.ask(5), kinds.remembered(5)
        finally:
            kinds.close()

    assert asyncio.run(main()) == (None, None)


def test_a_rate_limit_lets_a_burst_through_then_one_per_period_per_key():
    limit = admission.RateLimit(burst=3, every=2.0)
    assert [limit.allow("alice", 100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limit.allow("alice", 100.0) == 2.0      # empty: the next token in 2 s
    assert limit.allow("bob", 100.0) == 0.0        # another key has its own
    assert limit.allow("alice", 101.0) == 1.0      # refused calls do not push the refill back
    assert limit.allow("alice", 102.0) == 0.0 and limit.allow("alice", 102.0) > 0
    assert [limit.allow("alice", 1000.0) for _ in range(4)].count(0.0) == 3  # never more than the burst
