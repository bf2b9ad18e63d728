"""The web view's data layer: grid states, names hidden, queue reasons, usage rows and CSV, the
SVG's escaping (pure: status replies in, views out; no browser, no daemon)."""
from __future__ import annotations

import csv
import datetime
import io

from gpuguard.web import views
from gpuguard.web.pages import grid, h, me_page, queue_table
from gpuguard.web.svg import usage_chart

NOW = 1_800_000_000.0
GiB = 1 << 30
ALICE, BOB = views.Viewer("alice"), views.Viewer("bob")


def gpu(minor=0, holders=(), processes=(), **extra):
    return {"minor": minor, "label": str(minor), "profile": None, "name": "NVIDIA H100 80GB HBM3",
            "memory_total": 80 * GiB, "memory_used": sum(p["memory"] for p in processes),
            "utilization": 50, "holders": list(holders), "process_list": list(processes), **extra}


def holder(user="alice", uid=1001, quota=20 * GiB, used=0, granted=NOW - 3600, last_active=None, expires=None):
    return {"user": user, "uid": uid, "shared": False, "origin": "session", "granted_at": granted,
            "expires_at": expires, "last_active": last_active if last_active is not None else granted,
            "gpu_memory": quota, "memory_limit": quota, "memory_used": used}


def process(uid=1001, user="alice", memory=GiB, command="python"):
    return {"pid": 4242, "uid": uid, "user": user, "memory": memory, "command": command}


def state(g, viewer=ALICE, show_users=True):
    return views.cell("gpu1", g, NOW, viewer, show_users)


def test_states_in_the_order_they_win():
    busy = [process()]
    assert state(gpu()).state == "free"
    assert state(gpu(holders=[holder(used=GiB)], processes=busy)).state == "held"
    over = state(gpu(holders=[holder(used=30 * GiB)], processes=[process(memory=30 * GiB)]))
    assert (over.state, over.holders[0].over) == ("over", True)
    idle = state(gpu(holders=[holder(last_active=NOW - 2 * 3600)]))
    assert idle.state == "idle" and idle.words == "held, idle 2h00m"
    assert state(gpu(holders=[holder(last_active=NOW - 60)])).state == "held"  # idle for less than IDLE_SHOWN
    assert state(gpu(holders=[holder(last_active=NOW - 7200)], drained=True)).state == "drained"
    slurm = state(gpu(owner="slurm", holders=[holder()]))
    assert (slurm.state, slurm.words) == ("other", "owned by slurm")
    assert state(gpu(owner="gpuguard")).state == "free"


def test_an_unread_gpu_is_never_idle():
    unread = gpu(holders=[holder(last_active=NOW - 86400)])
    unread["process_list"] = None
    c = state(unread)
    assert c.state == "held" and c.processes is None and c.holders[0].idle_for is None


def test_time_left_and_a_slice_without_quota():
    c = state(gpu(holders=[holder(quota=None, expires=NOW + 5400)], processes=[process()]))
    assert c.holders[0].time_left == 5400 and not c.holders[0].over
    mig = state({**gpu(), "label": "0/gi7/ci0", "profile": "1g.18gb"})
    assert (mig.label, mig.profile) == ("0/gi7/ci0", "1g.18gb")


def test_hidden_names_everywhere_but_ones_own_and_for_admins():
    g = gpu(holders=[holder("bob", 1002, used=GiB)], processes=[process(1002, "bob")])
    hidden = state(g, ALICE, show_users=False)
    assert hidden.holders[0].user == views.HIDDEN and hidden.processes[0].user == views.HIDDEN
    assert state(g, BOB, show_users=False).holders[0].user == "bob"
    assert state(g, views.Viewer("carol", admin=True), show_users=False).holders[0].user == "bob"
    assert state(g, views.Viewer(), show_users=False).holders[0].user == views.HIDDEN
    assert state(g, views.Viewer(), show_users=True).holders[0].user == "bob"
    html = grid([views.server_view("gpu1", {"gpus": [g]}, None, NOW, ALICE, False)], NOW)
    assert "bob" not in html


def test_a_server_not_read_says_why():
    server = views.server_view("gpu2", None, "daemon not reachable", NOW, ALICE, True)
    assert server.cells == () and server.error == "not read: daemon not reachable"
    assert "not read: daemon not reachable" in grid([server], NOW)


