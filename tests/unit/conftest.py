"""The unit tests' shared fixture: `world`, every service wired with fakes (fakes.World)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes import World


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.services.close()
