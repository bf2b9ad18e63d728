"""Each user's CUDA_VISIBLE_DEVICES in a small file, for logins while the daemon is down.

`<socket directory>/held/<uid>` (`/run/gpuguard/held/1001`) holds the UUIDs of the user's
grants, comma-separated, on one line: what `gpuguard env` would print. The PAM module reads
it when no daemon answers, so a user who still holds GPUs (the gate keeps their grants while
the daemon is down) gets CUDA_VISIBLE_DEVICES and not "no CUDA-capable device". The file is
root's, mode 0400 plus a POSIX ACL entry giving read to that uid only (root's only on a file system
without ACLs: the PAM module runs as root); it is rewritten
atomically (a temporary file renamed over it) after every grant change and removed when the
user holds nothing. A failure to write is logged and changes no grant: the file is a courtesy.
Its other readers: the login shells' snippets (etc/profile.d/gpuguard.sh and its twins), and
`gpuguard env` and `whoami` while no daemon answers (`held`).
"""
from __future__ import annotations

import errno
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from gpuguard.backends import posix_acl
from gpuguard.logs import event

DIRECTORY = "held"
READ = 0o4


def directory_for(socket: Path) -> Path:
    """Where the files live: beside the daemon's socket (the PAM module derives it the same way)."""
    return socket.parent / DIRECTORY


def held(directory: Path, uid: int) -> list[str] | None:
    """The UUIDs `uid`'s file names, read as that user; None when there is no file to read (the
    user holds nothing, or no daemon ever wrote one)."""
    try:
        text = (directory / str(uid)).read_text()
    except OSError:
        return None
    return [uuid for uuid in text.strip().split(",") if uuid]


class VisibleDevicesFiles:
    """The files (the real edges.VisibleDevices): Grants.write_visible_devices says what each one holds."""

    def __init__(self, directory: Path):
        self.directory = directory

    def users(self) -> set[int]:
        try:
            self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
            return {int(name) for name in os.listdir(self.directory) if name.isdigit()}
        except OSError as exc:
            event(logging.WARNING, "visible_devices_failed", path=self.directory, error=exc.strerror or str(exc))
            return set()

    def write(self, uid: int, uuids: Sequence[str]) -> None:
        path = self.directory / str(uid)
        try:
            if uuids:
                self._write(path, uid, ",".join(uuids))
            else:
                path.unlink(missing_ok=True)
        except OSError as exc:
            event(logging.WARNING, "visible_devices_failed", uid=uid, path=path, error=exc.strerror or str(exc))

    def _write(self, path: Path, uid: int, devices: str) -> None:
        fd, temporary = tempfile.mkstemp(prefix=f".{uid}.", dir=self.directory)
        try:
            os.write(fd, f"{devices}\n".encode())
            os.fchmod(fd, 0o400)
            os.close(fd)
            fd = -1
            try:
                posix_acl.apply_acls(temporary, [uid], perm=READ)
            except OSError as exc:
                if exc.errno != errno.EOPNOTSUPP:
                    raise
                # a file system without ACLs: root's only, which is all the PAM module needs
            os.replace(temporary, path)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            Path(temporary).unlink(missing_ok=True)
            raise
