"""The unix socket server on its own: peer identity, bounds, bad input, slow and flooding clients."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON, run_as

from gpuguard import client, daemon_socket, protocol
from gpuguard.daemon.server import (
    MAX_CONNECTIONS_PER_USER,
    ROOT_BACKLOG,
    USERS_BACKLOG,
    Server,
    ServerError,
)

# A client run as a test user: open N silent connections, then make one call; print the reply.
FLOOD = """
import json, socket, sys
from gpuguard import client
path, silent = sys.argv[1], int(sys.argv[2])
held = []
for _ in range(silent):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    held.append(s)
try:
    print(json.dumps(client.call(path, "status", timeout=30)))
except client.Refused as exc:
    print(json.dumps({"ok": False, "error": str(exc), "code": exc.code}))
"""

# A client run as a test user: send N malformed requests of every kind, count the one-line refusals.
BAD_FLOOD = """
import json, socket, sys
path, count = sys.argv[1], int(sys.argv[2])
kinds = [b'{"v": 1, "op": ["x"]}\\n', b'{"v": 1, "op": {}}\\n', b'[]\\n', b'\\xff\\n', b'{"v": 1, "op": "st']
replies = refusals = 0
for i in range(count):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(kinds[i % len(kinds)])
        s.shutdown(socket.SHUT_WR)
        reply = b"".join(iter(lambda: s.recv(65536), b""))
    replies += 1
    message = json.loads(reply)
    refusals += reply.count(b"\\n") == 1 and message["ok"] is False and message["code"] == 2
