"""Telling a user something on their terminals, the way `write` does, without ever hanging.

The terminals are the user's utmp entries (psutil.users(): who is logged in where) plus the
ttys of their gpuguard sessions, written to only if, checked on the open descriptor (no race
with a swapped path), each is a character device that is a tty and is owned by that uid; and
the controlling terminals of the user's processes (procfs.controlling_ttys), whoever owns them:
sshd without utmp records, tmux panes, an editor's terminals, and `su - bob` on an admin's
terminal, where bob's notices belong. A process only gets a controlling terminal it has open,
so those are terminals the user can write to already. Opens and writes are non-blocking (a terminal stopped with ^S or whose
reader is gone gets EAGAIN, and its line is dropped), and all of it happens on one
background thread fed by a bounded queue, so a strange device can at worst stall that
thread, never the watcher. The log line and the stored event are the record; the
terminal is a courtesy.
"""
from __future__ import annotations

import logging
import os
import queue
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import psutil

from gpuguard.backends import procfs
from gpuguard.logs import event

DEV = Path("/dev")
QUEUE_SIZE = 1000  # lines waiting for terminals; more than this and new ones are dropped (and logged)
SCAN_EVERY = 2.0   # seconds a walk of /proc for controlling terminals serves (a tick may tell many users)
PTY_MAJORS = range(136, 144)  # UNIX98 pty slaves: /dev/pts/N, N = (major - 136) * 256 + minor
VT_MAJOR = 4                  # virtual consoles /dev/tty1 .. /dev/tty63
T = TypeVar("T")


def terminals(user: str, extra: Iterable[str] = ()) -> list[Path]:
    """Device paths of the user's terminals: utmp entries plus `extra` (session ttys), deduplicated.

    Only names under /dev are accepted ("pts/3", "/dev/pts/3"); "ssh", ":0" and the like are
    not terminals and are skipped.
    """
    names: list[str] = []
    try:
        names += [u.terminal for u in psutil.users() if u.name == user and u.terminal]
    except OSError:
        pass  # no utmp: session ttys only
    names += [name for name in extra if name]
    paths: list[Path] = []
    for name in names:
        path = Path(name) if name.startswith("/") else DEV / name
        try:
            path.relative_to(DEV)
        except ValueError:
            continue
        if ".." in path.parts or path in paths:
            continue
        paths.append(path)
    return paths


def tty_path(rdev: int) -> Path | None:
    """The /dev path of a terminal's device number: a pty slave or a virtual console (None: neither)."""
    major, minor = os.major(rdev), os.minor(rdev)
    if major in PTY_MAJORS:
        return DEV / "pts" / str((major - PTY_MAJORS.start) * 256 + minor)
    return DEV / f"tty{minor}" if major == VT_MAJOR and 0 < minor < 64 else None


def write_tty(path: Path, uid: int, text: str, rdev: int | None = None) -> bool:
    """Write text to one terminal of uid; False (and nothing written) when it is not theirs or not
    ready. rdev: a controlling terminal of uid's processes, by device number: it must be that
    device, whoever owns it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        theirs = st.st_uid == uid if rdev is None else st.st_rdev == rdev
        if not stat.S_ISCHR(st.st_mode) or not theirs or not os.isatty(fd):
            return False
        data = text.encode(errors="replace")
        os.write(fd, data)  # a partial write (full buffer) is acceptable: the event is the record
        return True
    except OSError:
        return False  # EAGAIN (terminal not reading), EIO (hung up): drop this line
    finally:
        os.close(fd)


def format_line(message: str) -> str:
    # \r\n: the terminal may be in raw mode (an editor, a REPL); \a gets attention like write(1).
    return "\r\n\a" + message + "\r\n"


class RemoteChannel(Protocol):
    def tell(self, user: str, message: str) -> None: ...

    def close(self, timeout: float = ...) -> None: ...


class Worker(Generic[T]):
    """One background thread fed by a bounded queue: `put` never blocks (False when full), and
    `close` lets the thread deliver what is queued (for up to `timeout`), then stops it."""

    def __init__(self, name: str, handle: Callable[[T], None], size: int = QUEUE_SIZE):
        self._handle = handle
        self._queue: queue.Queue[T | None] = queue.Queue(size)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: T) -> bool:
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            return False

    def close(self, timeout: float = 2.0) -> None:
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._handle(item)


class Notifier:
    """Delivers lines to users' terminals on a background thread; `tell` never blocks. Each line
    also goes to `remote` (remote_notify: webhook and e-mail), for users without a terminal."""

    def __init__(self, remote: RemoteChannel | None = None) -> None:
        self.remote = remote
        self._scanned: tuple[float, dict[int, set[int]]] | None = None  # (when, controlling_ttys()) on the thread
        self._worker: Worker[tuple[str, int, tuple[str, ...], str]] = Worker("gpuguard-notify", self._deliver)

    def tell(self, user: str, uid: int, message: str, ttys: Iterable[str] = ()) -> None:
        if self.remote is not None:
            self.remote.tell(user, message.replace("\r\n", "\n"))
        if not self._worker.put((user, uid, tuple(ttys), message)):
            event(logging.WARNING, "notify_dropped", user=user, reason="queue full")

    def close(self, timeout: float = 2.0) -> None:
        """Deliver what is queued (for up to `timeout`), then stop the thread (and the remote channel's)."""
        self._worker.close(timeout)
        if self.remote is not None:
            self.remote.close(timeout)

    def _deliver(self, item: tuple[str, int, tuple[str, ...], str]) -> None:
        user, uid, ttys, message = item
        try:
            line = format_line(message)
            written = [path for path in terminals(user, ttys) if write_tty(path, uid, line)]
            for rdev in sorted(self._controlling_ttys().get(uid, ())):
                path = tty_path(rdev)
                if path is not None and path not in written and write_tty(path, uid, line, rdev):
                    written.append(path)
            event(logging.DEBUG, "notified", user=user, ttys=[str(path) for path in written] or "none")
        except Exception:
            event(logging.ERROR, "notify_failed", exc_info=True, user=user)

    def _controlling_ttys(self) -> dict[int, set[int]]:
        """procfs.controlling_ttys, walked at most every SCAN_EVERY seconds."""
        now = time.monotonic()
        if self._scanned is None or now - self._scanned[0] >= SCAN_EVERY:
            self._scanned = (now, procfs.controlling_ttys())
        return self._scanned[1]
