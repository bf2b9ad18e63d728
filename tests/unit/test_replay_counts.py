"""What the replay counts (every job, censored waits, contention, work lost) and the trace formats
of batch clusters (open sessions, exact times, sacct, the heavy-tailed generator)."""
from __future__ import annotations

import io
import math
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from gpuguard import config as configuration
from gpuguard.replay import engine, trace

REPO = Path(__file__).resolve().parents[2]

HEADER = ",".join(trace.HEADER)
GIB = 1 << 30


def policy(scheduler: dict | None = None, **quota) -> configuration.Config:
    base = configuration.Config()
    return replace(base, defaults=replace(base.defaults, gpus=8, **quota),
                   scheduler=replace(base.scheduler, **(scheduler or {})))


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text("\n".join([HEADER, *lines]) + "\n")
    return path


def test_a_job_dropped_with_its_session_counts_with_its_censored_wait(tmp_path):
    path = write(tmp_path, "a,0,1000,0,900,1,0", "b,10,400,10,100,1,0")  # b leaves at 400, never served
    summary = engine.replay(trace.read(path), policy(), 1).summary(1)
    assert summary["jobs"] == 2 and summary["jobs_ran"] == 1 and summary["jobs_dropped"] == 1
    assert summary["censored_wait_p95"] == 390.0 and summary["wait_max"] == 390.0
    assert summary["ran_wait_max"] == 0.0  # only a ran, at once
    assert summary["user_wait_p95_worst"] == 390.0 and summary["user_wait_p95_median"] == 0.0
    # b's slowdown counts its wait and the whole run it never had: (390 + 100) / 100
    assert summary["slowdown_worst_user"] == pytest.approx(4.9)


def test_a_grant_idle_since_its_job_ended_is_released_idle_timeout_after_the_end(tmp_path):
    # a's job ends at 1000 with its session open until 5000; b's login at 1500 makes the watcher
    # check in between: it must record a's GPU as last active at the job's end, not at 1500
    path = write(tmp_path, "a,0,5000,0,1000,1,0", "b,1500,1600,1500,50,1,0")
    result = engine.replay(trace.read(path), policy(idle_timeout=600.0), 2)
    assert result.per_user["a"][0] == 1000.0 + 600.0


def test_an_open_session_lasts_until_its_last_job_has_run(tmp_path):
    path = write(tmp_path, "a,0,,0,900,1,0", "b,10,,10,100,1,0")
    summary = engine.replay(trace.read(path), policy(), 1).summary(1)
    assert summary["jobs_ran"] == 2 and summary["jobs_never_ran"] == 0
    assert summary["wait_max"] == 890.0  # a's session ends with its job, and its grant with it
    static = engine.static_reservation(trace.read(path), 1).summary(1)
    assert static["wait_max"] == 890.0 and static["gpu_seconds_granted"] == 1000.0


def test_a_batch_job_gives_its_gpus_back_as_it_ends_though_its_user_runs_others(tmp_path):
    # a runs two batch jobs, one on each GPU; b's job waits. a's short job ends at 100 while its long
    # one runs (a stays logged in): b has that GPU at once, as under static reservation, not once
    # reclaim_after (10 minutes) has passed.
    path = write(tmp_path, "a,0,,0,100,1,0", "a,0,,0,1000,1,0", "b,10,,10,50,1,0")
    result = engine.replay(trace.read(path), policy(), 2)
    summary = result.summary(2)
    assert summary["jobs_ran"] == 3 and summary["wait_max"] == 90.0
    assert summary["wait_max"] == engine.static_reservation(trace.read(path), 2).summary(2)["wait_max"]
    assert result.reclaims == 0
    assert result.per_user["a"][0] == 100.0 + 1000.0  # each job's GPU granted for its run only


