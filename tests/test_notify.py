"""Telling users on their terminals: only their own ttys, never blocking."""
from __future__ import annotations

import os
import select
import time
from pathlib import Path

import pytest

from gpuguard.backends import notify

UID = 54321  # any uid will do: ownership is all that is checked


@pytest.fixture
def pty():
    """A pseudo-terminal whose slave end belongs to UID; yields (master fd, slave path)."""
    master, slave = os.openpty()
    path = Path(os.ttyname(slave))
    os.chown(path, UID, -1)
    os.set_blocking(master, False)
    yield master, path
    os.close(slave)
    os.close(master)


def read_all(fd: int, timeout: float = 5.0) -> bytes:
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.05)[0]:
            try:
                data += os.read(fd, 65536)
            except BlockingIOError:
                pass
        elif data:
            break
    return data


def test_writes_to_the_users_own_terminal(pty):
    master, path = pty
    assert notify.write_tty(path, UID, notify.format_line("gpuguard: hello"))
    assert b"gpuguard: hello" in read_all(master)


def test_refuses_a_terminal_of_someone_else(pty):
    master, path = pty
    assert not notify.write_tty(path, UID + 1, "nope")
    assert read_all(master, 0.3) == b""


def test_refuses_files_that_are_not_terminals(tmp_path):
    plain = tmp_path / "file"
    plain.write_text("")
    os.chown(plain, UID, -1)
    assert not notify.write_tty(plain, UID, "nope")
    assert plain.read_text() == ""
    assert not notify.write_tty(Path("/dev/null"), 0, "nope")  # a char device, but not a tty
    assert not notify.write_tty(tmp_path / "missing", UID, "nope")


def test_a_terminal_nobody_reads_never_blocks(pty):
    master, path = pty
    started = time.monotonic()
    for _ in range(2000):  # far more than a pty buffers (a few KiB to 64 KiB)
        notify.write_tty(path, UID, "x" * 512)
    assert time.monotonic() - started < 10


def test_terminal_names_are_confined_to_dev(monkeypatch):
    monkeypatch.setattr(notify.psutil, "users", lambda: [])
    paths = notify.terminals("alice", ["pts/3", "/dev/pts/3", "/dev/tty7", "/etc/passwd", "pts/../../etc/shadow", ""])
    assert paths == [Path("/dev/pts/3"), Path("/dev/tty7")]


def test_utmp_terminals_of_the_user_only(monkeypatch):
    class U:
        def __init__(self, name, terminal):
            self.name, self.terminal = name, terminal
    monkeypatch.setattr(notify.psutil, "users", lambda: [U("alice", "pts/1"), U("bob", "pts/2"), U("alice", None)])
    assert notify.terminals("alice", ["pts/5"]) == [Path("/dev/pts/1"), Path("/dev/pts/5")]


def test_notifier_delivers_in_the_background(pty, monkeypatch):
    master, path = pty
    monkeypatch.setattr(notify.psutil, "users", lambda: [])
    notifier = notify.Notifier()
    started = time.monotonic()
    notifier.tell("someone", UID, "gpuguard: over quota", [str(path)])
    assert time.monotonic() - started < 0.1
    assert b"gpuguard: over quota" in read_all(master)
    notifier.close()
