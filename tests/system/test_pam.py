"""PAM: the native module and the pam_exec hook, in real PAM stacks driven by real PAM clients.

Two layers:
- Against a stub daemon (no gate): the exact request on the wire, escaping, the message
  line, CUDA_VISIBLE_DEVICES in the PAM environment, and every way the daemon can fail
  (absent, hanging, refusing, garbling), none of which may fail or hang a login.
- Against the real daemon on simulated GPUs (`gate`): real users get real grants, the
  gate lets exactly the granted GPU open, sessions reuse and release grants.

pamtester shows pam_info text and pam_exec `stdout` output on its stdout, which is how
these tests see the message line and, through an env probe placed after the module,
CUDA_VISIBLE_DEVICES as the login program would copy it into the user's shell.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path

import pytest
from conftest import BIN, PYTHON, popen_as, run_as
from daemon_fixture import RunningDaemon
from sim_helpers import gpuguard, start_burn, stop_burn
from ssh_harness import (
    MESSAGE,
    MODULE,
    UUIDS,
    PamSession,
    PamStacks,
    StubDaemon,
    env_probe,
    hook_line,
    info_lines,
    module_line,
    pamtester,
    probed_devices,
    reply_json,
)

from devtools.harness import wait_for
from gpuguard import config, daemon_socket, pam_hook
from gpuguard.backends import posix_acl

pytestmark = pytest.mark.usefixtures("pam_module")  # built once per session (tests/ssh_harness.py)


@pytest.fixture
def stacks():
    made = PamStacks()
    yield made
    made.remove_all()


@pytest.fixture
def stub(sandbox):
    """stub(reply) -> a StubDaemon on a socket in the sandbox; closed afterwards."""
    started: list[StubDaemon] = []

    def start(reply=None) -> StubDaemon:
        if reply is None:
            def reply(request):
                if request["op"] == "session_open":
                    return reply_json(ok=True, cuda_visible_devices=UUIDS, message=MESSAGE, session=7)
                return reply_json(ok=True)
        daemon = StubDaemon(sandbox / f"stub-{len(started)}.sock", reply)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.close()


def opened(result) -> bool:
    return result.returncode == 0 and "successfully opened a session" in result.stdout


# ------------------------------------------------------------------ native module, stub daemon

def test_module_sends_session_requests_and_sets_the_environment(stacks, stub, sandbox):
    daemon = stub()
    service = stacks.make(module_line(daemon.path), env_probe(sandbox))
    result = pamtester(service, "ggt-alice", items={"rhost": "192.0.2.7", "tty": "ssh"})
    assert opened(result), result
    assert "session has successfully been closed" in result.stdout
    assert daemon.requests == [
        {"v": 1, "op": "session_open", "user": "ggt-alice", "service": service,
         "rhost": "192.0.2.7", "tty": "ssh", "grant": "auto", "pid": result.pid},
        {"v": 1, "op": "session_close", "user": "ggt-alice", "service": service, "pid": result.pid},
    ]
    assert all(raw.endswith(b"\n") and raw.count(b"\n") == 1 for raw in daemon.raw)
    assert info_lines(result.stdout) == [MESSAGE]
    assert probed_devices(result.stdout) == UUIDS


def test_module_escapes_what_it_sends(stacks, stub):
    daemon = stub()
    service = stacks.make(module_line(daemon.path, "quiet"))
    user = 'ggt-"odd\\name'
    rhost = 'host"\\\t\x01/é'
    result = pamtester(service, user, "open_session", items={"rhost": rhost})
    assert opened(result), result
    (request,) = daemon.requests
    assert (request["user"], request["rhost"], request["tty"]) == (user, rhost, "")


def test_module_decodes_the_reply(stacks, stub, sandbox):
    """Escapes of every kind, unknown and nested fields in any order, controls made harmless."""
    message = 'gpuguard: GPU 1 \"big\" \\ é 日本 😀 /x\tline\x1b[31m'
    reply = ('{"v":1,"session":{"id":[1,2,{"x":"}]"}],"n":null},"message":' + json.dumps(message) + ',"ok":true,'
             '"extra":[true,false,-1.5e3,"\\"}"],"cuda_visible_devices":"GPU-\\u0061b\\/1"}\n')
    daemon = stub(lambda request: reply.encode())
    service = stacks.make(module_line(daemon.path), env_probe(sandbox))
    result = pamtester(service, "ggt-alice", "open_session")
    assert opened(result), result
    assert probed_devices(result.stdout) == "GPU-ab/1"
    assert info_lines(result.stdout) == ['gpuguard: GPU 1 "big" \\ é 日本 😀 /x line [31m']


def test_module_quiet_sets_the_environment_without_a_message(stacks, stub, sandbox):
    daemon = stub()
    service = stacks.make(module_line(daemon.path, "quiet"), env_probe(sandbox))
    result = pamtester(service, "ggt-alice", "open_session")
    assert opened(result), result
    assert info_lines(result.stdout) == []
    assert probed_devices(result.stdout) == UUIDS


# Listens where the daemon would, as a non-root user, and answers every connection with a grant.
IMPOSTOR = """
import json, socket, sys
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
server.listen(4)
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    with conn:
        conn.settimeout(1)
        try:
            request = conn.recv(65536)
        except OSError:
            request = b""
        print(json.dumps(request.decode()), flush=True)
        try:
            conn.sendall(sys.argv[2].encode())
        except OSError:
            pass
