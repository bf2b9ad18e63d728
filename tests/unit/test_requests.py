"""The socket's requests (gpuguard/requests.py): each operation's typed request, and the one-line
refusals a hostile or mistaken client gets for each kind of bad input, before any state is read."""
from __future__ import annotations

import math
import typing

import pytest
from fakes import GROUP

from gpuguard import fleet, protocol
from gpuguard.core import reporting
from gpuguard.core.errors import Refusal
from gpuguard.daemon import requests as rq
from gpuguard.daemon.api import Api

# The least each operation needs, and what it reads as.
MINIMAL: dict[str, tuple[dict, rq.Op]] = {
    "session_open": ({"user": "alice", "pid": 7}, rq.SessionOpen("alice", 7)),
    "session_close": ({"user": "alice", "pid": 7}, rq.SessionClose("alice", 7)),
    "whoami": ({}, rq.Whoami()),
    "status": ({}, rq.Status()),
    "fairshare": ({}, rq.Fairshare()),
    "gpus": ({}, rq.Gpus()),
    "report": ({"since": 10}, rq.Report(None, 10.0, None)),
    "events": ({}, rq.Events(None, 0.0, None)),
    "request": ({}, rq.Request()),
    "wait": ({"ticket": 3}, rq.Wait(3)),
    "release": ({}, rq.Release()),
    "cancel": ({}, rq.Cancel()),
    "grant": ({"user": "alice", "gpus": 1}, rq.Grant("alice", gpus=1)),
    "revoke": ({"user": "alice"}, rq.Revoke("alice")),
    "hold": ({"user": "alice"}, rq.Hold("alice")),
    "drain": ({"units": [0]}, rq.Drain((0,))),
    "resume": ({"units": [0]}, rq.Resume((0,))),
    "sync_nodes": ({}, rq.SyncNodes()),
    "reload": ({}, rq.Reload()),
    "use_history": ({}, rq.UseHistory()),
}


def parse(op: str, **fields: object) -> rq.Op:
    return rq.parse({"v": 1, "op": op, **fields})


def refusal(op: str, **fields: object) -> tuple[str, int]:
    with pytest.raises(Refusal) as caught:
        parse(op, **fields)
    return str(caught.value), caught.value.code


def test_every_operation_of_the_protocol_is_api_s_or_the_fleet_s():
    assert set(rq.KINDS) | fleet.OPERATIONS == protocol.OPERATIONS
    assert not set(rq.KINDS) & fleet.OPERATIONS
    assert set(MINIMAL) == set(rq.KINDS)


@pytest.mark.parametrize("op", sorted(rq.KINDS))
def test_each_operation_reads_as_its_own_type_served_by_the_api_method_of_its_name(op):
    fields, expected = MINIMAL[op]
    parsed = parse(op, **fields)
    assert type(parsed) is rq.KINDS[op] and parsed == expected
    hints = typing.get_type_hints(getattr(Api, op))
    assert hints["request"] is rq.KINDS[op]


def test_root_s_operations_are_the_admin_s_and_the_pam_module_s():
    assert {op for op, kind in rq.KINDS.items() if kind.root_only} == {
        "session_open", "session_close", "grant", "revoke", "reload", "sync_nodes", "drain", "resume", "hold"}


def test_every_field_is_read():
    assert parse("session_open", user="a", pid=1, service="sshd", rhost="h", tty="pts/1", grant="never") == \
        rq.SessionOpen("a", 1, "sshd", "h", "pts/1", "never")
    assert parse("report", user="a", since=1, until=2.5, by="gpu") == rq.Report("a", 1.0, 2.5, "gpu")
    assert parse("events", user="a", since=1, until=2, limit=5, rule="memory") == rq.Events("a", 1.0, 2.0, 5, "memory")
    assert parse("request", gpus=2, wait=True) == rq.Request(2, True)
    assert parse("wait", ticket=1, limit=0) == rq.Wait(1, 0.0)
    assert parse("release", units=[3, "GPU-0001"]) == rq.Release((3, "GPU-0001"))
    assert parse("grant", user="a", units=[1], **{"for": "2h"}) == rq.Grant("a", None, (1,), 7200.0)
    assert parse("hold", user="a", off=True) == rq.Hold("a", True)
    assert parse("drain", units=[1], reason="fan") == rq.Drain((1,), "fan")


def test_a_json_null_reads_as_a_missing_field():
    assert parse("request", gpus=None, wait=None) == rq.Request()
    assert refusal("session_close", user=None, pid=1) == ("missing field 'user'", 2)


@pytest.mark.parametrize("op, fields, error", [
    ("session_open", {"pid": 1}, "missing field 'user'"),
    ("session_open", {"user": "a"}, "missing field 'pid'"),
    ("session_close", {"user": "a"}, "missing field 'pid'"),
    ("wait", {}, "missing field 'ticket'"),
    ("report", {}, "missing field 'since'"),
    ("grant", {"gpus": 1}, "missing field 'user'"),
    ("revoke", {}, "missing field 'user'"),
    ("hold", {}, "missing field 'user'"),
    ("grant", {"user": "a"}, "give either gpus (a number) or units (a list)"),
    ("grant", {"user": "a", "gpus": 1, "units": [0]}, "give either gpus (a number) or units (a list)"),
    ("drain", {}, rq.DRAIN_WHOLE),
    ("resume", {}, "--gpu: name the GPUs to resume"),
])
def test_a_missing_field(op, fields, error):
    assert refusal(op, **fields) == (error, 2)


