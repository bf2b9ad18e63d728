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

import contextlib
import errno
import logging
import os
import secrets
import stat
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
    """The files (the real edges.VisibleDevices): Grants.write_visible_devices says what each one holds.

    Every step goes through the directory's descriptor, opened without following a link and
    refused unless it is root's and only root may change it: the socket may be where users write
    (an admin's `socket = "/tmp/gpuguard.sock"`), and a `held` another user made there first, or
    a link to /etc/sudoers.d, would have root create and remove files wherever it points (or
    set a read ACL on the file a name was swapped for)."""

    def __init__(self, directory: Path):
        self.directory = directory

    def users(self) -> set[int]:
        try:
            directory = self._open()
            try:
                return {int(name) for name in os.listdir(directory) if name.isdigit()}
            finally:
                os.close(directory)
        except OSError as exc:
            event(logging.WARNING, "visible_devices_failed", path=self.directory, error=exc.strerror or str(exc))
            return set()

    def write(self, uid: int, uuids: Sequence[str]) -> None:
        path = self.directory / str(uid)
        try:
            directory = self._open()
            try:
                if uuids:
                    self._write(directory, uid, ",".join(uuids))
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(str(uid), dir_fd=directory)
            finally:
                os.close(directory)
        except OSError as exc:
            event(logging.WARNING, "visible_devices_failed", uid=uid, path=path, error=exc.strerror or str(exc))

    def _open(self) -> int:
        """The directory's descriptor (made 0755 if missing); OSError unless it is root's alone."""
        try:
            self.directory.mkdir(mode=0o755, parents=True)
            made = True
        except FileExistsError:
            made = False
        directory = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        info = os.fstat(directory)
        if made and info.st_uid == 0:
            os.fchmod(directory, 0o755)  # mkdir applied the umask
            info = os.fstat(directory)
        if info.st_uid != 0 or info.st_mode & 0o002 or (info.st_mode & 0o020 and info.st_gid != 0):
            os.close(directory)
            raise OSError(errno.EPERM, f"not root's alone (owner uid {info.st_uid}, mode "
                                       f"{stat.S_IMODE(info.st_mode):04o}): no file written there")
        return directory

    def _write(self, directory: int, uid: int, devices: str) -> None:
        temporary = f".{uid}.{secrets.token_hex(8)}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400,
                     dir_fd=directory)
        try:
            os.write(fd, f"{devices}\n".encode())
            os.fchmod(fd, 0o400)
            try:
                posix_acl.apply_acls(f"/proc/self/fd/{fd}", [uid], perm=READ)  # this file, whatever its name is now
            except OSError as exc:
                if exc.errno != errno.EOPNOTSUPP:
                    raise
                # a file system without ACLs: root's only, which is all the PAM module needs
            os.replace(temporary, str(uid), src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary, dir_fd=directory)
            raise
        finally:
            os.close(fd)