"""


def test_module_trusts_no_reply_from_a_non_root_peer(stacks, sandbox, make_user):
    """Anyone can bind the socket path while the daemon is down: SO_PEERCRED must say root."""
    mallory = make_user()
    directory = sandbox / "run"
    directory.mkdir()
    os.chown(directory, mallory.uid, mallory.gid)
    path = directory / "gpuguard.sock"
    reply = reply_json(ok=True, cuda_visible_devices=UUIDS, message=MESSAGE).decode()
    impostor = popen_as(mallory, [PYTHON, "-c", IMPOSTOR, str(path), reply], stdout=subprocess.PIPE, text=True)
    try:
        assert impostor.stdout.readline() == "listening\n"
        service = stacks.make(module_line(path), env_probe(sandbox))
        result = pamtester(service, "ggt-alice", "open_session")
        assert opened(result), result  # the login goes on ...
        assert probed_devices(result.stdout) is None  # ... with nothing from the impostor in it
        assert info_lines(result.stdout) == [pam_hook.UNAVAILABLE]  # not the impostor's words
        # It was asked nothing either: the module hung up before sending the request.
        assert json.loads(impostor.stdout.readline()) == ""
    finally:
        impostor.kill()
        impostor.wait()


def test_module_no_grant_leaves_the_environment_alone(stacks, stub, sandbox):
    daemon = stub(lambda request: reply_json(ok=True, cuda_visible_devices="", message=""))
    service = stacks.make(module_line(daemon.path), env_probe(sandbox))
    result = pamtester(service, "ggt-alice", "open_session")
    assert opened(result), result
    assert info_lines(result.stdout) == []
    assert probed_devices(result.stdout) is None


def test_module_shows_a_message_without_a_grant(stacks, stub, sandbox):
    busy = "gpuguard: no GPU free right now (8 in use) - gpuguard status shows who has them"
    daemon = stub(lambda request: reply_json(ok=True, cuda_visible_devices="", message=busy))
    service = stacks.make(module_line(daemon.path), env_probe(sandbox))
    result = pamtester(service, "ggt-alice", "open_session")
    assert opened(result), result
    assert info_lines(result.stdout) == [busy]
    assert probed_devices(result.stdout) is None


def _hang(request):
    return None


def _bad_devices(request):
    return b'{"v":1,"ok":true,"cuda_visible_devices":"GPU-1 x"}\n'


def _newline_devices(request):
    return b'{"v":1,"ok":true,"cuda_visible_devices":"GPU-1\\nX=1"}\n'


@pytest.mark.parametrize("reply", [
    pytest.param(None, id="no-daemon"),
    pytest.param(_hang, id="daemon-hangs"),
    pytest.param(lambda r: reply_json(ok=False, error="internal error", code=1), id="refused"),
    pytest.param(lambda r: b"", id="closes-without-reply"),
    pytest.param(lambda r: b"this is not json\n", id="not-json"),
    pytest.param(lambda r: b'{"v":1,"ok":true,"cuda_visible_devices":"GPU-1', id="truncated"),
    pytest.param(_bad_devices, id="bad-devices"),
    pytest.param(_newline_devices, id="newline-devices"),
    pytest.param(lambda r: b'{"v":1,"ok":true,"pad":"' + b"x" * 100_000 + b'"}\n', id="oversized"),
    pytest.param(lambda r: b'{"v":1,"ok":true,"deep":' + b"[" * 100 + b"]" * 100 + b"}\n", id="too-deep"),
])
@pytest.mark.parametrize("control", ["optional", "required"])
def test_module_never_fails_or_hangs_a_login(stacks, stub, sandbox, reply, control):
    """Whatever the daemon does, the session opens (even as `required`) and gets no GPUs; with no
    usable answer the user is told in one line (a reply that parses but names bad devices is an answer)."""
    path = sandbox / "absent.sock" if reply is None else stub(reply).path
    service = stacks.make(module_line(path, control=control), env_probe(sandbox))
    result = pamtester(service, "ggt-alice", timeout=30)  # 2 s per call, by design
    assert opened(result), result
    assert "session has successfully been closed" in result.stdout
    assert probed_devices(result.stdout) is None
    answered = reply in (_bad_devices, _newline_devices)
    assert info_lines(result.stdout) == ([] if answered else [pam_hook.UNAVAILABLE])


def test_module_ignores_unknown_options(stacks, stub, sandbox):
    daemon = stub()
    service = stacks.make(module_line(daemon.path, "bogus=1", "debug"), env_probe(sandbox))
    result = pamtester(service, "ggt-alice", "open_session")
    assert opened(result), result
    assert probed_devices(result.stdout) == UUIDS


def test_module_exports_only_the_session_functions(pam_module):
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(MODULE)], capture_output=True,
                             text=True, check=True).stdout.split()
    assert {"pam_sm_open_session", "pam_sm_close_session"} <= set(symbols)
    assert not [s for s in symbols if s.startswith("pam_sm_") and "session" not in s]


# ------------------------------------------------------------------ pam_exec hook, stub daemon

def test_hook_sends_the_same_requests(stacks, stub, sandbox):
    daemon = stub()
    service = stacks.make(hook_line("--socket", str(daemon.path)), env_probe(sandbox))
    result = pamtester(service, "ggt-alice", items={"rhost": "192.0.2.7", "tty": "ssh"})
    assert opened(result), result
    assert daemon.requests == [
        {"v": 1, "op": "session_open", "user": "ggt-alice", "service": service,
         "rhost": "192.0.2.7", "tty": "ssh", "pid": result.pid},
        {"v": 1, "op": "session_close", "user": "ggt-alice", "service": service, "pid": result.pid},
    ]
    assert info_lines(result.stdout) == [MESSAGE]  # via pam_exec's `stdout`
    assert probed_devices(result.stdout) is None    # pam_exec cannot set the environment


def test_hook_finds_the_socket_in_the_config(stacks, stub, sandbox):
    daemon = stub()
    config = sandbox / "gpuguard.toml"
    config.write_text(f'[paths]\nsocket = "{daemon.path}"\n')
    by_option = stacks.make(hook_line("--config", str(config)))
    by_env = stacks.make(hook_line())
    assert opened(pamtester(by_option, "ggt-alice", "open_session"))
    assert opened(pamtester(by_env, "ggt-alice", "open_session", env={"GPUGUARD_CONFIG": str(config)}))
    assert [r["service"] for r in daemon.requests] == [by_option, by_env]


@pytest.mark.parametrize("direct", [False, True], ids=["gpuguard-pam-hook", "python-m"])
@pytest.mark.parametrize("case", ["no-daemon", "no-config", "daemon-hangs", "refused"])
def test_hook_always_exits_zero(stacks, stub, sandbox, case, direct):
    """As `required`, so pamtester fails if the hook exits non-zero; it must not, within ~2 s."""
    args = {
        "no-daemon": lambda: ("--socket", str(sandbox / "absent.sock")),
        "no-config": lambda: ("--config", str(sandbox / "absent.toml")),
        "daemon-hangs": lambda: ("--socket", str(stub(_hang).path)),
        "refused": lambda: ("--socket", str(stub(lambda r: reply_json(ok=False, error="no", code=1)).path)),
    }[case]()
    service = stacks.make(hook_line(*args, direct=direct, control="required"))
    result = pamtester(service, "ggt-alice", timeout=30)
    assert opened(result), result
    assert info_lines(result.stdout) == [pam_hook.UNAVAILABLE]


@pytest.mark.parametrize("direct", [False, True], ids=["gpuguard-pam-hook", "python-m"])
def test_hook_survives_bad_arguments(stacks, direct):
    """Both forms exit 0 even on a typo in the PAM line (the hook reads its own options)."""
    service = stacks.make(hook_line("--no-such-option", direct=direct, control="required"))
    assert opened(pamtester(service, "ggt-alice"))


def test_hook_module_form_sends_the_same_requests(stacks, stub):
    daemon = stub()
    service = stacks.make(hook_line("--socket", str(daemon.path), direct=True))
    result = pamtester(service, "ggt-alice", items={"rhost": "192.0.2.7", "tty": "ssh"})
    assert opened(result), result
    assert [r["op"] for r in daemon.requests] == ["session_open", "session_close"]
    assert {r["pid"] for r in daemon.requests} == {result.pid}
    assert info_lines(result.stdout) == [MESSAGE]


def test_hook_outside_pam_does_nothing(sandbox):
    hook = str(BIN / "gpuguard")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAM_")}
    result = subprocess.run([hook, "pam-hook", "--socket", str(sandbox / "x.sock")],
                            capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 0
    assert "nothing to do" in result.stderr
    for pam_type in ("auth", "account", "password"):
        result = subprocess.run([hook, "pam-hook", "--socket", str(sandbox / "x.sock")],
                                capture_output=True, text=True, timeout=30,
                                env={**env, "PAM_TYPE": pam_type, "PAM_USER": "ggt-" + secrets.token_hex(2)})
        assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_hook_request_from_the_pam_environment():
    env = {"PAM_TYPE": "open_session", "PAM_USER": "alice", "PAM_SERVICE": "sshd",
           "PAM_RHOST": "192.0.2.7", "PAM_TTY": "ssh"}
    assert pam_hook.build_request(env, 42) == {"op": "session_open", "user": "alice", "service": "sshd",
                                               "rhost": "192.0.2.7", "tty": "ssh", "pid": 42}
    assert pam_hook.build_request({"PAM_TYPE": "close_session", "PAM_USER": "alice"}, 42) == {
        "op": "session_close", "user": "alice", "service": "", "pid": 42}
    assert pam_hook.build_request({"PAM_TYPE": "auth", "PAM_USER": "alice"}, 42) is None
    with pytest.raises(pam_hook.HookError):
        pam_hook.build_request({"PAM_TYPE": "open_session"}, 42)


def test_hook_finds_the_socket_like_the_daemon(sandbox):
    """The hook reads paths.socket itself (cheaply); it must agree with gpuguard.config."""
    assert daemon_socket.DEFAULT_CONFIG == str(config.DEFAULT_PATH)
    assert daemon_socket.DEFAULT_SOCKET == str(config.PathsConfig().socket)
    good = sandbox / "good.toml"
    good.write_text('[paths]\nsocket = "/srv/gg.sock"\n')
    plain = sandbox / "plain.toml"
    plain.write_text('[access]\ngroup = "gpu"\n')
    broken = sandbox / "broken.toml"
    broken.write_text("[paths\n")
    odd = sandbox / "odd.toml"
    odd.write_text("paths = 3\n")
    assert pam_hook.socket_path(str(good), None, {}) == "/srv/gg.sock" == str(config.load(good).paths.socket)
    assert pam_hook.socket_path(None, None, {"GPUGUARD_CONFIG": str(good)}) == "/srv/gg.sock"
    assert pam_hook.socket_path(str(good), "/x.sock", {}) == "/x.sock"
    for path in (plain, broken, odd, sandbox / "absent.toml"):
        assert pam_hook.socket_path(str(path), None, {}) == daemon_socket.DEFAULT_SOCKET

PLAIN_CONFIGS = [
    '[paths]\nsocket = "/srv/a.sock"\n', "[paths]\nsocket='/srv/b.sock'  # ours\n",
    '[ paths ]\nstate_dir = "/x"\nsocket = "/srv/c.sock"\n[gpu]\nbackend = "nvml"\n',
    '[access]\ngroup = "gpu"\n', '[gpu]\nsocket = "/nope"\n', '[paths.sub]\nsocket = "/h"\n',
    # tomllib's, not the plain reader's:
    'paths.socket = "/d"\n', 'paths = {socket = "/e"}\n', '[paths]\nsocket = "/a\\\\b"\n',
    'x = """\n[paths]\nsocket = "/f"\n"""\n', '[paths]\n"socket" = "/g"\n', "[paths]\nsocket = 3\n",
]


@pytest.mark.parametrize("text", PLAIN_CONFIGS)
def test_the_hooks_plain_socket_reader_agrees_with_tomllib(text):
    """The hook reads a plain `socket = "..."` line without tomllib (~7 ms a login); whatever it
    reads must be what tomllib reads, and what it is unsure of it leaves to tomllib."""
    import tomllib

    found = daemon_socket.plain_socket(text)
    if found is not daemon_socket.UNSURE:
        assert found == tomllib.loads(text).get("paths", {}).get("socket", daemon_socket.DEFAULT_SOCKET)
    assert (found is daemon_socket.UNSURE) == (PLAIN_CONFIGS.index(text) >= 6)


# ------------------------------------------------------------------ the real daemon
@pytest.fixture
def gg_daemon(start_daemon):
    """The test daemon, with every session taking GPUs ([sessions] grant = "all"): these tests are
    about the module and the hook; which sessions take GPUs is test_scoped_sessions'."""
    return start_daemon(sessions={"grant": "all"})