def test_sharers_slow_each_other_and_the_gpu_counts_busy_once(tmp_path):
    # Two sharers of 40 GiB on one 80 GiB GPU, each job 100 s alone: together from 0 they take 200 s.
    path = write(tmp_path, f"a,0,1000,0,100,1,{GIB}", f"b,0,1000,0,100,1,{GIB}")
    summary = engine.replay(trace.read(path), policy(sharing=True, gpu_memory=40 * GIB), 1).summary(1)
    assert summary["jobs_ran"] == 2 and summary["wait_max"] == 0.0 and summary["most_sharers"] == 2
    assert summary["stretch_p95"] == 2.0
    assert summary["gpu_seconds_busy"] == 200.0 and summary["gpu_seconds_shared"] == 200.0  # not 400
    # b joins half-way: a has 50 s of work left, both at half pace until a ends at 150, b alone after.
    later = write(tmp_path, f"a,0,1000,0,100,1,{GIB}", f"b,50,1000,50,100,1,{GIB}")
    summary = engine.replay(trace.read(later), policy(sharing=True, gpu_memory=40 * GIB), 1).summary(1)
    assert summary["gpu_seconds_busy"] == 200.0 and summary["gpu_seconds_shared"] == 100.0
    assert summary["stretch_mean"] == pytest.approx((150 / 100 + 150 / 100) / 2)


def test_the_replayed_pool_never_oversubscribes_memory(tmp_path):
    lines = [f"u{i},0,10000,0,1000,1,{GIB}" for i in range(6)]
    summary = engine.replay(trace.read(write(tmp_path, *lines)), policy(sharing=True, gpu_memory=40 * GIB,
                                                                          max_sharers=8), 1).summary(1)
    assert summary["most_sharers"] == 2 and summary["jobs_ran"] == 6
    assert summary["gpu_seconds_busy"] <= summary["gpu_seconds_granted"]


def test_work_thrown_away_by_a_stop_is_counted(tmp_path):
    # a's 1-hour grant runs out at 3600 with b waiting: its 10-hour job is stopped, an hour's work lost.
    path = write(tmp_path, "a,0,,0,36000,1,0", "b,100,,100,100,1,0")
    summary = engine.replay(trace.read(path), policy({"soft_max_time": True}, max_time=3600.0), 1).summary(1)
    assert summary["kills"] == 1 and summary["revokes"] == 1
    assert summary["gpu_seconds_lost"] == pytest.approx(3600.0, abs=2 * configuration.Config().watcher.interval)
    assert summary["lost_of_demanded"] == pytest.approx(3600 / 36100, rel=0.01)


def test_times_are_written_exactly():
    long = trace.Session("a", 1_234_567.0, None, (trace.Job(1_234_567.25, 2_000_003.0, 8, 0),))
    out = io.StringIO()
    trace.write_csv([long], out)
    assert out.getvalue().splitlines()[1] == "a,1234567,,1234567.25,2000003,8,0"
    assert trace.exact(0.1) == "0.1" and float(trace.exact(1 / 3)) == 1 / 3


def test_a_session_end_that_is_empty_is_open_and_round_trips(tmp_path):
    sessions = list(trace.generate_batch(40, users=5, seed=2, days=1))
    out = io.StringIO()
    trace.write_csv(sessions, out)
    assert list(trace.read(write(tmp_path, *out.getvalue().splitlines()[1:]))) == sessions
    assert all(s.end is None for s in sessions)



def test_two_jobs_one_user_submitted_in_the_same_second_stay_two_jobs(tmp_path):
    # a job array: u's two jobs at 100, with v's between them and after; each open line is its own session
    path = write(tmp_path, "u,100,,100,50,1,0", "v,100,,100,50,1,0", "u,100,,100,50,1,0", "u,100,,100,70,4,0")
    sessions = list(trace.read(path))
    assert [(s.user, len(s.jobs)) for s in sessions] == [("u", 1), ("v", 1), ("u", 1), ("u", 1)]
    out = io.StringIO()
    trace.write_csv(sessions, out)
    assert list(trace.read(write(tmp_path, *out.getvalue().splitlines()[1:]))) == sessions
    # static reservation runs u's 4-GPU job beside the 1-GPU ones, not on the same session's GPUs
    assert engine.static_reservation(sessions, 4).waits == [0.0, 0.0, 0.0, 50.0]
    # a dense generated month repeats user and second often (here 31,000 jobs in 13 days would)
    dense = list(trace.generate_batch(3000, users=60, seed=1, days=0.5))
    assert len({(s.user, s.start) for s in dense}) < len(dense)
    out = io.StringIO()
    trace.write_csv(dense, out)
    assert list(trace.read(write(tmp_path, *out.getvalue().splitlines()[1:]))) == dense


