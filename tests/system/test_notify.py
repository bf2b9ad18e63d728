"""Telling users on their terminals: only their own ttys, never blocking.

Terminals are real ptys whose slave end belongs to a real test user. utmp entries are real
too: written with libc's pututxline() into a private /run (a tmpfs in the mount namespace of
a child process, so the host's utmp is neither read nor touched), where psutil.users() reads
them.
"Nothing arrived" is never a read that came back empty after a pause: a marker is written
to the terminal afterwards and everything before it is what arrived (a tty keeps order).
"""
from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import PYTHON

from gpuguard.backends import notify

ANSWER = 60.0  # seconds: a bound on waiting for a terminal or a thread, never an expectation
MARKER = b"ggt-marker"
USER_PROCESS, DEAD_PROCESS = 7, 8  # utmp entry types: logged in, logged out


@pytest.fixture
def alice(make_user):
    return make_user()


@pytest.fixture
def bob(make_user):
    return make_user()


@pytest.fixture
def ptys():
    """Factory: a pseudo-terminal whose slave end belongs to `user`; returns (master fd, slave path)."""
    opened: list[int] = []

    def open_for(user) -> tuple[int, Path]:
        master, slave = os.openpty()
        opened.extend((master, slave))
        path = Path(os.ttyname(slave))
        os.chown(path, user.uid, -1)
        os.set_blocking(master, False)
        return master, path

    yield open_for
    for fd in opened:
        os.close(fd)


def read_until(master: int, needle: bytes, timeout: float = ANSWER) -> bytes:
    """Read the terminal's output until `needle` has come (or `timeout` has passed: then what came)."""
    data = b""
    deadline = time.monotonic() + timeout
    while needle not in data and time.monotonic() < deadline:
        if select.select([master], [], [], 0.05)[0]:
            try:
                data += os.read(master, 65536)
            except BlockingIOError:
                pass
    return data


def arrived(master: int, path: Path) -> bytes:
    """Everything written to the terminal so far and not yet read: a marker goes in after it."""
    fd = os.open(path, os.O_WRONLY | os.O_NOCTTY)
    try:
        os.write(fd, MARKER)
    finally:
        os.close(fd)
    data = read_until(master, MARKER)
    assert MARKER in data, f"the marker never came back: {data!r}"
    return data[:data.index(MARKER)]


def test_writes_to_the_users_own_terminal(ptys, alice):
    master, path = ptys(alice)
    assert notify.write_tty(path, alice.uid, notify.format_line("gpuguard: hello"))
    assert b"gpuguard: hello" in read_until(master, b"gpuguard: hello")


def test_refuses_a_terminal_of_someone_else(ptys, alice, bob):
    master, path = ptys(alice)
    assert not notify.write_tty(path, bob.uid, "nope")
    assert arrived(master, path) == b""


def test_refuses_files_that_are_not_terminals(sandbox, alice):
    plain = sandbox / "file"
    plain.write_text("")
    os.chown(plain, alice.uid, -1)
    assert not notify.write_tty(plain, alice.uid, "nope")
    assert plain.read_text() == ""
    assert not notify.write_tty(Path("/dev/null"), 0, "nope")  # a char device, but not a tty
    assert not notify.write_tty(sandbox / "missing", alice.uid, "nope")


def test_a_terminal_nobody_reads_never_blocks(ptys, alice):
    master, path = ptys(alice)
    results: list[bool] = []
    # Far more than a pty buffers (a few KiB to 64 KiB); a blocking write would hang the thread.
    writer = threading.Thread(target=lambda: results.extend(notify.write_tty(path, alice.uid, "x" * 512)
                                                            for _ in range(2000)), daemon=True)
    writer.start()
    writer.join(ANSWER)
    assert not writer.is_alive(), "write_tty blocked on a terminal nobody reads"
    assert len(results) == 2000 and results[0]
    assert not all(results), "the buffer never filled: this test did not test anything"


