"""Fencing: a node writes only to the database it has written to before, or to a later leader of it.

PostgreSQL names a database cluster by its system identifier (a standby made from a primary
shares it) and each promotion starts a new timeline, higher than the one before. A node keeps
the identifier and the highest timeline it has written on (LineageMemory, a file in its state
directory, so a restart remembers), and refuses, before writing anything, a database that is
another one (another identifier) or an old leader (a lower timeline: a failed primary started
again read-write after its standby was promoted, as a rebooted database host comes up). What
runs the database (Patroni, by hand) does not matter: the node checks for itself.

A refused database puts the node offline (node.FleetNode: its offline policy), with the reason
in its log, `doctor` and `status --fleet`. An admin who moved the fleet to another database on
purpose changes `[fleet] database` in the config: the memory is kept per connection string.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from gpuguard.fleet.schema import FleetError
from gpuguard.services import state_files


@dataclass(frozen=True)
class Lineage:
    system_identifier: str  # pg_control_system(): shared by a primary and the standbys made from it
    timeline: int           # the leader's current timeline: each promotion takes a higher one

    def __str__(self) -> str:
        return f"system {self.system_identifier}, timeline {self.timeline}"


class Fenced(FleetError):
    """The database reached is not one this node may write to (refusal says why)."""


def refusal(remembered: Lineage | None, seen: Lineage) -> str | None:
    """Why a node that has written to `remembered` must not write to `seen` (None: it may)."""
    if remembered is None:
        return None
    if seen.system_identifier != remembered.system_identifier:
        return (f"fenced: the fleet database is another one (system {seen.system_identifier}; this node wrote to "
                f"system {remembered.system_identifier}): nothing written there; point [fleet] database at the "
                "fleet's database, or change it on purpose (the node then starts afresh)")
    if seen.timeline < remembered.timeline:
        return (f"fenced: the fleet database is an old leader (timeline {seen.timeline}; this node wrote on "
                f"timeline {remembered.timeline}, after a failover): nothing written there; make it a replica "
                "of the new leader (Patroni rewinds it; by hand: pg_rewind) and check the connection string")
    return None


def timeline_of(wal_file: str) -> int:
    """The timeline in a WAL file name (pg_walfile_name: its first 8 hex digits)."""
    return int(wal_file[:8], 16)


class LineageMemory:
    """The database this node writes to, per connection string: a small JSON file in the state
    directory (services.state_files: replaced atomically, so a crash leaves the old one or the new)."""

    def __init__(self, path: Path, conninfo: str):
        self.path = path
        self.key = hashlib.sha256(conninfo.encode()).hexdigest()[:16]  # no password in the file

    def remembered(self) -> Lineage | None:
        doc = state_files.read(self.path)
        if not isinstance(doc, dict) or doc.get("database") != self.key:
            return None  # none yet, or of another connection string: the admin moved the fleet
        try:
            return Lineage(str(doc["system_identifier"]), int(doc["timeline"]))
        except (KeyError, TypeError, ValueError):
            return None

    def remember(self, lineage: Lineage) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        state_files.write(self.path, {"database": self.key, "system_identifier": lineage.system_identifier,
                                      "timeline": lineage.timeline})