PATHS = ["module", "hook"]


def session_line(daemon: RunningDaemon, path: str) -> str:
    """The stack line under test, quiet enough for python-pam (no conversation)."""
    if path == "module":
        return module_line(daemon.socket, "quiet")
    return hook_line("--config", str(daemon.config_path), stdout=False)


def burn_status(daemon: RunningDaemon, user, minor: int) -> int:
    """`gpuguard sim burn` as the user: 0 if the gate and ACLs let the GPU open, 1 if not."""
    result = run_as(user, gpuguard(daemon.config_path, "sim", "burn", "--gpu", str(minor),
                                   "--mem", "1GiB", "--seconds", "1"))
    assert result.returncode in (0, 1), result
    return result.returncode


def usable_gpus(daemon: RunningDaemon, user) -> list[int]:
    return [minor for minor in range(daemon.config.gpu.simulated.count) if burn_status(daemon, user, minor) == 0]


@pytest.mark.gate
@pytest.mark.parametrize("path", PATHS)
def test_member_gets_a_gpu_and_only_that_gpu(gg_daemon, stacks, path):
    alice = gg_daemon.add_member()
    service = stacks.make(session_line(gg_daemon, path))
    assert usable_gpus(gg_daemon, alice) == []  # before login: the gate is closed
    with PamSession(service, alice.name) as session:
        (grant,) = gg_daemon.grants(alice)
        sessions = gg_daemon.whoami(alice)["sessions"]
        assert [(s["pid"], s["service"]) for s in sessions] == [(session.pid, service)]
        if path == "module":
            assert session.env.get("CUDA_VISIBLE_DEVICES") == grant["uuid"]
        else:  # pam_exec cannot set the environment; the grant is the same
            assert "CUDA_VISIBLE_DEVICES" not in session.env
        assert usable_gpus(gg_daemon, alice) == [grant["minor"]]
    # closed, and no process of alice's holds the GPU: released at once (after the reply)
    assert wait_for(lambda: gg_daemon.grants(alice) == [])
    assert gg_daemon.whoami(alice)["sessions"] == []
    assert usable_gpus(gg_daemon, alice) == []