def test_a_closed_sessions_lines_together_are_one_session_and_apart_two(tmp_path):
    path = write(tmp_path, "u,100,900,100,50,1,0", "u,100,900,200,50,1,0", "v,100,900,100,50,1,0")
    assert [(s.user, len(s.jobs)) for s in trace.read(path)] == [("u", 2), ("v", 1)]
    # the same user, start and end after another session's lines: two logins in the same second
    path = write(tmp_path, "u,100,900,100,50,1,0", "v,100,900,100,50,1,0", "u,100,900,200,50,1,0")
    assert [(s.user, len(s.jobs)) for s in trace.read(path)] == [("u", 1), ("v", 1), ("u", 1)]
    # out of order is still refused, on one line
    with pytest.raises(trace.TraceError, match="line 3: sessions must come in order of session_start"):
        list(trace.read(write(tmp_path, "u,100,900,100,50,1,0", "v,50,900,100,50,1,0")))


def test_a_job_bigger_than_the_pool_never_runs_and_holds_nobody_up(tmp_path):
    # 8 GPUs asked of 4 (the quota allows 8): refused as gpuguard request refuses it, and counted so;
    # the jobs after it run, as under static reservation
    path = write(tmp_path, "a,0,,0,100,8,0", "b,10,,10,100,1,0", "c,4000,,4000,100,2,0")
    ours = engine.replay(trace.read(path), policy(), 4).summary(4)
    static = engine.static_reservation(trace.read(path), 4).summary(4)
    for summary in (ours, static):
        assert (summary["jobs_ran"], summary["jobs_over_quota"], summary["jobs_dropped"]) == (2, 1, 0)


def test_a_gpu_a_waiting_job_counted_on_and_lost_to_reclaim_is_waited_for_again(tmp_path):
    # a's second job (2 GPUs, at 105) counts on the GPU her first left idle and waits for 1 more
    # (b holds the other until 1000). Alone in the queue, she keeps that idle GPU: taking it back
    # would only make her wait for it again. c comes at 106 for 1 GPU: reclaim takes it for him
    # at 110 (idle 10 s), and her job waits for 2 again, and runs on 2 from 1000, not on 1 from
    # 110 (as it once did, short).
    lines = ("b,0,,0,1000,1,0", "a,0,5000,0,100,1,0", "a,0,5000,105,200,2,0")
    alone = engine.replay(trace.read(write(tmp_path, *lines)), policy(reclaim_after=10.0), 2)
    assert sorted(alone.waits) == [0.0, 0.0, 895.0] and alone.reclaims == 0
    assert alone.busy == 1000 + 100 + 2 * 200
    result = engine.replay(trace.read(write(tmp_path, *lines, "c,106,,106,50,1,0")), policy(reclaim_after=10.0), 2)
    assert sorted(result.waits) == [0.0, 0.0, 4.0, 895.0]
    assert result.busy == 1000 + 100 + 2 * 200 + 50
    assert result.reclaims == 1


SACCT = """JobID|User|Submit|Start|End|AllocTRES
100|alice|2024-03-01T09:00:00|2024-03-01T09:10:00|2024-03-01T10:10:00|billing=8,cpu=8,gres/gpu=2,mem=64G,node=1
100.batch||2024-03-01T09:10:00|2024-03-01T09:10:00|2024-03-01T10:10:00|cpu=8,gres/gpu=2,mem=64G,node=1
101|bob|2024-03-01T08:00:00|2024-03-01T08:00:05|2024-03-01T08:30:05|cpu=4,gres/gpu:a100=4,mem=32G,node=1
102|carol|2024-03-01T09:30:00|Unknown|Unknown|cpu=4,gres/gpu=1
103|dave|2024-03-01T09:40:00|2024-03-01T09:41:00|2024-03-01T09:50:00|cpu=4,mem=8G,node=1
104|erin|2024-03-01T09:45:00|None|2024-03-01T09:46:00|cpu=4,gres/gpu=1
105|fay|2024-03-01T09:50:00|2024-03-01T09:50:00|2024-03-01T10:50:00|billing=54,cpu=16,gres/gpu:a100=4,gres/gpu=4,mem=208G,node=1
106|gus|2024-03-01T09:55:00|2024-03-01T09:55:00|2024-03-01T10:55:00|cpu=8,gres/gpu:a100=2,gres/gpu:v100=1,gres/gpumem=80G
"""


