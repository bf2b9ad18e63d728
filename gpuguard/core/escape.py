"""Escaping what a user chose before it reaches a log line or a terminal.

Kept apart from messages.py, which needs the rules and the model: protocol.py, logs.py and the
CLI's output use only this, and the pam_exec hook's path imports no more than it must.
"""
from __future__ import annotations

import re

_SGR = re.compile(r"(\x1b\[[0-9;]*m)")  # Select Graphic Rendition: colour and weight, nothing else


def printable(text: str) -> str:
    """`text` with every character that is not printable written as its escape (`\\r`, `\\x1b`,
    `\\u202e`): a string a user chose (a TTY or remote host given to PAM, a process name) can
    then neither move a terminal's cursor, recolour or erase a line, nor start a forged log line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def printable_keeping_colour(text: str) -> str:
    """printable(), except that colour sequences (SGR) pass: they can recolour text but cannot move
    the cursor, erase, set a title or start a line, so `gpuguard status` keeps its colours."""
    return "".join(part if _SGR.fullmatch(part) else printable(part) for part in _SGR.split(text))
