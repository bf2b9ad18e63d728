"""Workload traces for `gpuguard replay`: the CSV format, the Adobe notebook trace as published,
Slurm's accounting (sacct), and two synthetic generators.

The CSV format, one line per job, times in seconds from any origin, after a header line
(lines starting with # are comments):

    user,session_start,session_end,job_start,duration,gpus,gpu_memory
    alice,0,7200,300,600,2,17179869184

A session is a user logged in from session_start to session_end (the user's GPUs that came from
it go back when their last session ends); its jobs start inside it (job_start in [session_start,
session_end)), run `duration` > 0 seconds on `gpus` >= 1 GPUs and use `gpu_memory` bytes on each
(0: unknown). session_end may be empty: a batch job, an open session of its own that lasts until
the job has run (it waits in the queue however long it takes, rather than leaving with a login).
Each such line is its own session, so two jobs one user submitted in the same second stay two
jobs, as Slurm's job arrays do. A session's lines come together (the same user, start and end
again after another session's lines is another session: two logins in the same second), and
sessions come in order of session_start, so a replay reads the file as it goes (memory stays
flat however long the trace). Times are written exactly (the shortest text that reads back as
the same number).

Slurm's accounting, `sacct -a -P -X -o JobID,User,Submit,Start,End,AllocTRES` (recognised by its
header line; the fields in any order, others beside them), is read as one open session per job
with GPUs: it arrives at Submit and runs End - Start seconds on its gres/gpu count (the untyped
total where Slurm writes one beside the typed counts, else the typed counts added up). Job steps
(JobID with a dot) and jobs without GPUs are passed by; jobs with GPUs that never started, have
not ended or ran no time are left out and counted (read's `notes`). The times are read as the
local time sacct prints (epoch seconds, with SLURM_TIME_FORMAT=%s, read exactly), memory as unknown.

Any of the three may be gzipped (recognised by its first bytes) and may start with a byte order
mark; in CSV and sacct output, blank lines and lines starting with # are passed by.

The Adobe file (../shared/data/adobe-notebook-sessions-2021-06-01.json, a JSON object with a
`sessions` list, ticks of one minute) is read as it is: each session is one user named after
the first 8 characters of its id, each training burst with GPUs is one job, `vram` (GB) its
memory per GPU; bursts without GPUs are left out, and so are the 8 sessions that have no other.
A file of this layout from elsewhere may slip where the published one does not: a burst outside
its session, half a GPU, a negative vram are mended and counted (read's `notes`), not refused.
"""
from __future__ import annotations

import csv
import gzip
import heapq
import json
import math
import os
import random
import re
import stat
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from operator import attrgetter
from pathlib import Path
from typing import TextIO

from gpuguard.core.errors import UsageError
from gpuguard.protocol import MAX_NAME

HEADER = ("user", "session_start", "session_end", "job_start", "duration", "gpus", "gpu_memory")
ADOBE_TICK = 60.0  # seconds per tick in the Adobe file
GB = 10 ** 9
SACCT_FIELDS = ("JobID", "User", "Submit", "Start", "End", "AllocTRES")
GZIP_MAGIC = b"\x1f\x8b"
# Past this a time is no number of seconds (an epoch in milliseconds is 1.7e12): read as seconds,
# a nanosecond epoch's jobs would run for no time in a float's precision.
MAX_SECONDS = 1e11
_GRES_GPU = re.compile(r"(?:^|,)gres/gpu(:[^=,]+)?=(\d+)")  # a type (gres/gpu:a100=4), or none


class TraceError(UsageError):
    """A trace that cannot be read: one line naming the file and the line."""


@dataclass(frozen=True)
class Job:
    start: float
    duration: float
    gpus: int
    memory: int  # bytes per GPU, 0: unknown


@dataclass(frozen=True)
class Session:
    user: str
    start: float
    end: float | None  # None: open, until its last job has run
    jobs: tuple[Job, ...]

    @property
    def last(self) -> float:
        """When the session ends if none of its jobs waits: its end, or its last job's end when open."""
        if self.end is not None:
            return self.end
        return max((job.start + job.duration for job in self.jobs), default=self.start)