def test_slurm_accounting_is_read_as_one_open_session_per_gpu_job(tmp_path):
    path = tmp_path / "sacct.txt"
    path.write_text(SACCT)
    sessions = list(trace.read(path))
    # bob's job (submitted first), then alice's, fay's, gus's; steps, jobs without GPUs and jobs that
    # never ran are left out
    assert [(s.user, s.end, len(s.jobs)) for s in sessions] == [("bob", None, 1), ("alice", None, 1),
                                                                 ("fay", None, 1), ("gus", None, 1)]
    bob, alice, fay, gus = sessions
    assert fay.jobs[0].gpus == 4  # Slurm writes the typed count and the untyped total: 4 GPUs, not 8
    assert gus.jobs[0].gpus == 3  # typed counts only (no total written): added up; gpumem is no GPU
    assert bob.jobs[0].gpus == 4 and bob.jobs[0].duration == 1800.0
    assert alice.jobs[0].gpus == 2 and alice.jobs[0].duration == 3600.0
    assert alice.start - bob.start == 3600.0 and alice.jobs[0].start == alice.start
    summary = engine.replay(trace.read(path), policy(), 4).summary(4)
    assert summary["jobs_ran"] == 4
    notes: Counter[str] = Counter()
    assert len(list(trace.read(path, notes))) == 4
    never = "jobs with GPUs left out: never started or still running (Start or End Unknown)"
    assert notes == {never: 2}  # carol's and erin's
    converted = subprocess.run([sys.executable, "-m", "gpuguard", "trace", "convert", str(path)], capture_output=True,
                               text=True, check=True)
    assert converted.stderr.splitlines() == ["gpuguard: 4 jobs written", f"gpuguard: trace read with changes: 2 {never}"]


def test_sacct_with_epoch_times_reads_exactly_across_a_clock_change(tmp_path):
    # SLURM_TIME_FORMAT=%s: 20 minutes that local times across the autumn change would read as -40
    # (and a blank line and a comment before the header, as a person saving it may leave them)
    path = tmp_path / "sacct.txt"
    path.write_text("\n# sacct -a -P -X on gpu1\nJobID|User|Submit|Start|End|AllocTRES\n"
                    "7|ann|1730594400|1730595000|1730596200|cpu=4,gres/gpu=2\n")
    (session,) = trace.read(path)
    assert (session.start, session.jobs[0].duration, session.jobs[0].gpus) == (1730594400.0, 1200.0, 2)


def test_sacct_fields_in_another_order_read_the_same(tmp_path):
    lines = [line.split("|") for line in SACCT.splitlines()]
    order = [5, 1, 3, 0, 4, 2]  # AllocTRES|User|Start|JobID|End|Submit
    (tmp_path / "a.txt").write_text(SACCT)
    (tmp_path / "b.txt").write_text("\n".join("|".join(cells[i] for i in order) for cells in lines) + "\n")
    assert list(trace.read(tmp_path / "b.txt")) == list(trace.read(tmp_path / "a.txt"))


def test_sacct_output_without_the_fields_is_refused_on_one_line(tmp_path):
    path = tmp_path / "sacct.txt"
    path.write_text("JobID|User|Start\n1|a|2024-03-01T09:00:00\n")
    with pytest.raises(trace.TraceError, match="without Submit, End, AllocTRES"):
        list(trace.read(path))
    # a name the daemon would refuse (a replay logs every user in) is named by its line, not a traceback
    path.write_text(SACCT.replace("|alice|", "|" + "a" * 257 + "|"))
    with pytest.raises(trace.TraceError, match="line 2: user name longer than 256 characters"):
        list(trace.read(path))