def test_terminal_names_are_confined_to_dev(alice):
    # alice has just been created: the utmp of this machine has no entry for her, whatever it holds.
    paths = notify.terminals(alice.name, ["pts/3", "/dev/pts/3", "/dev/tty7", "/etc/passwd",
                                          "pts/../../etc/shadow", ""])
    assert paths == [Path("/dev/pts/3"), Path("/dev/tty7")]


# --- with utmp entries

UTMP_CHILD = r"""
import ctypes, json, struct, subprocess, sys
from gpuguard.backends import notify

records, job = json.loads(sys.argv[1]), json.loads(sys.argv[2])
# This process has a mount namespace of its own: the tmpfs and the utmp in it are gone with it.
subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "ggt-run", "/run"], check=True)
open("/var/run/utmp", "wb").close()
# Entries go in as login and sshd write them: libc's pututxline(). Only the fields that every
# glibc lays out alike are set (type, pid, line, id, user, host); the rest of the buffer is 0.
libc = ctypes.CDLL(None, use_errno=True)
libc.pututxline.restype = ctypes.c_void_p
libc.setutxent()
for n, (kind, pid, user, line) in enumerate(records):
    entry = ctypes.create_string_buffer(1024)
    struct.pack_into("@hi32s4s32s256s", entry, 0, kind, pid, line.encode(), b"g%03d" % n, user.encode(), b"")
    assert libc.pututxline(entry), ctypes.get_errno()
libc.endutxent()
if job["do"] == "terminals":
    print(json.dumps([str(path) for path in notify.terminals(job["user"], job["extra"])]))
else:  # tell, with no session ttys: utmp is the only way to the user's terminals
    notifier = notify.Notifier()
    notifier.tell(job["user"], job["uid"], job["message"])
    notifier.close(60)  # delivers what is queued, then the thread ends
    print(json.dumps("told"))
"""