def test_queue_reasons_from_whoami():
    status = {"gpus": [gpu(holders=[holder()])], "queue": [
        {"position": 1, "user": "bob", "gpus": 2, "since": NOW - 600, "priority": 0},
        {"position": 2, "user": "carol", "gpus": 1, "since": NOW - 60, "priority": 0}]}
    standings = {"bob": {"ahead": [], "estimate": NOW + 900},
                 "carol": {"ahead": [{"user": "bob", "why": "asked first"}], "estimate": None}}
    first, second = views.queue_rows("gpu1", status, standings, ALICE, True)
    assert first.why == "first in line: wants 2 GPUs, 0 free" and first.estimate == NOW + 900
    assert second.why == "behind bob: asked first"
    hidden = views.queue_rows("gpu1", status, standings, ALICE, False)
    assert [r.user for r in hidden] == [views.HIDDEN, views.HIDDEN]
    assert hidden[1].why == f"behind {views.HIDDEN}: asked first"


def report(*rows):
    total = {"key": "total", **{k: sum(r[k] for r in rows) for k in ("granted_seconds", "busy_seconds", "idle_seconds")}}
    return {"rows": list(rows), "total": total}


def usage(key, granted, busy):
    return {"key": key, "granted_seconds": granted * 3600.0, "busy_seconds": busy * 3600.0,
            "idle_seconds": (granted - busy) * 3600.0, "kills": {}}


def test_usage_rows_per_user_gpu_server_and_day_and_the_csv():
    reports = {"gpu1": report(usage("alice", 10, 8), usage("=cmd()", 4, 1)),
               "gpu2": report(usage("alice", 2, 2))}
    by_user = views.usage_rows("user", reports, views.Viewer("root", admin=True), False)
    assert [(u.label, u.granted_hours, u.busy_hours) for u in by_user] == [("alice", 12, 10), ("=cmd()", 4, 1)]
    assert by_user[0].busy_share == 10 / 12
    by_server = views.usage_rows("server", reports, ALICE, True)
    assert [(u.label, u.granted_hours) for u in by_server] == [("gpu1", 14), ("gpu2", 2)]
    hidden = views.usage_rows("user", reports, ALICE, False)
    assert [u.label for u in hidden] == ["alice", views.HIDDEN]
    gpus = views.usage_rows("gpu", {"gpu1": report(usage(3, 1, 1))}, ALICE, True)
    assert [u.label for u in gpus] == ["GPU 3"]
    table = list(csv.reader(io.StringIO(views.usage_csv([("user", by_user)]))))
    assert table[0] == list(views.CSV_COLUMNS)
    assert table[1] == ["user", "alice", "12.000", "10.000", "2.000", "0.833"]
    assert table[2][1] == "'=cmd()"  # a spreadsheet does not run it


def test_hostile_strings_are_text_in_every_page_part():
    evil = "<script>alert(1)</script>\"'&"
    g = gpu(holders=[holder(evil)], processes=[process(command=evil, user=evil)])
    html = grid([views.server_view(evil, {"gpus": [g]}, None, NOW, views.Viewer(), True)], NOW)
    assert "<script>" not in html and h(evil) in html
    chart = usage_chart(evil, [views.Usage(evil, 1.0, 0.5, 0.5)])
    assert "<script>" not in chart and chart.count(h(evil)) >= 2
    whoami = {"user": evil, "uid": 1, "member": True, "group": "g", "exempt": False,
              "quota": {"gpus": 1, "gpu_memory": None, "max_time": None},
              "grants": [], "sessions": [{"opened_at": NOW, "service": evil, "tty": evil, "rhost": evil}],
              "events": [{"time": NOW, "kind": "grant", "rule": evil, "minor": 0, "message": evil}], "queue": None}
    page = me_page(evil, {evil: whoami}, ALICE, True, own=False, standings={evil: None})
    assert "<script>" not in page and page.count(h(evil)) >= 6


def fairshare_reply(*users):
    """A `fairshare` reply as the daemon sends it: (name, decayed GPU-seconds, share, priority)."""
    rows = [{"user": name, "uid": 1000 + i, "usage": usage, "share": share, "priority": priority,
             "normalized": usage / share} for i, (name, usage, share, priority) in enumerate(users)]
    rows.sort(key=lambda u: (-u["priority"], u["normalized"], u["user"]))
    return {"ok": True, "users": rows, "half_life": 7 * 86400.0, "now": NOW}


def test_fair_share_ranks_by_priority_then_usage_per_share():
    reply = fairshare_reply(("alice", 7200.0, 2.0, 0), ("bob", 1800.0, 1.0, 0), ("carol", 36000.0, 1.0, 5),
                            ("dave", 90000.0, 1.0, 0))
    alice = views.fair_share("alice", None, reply)
    # carol's priority puts her first whatever her usage; bob's 0.5 h per share beats alice's 1.0.
    assert alice == views.FairShare(2.0, 2.0, 0, 3, 4, 7 * 86400.0) and alice.per_share == 1.0
    assert views.fair_share("carol", None, reply).rank == 1
    assert views.fair_share("dave", None, reply).rank == 4