def read(path: Path, notes: Counter[str] | None = None) -> Iterator[Session]:
    """The sessions of a trace file, in order of start: the Adobe JSON (recognised by its layout),
    sacct's output (by its header) or CSV, as UTF-8 text (a BOM is skipped) or gzip of it.
    notes: set to what reading left out or mended (sacct's jobs a replay cannot take, the Adobe
    layout's slips), each counted."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise TraceError(f"{path}: not a regular file (a pipe?): a replay reads its trace more than once; "
                             "write it to a file first")
        with open(path, "rb") as raw:
            compressed = raw.read(len(GZIP_MAGIC)) == GZIP_MAGIC
        handle = gzip.open(path, "rt", encoding="utf-8-sig") if compressed else open(path, encoding="utf-8-sig")
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror}") from None
    try:
        with handle:
            first = handle.read(1)
            while first.isspace():
                first = handle.read(1)
            handle.seek(0)
            if first == "{":
                yield from _adobe(path, handle, _set_to(notes))
            elif "JobID" in next(_said(handle), (0, ""))[1].rstrip("\n").split("|"):  # sacct -P, fields in any order
                handle.seek(0)
                yield from _sacct(path, handle, _set_to(notes))
            else:
                handle.seek(0)
                yield from _csv(path, handle)
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not UTF-8 text (nor gzip of it)") from None
    except (OSError, EOFError) as exc:  # a damaged or cut gzip file, a failing disk
        raise TraceError(f"{path}: {'damaged gzip: ' if compressed else ''}{exc}") from None


def _said(handle: TextIO) -> Iterator[tuple[int, str]]:
    """The lines that say something, numbered as in the file: no blank ones, no # comments."""
    return ((number, line) for number, line in enumerate(handle, start=1) if line.strip() and not line.startswith("#"))


def _csv(path: Path, handle: TextIO) -> Iterator[Session]:
    rows = _said(handle)
    header = next(rows, None)
    if header is None or tuple(c.strip() for c in header[1].strip().split(",")) != HEADER:
        raise TraceError(f"{path}: line {header[0] if header else 1}: expected the header {','.join(HEADER)}")
    current: tuple[str, float, float | None] | None = None
    jobs: list[Job] = []
    last_start = float("-inf")
    for number, line in rows:
        user, session_start, session_end, job = _csv_line(path, number, line)
        key = (user, session_start, session_end)
        if key != current or session_end is None:  # an open session is one line: a batch job
            if current is not None:
                yield Session(*current, tuple(jobs))
            if session_start < last_start:
                raise TraceError(f"{path}: line {number}: sessions must come in order of session_start")
            current, jobs, last_start = key, [], session_start
        jobs.append(job)
    if current is not None:
        yield Session(*current, tuple(jobs))


def _csv_line(path: Path, number: int, line: str) -> tuple[str, float, float | None, Job]:
    def bad(why: str) -> TraceError:
        return TraceError(f"{path}: line {number}: {why}")
    try:
        cells = next(csv.reader([line]))
    except csv.Error as exc:
        raise bad(str(exc)) from None
    if len(cells) != len(HEADER):
        raise bad(f"expected {len(HEADER)} fields ({','.join(HEADER)}), got {len(cells)}")
    user = cells[0].strip()
    if why := _bad_user(user):
        raise bad(why)
    try:
        session_start, job_start, duration = (float(cells[i]) for i in (1, 3, 4))
        session_end = float(cells[2]) if cells[2].strip() else None
        gpus, memory = int(cells[5]), int(cells[6])
    except ValueError:
        raise bad("times must be numbers of seconds (session_end may be empty), gpus and gpu_memory whole "
                  "numbers") from None
    job = Job(job_start, duration, gpus, memory)
    if why := _job_problem(session_start, session_end, job):
        raise bad(why)
    return user, session_start, session_end, job


def _job_problem(session_start: float, session_end: float | None, job: Job) -> str | None:
    """Why a replay could not run this job of this session, or None."""
    times = (session_start, job.start, job.duration, session_end or 0.0)
    if not all(math.isfinite(t) for t in times):
        return "times must be finite"
    if (largest := max(map(abs, times))) >= MAX_SECONDS:
        return f"times must be seconds: {largest:g} is over 3,000 years (milliseconds or nanoseconds?)"
    if job.start < session_start or (session_end is not None and job.start >= session_end):
        return (f"job_start {job.start:g} is outside its session [{session_start:g}, "
                f"{'open' if session_end is None else f'{session_end:g}'})")
    if job.duration <= 0 or job.gpus < 1 or job.memory < 0:
        return "duration must be > 0, gpus >= 1 and gpu_memory >= 0"
    return None


def _bad_user(user: str) -> str | None:
    """Why a replay could not log this user in (as the daemon's requests bound a name), or None."""
    if not user:
        return "empty user"
    if len(user) > MAX_NAME:
        return f"user name longer than {MAX_NAME} characters"
    return None


