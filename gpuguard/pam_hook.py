"""The pam_exec fallback for sites that cannot build pam_gpuguard.so.

    session optional pam_exec.so type=open_session quiet stdout /opt/gpuguard/bin/gpuguard pam-hook
    session optional pam_exec.so type=open_session quiet stdout /opt/gpuguard/bin/python3 -I -m gpuguard.pam_hook

type=open_session, and before any `pam_env.so user_readenv=1`: pam_exec runs this as root with
the PAM environment, which at close_session holds the user's ~/.pam_environment on Debian's
sshd stack (LD_PRELOAD, PYTHONPATH: the user's code as root, before any line of ours runs). The
daemon drops a session whose PAM caller is gone, so a close that never comes still releases.

pam_exec runs this as a child of the PAM application with PAM_TYPE, PAM_USER,
PAM_SERVICE, PAM_RHOST and PAM_TTY in the environment. It sends the daemon the same
session_open / session_close request as the native module, with the PAM caller's pid
(our parent), so the daemon grants and releases exactly as it does for the module.

What it cannot do is set CUDA_VISIBLE_DEVICES: a pam_exec child has no way to change
the session's environment. The message line goes to stdout, which pam_exec shows to the
user when given the `stdout` option.

It always exits 0, within about 2 s: a daemon outage, a bad config or a bug here must
never block a login. Failures go to syslog (authpriv, warning); GPU access then simply
stays closed, because the gate denies by default. It runs on every login and logout, so
it imports only what it needs (no argparse: three options are read by hand; `gpuguard
pam-hook` comes here before the CLI builds its parser): starting it costs about twice an
empty `python3 -I -S` (docs/performance.md).
"""
from __future__ import annotations

import os
import signal
import sys
import syslog
from collections import namedtuple
from contextlib import contextmanager

from gpuguard import client, daemon_socket
from gpuguard.core.errors import GpuguardError

TYPE_CHECKING = False  # not typing's, which would add a few ms to every login
if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping
    from typing import Any, TextIO

TIMEOUT = 2.0  # seconds, for everything: config, connect, send, reply
OPERATIONS = {"open_session": "session_open", "close_session": "session_close"}
# What a login is told when no daemon answers (the same line as pam_gpuguard.so's): the daemon
# stopped, or never started (enable --force on a host without a driver); doctor names the cause.
UNAVAILABLE = ("gpuguard: GPU service not answering: no new GPUs now, held ones stay yours; "
               "tell your admin (`sudo gpuguard doctor` says why)")


class HookError(GpuguardError):
    """Something that stops the hook from talking to the daemon; logged, never raised to PAM."""


class _Deadline(Exception):
    pass


def build_request(environ: Mapping[str, str], caller_pid: int) -> dict[str, Any] | None:
    """The daemon request for this PAM call, or None if this PAM_TYPE is not ours."""
    op = OPERATIONS.get(environ.get("PAM_TYPE", ""))
    if op is None:
        return None
    user = environ.get("PAM_USER", "")
    if not user:
        raise HookError(f"{op}: PAM_USER is not set")
    request: dict[str, Any] = {"op": op, "user": user, "service": environ.get("PAM_SERVICE", "")}
    if op == "session_open":
        request["rhost"] = environ.get("PAM_RHOST", "")
        request["tty"] = environ.get("PAM_TTY", "")
    request["pid"] = caller_pid
    return request


def socket_path(config_path: str | None, socket: str | None,
                environ: Mapping[str, str] | None = None) -> str:
    """--socket, else paths.socket from the config file, else the default (daemon_socket.find);
    a config it cannot read goes to syslog, and the default is tried."""
    if socket:
        return socket
    path, problem = daemon_socket.find(config_path, os.environ if environ is None else environ)
    if problem:
        _log(f"gpuguard pam-hook: {problem}; trying {path}")
    return path


