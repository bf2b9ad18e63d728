"""Text people read: the login line and the times and lists in it (shared by daemon and CLI)."""
from __future__ import annotations

import re

import time
from collections.abc import Iterable

from gpuguard.model import Gpu


def grant_message(gpus: list[Gpu], expires_at: float | None, shared: bool, wanted: int | None = None) -> str:
    """`gpuguard: GPU 3 (NVIDIA H100 80GB HBM3) is yours until 20:00 - run gpuguard whoami for details`"""
    names = ", ".join(sorted({gpu.name for gpu in gpus})) + (", shared" if shared else "")
    several = len(gpus) > 1
    subject = f"GPU{'s' if several else ''} {number_list(gpu.minor for gpu in gpus)} ({names})"
    until = f" until {clock(expires_at)}" if expires_at is not None else ""
    short = f" ({len(gpus)} of {wanted}: no more free)" if wanted and len(gpus) < wanted else ""
    return f"gpuguard: {subject} {'are' if several else 'is'} yours{until}{short} - run gpuguard whoami for details"


def cuda_export(uuids: Iterable[str]) -> str:
    """The line a shell evaluates to see exactly the user's GPUs (`gpuguard env`, `whoami`)."""
    return f"export CUDA_VISIBLE_DEVICES={','.join(uuids)}"


def stale_devices(shell_value: str | None, uuids: Iterable[str]) -> str | None:
    """What to tell a user whose shell's CUDA_VISIBLE_DEVICES (a tmux or screen shell older than
    their grant) no longer names their GPUs; None when it does, or is unset."""
    current = ",".join(uuids)
    if shell_value is None or shell_value == current:
        return None
    return (f"your shell's CUDA_VISIBLE_DEVICES={shell_value} is stale: your GPUs are {current or 'none'}; "
            'run eval "$(gpuguard env)"')


def clock(timestamp: float) -> str:
    """`20:00` today, `Tue 20:00` within six days either way, else `2025-03-04 20:00` (local time)."""
    moment = time.localtime(timestamp)
    if moment[:3] == time.localtime()[:3]:
        return time.strftime("%H:%M", moment)
    if abs(timestamp - time.time()) < 6 * 86400:
        return time.strftime("%a %H:%M", moment)
    return time.strftime("%Y-%m-%d %H:%M", moment)


def number_list(numbers: Iterable[int]) -> str:
    """`1,3,4`: GPU minors and pids as people type them."""
    return ",".join(str(n) for n in sorted(numbers))


def printable(text: str) -> str:
    """`text` with every character that is not printable written as its escape (`\\r`, `\\x1b`,
    `\\u202e`): a string a user chose (a TTY or remote host given to PAM, a process name) can
    then neither move a terminal's cursor, recolour or erase a line, nor start a forged log line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


_SGR = re.compile(r"(\x1b\[[0-9;]*m)")  # Select Graphic Rendition: colour and weight, nothing else


def printable_keeping_colour(text: str) -> str:
    """printable(), except that colour sequences (SGR) pass: they can recolour text but cannot move
    the cursor, erase, set a title or start a line, so `gpuguard status` keeps its colours."""
    return "".join(part if _SGR.fullmatch(part) else printable(part) for part in _SGR.split(text))