@pytest.mark.gate
@pytest.mark.parametrize("path", PATHS)
def test_non_member_gets_nothing(gg_daemon, stacks, make_user, path):
    bob = make_user()
    service = stacks.make(session_line(gg_daemon, path))
    with PamSession(service, bob.name) as session:
        assert "CUDA_VISIBLE_DEVICES" not in session.env
        assert gg_daemon.grants(bob) == []
        assert usable_gpus(gg_daemon, bob) == []


@pytest.mark.gate
@pytest.mark.parametrize("path", PATHS)
def test_second_session_reuses_the_grant(gg_daemon, stacks, path):
    alice = gg_daemon.add_member()
    service = stacks.make(session_line(gg_daemon, path))
    def held() -> list[tuple]:  # the grant itself, not what the watcher samples on it meanwhile (memory_used)
        return [(g["minor"], g["uuid"], g["granted_at"]) for g in gg_daemon.grants(alice)]
    with PamSession(service, alice.name) as first:
        (grant,) = held()
        with PamSession(service, alice.name) as second:
            assert held() == [grant]
            assert first.env.get("CUDA_VISIBLE_DEVICES") == second.env.get("CUDA_VISIBLE_DEVICES")
            pids = {s["pid"] for s in gg_daemon.whoami(alice)["sessions"]}
            assert pids == {first.pid, second.pid}
        # one session still open: the grant stays
        assert held() == [grant]
        assert usable_gpus(gg_daemon, alice) == [grant[0]]
    assert gg_daemon.grants(alice) == []