def with_utmp(records: list[tuple[int, str, str]], **job) -> object:
    """Run a notify job where utmp holds exactly `records` ((type, user, line)), in a child with a
    private /run; its JSON answer."""
    entries = [(kind, os.getpid(), user, line) for kind, user, line in records]
    run = subprocess.run(["unshare", "--mount", "--propagation", "private", PYTHON, "-c", UTMP_CHILD,
                          json.dumps(entries), json.dumps(job)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_utmp_terminals_of_the_user_only(alice, bob):
    records = [(USER_PROCESS, alice.name, "pts/41"), (USER_PROCESS, bob.name, "pts/42"),
               (USER_PROCESS, alice.name, ""),             # logged in without a terminal
               (DEAD_PROCESS, alice.name, "pts/43")]       # logged out
    found = with_utmp(records, do="terminals", user=alice.name, extra=["pts/5", "/dev/pts/41"])
    assert found == ["/dev/pts/41", "/dev/pts/5"]


def test_notifier_reaches_the_utmp_terminals_the_user_owns(ptys, alice, bob):
    mine, my_path = ptys(alice)
    theirs, their_path = ptys(bob)
    # utmp names both for alice, but only the first is hers.
    records = [(USER_PROCESS, alice.name, str(my_path.relative_to("/dev"))),
               (USER_PROCESS, alice.name, str(their_path.relative_to("/dev")))]
    assert with_utmp(records, do="tell", user=alice.name, uid=alice.uid, message="gpuguard: over quota") == "told"
    assert b"gpuguard: over quota" in read_until(mine, b"gpuguard: over quota")
    assert arrived(theirs, their_path) == b""  # the notifier has finished: nothing more can come


class Parking(logging.Handler):
    """Parks the notifier's thread in its "notified" log line (written after the first delivery)
    until released: a delivery that is stuck, as on a strange device, for as long as the test wants.
    (handle(), not emit(): parked, it must not hold the handler's lock other threads log through.)"""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.parked, self.release = threading.Event(), threading.Event()
        self.lines: list[str] = []

    def handle(self, record: logging.LogRecord) -> bool:
        self.lines.append(record.getMessage())
        if "event=notified" in record.getMessage() and not self.parked.is_set():
            self.parked.set()
            self.release.wait(ANSWER)
        return True

    def emit(self, record: logging.LogRecord) -> None:  # handle() does it all
        pass


def test_tell_never_waits_for_delivery(ptys, alice):
    master, path = ptys(alice)
    logger = logging.getLogger("gpuguard")
    level, parking = logger.level, Parking()
    logger.setLevel(logging.DEBUG)
    logger.addHandler(parking)
    notifier = notify.Notifier()
    try:
        notifier.tell(alice.name, alice.uid, "gpuguard: first", [str(path)])
        assert parking.parked.wait(ANSWER), f"the first line was never delivered: {parking.lines}"
        # Delivery is stuck now. tell() still returns at once, even once the queue is full.
        teller = threading.Thread(target=lambda: [notifier.tell(alice.name, alice.uid, line, [str(path)])
                                                  for line in ["gpuguard: second"] + ["."] * notify.QUEUE_SIZE],
                                  daemon=True)
        teller.start()
        teller.join(ANSWER)
        assert not teller.is_alive(), "tell() waited for a stuck delivery"
        assert any("event=notify_dropped" in line for line in parking.lines)  # the one over QUEUE_SIZE
        so_far = arrived(master, path)
        assert b"gpuguard: first" in so_far and b"gpuguard: second" not in so_far  # tell() wrote nothing itself
    finally:
        parking.release.set()
        notifier.close(ANSWER)
        logger.removeHandler(parking)
        logger.setLevel(level)
    assert b"gpuguard: second" in read_until(master, b"gpuguard: second")  # delivered once unstuck


# --- terminals found from the user's processes: no utmp entry, no session tty

HOLD_TERMINAL = ("import fcntl, termios, time\n"
                 "fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # stdin becomes its controlling terminal, as a login shell's\n"
                 "print('ready', flush=True)\n"
                 "time.sleep(300)\n")


@pytest.fixture
def on_terminal():
    """Factory: a process of `user` in a session of its own whose controlling terminal is `path`,
    which it was handed open (as sshd, tmux or su hand a shell its terminal)."""
    started: list[subprocess.Popen] = []

    def start(user, path: Path) -> subprocess.Popen:
        fd = os.open(path, os.O_RDWR | os.O_NOCTTY)
        try:
            proc = subprocess.Popen([PYTHON, "-c", HOLD_TERMINAL], stdin=fd, stdout=subprocess.PIPE,
                                    user=user.uid, group=user.gid, extra_groups=[], start_new_session=True)
        finally:
            os.close(fd)
        started.append(proc)
        assert proc.stdout.readline() == b"ready\n"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def tell(user, message: str) -> None:
    """What the daemon does: tell the user, with no session ttys; returns once it is delivered."""
    notifier = notify.Notifier()
    notifier.tell(user.name, user.uid, message)
    notifier.close(ANSWER)


def test_the_terminal_of_a_users_process_is_told_without_utmp(ptys, alice, bob, on_terminal):
    mine, my_path = ptys(alice)
    theirs, their_path = ptys(bob)
    on_terminal(alice, my_path)
    on_terminal(bob, their_path)
    tell(alice, "gpuguard: your job was stopped")
    assert b"gpuguard: your job was stopped" in read_until(mine, b"gpuguard: your job was stopped")
    assert arrived(theirs, their_path) == b""  # bob's terminal, with bob's process on it: not alice's


def test_a_su_shell_is_told_on_the_terminal_it_runs_on(ptys, alice, bob, on_terminal):
    admins, admins_path = ptys(alice)  # alice's terminal, where she ran `su - bob`
    on_terminal(bob, admins_path)
    tell(bob, "gpuguard: GPU 2 is yours now")
    assert b"gpuguard: GPU 2 is yours now" in read_until(admins, b"gpuguard: GPU 2 is yours now")
