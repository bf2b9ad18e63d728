"""The History page and the usage tables' orders, without a browser: the daemon's `use_history`
reply as the views read it, the lines the charts draw, who sees which series, and the sort links
(the real daemon, its samples and a browser: tests/system/test_web_history.py)."""
from __future__ import annotations

import re

from test_web_app import Canned, log_in, run

from gpuguard.web import views
from gpuguard.web.svg import _line, line_points, trend_chart
from gpuguard.web.views import Usage, Viewer

GiB = 1 << 30
START = 1_767_225_600.0


def reply(points: int = 6) -> dict:
    """GPU 0 busy in the middle, GPU 1 not sampled at first; alice and bob on GPU 0."""
    half = points // 2
    return {"ok": True, "span": "hour", "step": 60, "start": START, "ticks": [0] + [6] * (points - 1),
            "gpus": [{"minor": 0, "label": "0", "name": "H100", "memory_total": 80 * GiB,
                      "util": [None] + [100.0] * (half - 1) + [0.0] * half, "util_peak": [None] + [100.0] * (points - 1),
                      "memory": [None] + [40 * GiB] * (points - 1), "memory_peak": [None] + [40 * GiB] * (points - 1)},
                     {"minor": 10, "label": "10", "name": "H100", "memory_total": 80 * GiB,
                      "util": [None] * points, "util_peak": [None] * points,
                      "memory": [None] * points, "memory_peak": [None] * points}],
            "users": [{"uid": 1001, "user": "alice", "util": [None] + [150.0] * (points - 1),
                       "util_peak": [None] + [200.0] * (points - 1), "memory": [None] + [3 * GiB] * (points - 1),
                       "memory_peak": [None] + [4 * GiB] * (points - 1)},
                      {"uid": 1002, "user": "bob", "util": [None] + [10.0] * (points - 1),
                       "util_peak": [None] + [10.0] * (points - 1), "memory": [None] + [GiB] * (points - 1),
                       "memory_peak": [None] + [GiB] * (points - 1)}]}


def test_the_views_weigh_buckets_by_their_samples_and_show_users_only_to_themselves_or_admins():
    gpus, users = views.trends({"gpu1": reply()}, Viewer("bob"))
    assert [g.title for g in gpus] == ["GPU 0", "GPU 10"] and [u.key for u in users] == ["bob"]
    gpu = gpus[0]
    assert gpu.util == 40.0 and gpu.util_peak == 100.0 and gpu.memory == 40 * GiB  # 2 of 5 buckets at 100
    assert gpu.latest == (0.0, 40 * GiB) and gpus[1].latest is None and gpus[1].util is None
    _, everyone = views.trends({"gpu1": reply()}, Viewer("carol", admin=True))
    assert [u.key for u in views.sorted_trends(everyone, "util")] == ["alice", "bob"]
    assert [g.key for g in views.sorted_trends(gpus, "name")] == ["0", "10"]
    assert [g.key for g in views.sorted_trends(gpus, "util")] == ["0", "10"]  # unknown last
    gpus, users = views.trends({"gpu1": reply(), "gpu2": reply()}, Viewer("alice"))
    assert [g.title for g in gpus][:2] == ["gpu1 GPU 0", "gpu1 GPU 10"] and [u.title for u in users] == [
        "gpu1 alice", "gpu2 alice"]


def test_a_line_breaks_where_nothing_is_known_and_a_level_stretch_is_its_two_ends():
    assert _line([None, 1.0, 1.0, 1.0, 0.5, None, 0.25], 1.0) == "M1 0h2l1 50M6 75h0"
    assert _line([0.0] * 100, 100.0) == "M0 100h99"
    assert _line([0.1, 0.2, 0.1, 0.1, 0.1, 0.3], 1.0) == "M0 90l1-10 1 10h2l1-20"
    assert [_line([v], 100.0) for v in (35.5, 36.5, 69.99)] == ["M0 64h0", "M0 64h0", "M0 30h0"]  # as f"{v:.0f}" rounds
    values = [None, 0.5, 0.5, 0.25, None, None, 0.75, 0.75, 0.75, 1.0]
    assert line_points(_line(values, 1.0)) == {1: 50, 2: 50, 3: 75, 6: 25, 7: 25, 8: 25, 9: 0}
    gpus, users = views.trends({"gpu1": reply()}, Viewer("alice", admin=True))
    chart = trend_chart(gpus[0], "GPU 0")
    assert 'viewBox="0 0 5 100"' in chart and 'class="util" d="M1 0h1l1 100h2"' in chart
    assert 'class="mem" d="M1 50h4"' in chart  # 40 of 80 GiB
    alice = next(u for u in users if u.key == "alice")
    assert 'class="util" d="M1 25h4"' in trend_chart(alice, "alice")  # 150% of a 200% scale (her peak)