@pytest.mark.gate
@pytest.mark.parametrize("path", PATHS)
def test_grant_outlives_the_session_while_a_job_runs(gg_daemon, stacks, path):
    """`nohup job &; logout`: the GPU stays the user's until the job ends, then is released."""
    alice = gg_daemon.add_member()
    service = stacks.make(session_line(gg_daemon, path))
    with PamSession(service, alice.name):
        (grant,) = gg_daemon.grants(alice)
        job = start_burn(gg_daemon.config_path, grant["minor"], user=alice)
    try:
        assert gg_daemon.whoami(alice)["sessions"] == []
        assert [g["minor"] for g in gg_daemon.grants(alice)] == [grant["minor"]]
        assert job.poll() is None
    finally:
        stop_burn(job)
    assert wait_for(lambda: gg_daemon.grants(alice) == [], 30), gg_daemon.log()  # the watcher's next tick


@pytest.mark.gate
def test_login_message_and_environment_through_pamtester(gg_daemon, stacks, sandbox, make_user):
    """The user-visible result of a login: one gpuguard line, CUDA_VISIBLE_DEVICES for the shell."""
    alice = gg_daemon.add_member()
    service = stacks.make(module_line(gg_daemon.socket), env_probe(sandbox))
    result = pamtester(service, alice.name, items={"rhost": "127.0.0.1", "tty": "ssh"})
    assert opened(result), (result, gg_daemon.log())
    (line,) = info_lines(result.stdout)
    assert line.startswith("gpuguard: GPU ") and " is yours" in line and "gpuguard whoami" in line, line
    minor = int(line.split()[2])
    assert probed_devices(result.stdout) == gg_daemon.uuid(minor)
    assert wait_for(lambda: gg_daemon.grants(alice) == [])  # pamtester closed the session (released after the reply)

    bob = make_user()  # not a member: silence, nothing set
    result = pamtester(service, bob.name)
    assert opened(result), result
    assert info_lines(result.stdout) == []
    assert probed_devices(result.stdout) is None