def test_the_batch_generator_is_heavy_tailed_and_zipf_skewed():
    sessions = list(trace.generate_batch(5000, users=60, seed=4))
    durations = sorted(s.jobs[0].duration for s in sessions)
    assert 300 <= durations[len(durations) // 2] <= 1200  # median: minutes
    assert 8 * 3600 <= durations[math.ceil(0.99 * len(durations)) - 1] <= 40 * 3600  # p99: hours
    gpus = [s.jobs[0].gpus for s in sessions]
    assert set(gpus) == {1, 4, 8} and gpus.count(1) > gpus.count(4) > gpus.count(8)
    by_user = sorted((sum(s.user == u for s in sessions) for u in {s.user for s in sessions}), reverse=True)
    assert by_user[0] > 10 * by_user[len(by_user) // 2]  # Zipf: the heaviest user far above the median one
    even = list(trace.generate_batch(600, users=60, seed=4, assign="round-robin"))
    assert {sum(s.user == u for s in even) for u in {s.user for s in even}} == {10}
    assert list(trace.generate_batch(50, seed=7)) == list(trace.generate_batch(50, seed=7))


def test_a_job_waiting_after_its_session_closed_leaves_with_its_users_last_session(tmp_path):
    # alice's first session closes at 300 with its job still waiting (her second one keeps the place);
    # her last session ends at 600: the job never ran, its wait censored there.
    path = write(tmp_path, "bob,0,,0,5000,1,0", "alice,10,300,10,100,1,0", "alice,20,600,20,100,1,0")
    summary = engine.replay(trace.read(path), policy(), 1).summary(1)
    assert summary["jobs_never_ran"] == 2 and summary["jobs_ran"] == 1
    assert sorted(engine.replay(trace.read(path), policy(), 1).censored) == [580.0, 590.0]


def test_the_watcher_checks_what_the_queue_wants_and_the_rules_times_not_what_ended_or_started(tmp_path, monkeypatch):
    """A batch of events that only took things away (a job's end, a logout and its release) is not
    checked: no rule acts the moment something ends. Nor is a request served at once with nobody
    waiting: its job is on its new GPU (no idle clock) and no rule acts on the process at once. A
    request that has to wait is (the queue's demand grew: reclaim may act). What is left is still
    acted on at its time."""
    from gpuguard.services.watcher import Watcher
    checked: list[float] = []
    real_check = Watcher.check

    async def check(self, sample, now):
        checked.append(now)
        return await real_check(self, sample, now)
    monkeypatch.setattr(Watcher, "check", check)
    # a's job ends at 100 (its session stays open until 5000); b takes the other GPU at 200 and
    # leaves at 250, when c, waiting since 210, gets b's GPU
    path = write(tmp_path, "a,0,5000,0,100,1,0", "b,200,,200,50,1,0", "c,210,,210,50,1,0")
    result = engine.replay(trace.read(path), policy(idle_timeout=600.0), 2)
    assert checked == [210.0, 700.0]  # c's wait, and a's idle release due at 100 + 600
    assert result.per_user["a"][0] == 700.0 and result.releases == 3  # a's idle GPU, b's and c's at logout
    assert result.waits == [0.0, 0.0, 40.0]


def without_shortcuts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay checks every job's arrival and start, and asks next_change over everything after
    a batch of job ends (as before its shortcuts)."""
    from gpuguard.core import rules
    from gpuguard.replay.watching import ReplayWatch
    monkeypatch.setattr(rules, "acts_on_arrival", lambda grant, quota, now: True)
    monkeypatch.setattr(ReplayWatch, "next_moment_of",
                        lambda self, slots, now: self.watcher.next_moment(self.watcher.sampler.last, now))
    arrive = engine.Replay._on_arrive

    async def checked_arrival(self: engine.Replay, payload: tuple) -> None:
        self._added = True
        await arrive(self, payload)
    monkeypatch.setattr(engine.Replay, "_on_arrive", checked_arrival)


@pytest.mark.parametrize("name", ["default", "exclusive", "shared", "timed"])
def test_the_replays_shortcuts_decide_as_a_check_after_every_event_would(name, monkeypatch):
    """The replay checks a job's start only where a rule may act on it at once (or a rule's moment
    has come), and after a batch of job ends adds only their GPUs' idle clocks. Held against a
    replay that checks at every start and asks next_change over everything after every batch: the
    same counts, waits and work lost, on batch jobs and on interactive sessions that queue, get
    reclaimed, revoked and stopped. (Not against a check after every batch: that would act
    between the watcher's ticks, where the replay, as the daemon, acts at the tick.)"""
    config = configuration.load(REPO / "bench" / f"scheduling-{name}.toml")
    traces = [(list(trace.generate_batch(600, users=12, seed=5)), 40), (list(trace.generate(300, users=10, seed=3)), 6)]
    shortcut = [engine.replay(sessions, config, gpus).summary(gpus) for sessions, gpus in traces]
    without_shortcuts(monkeypatch)
    every = [engine.replay(sessions, config, gpus).summary(gpus) for sessions, gpus in traces]
    assert shortcut == every
    assert all(s["reclaims"] + s["releases"] + s["revokes"] for s in every)  # the runs took GPUs back


def test_a_job_starting_once_a_rule_is_due_is_checked_as_every_start_would_be(tmp_path, monkeypatch):
    """a's and b's GPUs, idle since 101, may be reclaimed from 111 (the tick after: 112); c waits
    from 105. a's next job starts at 111 on its idle GPU and ends at 112. The start comes once a
    rule is due, so it is checked then, as a replay that checks every start does."""
    path = write(tmp_path, "a,0,5000,0,101,1,0", "a,0,5000,111,1,1,0", "b,0,5000,0,101,1,0", "c,105,,105,50,1,0")
    config = policy(reclaim_after=10.0)
    shortcut = engine.replay(trace.read(path), config, 2).summary(2)
    without_shortcuts(monkeypatch)
    assert engine.replay(trace.read(path), config, 2).summary(2) == shortcut
    assert shortcut["reclaims"] == 1 and shortcut["jobs_ran"] == 4


def test_between_rare_checks_the_watcher_remembers_only_the_jobs_still_running(tmp_path, monkeypatch):
    """With nobody waiting and no idle release a replay checks almost never; the processes it tells
    the watcher about are forgotten when they end, as a check would forget them, so what the
    watcher remembers stays as small as what runs (not every job of the month)."""
    from gpuguard.replay.watching import ReplayWatch
    sizes: list[int] = []
    real_ended = ReplayWatch.ended

    def ended(self, key, slots, now):
        real_ended(self, key, slots, now)
        state = self.watcher.state
        assert key not in state.running_since and all(state.seen[slot] == now for slot in slots)
        sizes.append(len(state.running_since))
    monkeypatch.setattr(ReplayWatch, "ended", ended)
    # 300 one-GPU jobs of 10 users, at most 3 running at once, on 8 GPUs: never a queue
    path = write(tmp_path, *(f"u{i % 10},{i * 50},,{i * 50},120,1,0" for i in range(300)))
    result = engine.replay(trace.read(path), policy(), 8)
    assert result.waits == [0.0] * 300 and len(sizes) == 300
    assert max(sizes) <= 2  # the two others still running when one ends


@pytest.mark.parametrize("lines, gpus", [
    # w's request at 150 waits (the 2 free GPUs are held for it, reserve_after 0) and d's job comes
    # at 161.5, once a's GPU (idle since 100) may be released: d's arrival is checked then
    (["a,0,5000,0,100,1,0", "x,0,,0,161.5,1,0", "y,0,5000,0,1000,2,0", "d,0,5000,161.5,10,1,0",
      "w,150,5000,150,100,2,0"], 4),
    # d asks for more than its quota at 161.5: still an arrival once a rule is due
    (["a,0,5000,0,100,1,0", "d,0,5000,161.5,10,9,0"], 2),
])
def test_an_arrival_once_a_rule_is_due_is_checked_as_every_arrival_would_be(tmp_path, monkeypatch, lines, gpus):
    config = policy({"reserve_after": 0.0}, idle_timeout=61.0)
    shortcut = engine.replay(trace.read(write(tmp_path, *lines)), config, gpus)
    without_shortcuts(monkeypatch)
    every = engine.replay(trace.read(write(tmp_path, *lines)), config, gpus)
    assert shortcut.summary(gpus) == every.summary(gpus)
    assert shortcut.per_user["a"][0] == 161.5  # a's idle GPU goes at the arrival, not at the tick after


def test_a_job_started_by_a_checks_action_has_its_work_counted_from_its_start(tmp_path, monkeypatch):
    """Soft time stops the over-time job that loses least work. At 1100, x waiting, the grants of
    u (since 0), k (since 0) and w (since 60) are over time: u's job has run 1100 s, k's second
    one 900 s (since 200, on k's idle GPU), w's 1040 s. w's started at 60, during the check whose
    reclaim freed p's GPU: the watcher remembers it from then, not from its next check, so k's is
    the one stopped."""
    lines = ["p,0,5000,0,50,1,0", "u,0,5000,0,5000,1,0", "k,0,5000,0,100,1,0", "k,0,5000,200,5000,1,0",
             "w,55,5000,55,5000,1,0", "v,150,5000,150,10,9,0", "x,1100,5000,1100,10,1,0"]
    config = policy({"soft_max_time": True}, max_time=1000.0, reclaim_after=10.0)
    shortcut = engine.replay(trace.read(write(tmp_path, *lines)), config, 3)
    without_shortcuts(monkeypatch)
    every = engine.replay(trace.read(write(tmp_path, *lines)), config, 3)
    assert shortcut.summary(3) == every.summary(3)
    assert shortcut.revokes == 1 and shortcut.work_lost == 900.0
