"""The `gpuguard whoami` example of docs/users.md (the README's, before issue 34 moved it) against a
real run: the same lines in the same order, once names, numbers, times and UUIDs are set aside
(issue 22: the documented examples match what the commands print)."""
from __future__ import annotations

import re
from pathlib import Path

from devtools.harness import wait_for

README = Path(__file__).resolve().parents[2] / "docs" / "users.md"  # where the example lives


def readme_example() -> list[str]:
    text = README.read_text()
    block = text[text.index("alice@gpu1:~$ gpuguard whoami\n"):]
    return block.split("\n", 1)[1].split("```", 1)[0].rstrip("\n").splitlines()


def shape(line: str, user: str, group: str) -> str:
    """The line with what varies between machines and runs replaced by placeholders."""
    line = line.replace(user, "<user>").replace(group, "<group>")
    line = re.sub(r" \(nvidia-smi \d+\)", "", line)  # shown only where NVML's index differs from the minor
    line = re.sub(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", "<uuid>", line)
    # A time on another day carries its weekday or date (messages.clock): run after 16:00, an
    # 8-hour grant ends tomorrow ("Wed 00:03"), and the documented example is of one day.
    line = re.sub(r"\b(?:(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)|\d{4}-\d{2}-\d{2}) (?=\d{1,2}:\d{2}\b)", "", line)
    line = re.sub(r"\b\d{1,2}:\d{2}\b", "<time>", line)
    line = re.sub(r"\b\d+\b", "<n>", line)
    return " ".join(line.split())  # column widths follow the values


def test_the_readme_whoami_example_has_the_shape_of_a_real_run(start_daemon):
    d = start_daemon(defaults={"gpus": 1, "gpu_memory": "20GiB", "max_time": "8h"})
    alice = d.add_member()
    d.call("session_open", user=alice.name, service="sshd", rhost="10.0.0.7", tty="/dev/pts/3", pid=d.caller().pid)
    wait_for(lambda: d.grants(alice)[0]["memory_used"] is not None)  # the first sample of the GPU: its MEMORY

    real = d.cli_as(alice, "whoami")

    assert real.returncode == 0, real.stderr
    example = readme_example()
    assert [shape(line, "alice", "gpugroup") for line in example] == \
        [shape(line, alice.name, d.group) for line in real.stdout.splitlines()]
