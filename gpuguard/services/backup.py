"""A backup of the daemon's state, and putting one back (`gpuguard backup FILE`, `restore FILE`).

The file is a gzip-compressed tar (`tar tzf` lists it) of regular files, no directories:

    manifest.json     {"format": "gpuguard-backup", "version": 1, "schema": N, "gpuguard": "0.1.1",
                       "created": epoch seconds, "host": "...", "files": [the other members]}
    state.db          the store, one self-contained file (no WAL); its `PRAGMA user_version` is N
    drained.json      the drains (services.drains), when there were any
    queue_holds.json  the held requests (services.holds), when there were any

The store is copied with SQLite's online backup API, which reads one consistent snapshot while
the daemon goes on writing (WAL: the writer is never blocked), so a backup needs no stop. The
small files are each rewritten whole by a rename (state_files), so each is read whole too.
Not in it: the fleet outbox (fleet.db): its rows and their numbers are what the fleet database
has confirmed; an old copy put back would send ended grants twice or lose its place.

A restore reads and checks the whole file (members, manifest, the copy's integrity and schema)
in a scratch directory inside the state directory before it replaces anything, so a bad file
changes nothing; then the store's WAL files go first (a WAL left beside the new store would be
replayed into it), each file is put in place by a rename, and a small file the backup lacks is
removed: the state is the backup's, not a mix. The daemon migrates an older schema at start.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import socket
import sqlite3
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gpuguard.core.errors import EXIT_FAILED, EXIT_USAGE, GpuguardError
from gpuguard.services import drains, holds
from gpuguard.services.store import MIGRATIONS

FORMAT, VERSION = "gpuguard-backup", 1
MANIFEST, STORE = "manifest.json", "state.db"
SMALL_FILES = (drains.FILE, holds.FILE)  # the state files beside the store an admin's commands write
WAL_FILES = (f"{STORE}-wal", f"{STORE}-shm", f"{STORE}-journal")
MAX_MANIFEST = 64 * 1024  # a manifest is a few hundred bytes: a bigger one is no manifest of ours


class BackupError(GpuguardError):
    """A backup that cannot be made or read: a bad file is bad input (exit 2)."""

    code = EXIT_USAGE


@dataclass(frozen=True)
class Manifest:
    schema: int        # the store's schema version (store.MIGRATIONS applied)
    gpuguard: str      # the version that made it
    created: float     # epoch seconds
    host: str
    files: tuple[str, ...]  # the members beside the manifest: STORE, then the small files there were

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "schema": self.schema, "gpuguard": self.gpuguard,
                "created": self.created, "host": self.host, "files": list(self.files)}


def write(state_dir: Path, target: Path, version: str) -> Manifest:
    """Back up state_dir into the file `target` (replaced whole by a rename, mode 0600: the state
    names users). Raises BackupError (exit 1) when there is no store to back up or it cannot be read."""
    store = state_dir / STORE
    if not store.is_file():
        raise BackupError(f"no state database at {store}: nothing to back up", EXIT_FAILED)
    with tempfile.TemporaryDirectory(prefix="gpuguard-backup.") as scratch:
        copy = Path(scratch) / STORE
        schema = _copy_store(store, copy)
        small = [name for name in SMALL_FILES if (state_dir / name).is_file()]
        manifest = Manifest(schema, version, time.time(), socket.gethostname(), (STORE, *small))
        members: dict[str, bytes | Path] = {MANIFEST: json.dumps(manifest.to_json(), indent=1).encode() + b"\n",
                                            STORE: copy}
        for name in small:  # read whole: each is replaced whole by a rename, never written in place
            try:
                members[name] = (state_dir / name).read_bytes()
            except OSError as exc:
                raise BackupError(f"cannot read {state_dir / name}: {exc.strerror or exc}", EXIT_FAILED) from None
        try:
            _write_tar(target, members)
        except OSError as exc:
            raise BackupError(f"cannot write {target}: {exc.strerror or exc}", EXIT_FAILED) from None
    return manifest


def _copy_store(store: Path, copy: Path) -> int:
    """The online copy of the store into `copy`, as one file without WAL; returns its schema version."""
    try:
        # mode=rw: never creates a store; read-only would leave -wal and -shm behind a stopped daemon's
        source = sqlite3.connect(f"{store.absolute().as_uri()}?mode=rw", uri=True, timeout=10)
        try:
            target = sqlite3.connect(copy)
            try:
                source.backup(target)  # all pages in one step: one consistent snapshot
                target.execute("PRAGMA journal_mode=DELETE")
                schema: int = target.execute("PRAGMA user_version").fetchone()[0]
            finally:
                target.close()
        finally:
            source.close()
    except sqlite3.Error as exc:
        raise BackupError(f"cannot read {store}: {exc}", EXIT_FAILED) from None
    return schema


def _write_tar(target: Path, members: dict[str, bytes | Path]) -> None:
    """The tar of these members (the contents, or a file to stream: the store may be large), in order."""
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            # gzip's own default level: tarfile's 9 took 6 times as long for 0.2 % less (a 112 MiB store: 18 s, 3 s)
            with tarfile.open(fileobj=handle, mode="w:gz", compresslevel=6) as tar:
                for name, content in members.items():
                    info = tarfile.TarInfo(name)
                    info.mode, info.mtime = 0o600, int(time.time())
                    info.size = content.stat().st_size if isinstance(content, Path) else len(content)
                    with content.open("rb") if isinstance(content, Path) else io.BytesIO(content) as data:
                        tar.addfile(info, data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def restore(archive: Path, state_dir: Path) -> Manifest:
    """Replace the state in state_dir by the backup `archive` (the daemon must be stopped: the
    caller checks). Raises BackupError before anything is changed: exit 2 for a file that is no
    gpuguard backup or is damaged, exit 1 for one from a newer gpuguard."""
    made = not state_dir.exists()  # a wiped state directory: made for the scratch, gone again if refused
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        with tempfile.TemporaryDirectory(prefix=".restore.", dir=state_dir) as scratch:  # same filesystem: renames
            manifest = _unpack(archive, Path(scratch))
            _put_in_place(Path(scratch), state_dir, manifest.files)
    except BackupError:
        if made:
            shutil.rmtree(state_dir)
        raise
    return manifest


def _put_in_place(scratch: Path, state_dir: Path, files: tuple[str, ...]) -> None:
    for name in WAL_FILES:  # before the new store is in place: never replayed into it
        (state_dir / name).unlink(missing_ok=True)
    for name in (STORE, *SMALL_FILES):
        if name in files:
            os.replace(scratch / name, state_dir / name)
        else:
            (state_dir / name).unlink(missing_ok=True)
    _sync(state_dir)


def _unpack(archive: Path, scratch: Path) -> Manifest:
    """The backup's files written into scratch (mode 0600), every one checked; its manifest."""
    try:
        with tarfile.open(archive, mode="r:*") as tar:
            members = {member.name: member for member in tar.getmembers()}
            if MANIFEST not in members:
                raise BackupError(f"{archive}: not a gpuguard backup (no {MANIFEST})")
            with _open_member(archive, tar, members[MANIFEST], MAX_MANIFEST) as data:
                manifest = _manifest(archive, data.read())
            if set(members) != {MANIFEST, *manifest.files}:
                raise BackupError(f"{archive}: its members are not those its manifest lists")
            for name in manifest.files:
                path = scratch / name
                with _open_member(archive, tar, members[name], None) as data, _private(path) as out:
                    shutil.copyfileobj(data, out)
                if name != STORE:
                    _check_json(archive, path)
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error):  # their words span lines, name no cause
        raise BackupError(f"{archive}: not a gpuguard backup (no tar.gz, or one cut short or damaged)") from None
    except FileNotFoundError:
        raise BackupError(f"{archive}: no such file") from None
    except OSError as exc:  # unreadable, or the state directory full: nothing was replaced
        raise BackupError(f"cannot restore from {archive}: {exc.strerror or exc}", EXIT_FAILED) from None
    _check_store(archive, scratch / STORE, manifest.schema)
    return manifest


