"""Every live process's real uid, kept up to date by the kernel's process events, so that a
scan for one user's processes reads only theirs instead of walking all of /proc.

A logout's opener scan used to lstat every /proc entry (and read the status of root's): 0.5 s
at 10,000 processes. The netlink proc connector (NETLINK_CONNECTOR, group CN_IDX_PROC, after a
PROC_CN_MCAST_LISTEN; linux/cn_proc.h and linux/connector.h) tells of each fork, uid change and
exit as it happens, so the index below follows them: pid -> real uid and uid -> pids, live
processes only (threads are not processes: /proc lists thread-group leaders, and so does this; an
exec from a thread other than the leader ends the leader, with an exit event, and the exec event
brings the process back).

- Subscribed first, then seeded by one walk of /proc: a process that forks, changes uid or exits
  during the walk has its event queued behind it, applied after it, so none is missed.
- A lookup first applies every event queued so far (under the index's lock): whatever forked
  before the lookup is in the answer, however late the reading thread runs.
- The thread reads every DRAIN_EVERY (one wake-up per batch of events, not per event).
- Overflow (ENOBUFS: events lost under a fork flood), more events than EVENTS_PER_SECOND
  (reading them would cost the daemon more than a quarter of a core), or a failing read: the index stops listening and
  answers None ("walk /proc") until it subscribes and walks again, RESYNC_FIRST seconds later,
  doubling on each overflow up to RESYNC_MAX; a minute in sync resets the delay. A flood thus
  costs at most a few walks a minute, never an index that grows (it holds live pids only).
- When the connector cannot be opened (kernels before 6.6 without CAP_NET_ADMIN, a kernel
  without CONFIG_PROC_EVENTS, a pid or user namespace other than the host's), every scan walks
  /proc as before; that is logged once and counted (IndexCollector's metrics).

The events carry pids of the host's pid namespace; the daemon runs there (etc/gpuguard.service).
"""
from __future__ import annotations

import errno
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpuguard.backends import procfs
from gpuguard.logs import event

# linux/netlink.h, linux/connector.h, linux/cn_proc.h
NETLINK_CONNECTOR = 11
CN_IDX_PROC = CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN, PROC_CN_MCAST_IGNORE = 1, 2
NLMSG_DONE = 3
SO_RCVBUFFORCE = 33  # asm-generic/socket.h (Python's socket module does not name it)
PROC_EVENT_NONE, PROC_EVENT_FORK, PROC_EVENT_EXEC, PROC_EVENT_UID, PROC_EVENT_EXIT = 0, 0x1, 0x2, 0x4, 0x80000000

_NLMSGHDR = struct.Struct("=IHHII")    # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")     # idx, val, seq, ack, len, flags
_EVENT_HEAD = struct.Struct("=IIQ")    # what, cpu, timestamp_ns
_EVENT_DATA = struct.Struct("=iiii")   # the first four 32-bit fields of every event we read
_DATA_AT = _NLMSGHDR.size + _CN_MSG.size + _EVENT_HEAD.size  # 52
_SMALLEST = _DATA_AT + _EVENT_DATA.size

RECEIVE_BUFFER = 16 << 20    # bytes asked for (beyond net.core.rmem_max only with CAP_NET_ADMIN)
EVENTS_PER_SECOND = 40_000   # more, and the index stands down (about 6 µs an event here: a quarter of a core)
RESYNC_FIRST = 1.0           # seconds from a loss of sync to the next subscription and walk
RESYNC_MAX = 60.0
STABLE = 60.0                # seconds in sync after which the delay starts again at RESYNC_FIRST
ACK_WAIT = 2.0               # seconds the kernel has to acknowledge the subscription
DRAIN_EVERY = 0.05           # seconds between the thread's reads: a lookup reads what is queued anyway


class Change(NamedTuple):
    """One process event that matters to the index (threads' own are left out)."""

    kind: int   # PROC_EVENT_FORK, _EXEC, _UID, _EXIT, or _NONE for the kernel's acknowledgement
    pid: int    # the process (thread-group id); 0 for an acknowledgement
    value: int  # FORK: the parent's tgid; UID: the new real uid; EXEC, EXIT: 0; NONE: the errno (0: subscribed)


