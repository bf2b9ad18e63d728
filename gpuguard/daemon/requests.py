"""The socket's requests: one frozen dataclass per operation of Api, and the one parser that makes them.

Any local user may send anything. `parse` refuses a missing field, a wrong type, a number out of
range and a text or list too long with one line and code 2 (the CLI's usage exit), before an
operation reads any state, and never spends more than one pass over what the 64 KiB request
line (protocol.MAX_REQUEST) holds. It checks the message only: what depends on the machine
(whether a GPU exists, the caller's quota, who may look at whom) is the operation's.

A unit is an index into the inventory: a whole GPU's minor, or >= 65536 for a MIG slice
(model.slice_unit). Requests name them in `units`; `minors`, the key's name before, is still
read for one release, so a CLI older than its daemon keeps working (drop it after that release).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from gpuguard.core import policy, reporting, use_history
from gpuguard.core.errors import EXIT_USAGE, Refusal
from gpuguard.core.quantities import UnitError, parse_duration
from gpuguard.protocol import MAX_EVENTS, MAX_NAME, shown


def _bad(message: str) -> Refusal:
    return Refusal(message, EXIT_USAGE)


INT_RANGE = (-(1 << 63), (1 << 63) - 1)  # SQLite's, and far beyond any pid, count or unit
MAX_PAM_ITEM = 1024  # a PAM item (service, remote host, tty) is cut to this: a host name is at most 253
MAX_REASON = 200   # a drain's reason is cut to this
MAX_UNITS = 1024   # units one request names: 64 GPUs of 7 MIG slices each is 512
MAX_DURATION_TEXT = 64
UNITS_KEY, OLD_UNITS_KEY = "units", "minors"  # OLD_UNITS_KEY: read for one release (see the module's text)

UnitName = int | str  # a unit's number, or its UUID (`--gpu GPU-…`, `--gpu MIG-…`)
Units = tuple[UnitName, ...]
DRAIN_WHOLE = "--gpu: name whole GPUs (a drain covers all of a GPU's MIG slices)"
_REQUIRED: Any = object()


class Fields:
    """Typed reads of one request's fields. A JSON null reads as a missing field."""

    def __init__(self, message: dict[str, Any]):
        self.message = message

    def _value(self, key: str, default: Any, kind: type | None = None) -> Any:
        """The field's value, of this kind when one is named; default when it is missing (a
        Refusal when the field is required)."""
        value = self.message.get(key)
        if value is None:
            if default is _REQUIRED:
                raise _bad(f"missing field {key!r}")
            return default
        if kind is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise _bad(f"field {key!r}: expected {kind.__name__}, got {shown(value)}")
        return value

    def text(self, key: str, default: Any = _REQUIRED, limit: float = MAX_NAME) -> Any:
        value = self._value(key, default, str)
        if isinstance(value, str) and len(value) > limit:
            raise _bad(f"field {key!r}: longer than {limit:.0f} characters")
        return value

    def name(self, key: str = "user", default: Any = _REQUIRED) -> Any:
        return self.text(key, default, MAX_NAME)

    def clipped(self, key: str, limit: int) -> str:
        """Root's text, cut to limit rather than refused: a PAM item (a login keeps its GPUs
        whatever its remote host says) or an admin's words."""
        text: str = self.text(key, "", math.inf)
        return text[:limit]

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        value: str = self.text(key, default)
        if value not in choices:
            raise _bad(f"field {key!r}: must be one of {', '.join(choices)}, got {shown(value)}")
        return value

    def integer(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._value(key, default, int)
        if isinstance(value, int) and not INT_RANGE[0] <= value <= INT_RANGE[1]:
            raise _bad(f"field {key!r}: {shown(value)} is out of range")
        return value

    def flag(self, key: str, default: bool = False) -> bool:
        return bool(self._value(key, default, bool))

    def epoch(self, key: str, default: float | None = None) -> float | None:
        """A time in epoch seconds (since, until): finite, and in SQLite's range."""
        value = self._value(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _bad(f"field {key!r}: expected a number (epoch seconds), got {shown(value)}")
        if not INT_RANGE[0] <= value <= INT_RANGE[1]:
            raise _bad(f"field {key!r}: {shown(value)} is out of range")
        return float(value)

    def seconds(self, key: str) -> float | None:
        """A wait in seconds, >= 0 and finite (NaN fails both comparisons)."""
        value = self._value(key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 <= value < math.inf):
            raise _bad(f"field {key!r}: expected seconds >= 0, got {shown(value)}")
        return None if value is None else float(value)

    def duration(self, key: str) -> float | None:
        """A grant's term (`--for 8h`): positive; None when not given."""
        value = self._value(key, None)
        if value is None:
            return None
        if isinstance(value, str) and len(value) > MAX_DURATION_TEXT:
            raise _bad(f"--for: expected a duration like 8h, got {shown(value)}")
        try:
            seconds = parse_duration(value)
        except UnitError as exc:
            raise _bad(f"--for: {exc}") from None
        if not seconds:
            raise _bad("--for: must be a positive duration like 8h")
        return seconds

    def units(self) -> Units | None:
        """The units a request names, by number or UUID; None when it names none."""
        key = UNITS_KEY if self.message.get(UNITS_KEY) is not None else OLD_UNITS_KEY
        value = self.message.get(key)
        if value is None:
            return None
        if isinstance(value, list) and len(value) > MAX_UNITS:  # before reading them all
            raise _bad(f"field {key!r}: more than {MAX_UNITS} GPUs")
        if not isinstance(value, list) or not value or not all(
                isinstance(u, str) or (isinstance(u, int) and not isinstance(u, bool)
                                       and INT_RANGE[0] <= u <= INT_RANGE[1]) for u in value):
            raise _bad(f"field {key!r}: expected a non-empty list of GPU numbers, got {shown(value)}")
        return tuple(value)


@dataclass(frozen=True)
class Op:
    """A request of one operation. root_only: refused to any other caller before it is read."""

    root_only: ClassVar[bool] = False

    @classmethod
    def read(cls, fields: Fields) -> Op:
        return cls()


@dataclass(frozen=True)
class SessionOpen(Op):
    """A login, from the PAM module (grant: the stack's module option grant=)."""

    root_only: ClassVar[bool] = True
    user: str
    pid: int
    service: str = ""
    rhost: str = ""
    tty: str = ""
    grant: str = "auto"

    @classmethod
    def read(cls, fields: Fields) -> SessionOpen:
        return cls(user=fields.name(), pid=fields.integer("pid"), service=fields.clipped("service", MAX_PAM_ITEM),
                   rhost=fields.clipped("rhost", MAX_PAM_ITEM), tty=fields.clipped("tty", MAX_PAM_ITEM),
                   grant=fields.choice("grant", policy.LOGIN_GRANTS, "auto"))


@dataclass(frozen=True)
class SessionClose(Op):
    root_only: ClassVar[bool] = True
    user: str
    pid: int

    @classmethod
    def read(cls, fields: Fields) -> SessionClose:
        return cls(fields.name(), fields.integer("pid"))


@dataclass(frozen=True)
class Whoami(Op):
    user: str | None = None  # None: the caller

    @classmethod
    def read(cls, fields: Fields) -> Whoami:
        return cls(fields.name(default=None))


@dataclass(frozen=True)
class Status(Op):
    pass


@dataclass(frozen=True)
class Fairshare(Op):
    pass


@dataclass(frozen=True)
class Gpus(Op):
    pass


@dataclass(frozen=True)
class Records(Op):
    """A read of the records (report, events) in [since, until); until defaults to now."""

    user: str | None
    since: float
    until: float | None

    def __post_init__(self) -> None:
        if self.until is not None:
            self.period(self.until)  # refused before the operation runs

    def period(self, now: float) -> tuple[float, float]:
        until = now if self.until is None else self.until
        if self.since >= until:
            raise _bad("since must be before until")
        return self.since, until


@dataclass(frozen=True)
class Report(Records):
    by: str = "user"

    @classmethod
    def read(cls, fields: Fields) -> Report:
        user, since, until = fields.name(default=None), fields.epoch("since"), fields.epoch("until")
        if since is None:
            raise _bad("missing field 'since'")
        by = fields.text("by", "user")
        if by not in reporting.GROUPINGS:
            raise _bad(f"field 'by': one of {', '.join(reporting.GROUPINGS)}, got {shown(by)}")
        return cls(user, since, until, by)


@dataclass(frozen=True)
class Events(Records):
    limit: int = 200
    rule: str | None = None

    @classmethod
    def read(cls, fields: Fields) -> Events:
        user, since, until = fields.name(default=None), fields.epoch("since", 0.0), fields.epoch("until")
        assert since is not None  # it has a default
        limit = fields.integer("limit", 200)
        if not 1 <= limit <= MAX_EVENTS:
            raise _bad(f"field 'limit': between 1 and {MAX_EVENTS}, got {limit}")
        rule = fields.text("rule", None)
        if rule is not None and rule not in reporting.EVENT_RULES:
            raise _bad(f"--rule: no rule {shown(rule)} (rules: {', '.join(reporting.EVENT_RULES)})")
        return cls(user, since, until, limit, rule)


@dataclass(frozen=True)
class UseHistory(Op):
    """Utilisation and memory over the last hour, day or week."""

    span: str = "hour"

    @classmethod
    def read(cls, fields: Fields) -> UseHistory:
        return cls(fields.choice("span", use_history.SPANS, "hour"))


def _at_least_one(gpus: int | None) -> int | None:
    if gpus is not None and gpus < 1:
        raise _bad("gpus must be at least 1")
    return gpus


@dataclass(frozen=True)
class Request(Op):
    """`gpuguard request`: gpus (None: the quota's number) or memory (bytes: a fraction of one GPU;
    None: whole GPUs, or the quota's fraction when gpus is None too); wait: queue if none is free."""

    gpus: int | None = None
    wait: bool = False
    memory: int | None = None

    @classmethod
    def read(cls, fields: Fields) -> Request:
        gpus, memory = _at_least_one(fields.integer("gpus", None)), fields.integer("memory", None)
        if memory is not None and (gpus is not None or memory < 1):
            raise _bad("memory is a fraction of one GPU: a positive number of bytes, without gpus")
        return cls(gpus, fields.flag("wait"), memory)


@dataclass(frozen=True)
class Wait(Op):
    """Block on a queued request (ticket, from request --wait) for at most limit seconds (None: no end)."""

    ticket: int
    limit: float | None = None

    @classmethod
    def read(cls, fields: Fields) -> Wait:
        return cls(fields.integer("ticket"), fields.seconds("limit"))


@dataclass(frozen=True)
class Release(Op):
    units: Units | None = None  # None: every GPU held, and a place in the queue

    @classmethod
    def read(cls, fields: Fields) -> Release:
        return cls(fields.units())


@dataclass(frozen=True)
class Cancel(Op):
    user: str | None = None  # root only: another user's requests

    @classmethod
    def read(cls, fields: Fields) -> Cancel:
        return cls(fields.name(default=None))


@dataclass(frozen=True)
class Grant(Op):
    """root's `gpuguard grant`: either a number of GPUs or the units, for a term (None: the quota's)."""

    root_only: ClassVar[bool] = True
    user: str
    gpus: int | None = None
    units: Units | None = None
    duration: float | None = None

    @classmethod
    def read(cls, fields: Fields) -> Grant:
        user, gpus, units = fields.name(), fields.integer("gpus", None), fields.units()
        if (gpus is None) == (units is None):
            raise _bad("give either gpus (a number) or units (a list)")
        return cls(user, _at_least_one(gpus), units, fields.duration("for"))


@dataclass(frozen=True)
class Revoke(Op):
    root_only: ClassVar[bool] = True
    user: str
    units: Units | None = None  # None: all the user holds

    @classmethod
    def read(cls, fields: Fields) -> Revoke:
        return cls(fields.name(), fields.units())


@dataclass(frozen=True)
class Hold(Op):
    root_only: ClassVar[bool] = True
    user: str
    off: bool = False  # let the held requests go on

    @classmethod
    def read(cls, fields: Fields) -> Hold:
        return cls(fields.name(), fields.flag("off"))


@dataclass(frozen=True)
class Drain(Op):
    root_only: ClassVar[bool] = True
    units: Units
    reason: str = ""

    @classmethod
    def read(cls, fields: Fields) -> Drain:
        units = fields.units()
        if units is None:
            raise _bad(DRAIN_WHOLE)
        return cls(units, fields.clipped("reason", MAX_REASON))  # kept in the drains file, shown to holders


@dataclass(frozen=True)
class Resume(Op):
    root_only: ClassVar[bool] = True
    units: Units

    @classmethod
    def read(cls, fields: Fields) -> Resume:
        units = fields.units()
        if units is None:
            raise _bad("--gpu: name the GPUs to resume")
        return cls(units)


@dataclass(frozen=True)
class SyncNodes(Op):
    root_only: ClassVar[bool] = True


@dataclass(frozen=True)
class Reload(Op):
    root_only: ClassVar[bool] = True


# Api's operations by their wire name; the method of Api that serves each has the same name.
KINDS: dict[str, type[Op]] = {
    "session_open": SessionOpen, "session_close": SessionClose, "whoami": Whoami, "status": Status,
    "fairshare": Fairshare, "gpus": Gpus, "report": Report, "events": Events, "request": Request, "wait": Wait,
    "release": Release, "cancel": Cancel, "grant": Grant, "revoke": Revoke, "hold": Hold, "drain": Drain,
    "resume": Resume, "sync_nodes": SyncNodes, "reload": Reload, "use_history": UseHistory,
}


def kind_of(message: dict[str, Any]) -> type[Op]:
    """The request class of a message's op (a Refusal for an op Api does not serve)."""
    op = message.get("op")
    kind = KINDS.get(op) if isinstance(op, str) else None  # a list or an object is not hashable
    if kind is None:
        raise _bad(f"unknown operation {shown(op)}")
    return kind


def parse(message: dict[str, Any]) -> Op:
    """The typed request a decoded message (protocol.decode_request) asks for, or a Refusal
    with one line and code 2 saying what is wrong with it."""
    return kind_of(message).read(Fields(message))
