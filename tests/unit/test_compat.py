"""gpuguard.core.compat: the 3.11 standard library pieces gpuguard uses, on every supported Python
(`make test-py310` runs this file on 3.10, where the fallbacks are the ones in use)."""
from __future__ import annotations

import enum
import json

import pytest

from gpuguard.core.compat import StrEnum, tomllib


class Kind(StrEnum):
    GRANT = "grant"
    REVOKE = enum.auto()


def test_strenum_members_are_their_values() -> None:
    assert Kind.GRANT == "grant" and isinstance(Kind.GRANT, str)
    assert str(Kind.GRANT) == "grant" and f"{Kind.REVOKE}" == "revoke"  # auto(): the lowered name
    assert Kind("revoke") is Kind.REVOKE
    assert json.dumps({"kind": Kind.GRANT}) == '{"kind": "grant"}'


def test_strenum_refuses_values_that_are_not_strings() -> None:
    with pytest.raises(TypeError):
        class Bad(StrEnum):
            ONE = 1


def test_tomllib_reads_toml_and_names_its_error() -> None:
    assert tomllib.loads('a = "1GiB"\n[b]\nc = [1, 2]\n') == {"a": "1GiB", "b": {"c": [1, 2]}}
    with pytest.raises(tomllib.TOMLDecodeError):
        tomllib.loads("a = ")