def decode(datagram: bytes | memoryview) -> Iterator[Change]:
    """The changes in one datagram from the connector socket (pure; anything else is skipped)."""
    offset = 0
    while offset + _NLMSGHDR.size <= len(datagram):
        length, kind, _, _, _ = _NLMSGHDR.unpack_from(datagram, offset)
        if length < _NLMSGHDR.size or offset + length > len(datagram):
            return
        if kind == NLMSG_DONE and length >= _SMALLEST:
            idx, val = _CN_MSG.unpack_from(datagram, offset + _NLMSGHDR.size)[:2]
            if (idx, val) == (CN_IDX_PROC, CN_VAL_PROC):
                what = _EVENT_HEAD.unpack_from(datagram, offset + _NLMSGHDR.size + _CN_MSG.size)[0]
                a, b, c, d = _EVENT_DATA.unpack_from(datagram, offset + _DATA_AT)
                if what == PROC_EVENT_FORK and c == d:  # parent pid, tgid, child pid, tgid: a process, not a thread
                    yield Change(PROC_EVENT_FORK, d, b)
                elif what == PROC_EVENT_UID and a == b:  # pid, tgid, ruid, euid
                    yield Change(PROC_EVENT_UID, b, c & 0xFFFFFFFF)
                elif what == PROC_EVENT_EXIT and a == b:  # the leader: the process is gone from /proc's list
                    yield Change(PROC_EVENT_EXIT, b, 0)
                elif what == PROC_EVENT_EXEC:  # pid, tgid: equal after the exec, whichever thread called it
                    yield Change(PROC_EVENT_EXEC, b, 0)
                elif what == PROC_EVENT_NONE:
                    yield Change(PROC_EVENT_NONE, 0, a)
        offset += (length + 3) & ~3  # NLMSG_ALIGN


def subscription(op: int = PROC_CN_MCAST_LISTEN) -> bytes:
    """PROC_CN_MCAST_LISTEN (or _IGNORE), as the connector expects it (a netlink message holding a cn_msg)."""
    payload = struct.pack("=I", op)
    header = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(payload), 0)
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(header) + len(payload), NLMSG_DONE, 0, 0, 0) + header + payload