@pytest.mark.parametrize("op, fields, error", [
    ("session_open", {"user": 7, "pid": 1}, "field 'user': expected str, got 7"),
    ("session_open", {"user": "a", "pid": "1"}, "field 'pid': expected int, got '1'"),
    ("session_open", {"user": "a", "pid": True}, "field 'pid': expected int, got True"),
    ("session_open", {"user": "a", "pid": 1.0}, "field 'pid': expected int, got 1.0"),
    ("session_open", {"user": "a", "pid": 1, "tty": ["x"]}, "field 'tty': expected str, got ['x']"),
    ("whoami", {"user": {"op": "x"}}, "field 'user': expected str, got {'op': 'x'}"),
    ("request", {"gpus": "2"}, "field 'gpus': expected int, got '2'"),
    ("request", {"wait": 1}, "field 'wait': expected bool, got 1"),
    ("hold", {"user": "a", "off": "yes"}, "field 'off': expected bool, got 'yes'"),
    ("wait", {"ticket": 1, "limit": "10"}, "field 'limit': expected seconds >= 0, got '10'"),
    ("wait", {"ticket": 1, "limit": True}, "field 'limit': expected seconds >= 0, got True"),
    ("report", {"since": "yesterday"}, "field 'since': expected a number (epoch seconds), got 'yesterday'"),
    ("events", {"until": [1]}, "field 'until': expected a number (epoch seconds), got [1]"),
    ("events", {"limit": 2.5}, "field 'limit': expected int, got 2.5"),
    ("events", {"rule": 3}, "field 'rule': expected str, got 3"),
    ("release", {"units": 3}, "field 'units': expected a non-empty list of GPU numbers, got 3"),
    ("release", {"units": []}, "field 'units': expected a non-empty list of GPU numbers, got []"),
    ("release", {"units": [1, True]}, "field 'units': expected a non-empty list of GPU numbers, got [1, True]"),
    ("release", {"units": [1.5]}, "field 'units': expected a non-empty list of GPU numbers, got [1.5]"),
    ("release", {"units": [[0]]}, "field 'units': expected a non-empty list of GPU numbers, got [[0]]"),
    ("grant", {"user": "a", "units": [0], "for": [1]}, "--for: expected a duration like 30m, got [1]"),
    ("drain", {"units": [0], "reason": 5}, "field 'reason': expected str, got 5"),
])
def test_a_wrong_type(op, fields, error):
    assert refusal(op, **fields) == (error, 2)


@pytest.mark.parametrize("op, fields, error", [
    ("session_open", {"user": "a", "pid": 2 ** 70}, "field 'pid': 1180591620717411303424 is out of range"),
    ("wait", {"ticket": -(2 ** 63) - 1}, "field 'ticket': -9223372036854775809 is out of range"),
    ("request", {"gpus": 0}, "gpus must be at least 1"),
    ("grant", {"user": "a", "gpus": -1}, "gpus must be at least 1"),
    ("wait", {"ticket": 1, "limit": -1}, "field 'limit': expected seconds >= 0, got -1"),
    ("wait", {"ticket": 1, "limit": math.inf}, "field 'limit': expected seconds >= 0, got inf"),
    ("wait", {"ticket": 1, "limit": math.nan}, "field 'limit': expected seconds >= 0, got nan"),
    ("report", {"since": math.inf}, "field 'since': expected a number (epoch seconds), got inf"),
    ("report", {"since": math.nan}, "field 'since': expected a number (epoch seconds), got nan"),
    ("report", {"since": 2 ** 70}, "field 'since': 1180591620717411303424 is out of range"),
    ("report", {"since": 5, "until": 5}, "since must be before until"),
    ("events", {"limit": 0}, f"field 'limit': between 1 and {protocol.MAX_EVENTS}, got 0"),
    ("events", {"limit": protocol.MAX_EVENTS + 1},
     f"field 'limit': between 1 and {protocol.MAX_EVENTS}, got {protocol.MAX_EVENTS + 1}"),
    ("release", {"units": [2 ** 64]},
     "field 'units': expected a non-empty list of GPU numbers, got [18446744073709551616]"),
    ("grant", {"user": "a", "units": [0], "for": "0s"}, "--for: must be a positive duration like 8h"),
    ("grant", {"user": "a", "units": [0], "for": "none"}, "--for: must be a positive duration like 8h"),
    ("grant", {"user": "a", "units": [0], "for": math.inf}, "--for: expected a duration like 30m, got inf"),
    ("session_open", {"user": "a", "pid": 1, "grant": "sometimes"},
     "field 'grant': must be one of auto, always, never, got 'sometimes'"),
    ("report", {"since": 1, "by": "week"}, "field 'by': one of user, gpu, day, got 'week'"),
    ("events", {"rule": "memroy"}, f"--rule: no rule 'memroy' (rules: {', '.join(reporting.EVENT_RULES)})"),
])
def test_out_of_range(op, fields, error):
    assert refusal(op, **fields) == (error, 2)