print(json.dumps({"replies": replies, "one_line_refusals": refusals}))
"""


class Running:
    """A Server on its own event loop in a thread, answering with `handler`."""

    def __init__(self, path: Path, handler, read_timeout: float = 2.0):
        self.path = path
        self.loop = asyncio.new_event_loop()
        self.server = Server(path, handler, read_timeout=read_timeout)
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server.claim()  # as the daemon does, first thing
            self.loop.run_until_complete(self.server.start())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(10)

    def close(self) -> None:
        async def shutdown() -> None:  # as asyncio.run ends the daemon: the server, then every client task
            await self.server.close()
            clients = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def echo(request: dict, peer) -> dict:
    if request.get("boom"):
        raise RuntimeError("boom")
    return protocol.ok(op=request["op"], uid=peer.uid, gid=peer.gid, pid=peer.pid)


@pytest.fixture
def serve(sandbox) -> Iterator:
    running: list[Running] = []

    def start(handler=echo, read_timeout: float = 2.0, name: str = "s.sock") -> Running:
        server = Running(sandbox / "run" / name, handler, read_timeout)
        running.append(server)
        return server

    yield start
    for server in running:
        server.close()


def raw(path: Path, data: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        reply = b"".join(iter(lambda: sock.recv(65536), b""))
    return json.loads(reply)


def test_identity_comes_from_the_kernel_not_the_message(serve, make_user):
    server = serve()
    alice = make_user()
    code = "import json,sys; from gpuguard import client; print(json.dumps(client.call(sys.argv[1], 'status', uid=0)))"
    result = run_as(alice, [PYTHON, "-c", code, str(server.path)])
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert (reply["uid"], reply["gid"]) == (alice.uid, alice.gid)
    assert client.call(str(server.path), "whoami")["uid"] == 0


def test_socket_is_open_to_everyone_and_its_directory_traversable(serve):
    server = serve()
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o666
    assert stat.S_IMODE(os.stat(server.path.parent).st_mode) == 0o755


def test_a_directory_the_server_did_not_make_keeps_its_mode(sandbox):
    shared = sandbox / "tmp"  # like /tmp: sticky and world-writable
    shared.mkdir()
    os.chmod(shared, 0o1777)
    server = Running(shared / "s.sock", echo)
    try:
        assert client.call(str(server.path), "status")["ok"]
        assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777
    finally:
        server.close()


@pytest.mark.parametrize("data, fragment", [
    (b"not json\n", "not JSON"),
    (b"[1, 2]\n", "not a JSON object"),
    (b'{"v": 2, "op": "status"}\n', "unsupported protocol version 2"),
    (b'{"v": 1, "op": "shutdown"}\n', "unknown operation 'shutdown'"),
    (b'{"v": 1, "op": "status", "pad": "' + b"x" * protocol.MAX_REQUEST + b'"}\n', "exceeds 65536 bytes"),
    (b'{"v": 1, "op": ["x"]}\n', "unknown operation ['x']"),
    (b'{"v": 1, "op": {"status": 1}}\n', "unknown operation {'status': 1}"),
    (b'"status"\n', "not a JSON object"),
    (b'{"v": 1, "op": "status", "user": "\xff\xfe"}\n', "not JSON"),
    (b'{"v": 1, "op": "status"}', "incomplete request: the connection closed before the end of the line"),
    (b'{"v": 1, "op": "sta', "incomplete request: the connection closed"),
])
def test_bad_requests_are_refused_with_code_2(serve, data, fragment):
    reply = raw(serve().path, data)
    assert reply["ok"] is False and reply["code"] == 2
    assert fragment in reply["error"]


def test_a_5_mb_line_is_refused_without_reading_it_all(serve):
    server = serve()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(server.path))
        try:
            sock.sendall(b"{" + b"x" * (5 << 20) + b"}\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused and closed while the rest was still on its way, as it should
        reply = b"".join(iter(lambda: sock.recv(65536), b""))
    assert json.loads(reply) == {"v": 1, "ok": False, "code": 2, "error": "request exceeds 65536 bytes"}
    assert client.call(str(server.path), "status")["ok"]


def test_half_a_request_gets_a_reply_at_the_read_deadline(serve):
    server = serve(read_timeout=0.2)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(server.path))
        sock.sendall(b'{"v": 1, "op": "sta')  # and nothing more, the connection left open
        reply = json.loads(sock.recv(65536))
    assert reply == {"v": 1, "ok": False, "code": 2, "error": "incomplete request: no end of line within 0.2s"}


def test_a_flood_of_bad_requests_is_answered_but_logged_a_few_lines_per_user(serve, make_user, gpuguard_log):
    server = serve()
    mallory = make_user()
    flood = run_as(mallory, [PYTHON, "-c", BAD_FLOOD, str(server.path), "300"])
    assert flood.returncode == 0, flood.stderr
    assert json.loads(flood.stdout) == {"replies": 300, "one_line_refusals": 300}
    assert raw(server.path, b'{"v": 1, "op": 7}\n')["code"] == 2  # root's requests: a burst of their own
    bad = [line for line in gpuguard_log if "event=bad_request" in line]
    assert len([line for line in bad if f"uid={mallory.uid}" in line]) == server.server.throttle.burst
    assert [line for line in bad if "uid=0 " in line]
    assert not [line for line in gpuguard_log if "traceback=" in line]
    throttle = server.server.throttle
    throttle.clock = lambda: time.monotonic() + throttle.window  # the window has ended: the count comes in one line
    throttle.flush()
    [summary] = [line for line in gpuguard_log if "event=log_suppressed" in line and f"uid={mallory.uid}" in line]
    assert f"lines={300 - server.server.throttle.burst}" in summary


def test_a_handler_failure_is_an_error_reply_not_a_dead_server(serve):
    server = serve()
    reply = raw(server.path, protocol.encode({"op": "status", "boom": True}))
    assert reply == {"v": 1, "ok": False, "error": "internal error in the gpuguard daemon (see its log)", "code": 1}
    assert client.call(str(server.path), "status")["ok"]


def test_silent_clients_never_delay_others(serve):
    # A read timeout of an hour: if a silent client could hold the server up, the calls below
    # would hang and fail on their own client timeout.
    server = serve(read_timeout=3600)
    silent = []
    try:
        for _ in range(20):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(server.path))
            silent.append(sock)
        sock = silent[0]
        sock.sendall(b'{"v": 1, "op": "sta')  # half a request, never finished
        replies = [client.call(str(server.path), "status", timeout=10) for _ in range(50)]
        assert all(reply["ok"] for reply in replies)
    finally:
        for sock in silent:
            sock.close()


def test_a_silent_client_is_dropped_after_the_read_timeout(serve):
    server = serve(read_timeout=0.2)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(server.path))
        assert sock.recv(100) == b""  # closed by the server, with no reply


def test_a_user_flooding_the_socket_runs_out_of_connections_but_root_does_not(serve, make_user):
    server = serve(read_timeout=3600)
    mallory = make_user()
    result = run_as(mallory, [PYTHON, "-c", FLOOD, str(server.path), str(MAX_CONNECTIONS_PER_USER)])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"ok": False, "code": 1,
                                         "error": f"more than {MAX_CONNECTIONS_PER_USER} connections at once "
                                                  "from your user"}
    # below the cap a user is served (another one: mallory's closed connections may still be counted
    # for a moment), and root is never capped
    alice = make_user()
    result = run_as(alice, [PYTHON, "-c", FLOOD, str(server.path), str(MAX_CONNECTIONS_PER_USER - 1)])
    assert json.loads(result.stdout)["uid"] == alice.uid
    held = []
    try:
        for _ in range(MAX_CONNECTIONS_PER_USER + 10):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(server.path))
            held.append(sock)
        assert client.call(str(server.path), "status", timeout=10)["uid"] == 0
    finally:
        for sock in held:
            sock.close()


def test_a_stale_socket_is_replaced_but_a_live_one_is_not_taken_over(serve, sandbox):
    path = sandbox / "run" / "stale.sock"
    path.parent.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # bound, never listening: what a crashed daemon leaves
    server = serve(name="stale.sock")
    assert client.call(str(server.path), "status")["ok"]
    with pytest.raises(ServerError, match="another gpuguard daemon is serving"):
        Server(server.path, echo).claim()
    # Skipping the claim takes nothing over either (asyncio alone would replace the socket).
    with pytest.raises(ServerError, match="Address already in use"):
        asyncio.run(Server(server.path, echo).start())
    assert client.call(str(server.path), "status")["ok"]


def test_something_else_at_the_socket_path_is_refused(sandbox):
    path = sandbox / "file.sock"
    path.write_text("not a socket")
    with pytest.raises(ServerError, match="exists and is not a socket"):
        Server(path, echo).claim()
    assert path.read_text() == "not a socket"


def listen_backlog(path: Path) -> int:
    listed = subprocess.run(["ss", "-xlnH", "src", str(path)], capture_output=True, text=True, check=True)
    [line] = listed.stdout.splitlines()
    return int(line.split()[3])  # Send-Q of a listening socket: its backlog


def test_root_has_a_door_of_its_own_with_a_login_storms_queue(serve):
    # asyncio's default backlog of 100 filled under one user's connect flood: logins got EAGAIN.
    # Logins and admins now come in through root's door, which no flood of the users' socket reaches.
    server = serve()
    door = Path(daemon_socket.root_door(str(server.path)))
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert listen_backlog(door) == min(ROOT_BACKLOG, somaxconn) > 100
    assert listen_backlog(server.path) == min(USERS_BACKLOG, somaxconn)
    info = door.parent.lstat()
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o700
    # root's calls go through it (the peer a server sees is the same; the door is what differs)
    assert client.doors(str(server.path), 0) == [str(door), str(server.path)]
    assert client.call(str(server.path), "whoami")["uid"] == 0


def test_no_user_but_root_can_knock_at_roots_door(serve, make_user):
    server = serve()
    door = daemon_socket.root_door(str(server.path))
    code = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
            "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    print('denied')")
    result = run_as(make_user(), [PYTHON, "-c", code, door])
    assert result.stdout.strip() == "denied", result


def test_a_daemon_without_roots_door_still_serves_root(serve, sandbox):
    # A daemon from before root's door (or one that could not make its directory) serves root on
    # the users' socket: a root client finds no door and goes on to that socket.
    server = serve(name="old.sock")
    door = Path(daemon_socket.root_door(str(server.path)))
    door.unlink()
    assert client.call(str(server.path), "whoami")["uid"] == 0


def test_a_dead_daemons_door_is_passed_over_for_a_live_users_socket(serve):
    # A downgrade to a daemon from before root's door can leave the door's socket behind, refused.
    server = serve(name="downgraded.sock")
    door = Path(daemon_socket.root_door(str(server.path)))
    door.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(door))
    assert client.call(str(server.path), "whoami", timeout=30)["uid"] == 0


def test_a_door_of_someone_elses_is_neither_served_nor_trusted(sandbox, make_user):
    # In a world-writable directory another user can make the root/ directory first, and put a
    # socket of their own in it: the daemon does not serve it and root's client does not talk to it.
    mallory = make_user()
    users = sandbox / "tmp" / "gg.sock"
    (sandbox / "tmp").mkdir(mode=0o1777)
    os.chmod(sandbox / "tmp", 0o1777)
    door = Path(daemon_socket.root_door(str(users)))
    squat = ("import os, socket, sys, time\nos.mkdir(os.path.dirname(sys.argv[1]), 0o777)\n"
             "s = socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\nos.chmod(sys.argv[1], 0o777)\n"
             "s.listen(8)\nprint('ready', flush=True)\nc, _ = s.accept()\n"
             "c.sendall(b'{\"v\": 1, \"ok\": true, \"forged\": true}\\n')\ntime.sleep(30)")
    squatter = subprocess.Popen(["setpriv", f"--reuid={mallory.uid}", f"--regid={mallory.gid}", "--clear-groups",
                                 PYTHON, "-c", squat, str(door)], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline() == "ready\n"
        server = Running(users, echo)
        try:
            reply = client.call(str(users), "whoami")
            assert "forged" not in reply and reply["uid"] == 0
            assert door.parent.lstat().st_uid == mallory.uid  # left alone: not the daemon's to remove
        finally:
            server.close()
    finally:
        squatter.kill()
        squatter.wait()