def open_connector(receive_buffer: int = RECEIVE_BUFFER) -> socket.socket:
    """A non-blocking socket subscribed to process events; raises OSError (with the reason) when the
    kernel refuses or does not answer."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                         NETLINK_CONNECTOR)
    try:
        try:  # past net.core.rmem_max: needs CAP_NET_ADMIN, else the kernel's maximum
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, receive_buffer)
        except PermissionError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.bind((0, CN_IDX_PROC))
        sock.send(subscription())
        deadline = time.monotonic() + ACK_WAIT
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([sock], [], [], left)[0]:
                break
            # Events before the acknowledgement happened before the seeding walk, which sees their result.
            for change in decode(sock.recv(65536)):
                if change.kind == PROC_EVENT_NONE:
                    if change.value:
                        raise OSError(change.value, f"process events refused: {os.strerror(change.value)}")
                    return sock
        raise OSError(errno.ETIMEDOUT, "process events: the kernel did not acknowledge the subscription")
    except BaseException:
        sock.close()
        raise


def walk() -> dict[int, int]:
    """pid -> real uid of every live process /proc lists now (zombies and those exiting meanwhile
    are left out)."""
    found = {}
    with os.scandir(procfs.PROC) as entries:
        for entry in entries:
            if entry.name.isdigit() and (uid := _live_real_uid(entry.path)) is not None:
                found[int(entry.name)] = uid
    return found


def _live_real_uid(path: str) -> int | None:
    """The real uid in /proc/<pid>/status, or None for a process gone or a zombie: its exit event
    came already (or before the subscription), and it holds no descriptor any more."""
    try:
        with open(os.path.join(path, "status"), "rb") as status:
            for line in status:  # State: comes before Uid:
                if line.startswith(b"State:") and line.split()[1] in (b"Z", b"X"):
                    return None
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _real_uid(pid: int) -> int | None:
    return _live_real_uid(f"{procfs.PROC}/{pid}")


class UidTable:
    """pid -> real uid and uid -> pids, changed by the events (pure: no I/O but `read_uid`, asked
    for a process whose parent the table does not know)."""

    def __init__(self, uids: dict[int, int], read_uid: Callable[[int], int | None] = _real_uid) -> None:
        self.uid_of: dict[int, int] = {}
        self.pids_of: dict[int, set[int]] = {}
        self._read_uid = read_uid
        for pid, uid in uids.items():
            self._set(pid, uid)

    def apply(self, change: Change) -> None:
        if change.kind == PROC_EVENT_FORK:
            uid = self.uid_of.get(change.value)  # a child has the forking parent's uid
            if uid is None:
                uid = self._read_uid(change.pid)
            if uid is not None:
                self._set(change.pid, uid)
        elif change.kind == PROC_EVENT_UID:
            self._set(change.pid, change.value)
        elif change.kind == PROC_EVENT_EXIT:
            self._drop(change.pid)
        elif change.kind == PROC_EVENT_EXEC and change.pid not in self.uid_of:
            # A thread other than the leader exec'd: the kernel ended the leader (its exit event
            # came first) and gave the thread its pid. The process goes on, descriptors and all.
            uid = self._read_uid(change.pid)
            if uid is not None:
                self._set(change.pid, uid)

    def pids(self, uids: Iterable[int]) -> set[int]:
        return set().union(*(self.pids_of.get(uid, ()) for uid in uids))

    def _set(self, pid: int, uid: int) -> None:
        self._drop(pid)
        self.uid_of[pid] = uid
        self.pids_of.setdefault(uid, set()).add(pid)

    def _drop(self, pid: int) -> None:
        uid = self.uid_of.pop(pid, None)
        if uid is not None:
            pids = self.pids_of[uid]
            pids.discard(pid)
            if not pids:
                del self.pids_of[uid]


class ProcessIndex:
    """The users' processes by real uid, from process events (a thread of its own reads them).

    pids_of(uids) is the question the opener scans ask: those users' live pids, or None when the
    index is not in sync (the caller then walks /proc; counted in `fallback_walks`)."""

    def __init__(self, receive_buffer: int = RECEIVE_BUFFER, events_per_second: int = EVENTS_PER_SECOND,
                 resync_first: float = RESYNC_FIRST, clock: Callable[[], float] = time.monotonic) -> None:
        self.receive_buffer = receive_buffer
        self.events_per_second = events_per_second
        self._resync_first = self._delay = resync_first
        self._clock = clock
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._table: UidTable | None = None  # None: not in sync
        self._resync_at = 0.0
        self._synced_at = 0.0
        self._window = (0.0, 0)  # (start of this second, events read in it)
        self._wake_read, self._wake_write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stop = False
        self._thread: threading.Thread | None = None
        self.available = False       # the connector could be opened at start
        self.reason = ""             # why not, or why the index last lost sync
        self.fallback_walks = 0      # scans that walked /proc because the index could not answer
        self.resyncs = 0             # walks after a loss of sync
        self.losses = 0              # losses of sync (overflow, event flood, read error)
        self.events = 0              # changes applied (forks, uid changes, exits of processes)
        self.buffer = 0              # the receive buffer the kernel granted (bytes)

    # --- life cycle

    def start(self) -> bool:
        """Subscribe (here, so that a refusal is known and logged at start) and seed in the index's
        thread; False when the connector cannot be opened (the /proc walk stays, said once)."""
        try:
            sock = open_connector(self.receive_buffer)
        except OSError as exc:
            self.reason = exc.strerror or str(exc)
            event(logging.WARNING, "process_index_unavailable", reason=self.reason,
                  action="opener scans walk all of /proc")
            return False
        self.available = True
        self.buffer = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        event(logging.INFO, "process_index", source="netlink proc connector", receive_buffer=self.buffer)
        self._thread = threading.Thread(target=self._run, args=(sock,), name="proc-events", daemon=True)
        self._thread.start()
        return True

    def close(self) -> None:
        self._stop = True
        self._wake()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            self._unsubscribe()
        os.close(self._wake_read)
        os.close(self._wake_write)

    # --- questions

    @property
    def in_sync(self) -> bool:
        # In the lock, as _seed publishes the table and counts its resync: in sync is seen counted.
        with self._lock:
            return self._table is not None

    def pids_of(self, uids: Collection[int]) -> set[int] | None:
        """The live pids whose real uid is one of `uids`, as of now (events queued so far are read
        first), or None when the index cannot say (walk /proc instead)."""
        with self._lock:
            if self._sock is not None and self._table is not None:
                self._pump()
            if self._table is None:
                self.fallback_walks += 1
                return None
            return self._table.pids(uids)

    def size(self) -> int:
        table = self._table
        return len(table.uid_of) if table is not None else 0

    # --- the reading thread

    def _run(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
        self._seed()
        while not self._stop:
            sock = self._sock
            if sock is None:
                self._sleep(self._resync_at - self._clock())
                if not self._stop and self._clock() >= self._resync_at:
                    self._resubscribe()
                continue
            try:
                readable = select.select([sock.fileno(), self._wake_read], [], [])[0]
            except (OSError, ValueError):  # closed meanwhile by a lookup that lost sync
                continue
            if self._wake_read in readable:
                self._drain_wake()
            if sock.fileno() in readable:
                with self._lock:
                    if self._sock is sock:
                        self._pump()
                self._sleep(DRAIN_EVERY)  # events gather meanwhile: one wake-up per batch, not per event

    def _sleep(self, seconds: float) -> None:
        """Sleep, or less when woken (closing)."""
        select.select([self._wake_read], [], [], max(0.0, seconds))
        self._drain_wake()

    def _drain_wake(self) -> None:
        try:
            os.read(self._wake_read, 4096)
        except BlockingIOError:
            pass

    def _resubscribe(self) -> None:
        try:
            sock = open_connector(self.receive_buffer)
        except OSError as exc:  # e.g. out of descriptors: try again later
            with self._lock:
                self._lost(exc.strerror or str(exc))
            return
        with self._lock:
            self._sock = sock
        self._seed(resync=True)

    def _seed(self, resync: bool = False) -> None:
        """One walk after subscribing, outside the lock (it takes a while; lookups walk meanwhile),
        then every event queued during it, then in sync. A resync is counted in the same lock as
        the table it brings: whoever sees the index in sync sees it counted."""
        uids = walk()
        with self._lock:
            if self._sock is None:
                return
            self._table = UidTable(uids)
            self._pump()
            if self._table is not None:
                if resync:
                    self.resyncs += 1
                self._synced_at = self._clock()
                event(logging.INFO, "process_index_in_sync", processes=len(self._table.uid_of),
                      resyncs=self.resyncs)

    def _pump(self) -> None:
        """Apply every event queued in the socket (the lock held); a loss of sync on overflow,
        on a flood of events, or on a failing read."""
        assert self._sock is not None and self._table is not None
        while True:
            try:
                datagram = self._sock.recv(65536)
            except BlockingIOError:
                return
            except OSError as exc:
                self._lost("events lost (the receive buffer overflowed)" if exc.errno == errno.ENOBUFS
                           else f"reading events failed: {exc.strerror}")
                return
            changes = list(decode(datagram))
            if self._flooded():
                self._lost(f"more than {self.events_per_second:,} process events a second")
                return
            for change in changes:
                self._table.apply(change)
            self.events += len(changes)

    def _flooded(self) -> bool:
        """One more event read: whether more than events_per_second came in this second (every kind
        counts, exec and comm too: each costs a read)."""
        now = self._clock()
        start, seen = self._window
        if now - start >= 1.0:
            start, seen = now, 0
        self._window = (start, seen + 1)
        return seen + 1 > self.events_per_second

    def _lost(self, reason: str) -> None:
        """Stop listening (the lock held) and walk /proc until the next subscription."""
        now = self._clock()
        if self._synced_at and now - self._synced_at >= STABLE:
            self._delay = self._resync_first
        self._unsubscribe()
        self._table = None
        self._resync_at = now + self._delay
        event(logging.WARNING, "process_index_lost", reason=reason, resync_in=round(self._delay, 1),
              action="opener scans walk all of /proc until then")
        self._delay = min(RESYNC_MAX, self._delay * 2)
        self.reason = reason
        self.losses += 1
        self._wake()  # the thread may be waiting on the socket just closed

    def _unsubscribe(self) -> None:
        if self._sock is not None:
            try:  # the kernel counts listeners, not sockets, and makes events while any is counted
                self._sock.send(subscription(PROC_CN_MCAST_IGNORE))
            except OSError:
                pass
            self._sock.close()
            self._sock = None

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"x")
        except BlockingIOError:
            pass  # woken already


class IndexCollector(Collector):
    """The index's state for /metrics and the textfile: whether opener scans follow the users or walk /proc."""

    def __init__(self, index: ProcessIndex) -> None:
        self.index = index

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        index = self.index
        yield GaugeMetricFamily("gpuguard_process_index_in_sync", "1 while opener scans read only their users' "
                                "processes (netlink process events); 0: they walk all of /proc",
                                value=int(index.in_sync))
        yield GaugeMetricFamily("gpuguard_process_index_processes", "Live processes the index holds", value=index.size())
        yield CounterMetricFamily("gpuguard_process_index_fallback_walks", "Opener scans that walked all of /proc "
                                  "because the index could not answer", value=index.fallback_walks)
        yield CounterMetricFamily("gpuguard_process_index_events", "Process events applied (forks, uid "
                                  "changes, exits of processes)", value=index.events)
        yield CounterMetricFamily("gpuguard_process_index_losses", "Times the index lost sync (events lost "
                                  "or flooding)", value=index.losses)
        yield CounterMetricFamily("gpuguard_process_index_resyncs", "Walks of /proc that brought the index back "
                                  "in sync", value=index.resyncs)