def _adobe(path: Path, handle: TextIO, noted: Callable[[Counter[str]], None]) -> Iterator[Session]:
    """The Adobe layout, with the checks of a CSV line. Its slips a replay can take are mended and
    counted: a burst outside its session stretches the session to hold it, a fractional GPU count
    is rounded up (half a GPU still takes one), a negative vram is unknown memory."""
    counts: Counter[str] = Counter()
    try:
        data = json.load(handle)
        raw = data["sessions"]
        sessions = []
        for entry in raw:
            user = str(entry["id"])[:8]
            start, end = float(entry["start_tick"]) * ADOBE_TICK, float(entry["stop_tick"]) * ADOBE_TICK
            jobs = []
            for t in sorted(entry["trainings"], key=lambda t: t["start_tick"]):
                if not (t["gpus"] > 0 and t["duration_in_ticks"] > 0):
                    continue  # a burst without GPUs
                gpus, vram = math.ceil(t["gpus"]), float(t["vram"])
                counts["fractional GPU counts rounded up"] += gpus != t["gpus"]
                counts["negative vram read as unknown"] += vram < 0
                job = Job(float(t["start_tick"]) * ADOBE_TICK, float(t["duration_in_ticks"]) * ADOBE_TICK, gpus,
                          max(0, int(vram * GB)))
                if math.isfinite(job.start) and not start <= job.start < end:
                    counts["sessions stretched to hold a burst outside them"] += 1
                    start, end = min(start, job.start), max(end, job.start + job.duration)
                jobs.append(job)
            for job in jobs:
                if why := _job_problem(start, end, job) or _bad_user(user):
                    raise TraceError(f"{path}: session {user}: {why}")
            if jobs:  # a session that never asks for a GPU plays no part (and a CSV has no line for it)
                sessions.append(Session(user, start, end, tuple(jobs)))
    except TraceError:
        raise
    except (ValueError, KeyError, TypeError, OverflowError) as exc:
        raise TraceError(f"{path}: not a trace: JSON without the Adobe layout (sessions with trainings): {exc}"
                         ) from None
    noted(+counts)
    yield from sorted(sessions, key=lambda s: s.start)


def _sacct(path: Path, handle: TextIO, noted: Callable[[Counter[str]], None]) -> Iterator[Session]:
    lines = _said(handle)
    first, header = next(lines)
    names = header.rstrip("\n").split("|")
    if missing := [name for name in SACCT_FIELDS if name not in names]:
        raise TraceError(f"{path}: line {first}: sacct output without {', '.join(missing)} (run sacct -P -o "
                         f"{','.join(SACCT_FIELDS)})")
    at = {name: names.index(name) for name in SACCT_FIELDS}
    sessions = []
    counts: Counter[str] = Counter()
    for number, line in lines:
        cells = line.rstrip("\n").split("|")
        if len(cells) != len(names):
            raise TraceError(f"{path}: line {number}: expected {len(names)} fields separated by |, got {len(cells)}")
        job_id, user, tres = cells[at["JobID"]], cells[at["User"]].strip(), cells[at["AllocTRES"]]
        gpus = _gpus_of(tres)
        if "." in job_id or not user or gpus < 1:
            continue  # a step (its job has the line that counts), or no GPUs
        if why := _bad_user(user):
            raise TraceError(f"{path}: line {number}: {why}")
        try:
            submit, start, end = (_sacct_time(cells[at[name]]) for name in ("Submit", "Start", "End"))
        except ValueError as exc:
            raise TraceError(f"{path}: line {number}: {exc}") from None
        if submit is None or start is None or end is None:
            counts["jobs with GPUs left out: never started or still running (Start or End Unknown)"] += 1
        elif end <= start:
            counts["jobs with GPUs left out: ran no time (End at or before Start: a clock change? "
                   "SLURM_TIME_FORMAT=%s gives exact times)"] += 1
        else:
            sessions.append(Session(user, submit, None, (Job(submit, end - start, gpus, 0),)))
    noted(counts)
    yield from sorted(sessions, key=lambda s: s.start)


def _set_to(notes: Counter[str] | None) -> Callable[[Counter[str]], None]:
    """What a reader calls with its counts once it has read the file: they replace `notes`
    (a replay reads its trace three times, and says what it read once)."""
    def noted(counts: Counter[str]) -> None:
        if notes is not None:
            notes.clear()
            notes.update(counts)
    return noted


