"""Torture runs against a real daemon, shared by tests/system/test_torture.py (short) and bench/torture (long).

- crash(): login/logout cycles from many users in parallel while the daemon is SIGKILLed at random
  moments and restarted; after each restart the store passes its integrity check, the gate map,
  the store and the node ACLs agree, no GPU is held twice, and every session a client was told
  is open is still in the store.
- storm(): the same login storm twice, alone and while hostile clients attack the socket
  (malformed JSON, wrong types, 5 MB lines, half-sent requests, hundreds of idle connections,
  a non-root user asking for root operations); returns the median login latency of each.

A Target says how to reach the daemon; both callers build one from what they set up.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuguard import client
from gpuguard.backends import posix_acl
from gpuguard.backends.gate import Gate
from gpuguard.core.model import NVIDIA_MAJOR
from gpuguard.services.store import Store

RETRY_FOR = 60.0  # seconds a client retries while the daemon is down (restarts take a few)
KEEP_OPEN = 2     # sessions per user the crash torture keeps open while it kills the daemon


@dataclass
class Target:
    socket: str
    store_path: Path
    device_dir: Path
    gate_name: str
    users: list[tuple[str, int]]                  # (name, uid): members of the GPU group
    restart: Callable[[], None]                   # SIGKILL the daemon, start it again, return once it answers
    attacker_uid: int | None = None               # a non-root member the hostile clients run as
    callers: dict[str, int] = field(default_factory=dict)  # user -> pid of a live PAM caller stand-in


def call(target: Target, op: str, retry: bool = True, **fields) -> dict:
    """A request as root; while the daemon is down (a restart), retried for RETRY_FOR seconds."""
    deadline = time.monotonic() + RETRY_FOR
    while True:
        try:
            return client.call(target.socket, op, timeout=30, **fields)
        except client.DaemonUnreachable:
            if not retry or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@dataclass
class CrashReport:
    cycles: int = 0
    kills: int = 0
    checks: list[str] = field(default_factory=list)  # one line per failed check; empty = all held
    ambiguous: int = 0  # requests whose reply a kill took: either outcome is correct


def crash(target: Target, cycles: int, kills: int, workers: int = 4, seed: int = 0) -> CrashReport:
    """`cycles` login/logout cycles over the users, `kills` SIGKILLs at random moments among them."""
    rng = random.Random(seed)
    report = CrashReport()
    confirmed_open: Counter[str] = Counter()  # user -> sessions a reply said are open
    lock = threading.Lock()
    done = threading.Event()
    budget = iter(range(cycles))

    def worker(index: int) -> None:
        mine = target.users[index::workers]
        while not done.is_set():
            with lock:
                if next(budget, None) is None:
                    return
            name, _ = rng.choice(mine)
            pid = target.callers[name]
            try:
                client.call(target.socket, "session_open", timeout=30, user=name, service="ggt-torture", rhost="",
                            tty="pts/0", pid=pid)  # a terminal login: it takes GPUs
            except client.DaemonUnreachable:
                with lock:
                    report.ambiguous += 1
                continue
            with lock:
                confirmed_open[name] += 1
                if confirmed_open[name] <= KEEP_OPEN:
                    report.cycles += 1
                    continue  # kept open: it must survive every kill from now on
                confirmed_open[name] -= 1  # closing one: until its reply, either outcome is correct
            try:
                client.call(target.socket, "session_close", timeout=30, user=name, pid=pid)
            except client.DaemonUnreachable:
                with lock:
                    report.ambiguous += 1
                continue
            with lock:
                report.cycles += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
    for thread in threads:
        thread.start()
    for _ in range(kills):
        time.sleep(rng.uniform(0.05, 0.6))
        with lock:  # no client is between its reply and its bookkeeping while the daemon dies
            target.restart()
            report.kills += 1
            report.checks += check(target, dict(confirmed_open))
    for thread in threads:
        thread.join(600)
    done.set()
    report.checks += check(target, dict(confirmed_open))
    return report


def check(target: Target, confirmed_open: dict[str, int]) -> list[str]:
    """What must hold after a restart; one line per failure."""
    failures = []
    store = Store(target.store_path)
    try:
        if not store.integrity_ok():
            failures.append("store integrity check failed")
        grants = store.grants()
        sessions = Counter(s.user for s in store.sessions())
    finally:
        store.close()
    held = Counter(g.unit for g in grants)
    if twice := [m for m, n in held.items() if n > 1 and not all(g.shared for g in grants if g.unit == m)]:
        failures.append(f"GPU held twice: {twice}")
    with Gate(target.gate_name) as gate:
        in_map = gate.entries()
    wanted = {(g.uid, (NVIDIA_MAJOR, g.unit)) for g in grants}
    if in_map != wanted:
        failures.append(f"gate map != store: extra {in_map - wanted}, missing {wanted - in_map}")
    grantees: dict[int, set[int]] = {}
    for g in grants:
        grantees.setdefault(g.unit, set()).add(g.uid)
    for node in sorted(target.device_dir.glob("nvidia[0-9]*")):
        minor = int(node.name[len("nvidia"):])
        users = posix_acl.acl_users(node) - {0}
        if users - grantees.get(minor, set()):  # exempt users would be here too; the torture has none
            failures.append(f"ACL of {node.name} lets in {users - grantees.get(minor, set())} without a grant")
        if grantees.get(minor, set()) - users:
            failures.append(f"ACL of {node.name} misses grantees {grantees.get(minor, set()) - users}")
    for user, count in confirmed_open.items():
        # A reply lost to a kill leaves either outcome possible: the store may hold more, never fewer.
        if sessions[user] < count:
            failures.append(f"{user}: {count} sessions confirmed open, {sessions[user]} in the store")
    return failures


# --- hostile clients during a login storm

def _send(path: str, data: bytes, shut: bool = True, timeout: float = 10) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError:  # the listen queue is full: the attack goes on
            return b""
        try:
            sock.sendall(data)
            if shut:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            return b"".join(iter(lambda: sock.recv(65536), b""))
        except (ConnectionResetError, TimeoutError):
            return b""


ATTACKS: list[tuple[str, Callable[[str], bytes]]] = [
    ("malformed JSON", lambda path: _send(path, b"{not json\n")),
    ("wrong types", lambda path: _send(path, b'{"v": 1, "op": ["x"], "user": {"a": 1}}\n')),
    ("5 MB line", lambda path: _send(path, b"{" + b"x" * (5 << 20) + b"}\n")),
    ("half-sent", lambda path: _send(path, b'{"v": 1, "op": "sta')),
    ("root op as non-root", lambda path: _send(path, b'{"v": 1, "op": "grant", "user": "root", "gpus": 1}\n')),
]


def _attack(path: str, uid: int | None, idle: int) -> None:
    """An attacker process (forked): as `uid`, hold `idle` connections open and run the attacks
    in a loop until SIGTERM; then write how many of each it sent to stdout, and exit."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if uid is not None:
        os.setuid(uid)
    held, counts = [], Counter()
    for _ in range(idle):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            break
        held.append(sock)
    while not stop.is_set():
        for name, attack in ATTACKS:
            attack(path)
            counts[name] += 1
    for sock in held:
        sock.close()
    print(json.dumps(dict(counts)), flush=True)


