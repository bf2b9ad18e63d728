"""The units admins write in config files: sizes (`20GiB`) and durations (`8h`).

`None` stands for `unlimited` / `none`. Parsing is strict: anything ambiguous is an error.
"""
from __future__ import annotations

import math
import re

from gpuguard.errors import UsageError

_SIZE_UNITS = {
    "": 1, "B": 1,
    "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_NUMBER = r"(\d+(?:\.\d+)?)"

MAX_SIZE = 1 << 50          # 1 PiB: no GPU comes close; larger is a typo
MAX_DURATION = 366 * 86400  # a year: longer limits are "none"


class UnitError(UsageError):
    """A size or duration that cannot be read."""


def parse_size(value: str | int) -> int | None:
    """`512MiB`, `20GiB`, `80GB`, a plain byte count, or `unlimited` (None)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UnitError(f"expected a size like 20GiB, got {value!r}")
    number: int | float
    if isinstance(value, int):
        number, unit = value, ""
    else:
        text = value.strip()
        if text == "unlimited":
            return None
        match = re.fullmatch(_NUMBER + r"\s*([KMGT]i?B|B)?", text)
        if not match:
            raise UnitError(f"not a size: {value!r} (write e.g. 512MiB, 20GiB or unlimited)")
        number, unit = float(match.group(1)), match.group(2) or ""
    size = int(number * _SIZE_UNITS[unit])
    if size < 0:
        raise UnitError(f"size must not be negative: {value!r}")
    if size > MAX_SIZE:
        raise UnitError(f"size {value!r} is absurdly large")
    return size


def parse_duration(value: str | int | float) -> float | None:
    """`90s`, `30m`, `8h`, `2d`, plain seconds, or `none` (None)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UnitError(f"expected a duration like 30m, got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):  # TOML allows nan and inf; a sleep(nan) would stop the watcher
            raise UnitError(f"expected a duration like 30m, got {value!r}")
        seconds = float(value)
    else:
        text = value.strip()
        if text == "none":
            return None
        match = re.fullmatch(_NUMBER + r"\s*([smhd])?", text)
        if not match:
            raise UnitError(f"not a duration: {value!r} (write e.g. 90s, 30m, 8h, 2d or none)")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]
    if seconds < 0:
        raise UnitError(f"duration must not be negative: {value!r}")
    if seconds > MAX_DURATION:
        raise UnitError(f"duration {value!r} is absurdly long (use none for no limit)")
    return seconds


def format_size(size: int | None) -> str:
    if size is None:
        return "unlimited"
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if size >= _SIZE_UNITS[unit]:
            return f"{size / _SIZE_UNITS[unit]:.3g}{unit}"
    return f"{size}B"


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "none"
    for unit in ("d", "h", "m"):
        if seconds >= _DURATION_UNITS[unit] and seconds % _DURATION_UNITS[unit] == 0:
            return f"{int(seconds // _DURATION_UNITS[unit])}{unit}"
    return f"{seconds:g}s"
