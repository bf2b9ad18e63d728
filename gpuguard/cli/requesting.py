"""Asking for GPUs and waiting in the queue for them: what `gpuguard request` and `gpuguard run` share.

Human lines (the place in the queue, an interruption) go to stderr, so that what a command
prints on stdout stays what a shell can evaluate (`eval "$(gpuguard request --wait)"`)."""
from __future__ import annotations

import sys
import time

from gpuguard import client
from gpuguard.cli import CommandError
from gpuguard.cli.calls import ask, socket_of
from gpuguard.core.errors import EXIT_USAGE, GpuguardError
from gpuguard.core.messages import queue_message
from gpuguard.core.quantities import UnitError, parse_duration

TYPE_CHECKING = False  # not typing's: request starts within a few ms of Python itself
if TYPE_CHECKING:
    import argparse
    from typing import Any

RECONNECT = 1.0  # seconds between attempts to reach a restarting daemon while waiting
EXIT_INTERRUPTED = 130  # what a shell reports for a command ended by ^C (128 + SIGINT)


def timeout_of(args: argparse.Namespace, option: str = "--timeout") -> float | None:
    """--timeout's seconds (None: wait without limit); it needs --wait, whose limit it is."""
    if args.timeout is None:
        return None
    if not args.wait:
        raise CommandError(f"{option} goes with --wait (add --wait, or leave {option} out)", EXIT_USAGE)
    if args.timeout.strip().startswith("-"):
        raise CommandError(f"{option} {args.timeout}: must be positive: how long to wait, e.g. 30m (or leave "
                           f"{option} out to wait without limit)", EXIT_USAGE)
    try:
        seconds = parse_duration(args.timeout)
    except UnitError as exc:
        raise CommandError(f"{option} {args.timeout}: {exc}", EXIT_USAGE) from None
    if seconds is None:
        raise CommandError(f"{option}: expected a duration like 30m (leave it out to wait without limit)",
                           EXIT_USAGE)
    return seconds


def take(args: argparse.Namespace, gpus: int | None, wait: bool, timeout: float | None,
         give_back: bool = False, memory: int | None = None) -> dict[str, Any]:
    """The daemon's grant reply for `gpus` in all, or for one fraction of `memory` bytes; with
    `wait`, after waiting in the queue. Its
    `granted` is every unit this call got, the part granted at once included. give_back: when
    the wait ends without the rest (^C, the timeout, the queue left), that part is given back
    too (`request` leaves it held, as a plain request would have)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    reply = ask(args, "request", gpus=gpus, wait=wait or None, memory=memory)
    if not reply.get("queued"):
        return reply
    first = list(reply.get("granted", []))
    print(queue_message(reply["position"], reply["waiting"], reply["gpus"], reply["estimate"], then="waiting"),
          file=sys.stderr, flush=True)
    try:
        served = _wait(args, reply["ticket"], deadline)
    except KeyboardInterrupt:
        # The daemon takes the request out when this connection closes; a login's place stays.
        print("", file=sys.stderr)  # past the terminal's ^C
        _give_back(args, first, give_back)
        raise CommandError("interrupted: " + (
            "you stopped waiting; your login keeps its place in the queue (gpuguard cancel leaves it)"
            if reply.get("login_place") else "you left the queue"), EXIT_INTERRUPTED) from None
    except GpuguardError:
        _give_back(args, first, give_back)
        raise
    return {**served, "granted": [*first, *served.get("granted", [])]}


def _give_back(args: argparse.Namespace, units: list[int], wanted: bool) -> None:
    if units and wanted:
        give_back(args, units)


def give_back(args: argparse.Namespace, units: list[int]) -> None:
    """Release `units` (what a command took for itself), saying on stderr what stays and why."""
    try:
        reply = ask(args, "release", units=units)
    except GpuguardError as exc:
        print(f"gpuguard: {exc.line()}", file=sys.stderr)
        return
    print(reply["message"], file=sys.stderr)


def _wait(args: argparse.Namespace, ticket: int, deadline: float | None) -> dict[str, Any]:
    """Block on the daemon until the queued request is granted; across a daemon restart the
    queue is kept, so the call is made again until the deadline."""
    socket, _ = socket_of(args)
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            # The socket's own timeout outlasts the daemon's answer to `timeout`.
            reply = client.call(socket, "wait", timeout=None if left is None else left + 10, ticket=ticket,
                                **({} if left is None else {"limit": left}))
            return {key: value for key, value in reply.items() if key not in ("v", "ok")}
        except client.DaemonUnreachable:
            if left is not None and left <= 0:
                raise
            time.sleep(RECONNECT)  # a daemon restart: the queue survives it
