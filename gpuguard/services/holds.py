"""The queue requests an admin holds (`gpuguard hold USER`, `hold USER off`): a held request keeps
its place but is not served, and reserves nothing, like Slurm's `scontrol hold`.

QueueHolds is their one owner: it reads `<state_dir>/queue_holds.json` (a JSON list of queue row
ids, state_files) at start and writes it at each change, so a restart keeps them; the queue reads
which rows are held.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from gpuguard.services import state_files
from gpuguard.services.drains import NotSaved
from gpuguard.services.store import Store

FILE = "queue_holds.json"


class QueueHolds:
    def __init__(self, path: Path | None, store: Store) -> None:
        """path None: kept in memory only (a replay's)."""
        self.path = path
        self.store = store  # the queue's rows: a hold of a row gone since is forgotten
        self.ids: frozenset[int] = frozenset(state_files.read_ids(path)) if path is not None else frozenset()

    def hold(self, ids: Iterable[int]) -> None:
        """Hold these rows. Raises NotSaved (in force all the same) when the file is not written."""
        self._set(self.ids | set(ids))

    def release(self, ids: Iterable[int]) -> None:
        """Let these rows be served again; raises NotSaved as hold() does."""
        self._set(self.ids - set(ids))

    def _set(self, ids: frozenset[int]) -> None:
        self.ids = ids.intersection(q.waiter.id for q in self.store.queue_read())
        if self.path is None:
            return
        try:
            state_files.write(self.path, sorted(ids))
        except OSError as exc:
            raise NotSaved(exc.strerror or str(exc)) from None