def _gpus_of(tres: str) -> int:
    """The GPUs of an AllocTRES: its untyped gres/gpu count, which Slurm writes beside the typed
    ones (`gres/gpu:a100=4,gres/gpu=4` is 4 GPUs, not 8), or else the typed counts added up."""
    counts = _GRES_GPU.findall(tres)
    untyped = [int(count) for kind, count in counts if not kind]
    return sum(untyped) if untyped else sum(int(count) for _, count in counts)


def _sacct_time(text: str) -> float | None:
    """Seconds since the epoch of sacct's local time (2024-03-01T09:30:00) or of epoch seconds
    (SLURM_TIME_FORMAT=%s); None for Unknown/None."""
    text = text.strip()
    if text in ("", "Unknown", "None"):
        return None
    try:
        return float(text) if text.isdigit() else datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(f"expected a time such as 2024-03-01T09:30:00 or epoch seconds, got {text!r}") from None


def exact(number: float) -> str:
    """The shortest text that reads back as exactly `number` (whole numbers without a fraction)."""
    return str(int(number)) if number.is_integer() else repr(number)


def write_csv(sessions: Iterable[Session], out: TextIO) -> int:
    """The CSV form of sessions (e.g. the Adobe file converted); returns the number of jobs written."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(HEADER)
    count = 0
    for session in sessions:
        end = "" if session.end is None else exact(session.end)
        for job in session.jobs:
            writer.writerow([session.user, exact(session.start), end, exact(job.start), exact(job.duration),
                             job.gpus, job.memory])
            count += 1
    return count


def generate(jobs: int, users: int = 20, seed: int = 1, max_gpus: int = 4) -> Iterator[Session]:
    """A synthetic interactive workload: users log in for a few hours and run bursts of 1-`max_gpus`
    GPUs with think time between them; each user logs in about every 4 hours, which keeps about
    0.7 GPUs per user busy. The same arguments always give the same trace."""
    rng = random.Random(seed)
    clock = 0.0
    made = 0
    while made < jobs:
        clock += rng.expovariate(users / 14400.0)
        user = f"u{rng.randrange(users):03d}"
        start = round(clock)
        t = start + rng.randrange(60, 900)
        batch: list[Job] = []
        for _ in range(min(jobs - made, rng.randrange(1, 12))):
            duration = float(round(rng.expovariate(1 / 900.0)) + 30)
            gpus = rng.choice([1, 1, 1, 2, max_gpus] if max_gpus > 2 else [1])
            batch.append(Job(float(t), duration, gpus, rng.randrange(1, 40) * GB))
            t += int(duration) + rng.randrange(60, 1800)
        made += len(batch)
        yield Session(user, float(start), float(t + rng.randrange(60, 1800)), tuple(batch))


def generate_batch(jobs: int, users: int = 60, seed: int = 1, days: float = 30.0, assign: str = "zipf",
                   median: float = 600.0, sigma: float = 2.0) -> Iterator[Session]:
    """A synthetic batch cluster, as production GPU clusters' traces show it: jobs of 1, 4 or 8
    GPUs (75/15/10 %), each its own open session (it waits however long it takes), arriving as a
    Poisson stream over `days`; lognormal durations (median `median` seconds, shape `sigma`: with
    the defaults the p99 is about 17 hours, the longest of 30,000 about three weeks, and jobs over
    4 hours hold about 70 % of the GPU-time); users Zipf-skewed (user k submits in proportion to
    1/k) or in turn ("round-robin"). The same arguments always give the same trace."""
    for rng, user, clock, duration in _arrivals(jobs, users, seed, days, assign, median, sigma):
        gpus = rng.choices((1, 4, 8), (75, 15, 10))[0]
        start = float(round(clock))
        yield Session(user, start, None, (Job(start, duration, gpus, rng.randrange(1, 80) * GB),))


def _arrivals(jobs: int, users: int, seed: int, days: float, assign: str, median: float,
              sigma: float) -> Iterator[tuple[random.Random, str, float, float]]:
    """A batch generator's jobs as they arrive: (its random numbers, to draw the rest of the job
    from before the next, the user, the arrival, the duration)."""
    rng = random.Random(seed)
    weights = [1 / k for k in range(1, users + 1)]
    rate = jobs / (days * 86400.0)
    clock = 0.0
    for number in range(jobs):
        clock += rng.expovariate(rate)
        who = number % users if assign == "round-robin" else rng.choices(range(users), weights)[0]
        yield rng, f"u{who:03d}", clock, float(max(30, round(rng.lognormvariate(math.log(median), sigma))))


def generate_mixed(jobs: int, users: int = 60, seed: int = 1, days: float = 30.0, assign: str = "zipf",
                   interactive: float = 0.3) -> Iterator[Session]:
    """A cluster where notebook users and batch jobs meet: `interactive` of the jobs are bursts of
    1, 2 or 4 GPUs (60/30/10 %; exponential, mean 20 minutes, with up to half an hour of thinking
    between two) in logged-in sessions of their own users (i000..., a third as many as `users`,
    assigned as `assign` says), each session ending up to half an hour after its last burst (a
    burst still waiting then never runs); the rest is generate_batch's month with the same
    arguments. Sessions in order of start; the same arguments always give the same trace."""
    bursts = round(jobs * interactive)
    batch = generate_batch(jobs - bursts, users, seed, days, assign)
    return heapq.merge(batch, _notebooks(bursts, max(1, users // 3), seed + 1, days, assign), key=attrgetter("start"))


def _notebooks(jobs: int, users: int, seed: int, days: float, assign: str) -> Iterator[Session]:
    """generate_mixed's interactive sessions: `jobs` bursts in sessions arriving as a Poisson stream."""
    rng = random.Random(seed)
    weights = [1 / k for k in range(1, users + 1)]
    per_session = 6  # bursts, on average
    rate = max(1, jobs) / per_session / (days * 86400.0)
    clock, made, number = 0.0, 0, 0
    while made < jobs:
        clock += rng.expovariate(rate)
        who = number % users if assign == "round-robin" else rng.choices(range(users), weights)[0]
        number += 1
        start = float(round(clock))
        t = start + rng.randrange(60, 900)
        batch: list[Job] = []
        for _ in range(min(jobs - made, rng.randrange(1, 2 * per_session))):
            duration = float(round(rng.expovariate(1 / 1200.0)) + 30)
            gpus = rng.choices((1, 2, 4), (60, 30, 10))[0]
            batch.append(Job(t, duration, gpus, rng.randrange(1, 40) * GB))
            t += duration + rng.randrange(60, 1800)
        made += len(batch)
        yield Session(f"i{who:03d}", start, float(t + rng.randrange(60, 1800)), tuple(batch))


