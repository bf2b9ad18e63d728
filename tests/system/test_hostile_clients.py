"""Hostile clients against a real daemon: wrong types in every field of every operation, and a
user looping request/release. Each gets one reply line, nothing reaches the log as a traceback,
and the event history stays within its retention."""
from __future__ import annotations

import json
import re
from itertools import product

import pytest
from conftest import PYTHON, run_as

from gpuguard import protocol
from gpuguard.daemon import requests as rq

pytestmark = pytest.mark.gate

BAD_VALUES = [["x"], {"op": "grant"}, 1.5, True, -1, 2 ** 70, "x" * 5000, "\x00", "\x1b[2K\r", ""]
FIELDS = ["user", "pid", "service", "rhost", "tty", "gpus", "units", "minors", "for", "since", "limit", "ticket"]

# Run as a user (or root): every operation with one field set to each bad value, raw on the socket.
SEND_ALL = """
import json, socket, sys
path, requests = sys.argv[1], json.loads(sys.stdin.read())
replies = []
for request in requests:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(json.dumps(request).encode() + b"\\n")
        replies.append(b"".join(iter(lambda: s.recv(65536), b"")).decode())
print(json.dumps(replies))
"""


def hostile_requests() -> list[dict]:
    requests = []
    for op, field, value in product(sorted(protocol.OPERATIONS - {"reload"}), FIELDS, BAD_VALUES):
        request = {"v": 1, "op": op, "user": "root", "pid": 1, field: value}
        requests.append(request)
    return requests


def send_all(d, user, requests: list[dict]) -> list[str]:
    argv = [PYTHON, "-c", SEND_ALL, d.socket]
    result = (run_as(user, argv, input=json.dumps(requests), timeout=300) if user else
              __import__("subprocess").run(argv, input=json.dumps(requests), capture_output=True, text=True,
                                           timeout=300))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_wrong_types_in_every_field_get_one_line_replies_and_no_traceback(start_daemon):
    d = start_daemon(defaults={"gpus": 1})
    mallory = d.add_member()
    requests = hostile_requests()
    for user in (mallory, None):  # a member, then root (who may call every operation)
        replies = send_all(d, user, requests)
        assert len(replies) == len(requests)
        for request, reply in zip(requests, replies, strict=True):
            assert reply.endswith("\n") and reply.count("\n") == 1, (request, reply)
            message = json.loads(reply)
            assert message["ok"] or message["error"].isprintable(), (request, message)
    assert "traceback=" not in d.log(), re.findall(r"exception=\"[^\"]*\"", d.log())
    assert "internal_error" not in d.log()
    # And the daemon goes on serving logins.
    alice = d.add_member()
    assert len(d.open_session(alice)["gpus"]) == 1


# Raw lines (json.dumps cannot write what json.loads only just takes), one connection each.
SEND_LINES = SEND_ALL.replace('json.dumps(request).encode() + b"\\n"', "request.encode()")
# json.loads takes a value nested up to about 1,000 levels, less the stack beneath it: the depths
# around that bound, where a repr of the value a few frames deeper ran out of stack (the finding).
DEPTHS = range(940, 1000)


def nested_requests() -> list[str]:
    """Every operation of the daemon's own (a fleet's answer "not in a fleet" here) with every field
    a list nested DEPTHS deep, as raw lines."""
    lines = []
    for op, depth in product(sorted(set(rq.KINDS) - {"reload"}), DEPTHS):
        fields = ", ".join(f'"{field}": {"[" * depth}{"]" * depth}' for field in FIELDS)
        lines.append(f'{{"v": {protocol.VERSION}, "op": "{op}", {fields}}}\n')
    return lines


def test_fields_nested_as_deep_as_json_takes_are_refused_without_a_traceback(start_daemon):
    d = start_daemon(defaults={"gpus": 1})
    mallory = d.add_member()
    lines = nested_requests()
    for user in (mallory, None):  # a member, then root (who may call every operation)
        argv = [PYTHON, "-c", SEND_LINES, d.socket]
        result = (run_as(user, argv, input=json.dumps(lines), timeout=300) if user else
                  __import__("subprocess").run(argv, input=json.dumps(lines), capture_output=True, text=True,
                                               timeout=300))
        assert result.returncode == 0, result.stderr
        replies = json.loads(result.stdout)
        assert len(replies) == len(lines)
        for line, reply in zip(lines, replies, strict=True):
            assert reply.endswith("\n") and reply.count("\n") == 1, (line[:80], reply)
            message = json.loads(reply)
            assert message["ok"] or not message["error"].startswith("internal error"), (line[:80], message)
    assert "internal_error" not in d.log(), re.findall(r"exception=\"[^\"]*\"", d.log())[:3]


def test_looping_request_and_release_keeps_the_event_history_bounded(start_daemon):
    d = start_daemon(defaults={"gpus": 1}, events={"per_user": 10})
    mallory = d.add_member()
    loop = ("import sys, time\nfrom gpuguard import client\n"
            "def call(op):\n"
            "    while True:\n"
            "        try:\n"
            "            return client.call(sys.argv[1], op, timeout=30)\n"
            "        except client.Refused as exc:  # requests and releases are rate-limited per user\n"
            "            assert 'too many' in str(exc), exc\n"
            "            time.sleep(0.2)\n"
            "for _ in range(40):\n"
            "    call('request')\n"
            "    call('release')\n")
    result = run_as(mallory, [PYTHON, "-c", loop, d.socket], timeout=300)
    assert result.returncode == 0, result.stderr
    events = d.whoami(mallory)["events"]
    assert len(events) == 10  # 80 grants and releases happened; the newest 10 are kept
    assert [e["kind"] for e in events[-2:]] == ["grant", "release"]


FORGED_TTY = "pts/3\r\x1b[2Kgpuguard level=crit event=grant user=root gpus=0,1,2,3"
FORGED_RHOST = "\x1b]0;pwned\x07evil\u202e.example"


def test_session_fields_never_reach_the_log_or_a_terminal_raw(start_daemon):
    d = start_daemon(defaults={"gpus": 1})
    alice = d.add_member()
    caller = d.caller()
    d.call("session_open", user=alice.name, service="sshd", rhost=FORGED_RHOST, tty=FORGED_TTY, pid=caller.pid)
    log = d.log()
    assert not any(c in log for c in "\r\x1b\x07\u202e")
    assert not [line for line in log.splitlines() if not line.startswith("gpuguard level=")]
    assert not [line for line in log.splitlines() if line.startswith("gpuguard level=crit")]
    [opened] = [line for line in log.splitlines() if "event=session_open " in line]
    assert r'tty="pts/3\r\x1b[2Kgpuguard level=crit event=grant user=root gpus=0,1,2,3"' in opened
    assert r'rhost="\x1b]0;pwned\x07evil\u202e.example"' in opened
    for argv in (("whoami", "--user", alice.name), ("status",)):
        shown = d.cli(*argv)
        assert shown.returncode == 0, shown.stderr
        assert not any(c in shown.stdout for c in "\r\x1b\x07\u202e"), shown.stdout
    assert r"pts/3\r\x1b[2Kgpuguard level=crit" in d.cli("whoami", "--user", alice.name).stdout
    # An error quoting the client's own input is escaped too, on the wire and on stderr.
    refused = d.cli("whoami", "--user", "\x1b[31mroot")
    assert refused.returncode == 2 and refused.stderr == "gpuguard: no such user: \\x1b[31mroot\n"