class WithHistory(Canned):
    async def use_history(self, span):
        self.calls.append(("use_history", span))
        return {"gpu1": reply()}


def history_run(scenario):
    def patched(client, source):
        source.__class__ = WithHistory
        return scenario(client, source)
    run(patched)


def test_the_page_draws_every_gpu_and_the_viewer_s_own_series_with_the_numbers_as_text():
    async def scenario(client, source):
        assert (await client.get("/history", allow_redirects=False)).status == 303  # signed in only
        await log_in(client, "bob")
        page = await (await client.get("/history?span=hour")).text()
        assert page.count('<figure class="trend"') == 3  # two GPUs, and bob
        assert 'data-kind="user" data-key="bob"' in page and "alice" not in page
        assert 'aria-labelledby="trend-0"' in page and re.search(
            '<figcaption id="trend-0"><b><a [^>]+>GPU 0</a></b> <small>H100</small><br><span class="words">utilisation '
            r'40% \(peak 100%\), memory 40GiB \(peak 40GiB\) of 80GiB; now 0%, 40GiB</span>', page)
        assert re.search(r"<th scope=row><a [^>]+>GPU 10</a></th><td>unknown</td>", page)
        one = await client.get("/history?span=hour&server=gpu1&gpu=0")
        text = await one.text()
        assert one.status == 200 and text.count("<tr><th scope=row>") == 6 and "not sampled" in text
        assert (await client.get("/history?span=hour&server=gpu1&user=alice")).status == 404  # not hers to see
        assert (await client.get("/history?span=year")).status == 400
        await (await client.get("/history?span=hour")).text()
        assert source.calls.count(("use_history", "hour")) == 1  # kept for every viewer a moment
    history_run(scenario)


def test_an_admin_sorts_the_users_table_by_any_column():
    async def scenario(client, source):
        await log_in(client, "root2")
        page = await (await client.get("/history?span=hour&usort=name")).text()
        users = page.split("<h2>Users</h2>")[1]
        assert users.index(">alice</a></th>") < users.index(">bob</a></th>")
        assert '<th scope=col aria-sort="ascending"><a href="/history?span=hour&amp;usort=name&amp;sort=name">name' in users
        page = await (await client.get("/history?span=hour&usort=memory")).text()
        users = page.split("<h2>Users</h2>")[1]
        assert users.index(">alice</a></th>") < users.index(">bob</a></th>")
    history_run(scenario)


def test_usage_sorts_by_hours_busy_share_or_name_and_each_order_is_a_link():
    rows = [Usage("GPU 10", 5.0, 1.0, 4.0), Usage("GPU 2", 3.0, 3.0, 0.0), Usage("GPU 3", 4.0, None, None)]
    assert [r.label for r in views.sorted_usage(rows, "granted")] == ["GPU 10", "GPU 3", "GPU 2"]
    assert [r.label for r in views.sorted_usage(rows, "busy")] == ["GPU 2", "GPU 10", "GPU 3"]
    assert [r.label for r in views.sorted_usage(rows, "share")] == ["GPU 2", "GPU 10", "GPU 3"]
    assert [r.label for r in views.sorted_usage(rows, "name")] == ["GPU 2", "GPU 3", "GPU 10"]

    async def scenario(client, source):
        await log_in(client, "bob")
        page = await (await client.get("/usage?sort=busy")).text()
        assert '<p class="order">Order: <a href="/usage?since=' in page and "<b aria-current=true>most busy</b>" in page
        assert '<details class="numbers" open>' in page and 'aria-sort="descending"><a href=' in page
        assert (await client.get("/usage?sort=nonsense")).status == 400
    run(scenario)
