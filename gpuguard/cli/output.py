"""The escaping stdout of the `gpuguard` command (see gpuguard.cli): a module of its own so
that `gpuguard pam-hook`, which never prints a user's strings, does not import it."""
from __future__ import annotations

import io

from gpuguard.core.escape import printable_keeping_colour

TYPE_CHECKING = False  # not typing's: every command imports this module
if TYPE_CHECKING:
    from typing import TextIO


class PrintableOutput(io.TextIOBase):
    """A text stream that escapes control characters on their way to `stream`, line ends kept."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write("\n".join(printable_keeping_colour(line) for line in text.split("\n")))
        return len(text)

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.stream.encoding

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()
