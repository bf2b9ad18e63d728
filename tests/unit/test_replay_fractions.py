"""`gpuguard replay --fractions`: jobs a fraction could serve ask for part of one GPU, placed by
FGD, best-fit or first-fit; the GPUs left unallocatable while a fraction waits; the fractional
workload generator. Real replays through the daemon's services, on small traces."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gpuguard import config as configuration
from gpuguard.core.model import Placement
from gpuguard.replay import engine, trace

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30
HEADER = "user,session_start,session_end,job_start,duration,gpus,gpu_memory\n"
FRACTION_KEYS = ("whole_wait_p95", "fraction_wait_p95", "fraction_waiting_of_span", "unallocatable_gpus",
                 "stranding_gpus")


def policy(placement: Placement = Placement.FGD) -> configuration.Config:
    base = configuration.Config()
    return engine.with_placement(replace(base, defaults=replace(base.defaults, gpus=8)), placement)


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(HEADER + "".join(line + "\n" for line in lines))
    return path


def batch(user: str, at: float, duration: float, gpus: int, memory: int) -> str:
    """One batch job: an open session of its own."""
    return f"{user},{at:g},,{at:g},{duration:g},{gpus},{memory}"


def test_two_fractions_share_a_gpu_that_whole_jobs_take_in_turn(tmp_path):
    path = write(tmp_path, batch("a", 0, 100, 1, 30 * GIB), batch("b", 10, 100, 1, 40 * GIB))
    shared = engine.replay(trace.read(path), policy(), 1, fractions=True).summary(1)
    assert shared["jobs_ran"] == 2 and shared["wait_max"] == 0.0
    assert shared["most_sharers"] == 2
    assert shared["gpu_seconds_shared"] == 90.0  # 10..100, both on it
    assert shared["stretch_p95"] == 1.0  # a fraction runs at its own pace beside another
    assert shared["fraction_waiting_of_span"] == 0.0 and shared["unallocatable_gpus"] == 0.0
    whole = engine.replay(trace.read(path), policy(), 1).summary(1)
    assert whole["wait_max"] == 90.0 and whole["most_sharers"] == 1  # b waits for a's whole GPU


def test_a_whole_job_never_joins_fractions_and_keeps_its_wait_apart(tmp_path):
    path = write(tmp_path, batch("a", 0, 100, 1, 10 * GIB), batch("b", 5, 50, 1, 80 * GIB),
                 batch("c", 6, 50, 1, 10 * GIB))
    summary = engine.replay(trace.read(path), policy(), 1, fractions=True).summary(1)
    # b (a whole GPU's memory: a whole-GPU job) waits for the GPU to be empty; c, a fraction, fits
    # beside a at once (the queue serves what fits), and is gone before a is
    assert summary["whole_wait_p95"] == 95.0
    assert summary["fraction_wait_p95"] == 0.0
    assert summary["most_sharers"] == 2


# 2 GPUs; a 40 GiB and a 50 GiB fraction take one each (30 and 40 GiB left), then a 25 GiB one:
# best-fit and FGD put it beside the 50 (5 GiB left), first-fit on GPU 0 (15 GiB left). A 35 GiB
# fraction then fits GPU 0 beside the 40 at once, or, after first-fit, waits until the 40 ends
# at 1000 with 15 + 30 GiB of the two GPUs stranded: 45/80 of a GPU, on 2 GPUs.
PACKING = (batch("a", 0, 1000, 1, 40 * GIB), batch("b", 1, 1000, 1, 50 * GIB), batch("c", 2, 1000, 1, 25 * GIB),
           batch("d", 3, 100, 1, 35 * GIB))


@pytest.mark.parametrize("placement", [Placement.FGD, Placement.BEST_FIT])
def test_packing_placements_leave_room_for_the_next_fraction(tmp_path, placement):
    path = write(tmp_path, *PACKING)
    summary = engine.replay(trace.read(path), policy(placement), 2, fractions=True).summary(2)
    assert summary["wait_max"] == 0.0 and summary["most_sharers"] == 2
    assert summary["fraction_waiting_of_span"] == 0.0 and summary["unallocatable_gpus"] == 0.0


def test_first_fit_strands_memory_while_a_fraction_waits_and_it_is_measured(tmp_path):
    path = write(tmp_path, *PACKING)
    summary = engine.replay(trace.read(path), policy(Placement.FIRST_FIT), 2, fractions=True).summary(2)
    assert summary["wait_max"] == 997.0  # d, from 3 until a's end at 1000
    assert summary["unallocatable_gpus"] == pytest.approx(45 / 80)
    assert summary["stranding_gpus"] == 2.0
    # d waits 997 s of the span: 0 .. 1002 (c's end; d ends at 1100)
    assert summary["fraction_waiting_of_span"] == pytest.approx(round(997 / 1100, 4))


def test_compare_runs_each_placement_beside_fractions_off(tmp_path):
    path = write(tmp_path, *PACKING)
    report = engine.compare(lambda: trace.read(path), policy(), 2, fractions=True)
    assert report["first-fit"]["unallocatable_gpus"] == pytest.approx(45 / 80)
    assert report["fgd"]["unallocatable_gpus"] == report["best-fit"]["unallocatable_gpus"] == 0.0
    # fractions off: every job on a whole GPU of its own, in turn; nothing measured
    assert report["policy"]["most_sharers"] == 1 and report["policy"]["unallocatable_gpus"] is None
    assert report["policy"] == engine.replay(trace.read(path), policy(), 2).summary(2)


def test_fractions_change_nothing_for_jobs_no_fraction_could_serve(tmp_path):
    sessions = list(trace.generate_mixed(200, 12, seed=3, days=1.0))
    # unknown memory, or several GPUs: no fraction could serve any of them
    whole = [replace(s, jobs=tuple(replace(job, memory=0) for job in s.jobs)) for s in sessions]
    off = engine.replay(whole, policy(), 12).summary(12)
    on = engine.replay(whole, policy(), 12, fractions=True).summary(12)
    assert on["fraction_waiting_of_span"] == 0.0 and off["fraction_waiting_of_span"] is None
    for key in ("fraction_waiting_of_span", "unallocatable_gpus", "stranding_gpus"):
        del on[key], off[key]
    assert on == off
    assert off["whole_wait_p95"] == off["wait_p95"]  # every job is a whole-GPU one


def test_an_interactive_users_next_fraction_runs_on_their_idle_one(tmp_path):
    path = write(tmp_path, "a,0,1000,0,100,1,21474836480", "a,0,1000,200,100,1,10737418240",
                 "b,50,1000,50,100,1,64424509440")
    summary = engine.replay(trace.read(path), policy(), 1, fractions=True).summary(1)
    # a's 20 GiB fraction stays theirs between their jobs (no idle release); the 10 GiB job runs on it
    assert summary["jobs_ran"] == 3 and summary["wait_max"] == 0.0
    # a holds one grant, 0..1000, b 50..1000: a second of a's (20 + 60 + 10 GiB) would not fit, and wait
    assert summary["gpu_seconds_granted"] == 1000.0 + 950.0


def test_fractional_workloads_mix_sizes_and_heavy_tailed_durations():
    sessions = list(trace.generate_fractional(4000, 30, seed=7, days=5.0))
    assert sessions == list(trace.generate_fractional(4000, 30, seed=7, days=5.0))
    jobs = [job for session in sessions for job in session.jobs]
    parts = [job for job in jobs if engine.fractional(job)]
    assert 0.40 < len(parts) / len(jobs) < 0.48
    assert all(8 * GIB <= job.memory <= 72 * GIB and job.memory % GIB == 0 for job in parts)
    assert len({job.memory for job in parts}) == 17  # 10, 15, ..., 90 %
    assert {job.gpus for job in jobs if not engine.fractional(job)} == {1, 2, 4, 8}
    durations = sorted(job.duration for job in jobs)
    assert durations[math.ceil(0.99 * len(durations))] > 15 * durations[len(durations) // 2]
    small = [job.memory for s in trace.generate_fractional(4000, 30, seed=7, days=5.0, mix="small")
             for job in s.jobs if engine.fractional(job)]
    assert sorted(small)[len(small) // 2] < sorted(job.memory for job in parts)[len(parts) // 2]
    with pytest.raises(configuration.UsageError):
        list(trace.generate_fractional(10, mix="huge"))


def gpuguard(*args: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPUGUARD_CONFIG": "/nonexistent/gpuguard.toml"}
    return subprocess.run([sys.executable, "-m", "gpuguard", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, env=env, cwd=REPO)


def test_replay_fractions_prints_the_placements_side_by_side(tmp_path):
    path = tmp_path / "fractional.csv"
    with open(path, "w") as out:
        made = gpuguard("trace", "generate", "--profile", "fractional", "--jobs", "120", "--days", "0.5",
                        "--mix", "small", stdout=out)
    assert made.returncode == 0, made.stderr
    done = gpuguard("replay", str(path), "--gpus", "6", "--fractions")
    assert done.returncode == 0, done.stderr
    header = next(line for line in done.stdout.splitlines() if "fractions, FGD" in line)
    assert header.index("whole GPUs") < header.index("FGD") < header.index("best-fit") < header.index("first-fit")
    assert "GPUs unallocatable while a fraction waits" in done.stdout
    assert "time to GPU p95, whole-GPU jobs" in done.stdout
    plain = gpuguard("replay", str(path), "--gpus", "6")
    assert "fractions, FGD" not in plain.stdout and "unallocatable" not in plain.stdout
    bad = gpuguard("trace", "generate", "--profile", "fractional", "--fractional", "1.5")
    assert bad.returncode != 0 and "--fractional" in bad.stderr
