"""Changing quota tables in the admin's TOML files, for `gpuguard quota set`.

The edit is text in, text out, through tomlkit, so the admin's comments, key order and
layout survive and only the keys being changed differ. Values are parsed and checked with
the loader's own parsers (config.QUOTA_KEYS) and written as an admin would write them:
`gpus = 2`, `gpu_memory = "40GiB"`, `sharing = true`. `replace_file` then puts the new
text in place atomically, and only after the caller's check accepted the whole file.

tomlkit and tempfile are loaded by the edit itself: `quota show` prints with show_fields, and
tomlkit alone costs it more than Python's own start.
"""
from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuguard.config import QUOTA_KEYS
from gpuguard.core.compat import tomllib
from gpuguard.core.errors import UsageError
from gpuguard.core.quantities import format_duration, format_size

if TYPE_CHECKING:
    import tomlkit

DEFAULTS = ("defaults",)  # the [defaults] table of gpuguard.toml; ("users"|"groups", NAME) in quotas.toml
NEW_FILE_MODE = 0o644      # quota files are world-readable: anyone may run `gpuguard quota show`

def _size_shown(value: int | None) -> str:
    return format_size(value) + ("" if value is None else f" ({value} bytes)")


# How each quota field reads back to a person (and to `quota set`: the same syntax; a size also in bytes).
_SHOWN: dict[str, Callable[[Any], str]] = {
    "gpus": str,
    "gpu_memory": _size_shown,
    "fraction_memory": _size_shown,
    "min_fraction_memory": _size_shown,
    "max_fraction_memory": _size_shown,
    "max_fractions": lambda value: "any" if value is None else str(value),
    "max_time": format_duration,
    "idle_timeout": format_duration,
    "sharing": lambda value: "true" if value else "false",
    "share": lambda value: f"{value:g}",
    "reclaim_after": format_duration,
    "fleet_gpus": lambda value: "none" if value is None else str(value),
    "slices": lambda value: "any" if value is None else str(value),
    "whole_gpus": lambda value: "true" if value else "false",
    "slice_profiles": lambda value: json.dumps(list(value)),  # a TOML array, as quota set takes it
}


class QuotaEditError(UsageError):
    """One line naming the key (or argument) and the problem."""


def check_key(key: str) -> None:
    if key not in QUOTA_KEYS:
        raise QuotaEditError(f"{key or '(empty)'}: unknown key (known: {', '.join(QUOTA_KEYS)})")


def toml_value(text: str) -> Any:
    """What `KEY=text` means as a TOML value: `2` an integer, `true` a boolean, `"40GiB"` a string,
    and a bare word such as 40GiB, 24h or none the string an admin would have quoted."""
    try:
        parsed = tomllib.loads(f"value = {text}")
    except tomllib.TOMLDecodeError:
        return text.strip()
    if parsed.keys() != {"value"}:
        return text.strip()  # text with a newline would smuggle in more keys: keep it one string (refused later)
    return parsed["value"]


