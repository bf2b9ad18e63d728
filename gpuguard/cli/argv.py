"""What the front end (gpuguard.cli.main) decides about argv before any parser is built: where
gpuguard's own options were put, and what a word it does not know most likely meant.

argparse reads gpuguard's options (--help, --version, --config) only before the command and
then stops at it, so `gpuguard --help status` printed the status table and `gpuguard whoami
--config x.toml` was refused. `arrange` puts them where argparse reads them. Pure: no imports.
"""
from __future__ import annotations

TYPE_CHECKING = False  # not typing's: every command starts here
if TYPE_CHECKING:
    from collections.abc import Iterable

HELP = ("-h", "--help")
VERSION = "--version"
CONFIG = "--config"
# Commands whose words after the command are another program's (run's CMD, a kernel's command
# line): only what comes before the command is gpuguard's.
FOREIGN_WORDS = frozenset({"run", "jupyter"})
# Commands with a --config of their own (the policy a replay reads).
OWN_CONFIG = frozenset({"replay", "simulate"})
# What users of Slurm and nvidia-smi type, and gpuguard's command for it.
HABITS = {"squeue": "status", "sinfo": "status", "scancel": "cancel", "srun": "run", "salloc": "request",
          "sshare": "fairshare", "sacct": "report", "nvidia-smi": "gpus"}


def arrange(argv: list[str]) -> list[str] | None:
    """argv with gpuguard's own options where argparse reads them: --help before the command moved
    after it (`gpuguard --help status` is status's help), --config after the command moved before
    it; None where --version is among them (only the version is printed, as argparse does)."""
    end = argv.index("--") if "--" in argv else len(argv)
    before: list[str] = []
    after: list[str] = []
    command = None
    help_asked = False
    i = 0
    while i < end:
        word = argv[i]
        if command is not None and command in FOREIGN_WORDS:
            after.append(word)
        elif word == VERSION:
            return None
        elif command is None and word in HELP:
            help_asked = True
        elif word == CONFIG and command not in OWN_CONFIG:
            before += argv[i:i + 2]
            i += 1
        elif word.startswith(CONFIG + "=") and command not in OWN_CONFIG:
            before.append(word)
        elif command is None and not word.startswith("-"):
            command = word
        else:
            (before if command is None else after).append(word)
        i += 1
    return [*before, *([command] if command is not None else []), *after, *(["--help"] if help_asked else []),
            *argv[end:]]


def meant(word: str, names: Iterable[str]) -> str | None:
    """The name `word` most likely meant: a Slurm user's habit, else the closest by spelling."""
    if word in HABITS:
        return HABITS[word]
    import difflib  # only for a typo
    close = difflib.get_close_matches(word, list(names), n=1, cutoff=0.6)
    return close[0] if close else None


def no_command(typed: str, names: Iterable[str], see: str = "") -> str:
    """`no command 'stauts'; did you mean 'status'?` (typed: the words so far, the last one unknown;
    see: where the commands are listed, said when no guess is)."""
    *known, last = typed.split(" ")
    guess = meant(last, names)
    hint = f"; did you mean {' '.join([*known, guess])!r}?" if guess else f" (see {see})" if see else ""
    return f"no command {typed!r}{hint}"


def no_option(typed: str, prog: str, options: Iterable[str]) -> str:
    """`no option '--jsn' for gpuguard status; did you mean '--json'?` (a value after = is kept out
    of the guess and in the answer)."""
    name, equals, value = typed.partition("=")
    guess = meant(name, (option for option in options if option.startswith("--")))
    hint = f"; did you mean {guess + equals + value!r}?" if guess else ""
    return f"no option {typed!r} for {prog}{hint}"