def run(config_path: str | None = None, socket: str | None = None, quiet: bool = False,
        environ: Mapping[str, str] | None = None, caller_pid: int | None = None,
        out: TextIO | None = None) -> int:
    """Do what PAM_TYPE asks; always 0."""
    environ = os.environ if environ is None else environ
    caller_pid = os.getppid() if caller_pid is None else caller_pid
    out = sys.stdout if out is None else out
    request: dict[str, Any] | None = None
    answered = False
    try:
        with _deadline(TIMEOUT):
            request = build_request(environ, caller_pid)
            if request is None:
                if "PAM_TYPE" not in environ:
                    print("gpuguard pam-hook: run by pam_exec in a session stack; nothing to do",
                          file=sys.stderr)
                return 0
            path = socket_path(config_path, socket, environ)
            fields = {key: value for key, value in request.items() if key != "op"}
            reply = client.call(path, request["op"], timeout=TIMEOUT, **fields)
            answered = True
            message = " ".join(str(reply.get("message") or "").split())  # one line, no controls
            if message and not quiet and request["op"] == "session_open":
                print(message, file=out, flush=True)
    except client.DaemonUnreachable as exc:
        _log(f"{_describe(request)}: {exc}; no GPUs for this session")
    except client.Refused as exc:
        _log(f"{_describe(request)} refused: {exc}")
    except _Deadline:
        _log(f"{_describe(request)}: no answer within {TIMEOUT:g}s; no GPUs for this session")
    except Exception as exc:  # a login must never fail because of this hook
        _log(f"{_describe(request)}: {type(exc).__name__}: {exc}")
    if request is not None and request["op"] == "session_open" and not answered and not quiet:
        try:
            print(UNAVAILABLE, file=out, flush=True)
        except OSError:
            pass
    return 0


def _describe(request: dict[str, Any] | None) -> str:
    if not request:
        return "gpuguard pam-hook"
    return f"gpuguard {request.get('op', 'session')} for {request.get('user', '?')}"


def _log(message: str) -> None:
    try:
        syslog.openlog("gpuguard-pam-hook", syslog.LOG_PID, syslog.LOG_AUTHPRIV)
        syslog.syslog(syslog.LOG_WARNING, message)
    except Exception:  # no syslog is no reason to fail a login
        pass


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise _Deadline after `seconds`, whatever step is slow (config read, connect, reply)."""
    def expire(signum: int, frame: object) -> None:
        raise _Deadline()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


USAGE = """usage: gpuguard pam-hook [--config PATH] [--socket PATH] [--quiet]

pam_exec session hook (fallback for pam_gpuguard.so; always exits 0): asks the daemon for
the user's GPUs at open_session and releases them at close_session. Cannot set
CUDA_VISIBLE_DEVICES.
  --config PATH  config file (default: $GPUGUARD_CONFIG or /etc/gpuguard/gpuguard.toml)
  --socket PATH  daemon socket (default: paths.socket from the config)
  --quiet        do not print the message line"""


# The hook's options, a plain namedtuple: typing.NamedTuple would import typing.
Options = namedtuple("Options", "config socket quiet help", defaults=(None, None, False, False))


def parse_arguments(argv: list[str], config_path: str | None = None) -> Options:
    """--config PATH, --socket PATH (also as --opt=PATH), --quiet, -h/--help; HookError otherwise."""
    values: dict[str, Any] = {"config": config_path}
    args = iter(argv)
    for arg in args:
        name, has_value, value = arg.partition("=")
        if name in ("--config", "--socket"):
            value = value if has_value else next(args, "")
            if not value:
                raise HookError(f"{name} needs a path")
            values[name[2:]] = value
        elif arg in ("--quiet", "-h", "--help"):
            values["quiet" if arg == "--quiet" else "help"] = True
        else:
            raise HookError(f"unknown argument {arg!r}")
    return Options(**values)


def main(argv: list[str] | None = None, config_path: str | None = None) -> int:
    """The command line: `config_path` is a --config given to `gpuguard` before `pam-hook`."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        options = parse_arguments(argv, config_path)
    except HookError as exc:  # a typo in the PAM line must not fail the login either
        print(f"gpuguard pam-hook: {exc}", file=sys.stderr)
        _log(f"gpuguard pam-hook: {exc} in {argv}")
        return 0
    if options.help:
        print(USAGE)
        return 0
    return run(config_path=options.config, socket=options.socket, quiet=options.quiet)


if __name__ == "__main__":
    sys.exit(main())
