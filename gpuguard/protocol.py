"""The daemon's wire format: one JSON object per line, one request per connection.

A request is `{"v": 1, "op": "<operation>", ...fields}` (requests.py types each operation's
fields; GPUs and MIG slices are named in `units`); the reply is
`{"v": 1, "ok": true, ...}` or `{"v": 1, "ok": false, "error": "<one line>", "code": N}`
where N is the CLI exit code the caller should use. Identity is never part of a
message: the server takes it from SO_PEERCRED. JSON only, never pickle.
"""
from __future__ import annotations

import json
import reprlib

from gpuguard.core.errors import UsageError
from gpuguard.core.escape import printable

TYPE_CHECKING = False  # not typing's: it costs the pam_exec hook (gpuguard.pam_hook) a few ms per login
if TYPE_CHECKING:
    from typing import Any

    from gpuguard.core.model import Event, Grant

VERSION = 1
MAX_REQUEST = 64 * 1024  # a login request is a few hundred bytes; anything larger is hostile
MAX_REPLY = 16 * 1024 * 1024  # status of a busy server, with its event history
MAX_EVENTS = 5000  # one events reply; a longer history is read with --since windows
MAX_NAME = 256  # a user name (Linux's LOGIN_NAME_MAX; useradd allows 32)

OPERATIONS = frozenset({
    "session_open", "session_close", "whoami", "status", "request", "release",
    "grant", "revoke", "reload", "sync_nodes", "report", "events", "wait", "gpus",
    "fleet_status", "where",  # a fleet's (gpuguard.fleet.ops)
    "cancel", "fairshare", "drain", "resume", "hold",  # steering the queue
    "use_history",  # utilisation and memory over time
})


# Operations renamed, read under the old name for one release (an older CLI): old -> new.
RENAMED_OPERATIONS = {"cluster_status": "fleet_status"}


class ProtocolError(UsageError):
    """A message that is not valid protocol (bad JSON, too large, unknown op or version)."""


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps({"v": VERSION, **message}, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes, limit: int = MAX_REPLY) -> dict[str, Any]:
    if len(line) > limit:
        raise ProtocolError(f"message exceeds {limit} bytes")
    try:
        message = json.loads(line)
    except ValueError as exc:  # bad JSON or UTF-8, or an integer over Python's limit of 4,300 digits
        raise ProtocolError(f"not JSON: {exc}") from None
    except RecursionError:  # [[[[...]]]] within the size limit: hostile, not an internal error
        raise ProtocolError("not JSON: nested too deeply") from None
    if not isinstance(message, dict):
        raise ProtocolError("message is not a JSON object")
    if message.get("v") != VERSION:
        raise ProtocolError(f"unsupported protocol version {shown(message.get('v'))} (this is {VERSION})")
    return message


def decode_request(line: bytes) -> dict[str, Any]:
    message = decode(line, MAX_REQUEST)
    op = message.get("op")
    if isinstance(op, str) and op in RENAMED_OPERATIONS:
        message["op"] = op = RENAMED_OPERATIONS[op]
    if not isinstance(op, str) or op not in OPERATIONS:  # a list or an object is not hashable
        raise ProtocolError(f"unknown operation {shown(op)}")
    return message


def _bounded_repr() -> reprlib.Repr:
    bounded = reprlib.Repr()
    # 4 levels deep at most: json.loads takes a value nested nearly as deep as the stack allows,
    # and a plain repr of it, a few frames deeper, ran out of stack (RecursionError: "internal error")
    bounded.maxlevel = 4
    # and as long as anything shown is cut to (`limit`) anyway, so that short values read as repr() has them
    bounded.maxstring = bounded.maxother = bounded.maxlong = 200
    bounded.maxlist = bounded.maxtuple = bounded.maxdict = bounded.maxset = bounded.maxfrozenset = 30
    return bounded


_BOUNDED = _bounded_repr()


def shown(value: Any, limit: int = 60) -> str:
    """A client's value in an error message: its repr, cut short (the client chose its size and depth)."""
    text = _BOUNDED.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def ok(**fields: Any) -> dict[str, Any]:
    return {"ok": True, **fields}


def record(item: Grant | Event) -> dict[str, Any]:
    """A grant or an event as replies carry it: its fields, its unit under the key "minor" that
    every client reads (the CLI, the web view, scripts): the wire's name, kept until the protocol
    itself changes (the code calls it `unit`, as it is one)."""
    from dataclasses import asdict  # here: the pam_exec hook imports this module at each login

    return {("minor" if key == "unit" else key): value for key, value in asdict(item).items()}


def refused(error: str, code: int = 1) -> dict[str, Any]:
    """An error reply. Errors quote what clients sent (a user name, a field), and the CLI prints
    them on a terminal: control characters are escaped here, once for every refusal."""
    return {"ok": False, "error": printable(error), "code": code}
