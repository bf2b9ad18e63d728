"""The units admins write in config files: sizes (`20GiB`) and durations (`8h`, `1h30m`).

`None` stands for `unlimited` / `none`. Parsing is strict: a bare number has no unit and is
refused with the value it most likely meant ("did you mean 20GiB?"), so `gpu_memory = 20` can
never quietly mean 20 bytes.

Sizes are binary whatever the spelling: `G`, `GB` and `GiB` all mean 2^30 bytes. GPU vendors
write memory that way (an "80GB" H100 has 80 GiB; nvidia-smi counts MiB), so an admin who
copies a number from a spec sheet gets what they meant. `quota show` prints the bytes too.
"""
from __future__ import annotations

import math
import re

from gpuguard.core.errors import UsageError

# Binary multiples under every common spelling (the key is lower-cased).
_SIZE_UNITS = {
    "b": 1,
    **{spelling: 1 << (10 * power)
       for power, letter in enumerate("kmgtp", start=1)
       for spelling in (letter, f"{letter}b", f"{letter}ib")},
}
_SIZE_NAMES = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_DURATION_UNITS = {
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600),
    **dict.fromkeys(("d", "day", "days"), 86400),
    **dict.fromkeys(("w", "wk", "week", "weeks"), 7 * 86400),
}
_NUMBER = r"(\d+(?:\.\d+)?)"
_DURATION_PART = re.compile(_NUMBER + r"\s*([a-z]+)\s*")
_BARE_NUMBER = re.compile(r"\s*" + _NUMBER + r"\s*")

MAX_SIZE = 1 << 50          # 1 PiB: no GPU comes close; larger is a typo
MAX_DURATION = 366 * 86400  # a year: longer limits are "none"


class UnitError(UsageError):
    """A size or duration that cannot be read, with the value it most likely meant."""


def _bare(value: str | int | float) -> float | None:
    """The number of a value written without a unit (`20`, 20, 3600.0), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and (match := _BARE_NUMBER.fullmatch(value)):
        return float(match.group(1))
    return None


def _number_text(number: float) -> str:
    return f"{number:g}"


def size_guess(number: float) -> str:
    """What a size written without a unit most likely meant: `20` -> 20GiB, 21474836480 -> 20GiB."""
    if number >= 1 << 20:
        return format_size(int(number))  # a byte count: name it the usual way
    return f"{_number_text(number)}GiB" if number < 4096 else f"{_number_text(number)}MiB"


def duration_guess(number: float) -> str:
    """What a duration written without a unit most likely meant: `8` -> 8h, `3600` -> 1h, and
    `0` -> no limit (`0h` is no time at all, which every time limit refuses)."""
    if number == 0:
        return "none (no limit) or 0s"
    if number >= 60:  # seconds, as plain numbers meant before units were required
        return f"{_number_text(number)}s ({format_duration(number)})"
    return f"{_number_text(number)}h"


def parse_size(value: str | int) -> int | None:
    """`512MiB`, `20GiB`, `80GB` (= 80GiB), `1.5g`, or `unlimited` (None)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UnitError(f"expected a size like 20GiB, got {value!r}")
    bare = _bare(value)
    if bare is not None:
        raise UnitError(f"{value!r} has no unit; did you mean {size_guess(bare)}? (sizes: 512MiB, 20GiB, unlimited)")
    assert isinstance(value, str)
    text = value.strip()
    if text.lower() == "unlimited":
        return None
    match = re.fullmatch(_NUMBER + r"\s*([a-zA-Z]+)", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise UnitError(f"not a size: {value!r} (write e.g. 512MiB, 20GiB or unlimited)")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if size > MAX_SIZE:
        raise UnitError(f"size {value!r} is absurdly large")
    return size


def parse_duration(value: str | int | float, bare_unit: str | None = None) -> float | None:
    """`90s`, `30m`, `8h`, `2d`, `1w`, compounds (`1h30m`, `1h 30min`), words (`8 hours`), or `none`.

    A bare number is refused with a guess, unless the caller names the unit it means
    (`bare_unit="s"`: an option called --seconds)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UnitError(f"expected a duration like 30m, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):  # TOML allows nan and inf
        raise UnitError(f"expected a duration like 30m, got {value!r}")
    bare = _bare(value)
    if bare is not None:
        if bare_unit is None:
            raise UnitError(f"{value!r} has no unit; did you mean {duration_guess(bare)}? "
                            "(durations: 90s, 30m, 8h, 1h30m, 2d, 1w, none)")
        seconds = bare * _DURATION_UNITS[bare_unit]
    else:
        assert isinstance(value, str)
        text = value.strip().lower()
        if text == "none":
            return None
        seconds = _compound(value, text)
    if seconds > MAX_DURATION:
        raise UnitError(f"duration {value!r} is absurdly long (use none for no limit)")
    return seconds


def _compound(value: str, text: str) -> float:
    """`1h30m` -> 5400: number-unit pairs, each unit once, largest first."""
    seconds, position, last = 0.0, 0, math.inf
    while position < len(text):
        match = _DURATION_PART.match(text, position)
        unit = _DURATION_UNITS.get(match.group(2)) if match else None
        if match is None or unit is None or unit >= last:
            raise UnitError(f"not a duration: {value!r} (write e.g. 90s, 30m, 8h, 1h30m, 2d, 1w or none)")
        seconds += float(match.group(1)) * unit
        position, last = match.end(), unit
    if position == 0:
        raise UnitError(f"not a duration: {value!r} (write e.g. 90s, 30m, 8h, 1h30m, 2d, 1w or none)")
    return seconds


def format_size(size: int | None) -> str:
    if size is None:
        return "unlimited"
    for unit, factor in _SIZE_NAMES:
        if size >= factor:
            return f"{size / factor:.3g}{unit}"
    return f"{size}B"


def format_duration(seconds: float | None) -> str:
    """`8h`, `1h30m`, `2d4h`, `45s`, `1.5s`: the largest units first, whole seconds from 10s on,
    so a time reads as a person would say it (`9.98768s` is `10s`) and `parse_duration` reads it back."""
    if seconds is None:
        return "none"
    if seconds < 10 and seconds != int(seconds):
        return f"{seconds:.2g}s"
    left = int(round(seconds))
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size or (unit == "s" and not parts):
            parts.append(f"{left // size}{unit}")
            left %= size
        if parts and not left:
            break
    return "".join(parts)


def format_gpu_hours(*seconds: float) -> tuple[str, ...]:
    """GPU-seconds as GPU-hours, with the fewest decimals (one at least, six at most) at which
    values that differ read differently: `(0.0, 0.0)` for a fair-share comparison says nothing."""
    hours = [value / 3600 for value in seconds]
    for digits in range(1, 7):
        shown = tuple(f"{value:.{digits}f}" for value in hours)
        if len(set(shown)) == len(set(hours)):
            return shown
    return shown