@pytest.mark.parametrize("op, fields, error", [
    ("whoami", {"user": "x" * (protocol.MAX_NAME + 1)}, f"field 'user': longer than {protocol.MAX_NAME} characters"),
    ("report", {"since": 1, "by": "x" * (protocol.MAX_NAME + 1)}, f"field 'by': longer than {protocol.MAX_NAME} characters"),
    ("release", {"units": list(range(rq.MAX_UNITS + 1))}, f"field 'units': more than {rq.MAX_UNITS} GPUs"),
    ("grant", {"user": "a", "units": [0], "for": "1h" * 40},
     "--for: expected a duration like 8h, got " + protocol.shown("1h" * 40)),
])
def test_too_long(op, fields, error):
    assert refusal(op, **fields) == (error, 2)


def test_names_at_their_limit_are_read():
    assert parse("whoami", user="x" * protocol.MAX_NAME) == rq.Whoami("x" * protocol.MAX_NAME)
    assert len(parse("release", units=list(range(rq.MAX_UNITS))).units or ()) == rq.MAX_UNITS


def test_a_refusal_quotes_a_client_s_value_cut_short():
    error, code = refusal("session_open", user="a", pid="9" * 5000)
    assert code == 2 and len(error) < 100 and error.endswith("...")


def test_root_s_texts_are_cut_not_refused():
    """A login keeps its GPUs whatever its PAM items say; an admin's reason is kept short."""
    assert parse("drain", units=[0], reason="r" * 5000) == rq.Drain((0,), "r" * rq.MAX_REASON)
    opened = parse("session_open", user="a", pid=1, rhost="h" * 5000, tty="t" * 5000, service="s" * 5000)
    assert opened == rq.SessionOpen("a", 1, *(letter * rq.MAX_PAM_ITEM for letter in "sht"))
    assert refusal("session_open", user="a", pid=1, rhost=["h"]) == ("field 'rhost': expected str, got ['h']", 2)


def test_the_old_minors_key_is_still_read_and_units_wins_over_it():
    assert parse("release", minors=[1, 2]) == rq.Release((1, 2))
    assert parse("revoke", user="a", minors=[3], units=[4]) == rq.Revoke("a", (4,))
    assert parse("grant", user="a", minors=[3]) == rq.Grant("a", units=(3,))
    assert refusal("resume", minors="3") == ("field 'minors': expected a non-empty list of GPU numbers, got '3'", 2)


@pytest.mark.parametrize("op", [None, 3, ["status"], "fleet_status", "nonsense"])
def test_an_operation_api_does_not_serve(op):
    with pytest.raises(Refusal) as caught:
        rq.parse({"v": 1, "op": op})
    assert caught.value.code == 2 and str(caught.value).startswith("unknown operation ")


def test_the_period_ends_now_unless_until_is_given():
    assert rq.Report(None, 10.0, None).period(now=50.0) == (10.0, 50.0)
    assert rq.Events(None, 0.0, 20.0).period(now=50.0) == (0.0, 20.0)
    with pytest.raises(Refusal, match="since must be before until"):
        rq.Report(None, 60.0, None).period(now=50.0)


# Through Api: the order of the checks, and the units of both keys.

def test_root_s_operations_are_refused_to_a_user_before_their_fields_are_read(world):
    world.lookup.add("alice", 1001, GROUP)
    reply = world.call("grant", uid=1001, user=["not", "a", "name"], units="bad")
    assert reply == {"ok": False, "error": "grant is for root only", "code": 1}


def test_a_malformed_request_changes_nothing(world):
    world.lookup.add("alice", 1001, GROUP)
    reply = world.call("request", uid=1001, gpus=True)
    assert reply == {"ok": False, "error": "field 'gpus': expected int, got True", "code": 2}
    assert world.held(1001) == [] and world.store.queue() == []


def test_grants_by_units_by_the_old_minors_key_and_by_uuid(world):
    world.quota(gpus=4)
    world.lookup.add("alice", 1001, GROUP)
    assert world.call("grant", user="alice", units=[1])["gpus"] == [1]
    assert world.call("grant", user="alice", minors=[2])["gpus"] == [2]  # a CLI of the release before
    assert world.call("grant", user="alice", units=["GPU-0003"])["gpus"] == [3]
    assert world.held(1001) == [1, 2, 3]
    unknown = world.call("grant", user="alice", units=["GPU-9999"])
    assert (unknown["error"], unknown["code"]) == ("--gpu: no GPU or MIG slice 'GPU-9999' on this machine", 2)
    missing = world.call("grant", user="alice", units=[7])
    assert (missing["error"], missing["code"]) == ("no GPU 7 on this machine (GPUs: 0,1,2,3)", 2)
    released = world.call("release", uid=1001, units=[2, 3])
    assert released["released"] == [2, 3] and world.held(1001) == [1]
