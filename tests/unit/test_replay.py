"""`gpuguard replay` and its traces: the replay through the daemon's code, static reservation,
the metrics, and bad input. The Adobe file is used when ../shared/data has it."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from gpuguard import config as configuration
from gpuguard.core.model import Quota
from gpuguard.replay import engine, trace

REPO = Path(__file__).resolve().parents[2]
# CI clones shared/ beside the repository; GPUGUARD_DATA names another copy of shared/data.
DATA = Path(os.environ.get("GPUGUARD_DATA") or REPO.parent / "shared" / "data")
ADOBE = DATA / "adobe-notebook-sessions-2021-06-01.json"
needs_adobe = pytest.mark.skipif(not ADOBE.exists(), reason=f"{ADOBE} is not there")


def policy(**quota) -> configuration.Config:
    base = configuration.Config()
    return replace(base, defaults=replace(base.defaults, gpus=8, **quota))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def gpuguard(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPUGUARD_CONFIG": "/nonexistent/gpuguard.toml"}
    return subprocess.run([sys.executable, "-m", "gpuguard", *args], capture_output=True, text=True, env=env,
                          cwd=REPO)


def test_jain_and_percentile_on_known_numbers():
    assert engine.jain([1.0, 1.0, 1.0]) == 1.0
    assert engine.jain([1.0, 0.0]) == 0.5
    assert engine.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert engine.percentile(list(map(float, range(1, 101))), 0.95) == 95.0
    assert engine.percentile([], 0.5) is None


def test_two_users_on_one_gpu_take_turns_through_the_queue(tmp_path):
    path = write(tmp_path, "user,session_start,session_end,job_start,duration,gpus,gpu_memory\n"
                           "a,0,1000,0,100,1,0\n"
                           "b,10,1000,10,100,1,0\n")
    ours = engine.replay(trace.read(path), policy(reclaim_after=5.0), 1)
    summary = ours.summary(1)
    assert summary["jobs_ran"] == 2 and summary["jobs_never_ran"] == 0
    # b waits for a's job to end (100) and its grant to be reclaimed 5 s later, at the 2 s tick.
    assert summary["wait_max"] == pytest.approx(96.0)
    assert summary["reclaims"] == 1
    assert summary["gpu_seconds_busy"] == 200.0
    static = engine.static_reservation(trace.read(path), 1).summary(1)
    assert static["wait_max"] == 990.0  # b's session waits for all of a's


def test_without_reclaim_a_grant_stays_until_logout(tmp_path):
    path = write(tmp_path, "user,session_start,session_end,job_start,duration,gpus,gpu_memory\n"
                           "a,0,500,0,100,1,0\n"
                           "b,10,1000,10,100,1,0\n")
    summary = engine.replay(trace.read(path), policy(), 1).summary(1)
    assert summary["wait_max"] == 490.0  # a's logout at 500 releases it
    assert summary["releases"] == 2 and summary["reclaims"] == 0


def test_a_job_over_the_quota_never_runs(tmp_path):
    path = write(tmp_path, "user,session_start,session_end,job_start,duration,gpus,gpu_memory\n"
                           "a,0,500,0,100,4,0\n")
    base = configuration.Config()
    summary = engine.replay(trace.read(path), replace(base, defaults=Quota(gpus=2)), 8).summary(8)
    assert summary["jobs_never_ran"] == 1 and summary["jobs_over_quota"] == 1


def test_a_generated_trace_replays_with_every_job_run_on_a_large_pool():
    sessions = list(trace.generate(300, users=10, seed=3))
    assert sum(len(s.jobs) for s in sessions) == 300
    summary = engine.replay(sessions, policy(idle_timeout=60.0), 64).summary(64)
    assert summary["jobs_ran"] == 300 and summary["wait_max"] == 0.0
    assert summary["gpu_seconds_busy"] == pytest.approx(sum(j.gpus * j.duration for s in sessions for j in s.jobs))


def test_generated_trace_round_trips_through_csv(tmp_path):
    out = io.StringIO()
    sessions = list(trace.generate(50, users=5, seed=9))
    assert trace.write_csv(sessions, out) == 50
    assert list(trace.read(write(tmp_path, out.getvalue()))) == sessions


@pytest.mark.parametrize("line, why", [
    ("a,0,100,50,10,1", "expected 7 fields"),
    ("a,0,100,500,10,1,0", "outside its session"),
    ("a,0,100,50,ten,1,0", "must be numbers"),
    ("a,0,100,50,10,0,0", "gpus >= 1"),
    ("a" * 257 + ",0,100,50,10,1,0", "user name longer than 256 characters"),  # as the daemon bounds it
    ("a,1700000000000000000,,1700000000000000000,30000000000,1,0", "over 3,000 years"),  # nanoseconds
])
def test_a_malformed_line_is_named_by_its_number(tmp_path, line, why):
    path = write(tmp_path, f"# a comment\n{','.join(trace.HEADER)}\nb,0,100,5,10,1,0\n{line}\n")
    with pytest.raises(trace.TraceError, match=f"line 4: .*{why}"):
        list(trace.read(path))
    result = gpuguard("replay", str(path), "--gpus", "2")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "line 4" in result.stderr


def test_a_trace_with_a_bom_or_gzipped_reads_as_the_plain_file(tmp_path):
    import gzip
    text = f"{','.join(trace.HEADER)}\na,0,100,5,10,1,0\nb,1,,1,20,2,0\n"
    plain = list(trace.read(write(tmp_path, text)))
    assert len(plain) == 2
    bom = tmp_path / "bom.csv"  # Excel's "CSV UTF-8", Windows tools
    bom.write_text("\ufeff" + text, encoding="utf-8")
    packed = tmp_path / "trace.csv.gz"
    packed.write_bytes(gzip.compress(text.encode()))
    assert list(trace.read(bom)) == plain and list(trace.read(packed)) == plain
    assert json.loads(gpuguard("replay", str(packed), "--gpus", "2", "--json").stdout)["policy"]["jobs_ran"] == 2


@pytest.mark.parametrize("content, why", [
    ("user\n\u00e9\n".encode("latin-1"), "not UTF-8 text"),
    ("\ufeffuser".encode("utf-16"), "not UTF-8 text"),  # PowerShell's redirection
    (b"\x1f\x8b\x08\x00" + b"\x00" * 6, "gzip"),  # cut short
    (b'{"sessions": [{"id": "s1", "start_tick": 0, "stop_tick": 10, "trainings": [{"start_tick": NaN, '
     b'"duration_in_ticks": 2, "gpus": 1, "vram": 1}]}]}', "session s1: times must be finite"),
    (b'{"sessions": [{"id": "s1", "start_tick": 0, "stop_tick": 10, "trainings": [{"start_tick": 1, '
     b'"duration_in_ticks": 2, "gpus": 1, "vram": "lots"}]}]}', "not a trace"),
])
def test_a_file_that_is_no_trace_is_a_one_line_error(tmp_path, content, why):
    path = tmp_path / "trace"
    path.write_bytes(content)
    with pytest.raises(trace.TraceError, match=why):
        list(trace.read(path))
    result = gpuguard("replay", str(path), "--gpus", "2")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and why.split(":")[0] in result.stderr


def test_the_adobe_layouts_slips_are_mended_and_said(tmp_path):
    # a burst before its session, half a GPU, a negative vram: the session stretched to hold the
    # burst, 1 GPU, memory unknown; said once on stderr, though a replay reads the file three times
    path = tmp_path / "notebooks.json"
    path.write_text(json.dumps({"sessions": [
        {"id": "s1-long-id", "start_tick": 5, "stop_tick": 10, "trainings": [
            {"start_tick": 1, "duration_in_ticks": 2, "gpus": 0.5, "vram": -1},
            {"start_tick": 6, "duration_in_ticks": 2, "gpus": 2, "vram": 3}]}]}))
    notes: Counter[str] = Counter()
    (session,) = trace.read(path, notes)
    assert (session.start, session.end) == (60.0, 600.0)
    assert session.jobs == (trace.Job(60.0, 120.0, 1, 0), trace.Job(360.0, 120.0, 2, 3 * trace.GB))
    assert notes == {"sessions stretched to hold a burst outside them": 1, "fractional GPU counts rounded up": 1,
                     "negative vram read as unknown": 1}
    result = gpuguard("replay", str(path), "--gpus", "2", "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["trace_notes"] == notes
    assert result.stderr == ("gpuguard: trace read with changes: 1 fractional GPU counts rounded up; 1 negative "
                             "vram read as unknown; 1 sessions stretched to hold a burst outside them\n")


def test_a_pipe_is_refused_in_one_line_since_a_replay_reads_its_trace_more_than_once(tmp_path):
    text = f"{','.join(trace.HEADER)}\na,0,100,5,10,1,0\n"
    result = subprocess.run([sys.executable, "-m", "gpuguard", "replay", "/dev/stdin", "--gpus", "2"], input=text,
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "write it to a file first" in result.stderr


def test_bad_pool_sizes_and_missing_files_exit_2(tmp_path):
    path = write(tmp_path, f"{','.join(trace.HEADER)}\na,0,100,5,10,1,0\n")
    for args in (["--gpus", "0"], ["--gpus", "-3"]):
        result = gpuguard("replay", str(path), *args)
        assert result.returncode == 2 and "--gpus must be between 1" in result.stderr
    assert gpuguard("replay", str(tmp_path / "none.csv")).returncode == 2


def test_replay_prints_both_columns_and_json(tmp_path):
    path = write(tmp_path, f"{','.join(trace.HEADER)}\na,0,100,5,10,1,0\n")
    table = gpuguard("replay", str(path), "--gpus", "2")
    assert table.returncode == 0 and "static reservation" in table.stdout and "time to GPU p95" in table.stdout
    data = json.loads(gpuguard("simulate", str(path), "--gpus", "2", "--json").stdout)  # the old name still works
    assert data["policy"]["jobs_ran"] == 1 and data["static"]["gpu_seconds_granted"] == 100.0


@needs_adobe
def test_the_adobe_figures_under_static_reservation():
    """The data README's figures: 304,219 GPU-minutes reserved, 78,255 busy, a 142-GPU peak."""
    at_peak = engine.static_reservation(trace.read(ADOBE), 142).summary(142)
    assert at_peak["gpu_seconds_granted"] == 304_219 * 60
    assert at_peak["gpu_seconds_busy"] == 78_255 * 60
    assert at_peak["wait_max"] == 0.0
    assert engine.static_reservation(trace.read(ADOBE), 141).summary(141)["wait_max"] > 0


