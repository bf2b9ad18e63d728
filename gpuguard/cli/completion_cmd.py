"""`gpuguard completion bash|zsh|tcsh|fish`: the shell completion script, generated from the same
argparse definitions that `--help` and the man page (`make man`) show: by shtab for bash, zsh and
tcsh, and here for fish (which shtab does not write).

Generating it loads every command's module (a few hundred ms); the script is kept in the user's
cache directory (`$XDG_CACHE_HOME/gpuguard`, else `~/.cache/gpuguard`) under a key made of the
version and the command modules' modification times, so a shell that sources it at every start
gets the cached copy without loading the CLI again, and an upgrade makes a new one.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

from gpuguard.cli import summary
from gpuguard.core.errors import EXIT_OK

SHELLS = ("bash", "zsh", "tcsh", "fish")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "completion", help=summary("completion"),
        description="Print the completion script for SHELL. Example (try it): eval \"$(gpuguard completion bash)\"; "
                    "install it with: gpuguard completion bash > /usr/share/bash-completion/completions/gpuguard; "
                    "fish: gpuguard completion fish > ~/.config/fish/completions/gpuguard.fish")
    parser.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    parser.set_defaults(func=print_completion)


def cache_path(shell: str) -> Path | None:
    """Where this version's script for `shell` is kept; None without a home to keep it in."""
    from gpuguard import __version__, cli

    base = os.environ.get("XDG_CACHE_HOME") or (os.path.expanduser("~/.cache") if "HOME" in os.environ else "")
    if not base:
        return None
    package = Path(cli.__file__).parent
    stamp = hashlib.sha256(repr((__version__, sorted((p.name, p.stat().st_mtime_ns) for p in package.glob("*.py"))))
                           .encode()).hexdigest()[:16]
    return Path(base) / "gpuguard" / f"completion-{shell}-{stamp}"


def script(shell: str) -> str:
    from gpuguard.cli import build_parser
    parser = build_parser()
    if shell == "fish":
        return fish(parser)
    import shtab  # only this command needs it
    return shtab.complete(parser, shell=shell)


def fish(parser: argparse.ArgumentParser) -> str:
    """complete(1) lines for fish: the commands with their help, then each command's options."""
    def quote(text: str | None) -> str:
        return "'" + (text or "").replace("\\", "\\\\").replace("'", "\\'") + "'"

    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in commands._choices_actions}
    lines = ["complete -c gpuguard -f"]
    for name, sub in commands.choices.items():
        lines.append(f"complete -c gpuguard -n __fish_use_subcommand -a {name} -d {quote(helps.get(name))}")
        for action in sub._actions:
            longs = [o[2:] for o in action.option_strings if o.startswith("--")]
            shorts = [o[1:] for o in action.option_strings if len(o) == 2]
            if not longs and not shorts:
                continue
            flags = " ".join([*(f"-l {o}" for o in longs), *(f"-s {o}" for o in shorts)])
            takes = " -r" if action.nargs != 0 else ""
            lines.append(f"complete -c gpuguard -n '__fish_seen_subcommand_from {name}' {flags}{takes} "
                         f"-d {quote(action.help)}")
    return "\n".join(lines) + "\n"


def print_completion(args: argparse.Namespace) -> int:
    path = cache_path(args.shell)
    try:
        text = path.read_text() if path else None
    except OSError:
        text = None
    if text is None:
        text = script(args.shell)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                temporary = path.with_name(f".{path.name}.{os.getpid()}")
                temporary.write_text(text)
                temporary.replace(path)
            except OSError:
                pass  # a read-only home: generated each time
    sys.stdout.write(text)
    return EXIT_OK
