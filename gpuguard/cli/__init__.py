"""The `gpuguard` command: argparse front end, one module per command group.

Each `*_cmd` module in this package has `register(subparsers)`, which adds its commands and
sets `func(args) -> int` on them. Exit codes are the same everywhere: 0 ok, 1 refused or
failed, 2 bad usage or input, 3 daemon unreachable. Errors are one line, no traceback.

What the commands print can hold strings users chose (a PAM TTY or remote host in whoami,
a process name in an event): everything written to stdout and every error goes through
messages.printable, so no control character reaches the terminal (JSON escapes its own).
"""
from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import pkgutil
import sys
from typing import Any

from gpuguard import __version__, config
from gpuguard.errors import GpuguardError
from gpuguard.messages import printable, printable_keeping_colour


class CommandError(GpuguardError):
    """A command's own one-line failure, with the exit code to use."""


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise CommandError(f"{what} needs root")


def load_config(args: argparse.Namespace) -> config.Config:
    """The config named by --config, $GPUGUARD_CONFIG or the default path (errors exit 2)."""
    return config.load(args.config)


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def print_rows(rows: list[list[str]]) -> None:
    """A plain aligned table, first row the header, like ps and nvidia-smi print."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuguard", description="Fair, kernel-enforced GPU sharing.")
    parser.add_argument("--version", action="version", version=f"gpuguard {__version__}")
    parser.add_argument("--config", metavar="PATH",
                        help=f"config file (default: $GPUGUARD_CONFIG or {config.DEFAULT_PATH})")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Every `*_cmd` module in this package contributes its commands.
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.endswith("_cmd"):
            importlib.import_module(f"{__name__}.{info.name}").register(subparsers)
    return parser


class PrintableOutput(io.TextIOBase):
    """A text stream that escapes control characters on their way to `stream`, line ends kept."""

    def __init__(self, stream: io.TextIOBase):
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sys.stdout = PrintableOutput(sys.stdout)
    try:
        return args.func(args)
    except GpuguardError as exc:
        return _fail(exc.line(), exc.code)  # a verifier log or a multi-line cause goes to the daemon's log
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `gpuguard status | head`: the reader left; say nothing more, like other tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _fail(message: str, code: int) -> int:
    print(f"gpuguard: {printable(message)}", file=sys.stderr)
    return code