@needs_adobe
def test_the_adobe_file_is_read_as_it_is_and_converts_to_the_same_trace(tmp_path):
    sessions = list(trace.read(ADOBE))
    assert len(sessions) == 51 and sum(len(s.jobs) for s in sessions) == 518  # 8 sessions use no GPU
    out = io.StringIO()
    trace.write_csv(sessions, out)
    assert list(trace.read(write(tmp_path, out.getvalue()))) == sessions


def _heavy_under_light_stream(tmp_path: Path, max_wait_boost: float) -> dict[str, list[float]]:
    """One GPU: a heavy user's 10-hour job, then a request of theirs at 36,050 s while 200 light
    users (no usage) each ask for 100 s, one every 100 s from 35,990 s: the GPU is never free for long."""
    lines = [",".join(trace.HEADER), "heavy,0,,0,36000,1,0"]
    lights = [f"l{i:03d},{35990 + 100 * i},,{35990 + 100 * i},100,1,0" for i in range(200)]
    lines += lights[:1] + ["heavy,36050,,36050,100,1,0"] + lights[1:]
    config = policy()
    config = replace(config, scheduler=replace(config.scheduler, max_wait_boost=max_wait_boost))
    return engine.replay(trace.read(write(tmp_path, "\n".join(lines) + "\n")), config, 1).user_waits


