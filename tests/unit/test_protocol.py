"""The wire format: what the daemon accepts, and that hostile input is a ProtocolError, never a crash."""
import json

import pytest

from gpuguard import protocol
from gpuguard.core.model import Event, Grant, slice_unit
from gpuguard.protocol import ProtocolError


def test_request_round_trip():
    line = protocol.encode({"op": "whoami", "user": "alice"})
    assert line.endswith(b"\n") and b"\n" not in line[:-1]
    assert protocol.decode_request(line) == {"v": protocol.VERSION, "op": "whoami", "user": "alice"}


@pytest.mark.parametrize("line, fragment", [
    (b"{not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "exceeds"),
    (b"[" * 30_000 + b"]" * 30_000, "not JSON: nested too deeply"),
    (b'{"v": 1, "op": "whoami", "gpus": ' + b"9" * 5000 + b"}", "not JSON: .*4300"),  # Python's digit limit
    (b'["a list"]', "not a JSON object"),
    (b'{"v": 2, "op": "whoami"}', "unsupported protocol version 2"),
    (b'{"op": "whoami"}', "unsupported protocol version None"),
    (b'{"v": 1, "op": "format_disk"}', "unknown operation 'format_disk'"),
    (b'{"v": 1, "op": ["x"]}', r"unknown operation \['x'\]"),
    (b'{"v": 1, "op": {"a": 1}}', "unknown operation {'a': 1}"),
    (b'{"v": 1, "op": null}', "unknown operation None"),
    (b'{"v": 1, "op": 3}', "unknown operation 3"),
    (b'{"v": [1], "op": "whoami"}', r"unsupported protocol version \[1\]"),
    (b'{"v": 1, "op": "' + b"x" * 1000 + b'"}', r"unknown operation 'x{59}\.\.\.$"),
    (b'"just a string"', "not a JSON object"),
    (b"17", "not a JSON object"),
])
def test_bad_requests_are_protocol_errors(line, fragment):
    with pytest.raises(ProtocolError, match=fragment):
        protocol.decode_request(line)


def test_a_value_nested_as_deep_as_json_takes_is_shown_without_running_out_of_stack():
    """json.loads takes a value nested nearly as deep as the stack allows; the daemon repr'd it in
    a refusal some frames deeper, which raised RecursionError (its "internal error")."""
    value = next(value for depth in range(999, 0, -1) if (value := _loaded("[" * depth + "]" * depth)) is not None)

    def deeper(frames: int) -> str:  # the request's way from the socket to the refusal, and more
        return deeper(frames - 1) if frames else protocol.shown(value)

    assert deeper(200) == "[[[[[...]]]]]"


def _loaded(text: str) -> object:
    try:
        return json.loads(text)
    except RecursionError:
        return None


def test_a_grants_and_an_events_unit_travel_under_the_wires_key_minor():
    grant = Grant(1001, "alice", slice_unit(3, 1, 0), 10.0, None, 10.0, uuid="MIG-x")
    event = Event(10.0, 1001, "alice", "grant", "yours", unit=2)
    sent = [protocol.record(grant), protocol.record(event)]
    assert [(r["minor"], "unit" in r) for r in sent] == [(slice_unit(3, 1, 0), False), (2, False)]
    assert list(sent[0])[:4] == ["uid", "user", "minor", "granted_at"]  # in the fields' order, as before
    assert protocol.decode(protocol.encode(sent[1]))["minor"] == 2