def parse_assignment(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` as (key, TOML value), checked exactly as the loader checks it; `KEY=` is
    (key, None): remove the key from the table. Raises QuotaEditError."""
    key, equals, raw = text.partition("=")
    key = key.strip()
    if not equals:
        raise QuotaEditError(f"{text}: expected KEY=VALUE (or KEY= to remove the key)")
    check_key(key)
    if not raw.strip():
        return key, None
    value = toml_value(raw)
    try:
        QUOTA_KEYS[key](value)
    except ValueError as exc:  # the units' UnitError is a ValueError too
        raise QuotaEditError(f"{key}: {exc}") from None
    return key, value


def show_value(key: str, value: Any) -> str:
    """A parsed quota value as `quota show` prints it (the syntax `quota set` takes)."""
    return _SHOWN.get(key, str)(value)


def show_fields(fields: dict[str, Any]) -> str:
    """`gpus=2 max_time=4h`: the fields in the order QUOTA_KEYS lists them."""
    return " ".join(f"{key}={show_value(key, fields[key])}" for key in QUOTA_KEYS if key in fields)


def edit(text: str, table: tuple[str, ...], changes: dict[str, Any]) -> str:
    """`text` with the keys of `table` set to the given TOML values, or removed where the value
    is None. Everything else stays byte for byte. A table that does not exist yet is added at
    the end of the file (for groups: after every other group, so it ranks last), and a user or
    group table left with nothing in it (no keys, no comments) is removed."""
    import tomlkit
    from tomlkit.exceptions import TOMLKitError
    try:
        doc = tomlkit.parse(text)
    except TOMLKitError as exc:  # tomllib took it, so this is rare: still one line
        raise QuotaEditError(f"cannot edit this file: {exc}") from None
    parent, entry = _find(doc, table)
    if entry is None:
        new = {key: value for key, value in changes.items() if value is not None}
        return _append_table(text, table, new) if new else text
    for key, value in changes.items():
        if value is not None:
            entry[key] = value  # tomlkit keeps the old line's indent and trailing comment
        elif key in entry:
            del entry[key]
    if table != DEFAULTS and _is_blank(entry):
        del parent[table[-1]]
    return doc.as_string()


def _find(doc: tomlkit.TOMLDocument, table: tuple[str, ...]) -> tuple[Any, Any]:
    """The table at `table` and the table holding it; (holder or None, None) where it is absent."""
    parent: Any = None
    node: Any = doc
    for part in table:
        if not hasattr(node, "get"):
            raise QuotaEditError(f"{'.'.join(table)}: {part!r} is inside a value that is not a table")
        parent, node = node, node.get(part)
        if node is None:
            return parent, None
    if not hasattr(node, "get"):
        raise QuotaEditError(f"{'.'.join(table)}: expected a table, found {node!r}")
    return parent, node


def _is_blank(entry: Any) -> bool:
    # Comments in a table's body (tomlkit also files there the comments above the next header)
    # or on its header line are the admin's words: keep such a table, even with no keys left.
    # (Null: what tomlkit leaves where a key was deleted.)
    from tomlkit.items import Null, Whitespace
    return (len(entry) == 0 and not entry.trivia.comment
            and all(isinstance(item, (Whitespace, Null)) for _, item in entry.value.body))


def _append_table(text: str, table: tuple[str, ...], values: dict[str, Any]) -> str:
    # Appended as text rather than through tomlkit: tomlkit would insert it right after the
    # last sibling table, below comments that belong to whatever table follows.
    import tomlkit
    nested: dict[str, Any] = values
    for part in reversed(table):
        nested = {part: nested}
    separator = "" if not text.strip() or text.endswith("\n\n") else "\n" if text.endswith("\n") else "\n\n"
    return text + separator + tomlkit.dumps(nested)


def replace_file(path: Path, text: str, check: Callable[[Path], None]) -> None:
    """Put `text` in `path` atomically: a temporary file in the same directory (same mode and
    owner as the file it replaces), fsync, `check(temporary path)`, then rename over the file.
    When check raises, the file is untouched and the temporary file gone. A symlinked file is
    written where the link points, so the link (e.g. to a config-management checkout) stays."""
    import tempfile
    target = Path(os.path.realpath(path))
    try:
        old = target.stat()
    except FileNotFoundError:
        old = None
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:  # newlines exactly as given
            handle.write(text)
            handle.flush()
            if old is not None:
                os.fchown(handle.fileno(), old.st_uid, old.st_gid)  # before chmod: chown clears set-id bits
            os.fchmod(handle.fileno(), stat.S_IMODE(old.st_mode) if old is not None else NEW_FILE_MODE)
            os.fsync(handle.fileno())
        check(Path(temporary))
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    # The rename itself must reach the disk, or a crash could bring back the old file.
    directory = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