def test_a_heavy_users_request_under_a_stream_of_light_users_is_served_within_the_age_bound(tmp_path):
    bound = 1000.0
    waits = _heavy_under_light_stream(tmp_path, bound)
    # the bound, plus the light request that came before it, plus the job running when it is boosted
    assert bound <= waits["heavy"][1] <= bound + 2 * 100 + 2 * policy().watcher.interval
    # without the bound fair share serves every light user first: it waits for the whole stream
    starved = _heavy_under_light_stream(tmp_path, 10 * 86400.0)
    assert starved["heavy"][1] > 15000


def test_the_replays_decisions_come_from_the_daemons_watcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay has no rules of its own: every release and stop is an action of Watcher.check,
    and a watcher that decides nothing leaves the replay with nothing decided."""
    from gpuguard.services.watcher import Watcher
    path = write(tmp_path, "user,session_start,session_end,job_start,duration,gpus,gpu_memory\n"
                           "a,0,1000,0,100,1,0\n"
                           "b,10,1000,10,100,1,0\n")
    real_check = Watcher.check
    acted: list = []
    calls = [0]

    async def counted(self, sample, now):
        calls[0] += 1
        done = await real_check(self, sample, now)
        acted.extend(done)
        return done
    monkeypatch.setattr(Watcher, "check", counted)
    summary = engine.replay(trace.read(path), policy(reclaim_after=5.0), 1).summary(1)
    assert calls[0] == 2  # b joining the queue (a is served at once), and the wake at which the reclaim is due
    assert [(a.kind, a.rule) for a in acted] == [("release", "reclaim")] and summary["reclaims"] == 1

    async def idle(self, sample, now):
        calls[0] += 1
        return []
    monkeypatch.setattr(Watcher, "check", idle)
    blind = engine.replay(trace.read(path), policy(reclaim_after=5.0), 1).summary(1)
    # nobody reclaims a's idle GPU for b: b waits until a's session ends at 1000 s
    assert blind["reclaims"] == 0 and blind["wait_max"] == pytest.approx(990.0)
