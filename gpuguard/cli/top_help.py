"""`gpuguard --help` and `gpuguard` alone, printed from the table of commands (cli.TABLE) without
argparse or any command's module. The full parser loads every `*_cmd` module (the config loader
and tomlkit among them): 12.9x the CPU of an empty `python3 -I -S`, where a user's command has
3x (issues 19 and 38); this module, 1.5x. It needs neither re nor textwrap (argparse's), nor
shutil (for the terminal's width), each as dear as a third of Python's own start.

The text is argparse's own, byte for byte, at the terminal's width: this module lays it out as
argparse's HelpFormatter does for this one parser, and tests/unit/test_cli_fast_help.py holds it
to the full parser's output at every width (Pythons 3.10 to 3.13 checked). Where the usage line
would wrap, a help has what `wrap` below does not know, or a later Python's argparse may lay it out
otherwise (LAID_OUT), it answers None and the full parser prints the help as before.
"""
from __future__ import annotations

import os
import sys

from gpuguard.cli import CONFIG_HELP, DESCRIPTION, EPILOG, PAM_HOOK, PAM_HOOK_HELP, TABLE
from gpuguard.core.errors import EXIT_OK, EXIT_USAGE

USAGE = "usage: gpuguard [-h] [--version] [--config PATH] COMMAND ..."
DEFAULT_CONFIG = "/etc/gpuguard/gpuguard.toml"  # daemon_socket's, which loads re; the test keeps them equal
OPTIONS = (("-h, --help", "show this help message and exit"),
           ("--version", "show program's version number and exit"),
           ("--config PATH", CONFIG_HELP.format(DEFAULT_CONFIG)))
# The Pythons whose argparse lays the help out as render does (3.13 counts a command's own indent
# in the width of the column; 3.14 colours help): a later one's prints it itself.
LAID_OUT = ((3, 10), (3, 14))
# What the parser's error() prints for no command (argparse's words, then gpuguard's pointer).
MISSING = "gpuguard: the following arguments are required: COMMAND (see gpuguard --help)\n"
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")  # textwrap's [^\d\W], in ASCII
_WORD_PUNCTUATION = frozenset("0123456789!\"'&.,?") | _LETTERS                 # textwrap's word_punct


def answer(arranged: list[str]) -> int | None:
    """Print the top-level help (argv asks for it) or the missing command's error (argv has
    nothing else than a --config), as the full parser would, and give the exit code; None for
    any other argv (arranged by cli.argv.arrange, no command in it), or a help argparse lays out
    in a way this module does not."""
    asked = arranged[-1:] == ["--help"]
    words = arranged[:-1] if asked else arranged
    if not (words == [] or (len(words) == 1 and words[0].startswith("--config="))
            or (len(words) == 2 and words[0] == "--config" and not words[1].startswith("-"))):
        return None
    if not asked:
        sys.stderr.write(MISSING)
        return EXIT_USAGE
    text = render(columns())
    if text is None:
        return None
    try:
        sys.stdout.write(text)
    except OSError:  # as argparse's print_help
        pass
    return EXIT_OK


def columns() -> int:
    """shutil.get_terminal_size().columns (shutil loads bz2, lzma and fnmatch): $COLUMNS, else
    the terminal's, else 80."""
    try:
        count = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        count = 0
    if count > 0:
        return count
    try:
        count = os.get_terminal_size(sys.__stdout__.fileno()).columns if sys.__stdout__ is not None else 0
    except (AttributeError, ValueError, OSError):
        count = 0
    return count or 80


