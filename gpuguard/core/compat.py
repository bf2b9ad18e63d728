"""What Python 3.11 added that gpuguard uses, for Python 3.10 (Ubuntu 22.04's python3).

Import `tomllib` and `StrEnum` from here, never from the standard library directly.
"""
from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    from enum import StrEnum

    import tomllib
else:  # pragma: no cover - exercised by `make test-py310`
    import tomli as tomllib

    class StrEnum(str, enum.Enum):
        """enum.StrEnum of 3.11: members are str, and str() gives the value, not `Class.MEMBER`."""

        def __new__(cls, value: str) -> StrEnum:
            if not isinstance(value, str):
                raise TypeError(f"{value!r} is not a string")
            member = str.__new__(cls, value)
            member._value_ = value
            return member

        def __str__(self) -> str:
            return str(self.value)

        @staticmethod
        def _generate_next_value_(name: str, start: int, count: int, last_values: list[str]) -> str:
            return name.lower()

__all__ = ["StrEnum", "tomllib"]
