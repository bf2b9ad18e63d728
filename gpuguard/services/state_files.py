"""Small JSON files beside the state database for what an admin sets by hand (drained GPUs, held
requests): read at start, rewritten atomically (a temporary file, fsync, rename) at each change,
so a restart keeps them. A file that cannot be read counts as empty, and is logged."""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from gpuguard.logs import event


def read(path: Path) -> Any:
    """The file's JSON, or None when it is missing or unreadable (logged)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        event(logging.ERROR, "state_file_unreadable", path=path, error=str(exc), action="taken as empty")
        return None


def write(path: Path, data: Any) -> None:
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def read_ids(path: Path) -> set[int]:
    """A file holding a JSON list of whole numbers (queue rows); anything else counts as empty."""
    data = read(path)
    return {i for i in data if isinstance(i, int) and not isinstance(i, bool)} if isinstance(data, list) else set()