@pytest.mark.gate
def test_hook_message_through_pamtester(gg_daemon, stacks, sandbox):
    alice = gg_daemon.add_member()
    service = stacks.make(hook_line("--config", str(gg_daemon.config_path)), env_probe(sandbox))
    result = pamtester(service, alice.name)
    assert opened(result), (result, gg_daemon.log())
    (line,) = info_lines(result.stdout)
    assert line.startswith("gpuguard: GPU ") and " is yours" in line, line
    assert probed_devices(result.stdout) is None
    assert wait_for(lambda: gg_daemon.grants(alice) == [])  # the release after logout runs after the reply


@pytest.mark.gate
@pytest.mark.parametrize("path", PATHS)
def test_daemon_down_login_succeeds_with_gpus_closed(gg_daemon, stacks, sandbox, path):
    alice = gg_daemon.add_member()
    assert gg_daemon.stop() == 0  # SIGTERM: the gate stays attached, the socket goes away
    if path == "module":
        line = module_line(gg_daemon.socket, control="required")
    else:
        line = hook_line("--config", str(gg_daemon.config_path), control="required")
    service = stacks.make(line, env_probe(sandbox))
    result = pamtester(service, alice.name)
    assert opened(result), result
    assert "session has successfully been closed" in result.stdout
    assert info_lines(result.stdout) == [pam_hook.UNAVAILABLE]  # the same line from module and hook
    assert probed_devices(result.stdout) is None  # alice holds nothing
    with PamSession(stacks.make(session_line(gg_daemon, path)), alice.name) as session:
        assert "CUDA_VISIBLE_DEVICES" not in session.env
        assert usable_gpus(gg_daemon, alice) == []