def _open_member(archive: Path, tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int | None) -> IO[bytes]:
    """A member's contents: a regular file only (no link, device or directory is ever followed or made)."""
    if not member.isreg() or (limit is not None and member.size > limit):
        raise BackupError(f"{archive}: its member {member.name!r} is not a file of ours")
    handle = tar.extractfile(member)
    assert handle is not None  # a regular member always has one
    return handle


def _private(path: Path) -> IO[bytes]:
    """A new file only root reads: the state names users and their sessions."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")


def _manifest(archive: Path, data: bytes) -> Manifest:
    try:
        raw = json.loads(data)
    except ValueError:
        raise BackupError(f"{archive}: its {MANIFEST} is not JSON") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise BackupError(f"{archive}: not a gpuguard backup (its {MANIFEST} names another format)")
    if raw.get("version") != VERSION:
        raise BackupError(f"{archive}: backup format {raw.get('version')!r}, this gpuguard reads {VERSION}; "
                          "restore it with the gpuguard that made it, or a newer one", EXIT_FAILED)
    files, schema = raw.get("files"), raw.get("schema")
    known = {STORE, *SMALL_FILES}
    if (not isinstance(files, list) or STORE not in files or not set(files) <= known or len(set(files)) != len(files)
            or not isinstance(schema, int) or isinstance(schema, bool)):
        raise BackupError(f"{archive}: its {MANIFEST} is damaged (files or schema)")
    return Manifest(schema, str(raw.get("gpuguard", "")), float(raw.get("created", 0)), str(raw.get("host", "")),
                    tuple(files))


def _check_json(archive: Path, path: Path) -> None:
    try:
        json.loads(path.read_bytes())
    except ValueError:
        raise BackupError(f"{archive}: its {path.name} is not JSON") from None


def _check_store(archive: Path, copy: Path, schema: int) -> None:
    """The copy opens, is whole, is at the manifest's schema, and that schema is not newer than this build's."""
    try:
        db = sqlite3.connect(f"{copy.absolute().as_uri()}?mode=ro", uri=True)
        try:
            whole = db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            version: int = db.execute("PRAGMA user_version").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise BackupError(f"{archive}: its {STORE} is no SQLite database ({exc})") from None
    if not whole:
        raise BackupError(f"{archive}: its {STORE} is damaged (PRAGMA integrity_check)")
    if version != schema:
        raise BackupError(f"{archive}: its {STORE} has schema {version}, its {MANIFEST} says {schema}")
    if version > len(MIGRATIONS):
        raise BackupError(f"{archive}: schema version {version} is newer than this gpuguard ({len(MIGRATIONS)}); "
                          "restore it with a gpuguard at least as new as the one that made it", EXIT_FAILED)


def _sync(directory: Path) -> None:
    """The renames in directory on disk before the command says it is done."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
