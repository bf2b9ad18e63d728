"""The mixed generator (issue 40's dominance traces): notebook sessions among batch jobs, as a
replay reads them."""
from __future__ import annotations

import io
from pathlib import Path

from gpuguard.replay import engine, trace


def test_mixed_trace_has_both_kinds_in_order_and_reads_back(tmp_path: Path) -> None:
    sessions = list(trace.generate_mixed(600, users=12, seed=5, days=2.0))
    assert sessions == list(trace.generate_mixed(600, users=12, seed=5, days=2.0))  # the same arguments, the same
    assert [s.start for s in sessions] == sorted(s.start for s in sessions)
    notebooks = [s for s in sessions if s.end is not None]
    batch = [s for s in sessions if s.end is None]
    assert sum(len(s.jobs) for s in sessions) == 600
    assert sum(len(s.jobs) for s in notebooks) == 180  # 30 %
    assert {s.user[0] for s in notebooks} == {"i"} and {s.user[0] for s in batch} == {"u"}
    assert all(s.start <= j.start and j.start + j.duration <= (s.end or 0) for s in notebooks for j in s.jobs)
    assert {j.gpus for s in notebooks for j in s.jobs} <= {1, 2, 4}
    out = io.StringIO()
    trace.write_csv(sessions, out)
    path = tmp_path / "mixed.csv"
    path.write_text(out.getvalue())
    assert list(trace.read(path)) == sessions
    assert engine.describe(trace.read(path))["jobs"] == 600


def test_equal_users_take_turns_in_the_notebooks_too() -> None:
    notebooks = [s for s in trace.generate_mixed(300, users=9, seed=2, days=1.0, assign="round-robin") if s.end]
    users = [s.user for s in notebooks]
    assert users[:3] == ["i000", "i001", "i002"] and users[3] == "i000"