def test_fair_share_of_a_user_without_recent_usage_and_of_no_source():
    reply = fairshare_reply(("bob", 1800.0, 1.0, 0), ("carol", 0.0, 1.0, 0))
    erin = views.fair_share("erin", {"share": 1.0, "priority": 0}, reply)
    assert (erin.hours, erin.rank, erin.of) == (0.0, 2, 3)  # carol's name breaks the tie, as the queue's does
    assert views.fair_share("erin", {"share": 1.0, "priority": 1}, reply).rank == 1
    assert views.fair_share("erin", None, reply) is None  # no quota known: no share to rank by
    assert views.fair_share("alice", {"share": 1.0, "priority": 0}, None) is None


def test_me_page_fair_share_block_names_no_one_else():
    whoami = {"user": "alice", "uid": 1, "member": True, "group": "g", "exempt": False, "quota": None,
              "grants": [], "sessions": [], "events": [], "queue": None}
    reply = fairshare_reply(("alice", 3 * 3600.0, 1.5, 0), ("bob", 1800.0, 1.0, 0), ("carol", 99.0, 1.0, 0))
    standing = views.fair_share("alice", None, reply)
    page = me_page("alice", {"gpu1": whoami, "gpu2": whoami}, ALICE, False, own=True,
                   standings={"gpu1": standing, "gpu2": None})
    assert "Recent use <span class=\"hours\">3.00</span> GPU-hours, share <span class=\"share\">1.5</span>" in page
    assert '<span class="rank">3rd of 3</span> by usage per share (2.00); a lower rank is served first.' in page
    assert "half every 7d00h" in page and "the more you used lately, the later you go" in page
    assert "Not available from this source." in page  # gpu2: the fleet database knows no fair share
    assert "bob" not in page and "carol" not in page


def test_ordinals():
    assert [views.ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 112)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "112th"]


def test_durations():
    assert [views.duration(s) for s in (5, 600, 3 * 3600 + 420, 2 * 86400 + 3 * 3600)] == ["5s", "10m", "3h07m", "2d03h"]


def test_an_old_sample_is_said_with_its_age_and_a_fresh_one_is_not():
    viewer = views.Viewer()
    old = views.server_view("gpu1", {"gpus": [gpu()], "sampled_at": NOW - 45.4}, None, NOW, viewer, True)
    fresh = views.server_view("gpu1", {"gpus": [gpu()], "sampled_at": NOW - 2}, None, NOW, viewer, True)
    assert round(old.age, 3) == 45.4
    assert "The GPUs of gpu1 were last read 45 s ago" in grid([old], NOW)
    assert "stale-banner" not in grid([fresh], NOW)


def test_a_queue_not_read_is_not_said_to_be_empty():
    assert queue_table([], ["gpu1: not read: gpuguard daemon not reachable"]) == \
        '<p class="error">gpu1: not read: gpuguard daemon not reachable</p>'
    assert "Nobody waits" in queue_table([], [])


def test_the_by_day_chart_ends_at_the_periods_end_in_weeks_past_its_limit():
    days = [views.Usage("2025-12-08", 2.0, 1.0, 1.0), views.Usage("2026-12-05", 4.0, 1.0, 3.0)]
    short = views.by_period(days, datetime.date(2026, 11, 6), datetime.date(2026, 12, 6))
    assert len(short) == 31 and short[-1] == views.Usage("2026-12-06", 0.0, 0.0, 0.0)
    assert short[-2].granted_hours == 4.0
    year = views.by_period(days, datetime.date(2025, 12, 7), datetime.date(2026, 12, 6))
    assert len(year) == 53 and year[0].label == "week of 2025-12-01" and year[-1].label == "week of 2026-11-30"
    assert year[1].granted_hours == 2.0 and year[-1].granted_hours == 4.0  # the most recent week kept
    chart = usage_chart("by day", year)
    assert "week of 2026-11-30" in chart and "4.0 h, 25% busy" in chart


def test_a_chart_past_its_bar_limit_keeps_the_largest_and_says_so():
    users = views.largest_first(views.Usage(f"user{i:03}", float(i), None, None) for i in range(250))
    chart = usage_chart("by user", users)
    assert users[0].label == "user249" and ">user249<" in chart.split("<details")[0]
    assert ">user000<" not in chart.split("<details")[0] and "The 200 largest of 250" in chart
    assert "user000" in chart.split("<details")[1]  # in the numbers
