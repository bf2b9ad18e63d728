"""The pam_exec fallback for sites that cannot build pam_gpuguard.so.

    session optional pam_exec.so quiet stdout /opt/gpuguard/bin/gpuguard pam-hook
    session optional pam_exec.so quiet stdout /opt/gpuguard/bin/python3 -I -m gpuguard.pam_hook

pam_exec runs this as a child of the PAM application with PAM_TYPE, PAM_USER,
PAM_SERVICE, PAM_RHOST and PAM_TTY in the environment. It sends the daemon the same
session_open / session_close request as the native module, with the PAM caller's pid
(our parent), so the daemon grants and releases exactly as it does for the module.

What it cannot do is set CUDA_VISIBLE_DEVICES: a pam_exec child has no way to change
the session's environment. The message line goes to stdout, which pam_exec shows to the
user when given the `stdout` option.

It always exits 0, within about 2 s: a daemon outage, a bad config or a bug here must
never block a login. Failures go to syslog (authpriv, warning); GPU access then simply
stays closed, because the gate denies by default. This module imports only what it
needs, so `python -m gpuguard.pam_hook` starts faster than the full CLI.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import syslog
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TextIO

from gpuguard import client
from gpuguard.errors import GpuguardError

TIMEOUT = 2.0  # seconds, for everything: config, connect, send, reply
# The same defaults as gpuguard.config (a test keeps them equal), without importing it.
DEFAULT_CONFIG = "/etc/gpuguard/gpuguard.toml"
DEFAULT_SOCKET = "/run/gpuguard/gpuguard.sock"
OPERATIONS = {"open_session": "session_open", "close_session": "session_close"}


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
    """--socket, else paths.socket from the config file, else the default.

    Only that one key is read, with tomllib, not through gpuguard.config: full validation
    (and the quotas file) costs a login ~12 ms more, and a typo in quotas.toml must not
    send the hook to the wrong socket. The daemon validates the config; the hook only
    needs to find it.
    """
    if socket:
        return socket
    environ = os.environ if environ is None else environ
    path = config_path or environ.get("GPUGUARD_CONFIG") or DEFAULT_CONFIG
    from gpuguard.compat import tomllib
    try:
        with open(path, "rb") as file:
            value = tomllib.load(file).get("paths", {}).get("socket", DEFAULT_SOCKET)
    except (OSError, tomllib.TOMLDecodeError, AttributeError) as exc:
        _log(f"gpuguard pam-hook: cannot read {path} ({exc}); trying {DEFAULT_SOCKET}")
        return DEFAULT_SOCKET
    if not isinstance(value, str) or not value:
        _log(f"gpuguard pam-hook: {path}: paths.socket is not a path; trying {DEFAULT_SOCKET}")
        return DEFAULT_SOCKET
    return value


def run(config_path: str | None = None, socket: str | None = None, quiet: bool = False,
        environ: Mapping[str, str] | None = None, caller_pid: int | None = None,
        out: TextIO | None = None) -> int:
    """Do what PAM_TYPE asks; always 0."""
    environ = os.environ if environ is None else environ
    caller_pid = os.getppid() if caller_pid is None else caller_pid
    out = sys.stdout if out is None else out
    request: dict[str, Any] | None = None
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
            message = " ".join(str(reply.get("message") or "").split())  # one line, no controls
            if message and not quiet and request["op"] == "session_open":
                print(message, file=out, flush=True)
    except client.DaemonUnreachable as exc:
        _log(f"{_describe(request)}: {exc}; no GPUs for this session")
    except client.Refused as exc:
        _log(f"{_describe(request)} refused: {exc}")
    except _Deadline:
        _log(f"{_describe(request)}: no answer within {TIMEOUT:g}s; no GPUs for this session")
    except Exception as exc:  # noqa: BLE001 - a login must never fail because of this hook
        _log(f"{_describe(request)}: {type(exc).__name__}: {exc}")
    return 0


def _describe(request: dict[str, Any] | None) -> str:
    if not request:
        return "gpuguard pam-hook"
    return f"gpuguard {request.get('op', 'session')} for {request.get('user', '?')}"


def _log(message: str) -> None:
    try:
        syslog.openlog("gpuguard-pam-hook", syslog.LOG_PID, syslog.LOG_AUTHPRIV)
        syslog.syslog(syslog.LOG_WARNING, message)
    except Exception:  # noqa: BLE001 - no syslog is no reason to fail a login
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", metavar="PATH",
                        help="daemon socket (default: paths.socket from the config)")
    parser.add_argument("--quiet", action="store_true", help="do not print the message line")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuguard-pam-hook",
                                     description="pam_exec hook: ask the gpuguard daemon for GPUs")
    parser.add_argument("--config", metavar="PATH", help="config file (default: $GPUGUARD_CONFIG or /etc/gpuguard/gpuguard.toml)")
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a typo in the PAM line must not fail the login either
        if exc.code:
            _log(f"gpuguard pam-hook: bad arguments {argv if argv is not None else sys.argv[1:]}")
        return 0
    return run(config_path=args.config, socket=args.socket, quiet=args.quiet)


if __name__ == "__main__":
    sys.exit(main())
