"""reporting.fractions, the one place every view (status, gpus, whoami, the grid, the metrics)
reads a GPU's fractions and its memory left to promise from; and the grid's words for them."""
from __future__ import annotations

from fakes import gpu

from gpuguard.core.model import Grant
from gpuguard.core.reporting import fractions
from gpuguard.web import views
from gpuguard.web.pages import grid

GiB = 1 << 30


def grant(user: str, uid: int, unit: int = 0, shared: bool = True, memory: int | None = None, at: float = 0.0) -> Grant:
    return Grant(uid, user, unit, granted_at=at, expires_at=None, last_active=at, shared=shared, memory=memory)


def test_sharers_promises_are_summed_and_the_rest_is_left_in_the_order_granted():
    held = [grant("bob", 1002, memory=40 * GiB, at=2.0), grant("alice", 1001, memory=30 * GiB, at=1.0),
            grant("carol", 1003, unit=1, shared=False, memory=40 * GiB)]
    assert fractions(gpu(0), held) == {
        "fractions": [{"user": "alice", "uid": 1001, "memory": 30 * GiB}, {"user": "bob", "uid": 1002, "memory": 40 * GiB}],
        "memory_promised": 70 * GiB, "memory_left": 10 * GiB}
    # a whole grant shows as before, with nothing left to promise; a free GPU has all its memory left
    assert fractions(gpu(1), held) == {"fractions": [], "memory_promised": 0, "memory_left": 0}
    assert fractions(gpu(2), held) == {"fractions": [], "memory_promised": 0, "memory_left": 80 * GiB}


def test_an_unknown_promise_leaves_the_memory_left_unknown_and_overpromising_leaves_none():
    assert fractions(gpu(0), [grant("alice", 1001, memory=30 * GiB), grant("bob", 1002)])["memory_left"] is None
    assert fractions(gpu(0), [grant("alice", 1001, memory=50 * GiB), grant("bob", 1002, memory=40 * GiB)]) == {
        "fractions": [{"user": "alice", "uid": 1001, "memory": 50 * GiB}, {"user": "bob", "uid": 1002, "memory": 40 * GiB}],
        "memory_promised": 90 * GiB, "memory_left": 0}


def test_the_grid_cell_counts_fractions_and_hides_names_it_may_not_show():
    def sharer(user: str, uid: int, memory: int) -> dict:
        return {"user": user, "uid": uid, "shared": True, "memory": memory, "origin": "request", "granted_at": 0.0,
                "expires_at": None, "last_active": 0.0, "gpu_memory": 80 * GiB, "memory_limit": memory,
                "memory_used": 35 * GiB}

    status = {"minor": 0, "label": "0", "name": "NVIDIA H100 80GB HBM3", "memory_total": 80 * GiB, "memory_used": 0,
              "utilization": 0, "process_list": [], "holders": [sharer("alice", 1001, 30 * GiB), sharer("bob", 1002, 40 * GiB)],
              "memory_promised": 70 * GiB, "memory_left": 10 * GiB}
    c = views.cell("gpu1", status, 100.0, views.Viewer("alice"), show_users=False)
    assert (c.fractions, c.memory_promised, c.memory_left, c.state) == (2, 70 * GiB, 10 * GiB, "over")  # alice: 35 > 30
    html = grid([views.Server("gpu1", (c,), None, {"over": 1})], 100.0)
    assert "2 fractions: 70GiB promised, 10GiB left" in html and "35GiB of 30GiB fraction OVER" in html
    assert "bob" not in html and "35GiB of 40GiB fraction;" in html  # bob's name hidden, his fraction shown