def render(columns: int) -> str | None:
    """The full parser's format_help() at this terminal width (argparse's HelpFormatter laid out
    for the parser's actions: COMMAND's choices, then -h, --version and --config)."""
    width = columns - 2
    if len(USAGE) > width or not LAID_OUT[0] <= sys.version_info[:2] < LAID_OUT[1]:
        return None  # argparse breaks the usage line, or lays out otherwise: its own layout
    commands = [(f"{name} ({', '.join(aliases)})" if aliases else name, help)
                for name, _, aliases, help in TABLE] + [(PAM_HOOK, PAM_HOOK_HELP)]
    indent = 2 if sys.version_info >= (3, 13) else 0  # of the commands under COMMAND, in the column's width
    longest = max(len("COMMAND"), *(len(option) for option, _ in OPTIONS),
                  *(len(command) + indent for command, _ in commands)) + 2
    help_position = min(longest + 2, min(24, max(width - 20, 4)))
    help_width = max(width - help_position, 11)

    def row(indent: int, invocation: str, help: str) -> str | None:
        lines = None if "%" in help else wrap(help, help_width)  # argparse expands %(prog)s and the like
        if lines is None:
            return None
        action_width = help_position - indent - 2
        if len(invocation) <= action_width:
            first = f"{' ' * indent}{invocation.ljust(action_width)}  {lines[0]}\n"
        else:
            first = f"{' ' * indent}{invocation}\n{' ' * help_position}{lines[0]}\n"
        return first + "".join(f"{' ' * help_position}{line}\n" for line in lines[1:])

    rows = [row(4, invocation, help) for invocation, help in commands]
    options = [row(2, invocation, help) for invocation, help in OPTIONS]
    if any(part is None for part in (*rows, *options)):
        return None
    text = (f"{USAGE}\n\n{DESCRIPTION}\n\n\npositional arguments:\n  COMMAND\n{''.join(filter(None, rows))}\n"
            f"\noptions:\n{''.join(filter(None, options))}\n{EPILOG}\n\n")
    while "\n\n\n" in text:  # argparse's _long_break_matcher
        text = text.replace("\n\n\n", "\n\n")
    return text.strip("\n") + "\n"


def wrap(text: str, width: int) -> list[str] | None:
    """textwrap.wrap(text, width) after argparse's whitespace clean-up, for a line of help in
    printable ASCII: broken at spaces and after the hyphens textwrap breaks after (GPU-|hours);
    None for a text with what textwrap splits otherwise (an em-dash, a word longer than a line)."""
    if not (text.isascii() and text.isprintable()):
        return None
    words = text.split()
    if len(" ".join(words)) <= width:
        return [" ".join(words)]
    chunks: list[str] = []
    for word in words:
        pieces = _pieces(word)
        if pieces is None:
            return None
        chunks += [*pieces, " "]
    chunks.pop()
    lines: list[str] = []
    i = 0
    while i < len(chunks):  # textwrap's _wrap_chunks, drop_whitespace and all
        if chunks[i] == " " and lines:
            i += 1
        line: list[str] = []
        length = 0
        while i < len(chunks) and length + len(chunks[i]) <= width:
            line.append(chunks[i])
            length += len(chunks[i])
            i += 1
        if i < len(chunks) and len(chunks[i]) > width:
            return None  # textwrap breaks a long word in its own way
        if line and line[-1] == " ":
            line.pop()
        if line:
            lines.append("".join(line))
    return lines


def _pieces(word: str) -> list[str] | None:
    """A word as textwrap's wordsep_re splits it: after a hyphen between letters (two before it,
    or a letter, a hyphen and a letter; a letter, maybe a hyphen, and a letter after it)."""
    pieces: list[str] = []
    start = 0
    for i, char in enumerate(word):
        if char != "-":
            continue
        if word[i + 1:i + 2] == "-" and i and word[i - 1] in _WORD_PUNCTUATION:
            return None  # an em-dash (word--word): a chunk of its own
        before = (i >= 2 and word[i - 2] in _LETTERS and word[i - 1] in _LETTERS) or (
            i >= 3 and word[i - 3] in _LETTERS and word[i - 2] == "-" and word[i - 1] in _LETTERS)
        after = word[i + 1:i + 2] in _LETTERS and (
            word[i + 2:i + 3] in _LETTERS or (word[i + 2:i + 3] == "-" and word[i + 3:i + 4] in _LETTERS))
        if before and after:
            pieces.append(word[start:i + 1])
            start = i + 1
    return [*pieces, word[start:]]