def storm(target: Target, logins: int, attackers: int = 3, idle: int = 500) -> dict:
    """Median login+logout latency of `logins` cycles, alone and under attack (attacker processes
    running as target.attacker_uid), and how many of each attack were sent meanwhile."""
    def measure() -> float:
        times = []
        for i in range(logins):
            name, _ = target.users[i % len(target.users)]
            start = time.perf_counter()
            call(target, "session_open", retry=False, user=name, service="ggt-storm", rhost="", tty="pts/0",
                 pid=target.callers[name])
            call(target, "session_close", retry=False, user=name, pid=target.callers[name])
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    alone = measure()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import torture; "
            "torture._attack(sys.argv[2], None if sys.argv[3] == '-' else int(sys.argv[3]), int(sys.argv[4]))")
    uid = "-" if target.attacker_uid is None else str(target.attacker_uid)
    children = [subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).parent), target.socket, uid,
                                  str(idle // attackers)], stdout=subprocess.PIPE, text=True, cwd="/")
                for _ in range(attackers)]
    time.sleep(2.0)  # the idle connections are open and the attacks running
    attacked = measure()
    sent: Counter = Counter()
    for child in children:
        child.terminate()
        out, _ = child.communicate(timeout=60)
        sent.update(json.loads(out or "{}"))
    return {"alone": alone, "attacked": attacked, "ratio": attacked / alone, "sent": dict(sent)}
