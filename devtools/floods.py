"""Floods a hostile local user can make, run as that user: `PYTHON devtools/floods.py KIND ...`
(the flood tests and `make bench` share them).

Each prints `ready` once its flood stands, then keeps it up until killed (its process group:
the runner starts it in a session of its own).

    slowloris PORT N        N TCP connections to the metrics endpoint, each sending an HTTP
                            request a few bytes at a time and never finishing it; one the
                            daemon closes is opened again
    subuids SOCKET UIDS N   run as root of a user namespace (unshare --map-auto): UIDS
                            processes, each as another uid of the namespace (a subuid to the
                            daemon), hold N connections to the socket and open them again every 2 s
    fds NODE PROCS N        PROCS processes holding N descriptors each of NODE (O_PATH: the
                            absent driver's open cannot succeed on simulated GPUs)
    release SOCKET LOOPS    LOOPS processes calling `release` in a loop; each refusal's reason
                            is counted, and the counts written to the file named by $FLOOD_COUNTS
                            (one line per reply) as they come
    forks LOOPS             LOOPS processes forking children that exit at once, as fast as they
                            can: a flood of the kernel's process events (fork, exit)
    connects SOCKET PROCS N PROCS processes, each keeping N connections to the socket open and
                            connecting again at once when one is refused, closed or cannot
                            get into the listen queue (a connect flood of the kernel's queue)
    subconnects SOCKET PROCS N  the same, run as root of a user namespace: each process as
                            another uid of the namespace (a subuid to the daemon)
    newuids SOCKET PROCS N  the same, run as root of a user namespace, each connection made as
                            a uid of the namespace not used before (seteuid): a subuid the
                            daemon has never seen, 65,536 of them before one comes again
    spin PROCS              PROCS processes burning CPU and touching nothing else: what a
                            flood's processes cost the machine, without the flood
"""
from __future__ import annotations

import errno
import itertools
import json
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Iterator


def _ready() -> None:
    print("ready", flush=True)


def _forever(children: int) -> None:
    for _ in range(children):
        os.wait()


def slowloris(port: int, count: int) -> None:
    held: list[socket.socket | None] = [None] * count
    asked = [False] * count  # whether the request line went out on that connection
    started = False
    while True:
        for i, sock in enumerate(held):
            try:
                if sock is None:  # connected without waiting: a server that stopped accepting costs no time
                    sock = held[i] = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    sock.setblocking(False)
                    sock.connect_ex(("127.0.0.1", port))
                    asked[i] = False
                else:  # the request line, then one byte of a header line that never ends
                    sock.send(b"X" if asked[i] else b"GET /metrics HTTP/1.1\r\n")
                    asked[i] = True
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.ENOTCONN):
                    continue  # still in the server's listen queue: it stays there
                if sock is not None:  # closed by the server: a new one next round
                    sock.close()
                held[i] = None
        if not started:
            started = True
            _ready()
        time.sleep(0.5)


def subuids(path: str, uids: int, count: int) -> None:
    for uid in range(1, uids + 1):
        if os.fork() == 0:
            os.setgid(uid)  # (setgroups is denied in the namespace: its groups stay the user's)
            os.setuid(uid)
            while True:
                held = []
                for _ in range(count):
                    try:
                        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        sock.connect(path)
                        held.append(sock)
                    except OSError:
                        sock.close()
                time.sleep(2)
                for sock in held:
                    sock.close()
    time.sleep(2)  # every child has made its first round
    _ready()
    _forever(uids)


def fds(node: str, procs: int, count: int) -> None:
    for _ in range(procs):
        if os.fork() == 0:
            first = os.open(node, os.O_PATH)
            for _ in range(count - 1):
                os.dup(first)
            signal.pause()
    time.sleep(1)
    _ready()
    _forever(procs)


def release(path: str, loops: int) -> None:
    counts = os.environ["FLOOD_COUNTS"]
    for _ in range(loops):
        if os.fork() == 0:
            while True:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.settimeout(60)
                    sock.connect(path)
                    sock.sendall(b'{"v": 1, "op": "release"}\n')
                    reply = json.loads(b"".join(iter(lambda: sock.recv(65536), b"")) or b"{}")
                with open(counts, "a") as out:  # one short line per write: appends do not interleave
                    out.write(json.dumps(reply.get("error", "ok")) + "\n")
    _ready()
    _forever(loops)


def forks(loops: int) -> None:
    for _ in range(loops):
        if os.fork() == 0:
            while True:
                if os.fork() == 0:
                    os._exit(0)
                os.wait()
    _ready()
    _forever(loops)


def _keep_connecting(path: str, count: int, uids: Iterator[int] | None = None) -> None:
    """Hold `count` non-blocking connections to path, each opened again as soon as it is refused
    (the daemon closed it or wrote its refusal) or the listen queue had no room for it; each as
    the next of `uids` when given (the peer credentials are the euid at connect)."""
    poller = select.poll()
    held: dict[int, socket.socket] = {}

    def connect() -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        if uids is not None:
            os.seteuid(next(uids))
        connected = sock.connect_ex(path)
        if uids is not None:
            os.seteuid(0)
        if connected == 0:
            held[sock.fileno()] = sock
            poller.register(sock, select.POLLIN)
        else:  # EAGAIN (queue full) or ECONNREFUSED: again next round
            sock.close()

    while True:
        for _ in range(count - len(held)):
            connect()
        for fd, _ in poller.poll(10 if len(held) < count else 1000):
            poller.unregister(fd)
            held.pop(fd).close()


def connects(path: str, procs: int, count: int, as_subuids: bool = False, new_uids: bool = False) -> None:
    for uid in range(1, procs + 1):
        if os.fork() == 0:
            if as_subuids:
                os.setgid(uid)
                os.setuid(uid)
            # process i connects as uids i, i + procs, ...: no two connections of the flood share one
            _keep_connecting(path, count, itertools.cycle(range(uid, 65536, procs)) if new_uids else None)
    time.sleep(2)  # every child has opened its first connections
    _ready()
    _forever(procs)


def spin(procs: int) -> None:
    for _ in range(procs):
        if os.fork() == 0:
            while True:
                pass
    _ready()
    _forever(procs)


def main(argv: list[str]) -> int:
    kind, args = argv[0], argv[1:]
    if kind == "slowloris":
        slowloris(int(args[0]), int(args[1]))
    elif kind == "subuids":
        subuids(args[0], int(args[1]), int(args[2]))
    elif kind == "fds":
        fds(args[0], int(args[1]), int(args[2]))
    elif kind == "release":
        release(args[0], int(args[1]))
    elif kind == "forks":
        forks(int(args[0]))
    elif kind == "spin":
        spin(int(args[0]))
    elif kind in ("connects", "subconnects", "newuids"):
        connects(args[0], int(args[1]), int(args[2]), as_subuids=kind == "subconnects", new_uids=kind == "newuids")
    else:
        print(f"unknown flood {kind}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