GIB = 1 << 30
FRACTION_GPU = 80 * GIB  # the memory of the GPU the fractional generator's sizes are parts of (the replay's)
# Fraction sizes, percent of a GPU's memory -> weight: "spread" draws every size from 10 to 90 %
# alike; "small" is a notebook-heavy mix (most asks 10-25 %, some half a GPU, few larger).
FRACTION_MIXES: dict[str, dict[int, float]] = {
    "spread": {p: 1.0 for p in range(10, 91, 5)},
    "small": {10: 20, 15: 10, 20: 15, 25: 15, 30: 8, 40: 7, 50: 12, 60: 4, 75: 6, 90: 3},
}


def generate_fractional(jobs: int, users: int = 60, seed: int = 1, days: float = 30.0, assign: str = "zipf",
                        fractional: float = 0.44, mix: str = "spread", median: float = 600.0,
                        sigma: float = 1.5) -> Iterator[Session]:
    """A synthetic batch cluster with fractional GPU requests, to tune fraction placement on
    (never a published production trace: those are for evaluation). `fractional` of the jobs
    ask for part of one GPU: gpu_memory of a percent drawn from FRACTION_MIXES[mix] of an 80 GiB
    GPU, to the GiB; the rest are whole-GPU jobs of 1, 2, 4 or 8 GPUs (60/20/12/8 %) with
    gpu_memory a whole GPU's (so no replay takes them as fractions). Each job is its own open
    session, arriving as a Poisson stream over `days`; lognormal durations (median `median`
    seconds, shape `sigma`: heavy-tailed, with the defaults the p99 is about 5.5 hours);
    users Zipf-skewed or in turn ("round-robin"), as generate_batch's. The same arguments
    always give the same trace."""
    if mix not in FRACTION_MIXES:
        raise UsageError(f"unknown fraction mix {mix!r}: one of {', '.join(FRACTION_MIXES)}")
    sizes, weights = zip(*FRACTION_MIXES[mix].items(), strict=True)
    for rng, user, clock, duration in _arrivals(jobs, users, seed, days, assign, median, sigma):
        if rng.random() < fractional:
            gpus, memory = 1, round(rng.choices(sizes, weights)[0] * FRACTION_GPU / 100 / GIB) * GIB
        else:
            gpus, memory = rng.choices((1, 2, 4, 8), (60, 20, 12, 8))[0], FRACTION_GPU
        start = float(round(clock))
        yield Session(user, start, None, (Job(start, duration, gpus, memory),))
