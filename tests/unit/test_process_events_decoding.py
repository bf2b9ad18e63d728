"""The process events' decoding and the uid table (pure); the datagrams are built here field by
field from linux/cn_proc.h's layout (the system test reads the kernel's own)."""
from __future__ import annotations

import struct

from gpuguard.backends.proc_events import (
    PROC_EVENT_EXEC,
    PROC_EVENT_EXIT,
    PROC_EVENT_FORK,
    PROC_EVENT_NONE,
    PROC_EVENT_UID,
    Change,
    UidTable,
    decode,
    subscription,
)

GID = 0x40


def datagram(what: int, *data: int, idx: int = 1) -> bytes:
    """nlmsghdr + cn_msg + proc_event (what, cpu, timestamp, then the event's 32-bit fields, 24 bytes)."""
    body = struct.pack("=IIQ", what, 3, 123456789) + struct.pack(f"={len(data)}I", *data).ljust(24, b"\0")
    cn = struct.pack("=IIIIHH", idx, 1, 7, 0, len(body), 0) + body
    return struct.pack("=IHHII", 16 + len(cn), 3, 0, 7, 0) + cn


def test_fork_uid_exit_and_the_acknowledgement_are_decoded() -> None:
    assert list(decode(datagram(PROC_EVENT_FORK, 100, 100, 200, 200))) == [Change(PROC_EVENT_FORK, 200, 100)]
    assert list(decode(datagram(PROC_EVENT_UID, 200, 200, 1000, 0))) == [Change(PROC_EVENT_UID, 200, 1000)]
    assert list(decode(datagram(PROC_EVENT_EXIT, 200, 200, 0, 9))) == [Change(PROC_EVENT_EXIT, 200, 0)]
    assert list(decode(datagram(PROC_EVENT_NONE, 1))) == [Change(PROC_EVENT_NONE, 0, 1)]  # EPERM
    assert list(decode(datagram(PROC_EVENT_UID, 5, 5, 4294967294, 0))) == [Change(PROC_EVENT_UID, 5, 4294967294)]


def test_threads_other_events_and_other_connectors_are_skipped() -> None:
    assert list(decode(datagram(PROC_EVENT_FORK, 100, 100, 201, 100))) == []  # a thread of 100
    assert list(decode(datagram(PROC_EVENT_EXIT, 201, 100, 0, 0))) == []      # a thread ending
    assert list(decode(datagram(PROC_EVENT_UID, 201, 100, 1000, 1000))) == []  # a thread's own setuid
    assert list(decode(datagram(GID, 200, 200, 5, 5))) == []
    assert list(decode(datagram(PROC_EVENT_EXIT, 200, 200, 0, 0, idx=2))) == []


def test_truncated_or_several_messages_in_one_datagram() -> None:
    two = datagram(PROC_EVENT_FORK, 1, 1, 2, 2) + datagram(PROC_EVENT_EXIT, 2, 2, 0, 0)
    assert list(decode(two)) == [Change(PROC_EVENT_FORK, 2, 1), Change(PROC_EVENT_EXIT, 2, 0)]
    assert list(decode(two[:-10])) == [Change(PROC_EVENT_FORK, 2, 1)]
    assert list(decode(b"\x04\x00")) == []


def test_the_subscription_is_a_cn_msg_for_the_proc_connector() -> None:
    message = subscription()
    length, kind = struct.unpack_from("=IH", message)
    assert (length, kind) == (len(message), 3) == (40, 3)
    assert struct.unpack_from("=IIIIHH", message, 16) == (1, 1, 0, 0, 4, 0)
    assert struct.unpack_from("=I", message, 36) == (1,)  # PROC_CN_MCAST_LISTEN
    assert struct.unpack_from("=I", subscription(2), 36) == (2,)


def test_a_child_takes_its_parents_uid_and_follows_its_own_changes() -> None:
    table = UidTable({1: 0, 10: 1000}, read_uid=lambda pid: None)
    table.apply(Change(PROC_EVENT_FORK, 11, 10))
    table.apply(Change(PROC_EVENT_FORK, 12, 1))
    assert table.pids([1000]) == {10, 11} and table.pids([0]) == {1, 12}
    table.apply(Change(PROC_EVENT_UID, 12, 1000))  # root's child became the user's (su, sshd)
    assert table.pids([1000]) == {10, 11, 12} and table.pids([0]) == {1}
    table.apply(Change(PROC_EVENT_EXIT, 10, 0))
    table.apply(Change(PROC_EVENT_EXIT, 99, 0))  # never known: nothing to drop
    assert table.pids([1000, 0]) == {1, 11, 12}
    for pid in (1, 11, 12):
        table.apply(Change(PROC_EVENT_EXIT, pid, 0))
    assert table.uid_of == {} and table.pids_of == {}  # nothing kept for the dead


def test_a_child_of_an_unknown_parent_is_read_and_one_gone_already_is_left_out() -> None:
    read: list[int] = []

    def read_uid(pid: int) -> int | None:
        read.append(pid)
        return 1000 if pid == 20 else None

    table = UidTable({}, read_uid=read_uid)
    table.apply(Change(PROC_EVENT_FORK, 20, 5))
    table.apply(Change(PROC_EVENT_FORK, 21, 5))
    assert read == [20, 21] and table.uid_of == {20: 1000}
    table.apply(Change(PROC_EVENT_FORK, 22, 20))  # the parent is known now: no read
    assert read == [20, 21] and table.pids([1000]) == {20, 22}


def test_a_reused_pid_is_the_new_process() -> None:
    table = UidTable({1: 0, 30: 1000}, read_uid=lambda pid: None)
    table.apply(Change(PROC_EVENT_EXIT, 30, 0))
    table.apply(Change(PROC_EVENT_FORK, 30, 1))  # the same pid, forked by root
    assert table.pids([1000]) == set() and table.pids([0]) == {1, 30}


def test_an_exec_from_a_thread_brings_back_the_process_its_leaders_exit_took_away() -> None:
    assert list(decode(datagram(PROC_EVENT_EXEC, 40, 40))) == [Change(PROC_EVENT_EXEC, 40, 0)]
    read: list[int] = []

    def read_uid(pid: int) -> int | None:
        read.append(pid)
        return 1000

    table = UidTable({40: 1000}, read_uid=read_uid)
    table.apply(Change(PROC_EVENT_EXEC, 40, 0))  # an ordinary exec: known, nothing read
    assert read == [] and table.pids([1000]) == {40}
    table.apply(Change(PROC_EVENT_EXIT, 40, 0))  # the leader, ended by a thread's exec
    table.apply(Change(PROC_EVENT_EXEC, 40, 0))
    assert read == [40] and table.pids([1000]) == {40}
