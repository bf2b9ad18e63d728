"""The wire format: what the daemon accepts, and that hostile input is a ProtocolError, never a crash."""
import pytest

from gpuguard import protocol
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