@pytest.mark.gate
def test_daemon_down_a_holder_gets_the_gpus_it_held_from_the_daemons_file(gg_daemon, stacks, sandbox, make_user):
    """The gate keeps a grant while the daemon is down; the login says the service is down and sets
    CUDA_VISIBLE_DEVICES from <socket dir>/held/<uid>, a file only root and that user can read."""
    d = gg_daemon
    alice, bob = d.add_member(), d.add_member()
    assert d.cli("grant", alice.name, "--gpu", "2").returncode == 0
    held, uuid = Path(d.socket).parent / "held" / str(alice.uid), d.uuid(2)
    assert held.read_text() == f"{uuid}\n"
    status = held.stat()
    assert status.st_uid == 0 and status.st_mode & 0o077 == 0o040  # group bits: the ACL mask
    assert posix_acl.acl_entries(held) == [(posix_acl.USER_OBJ, 4, posix_acl.UNDEFINED_ID),
                                           (posix_acl.USER, 4, alice.uid),
                                           (posix_acl.GROUP_OBJ, 0, posix_acl.UNDEFINED_ID),
                                           (posix_acl.MASK, 4, posix_acl.UNDEFINED_ID),
                                           (posix_acl.OTHER, 0, posix_acl.UNDEFINED_ID)]
    assert run_as(alice, ["cat", str(held)]).stdout == f"{uuid}\n"  # the ACL entry: alice may read it
    assert run_as(bob, ["cat", str(held)]).returncode != 0                  # nobody else
    assert d.stop() == 0

    service = stacks.make(module_line(d.socket, control="required"), env_probe(sandbox))
    result = pamtester(service, alice.name)

    assert opened(result), result
    assert info_lines(result.stdout) == [pam_hook.UNAVAILABLE]
    assert probed_devices(result.stdout) == uuid
    assert usable_gpus(d, alice) == [2]  # the gate kept the grant
    other = pamtester(service, bob.name)
    assert info_lines(other.stdout) == [pam_hook.UNAVAILABLE] and probed_devices(other.stdout) is None


@pytest.mark.gate
def test_the_held_file_follows_grants_and_a_forged_one_is_ignored(gg_daemon, stacks, sandbox):
    d = gg_daemon
    alice = d.add_member()
    assert d.cli("grant", alice.name, "--gpu", "1").returncode == 0
    held = Path(d.socket).parent / "held" / str(alice.uid)
    assert held.exists()
    assert d.cli("revoke", alice.name).returncode == 0
    assert not held.exists()  # nothing held: no file
    assert d.stop() == 0
    held.write_text("GPU-0950a11d-6246-54e9-a026-fb5cd4088e0c\n")  # root's but writable by others: not trusted
    held.chmod(0o666)
    service = stacks.make(module_line(d.socket), env_probe(sandbox))
    result = pamtester(service, alice.name)
    assert opened(result) and probed_devices(result.stdout) is None, result
    held.unlink()
