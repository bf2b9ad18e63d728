"""The `gpuguard` command: argparse front end, one module per command group.

Each `*_cmd` module in this package has `register(subparsers)`, which adds its commands and
sets `func(args) -> int` on them. Exit codes are the same everywhere: 0 ok, 1 refused or
failed, 2 bad usage or input, 3 daemon unreachable. Errors are one line, no traceback.

What the commands print can hold strings users chose (a PAM TTY or remote host in whoami,
a process name in an event): everything written to stdout and every error goes through
escape.printable, so no control character reaches the terminal (JSON escapes its own).

Start-up is lazy: a command imports only its own module (COMMANDS), and `pam-hook`, which
runs on every login through pam_exec, skips this front end altogether (gpuguard.pam_hook
parses its own few options): this module imports nothing heavy before it knows the command.
"""
from __future__ import annotations

import os
import sys

from gpuguard.core.errors import EXIT_OK, EXIT_USAGE, GpuguardError  # no imports of its own: cheap

TYPE_CHECKING = False  # not typing's: `gpuguard pam-hook` runs at every login (see above)
if TYPE_CHECKING:
    import argparse
    import typing
    from collections.abc import Callable
    from types import SimpleNamespace
    from typing import Any

    from gpuguard import config


class CommandError(GpuguardError):
    """A command's own one-line failure, with the exit code to use."""


def unit_arg(text: str) -> int | str:
    """argparse type of --gpu: a GPU (3) or a MIG slice (3/gi1/ci0), as whoami and status show them,
    or a UUID (GPU-..., MIG-...) as CUDA_VISIBLE_DEVICES and nvidia-smi -L show it (the daemon maps it)."""
    import argparse

    from gpuguard.core.unit_numbers import parse_unit
    if text.startswith(("GPU-", "MIG-")):
        return text
    try:
        return parse_unit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fraction_size(text: str) -> int:
    """argparse type of --memory: a fraction of one GPU's memory, a size such as 20GiB."""
    import argparse

    from gpuguard.core.quantities import UnitError, parse_size
    try:
        size = parse_size(text)
    except UnitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not size:
        raise argparse.ArgumentTypeError(f"{text!r} is not a part of a GPU: give a size such as 20GiB")
    return size


def gpu_count(text: str) -> int:
    """argparse type of --gpus: a number of GPUs, 1 or more."""
    import argparse
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GPUs: give 1 or more "
                                         "(or leave --gpus out for the default)")
    return count


def no_such_user(name: str, *spellings: str) -> CommandError:
    """The refusal of a user name no account has, naming the option as it was typed (`-u` or `--user`)."""
    typed = next((option for word in sys.argv[1:] for option in spellings
                  if word == option or word.startswith(option + "=")), spellings[-1])
    return CommandError(f"{typed} {name}: no user named {name} on this host; check the spelling", EXIT_USAGE)


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise CommandError(f"{what} needs root")


def load_config(args: argparse.Namespace) -> config.Config:
    """The config named by --config, $GPUGUARD_CONFIG or the default path (errors exit 2)."""
    from gpuguard import config
    return config.load(args.config)


def print_json(data: Any) -> None:
    import json
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def print_rows(rows: list[list[str]]) -> None:
    """A plain aligned table, first row the header, like ps and nvidia-smi print. A cell is one
    line whatever it holds (a name from a database or a process): a newline in it is written as
    `\\n`, so it cannot start a forged row; only colour sequences pass (the status table's own)."""
    from gpuguard.core.escape import printable_keeping_colour

    cells = [[printable_keeping_colour(cell) for cell in row] for row in rows]
    widths = [max(len(row[column]) for row in cells) for column in range(len(cells[0]))]
    for row in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


# Every command, in the order `gpuguard --help` lists them (the users' first), with the module
# that registers it, its other names and its line of help. A command loads only its own module;
# `gpuguard --help` and `gpuguard` alone print the table itself (cli.top_help), loading no module
# and not argparse. The full parser (a command's help, a typo, completion, the man page) loads
# every `*_cmd` module, in this order, and their add_parser(help=...) must say what this table
# says: tests/unit/test_cli_fast_help.py sees any difference, tests/system/test_cli_startup.py a
# command missing here.
TABLE: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("run", "run_cmd", (), "run a command on GPUs taken for it, given back when it ends (like srun)"),
    ("jupyter", "jupyter_cmd", (), "notebook kernels that start with your GPUs"),
    ("whoami", "user_cmd", (), "your GPUs, quota, sessions and recent events"),
    ("env", "user_cmd", (), "the export CUDA_VISIBLE_DEVICES=... line for your GPUs now"),
    ("request", "user_cmd", (), "get GPUs now, up to your quota (--wait: queue for them)"),
    ("cancel", "user_cmd", (), "leave the queue (your GPUs stay yours)"),
    ("fairshare", "user_cmd", (), "every user's recent GPU usage and share, in queue order (like sshare)"),
    ("release", "user_cmd", (), "give GPUs back (the ones your processes still use stay)"),
    ("status", "status_cmd", (), "who holds which GPU, memory, utilisation and processes"),
    ("report", "report_cmd", (), "GPU-hours granted, busy and idle, and processes stopped, per user, GPU or day"),
    ("events", "report_cmd", (), "warnings, kills, grants and releases, newest last"),
    ("quota", "quota_cmd", (), "show or change per-user, per-group and default quotas"),
    ("prefs", "prefs_cmd", (), "your own settings: whether VS Code Remote-SSH and ssh -T sessions take GPUs"),
    ("grant", "admin_cmd", (), "give a user GPUs (beyond login grants; root)"),
    ("revoke", "admin_cmd", (), "take GPUs back from a user (root)"),
    ("reload", "admin_cmd", (), "make the daemon read its config again (root)"),
    ("drain", "admin_cmd", (), "give GPUs to nobody new, for maintenance (root)"),
    ("hold", "admin_cmd", (), "hold a user's queued request, or let it go on (root)"),
    ("resume", "admin_cmd", (), "give drained GPUs out again (root)"),
    ("backup", "backup_cmd", (), "copy the daemon's state into a file, while it runs (root)"),
    ("restore", "backup_cmd", (), "replace the daemon's state by a backup (root, daemon stopped)"),
    ("completion", "completion_cmd", (), "print the shell completion script"),
    ("config", "config_cmd", (), "check configuration files"),
    ("daemon", "daemon_cmd", (), "run the gpuguard agent (root, foreground)"),
    ("doctor", "doctor_cmd", (), "check this machine's gpuguard setup (root)"),
    ("enable", "enable_cmd", (), "make gpuguard take effect: modprobe.d option, udev rule, PAM profile, daemon (root)"),
    ("disable", "enable_cmd", (),
     "undo enable: daemon stopped, gate detached, GPU nodes open as the driver makes them (root)"),
    ("where", "fleet_cmd", (), "which server of the fleet has GPUs for you now, near your data"),
    ("fleet", "fleet_cmd", (), "the fleet database: its roles, and taking a decommissioned server out (root)"),
    ("gate", "gate_cmd", (), "the kernel gate: status, attach, detach (root)"),
    ("acl", "gate_cmd", (), "device nodes and their ACLs (root; run by udev)"),
    ("gpus", "gpus_cmd", (), "list GPUs, their use and topology"),
    ("replay", "replay_cmd", ("simulate",), "replay a workload trace: the configured policy beside static reservation"),
    ("trace", "replay_cmd", (), "make trace files for gpuguard replay"),
    ("sim", "sim_cmd", (), 'programs for simulated GPUs (gpu.backend = "simulated")'),
    ("web", "web_cmd", (), "serve the read-only web view of the GPUs, the queue and usage"),
)
COMMANDS = {name: module for command, module, aliases, _ in TABLE for name in (command, *aliases)}
_SUMMARIES = {command: text for command, _, _, text in TABLE}


def summary(command: str) -> str:
    """A command's one-line help as TABLE says it: the full parser's (each module's add_parser) and
    the fast --help's alike, written once."""
    return _SUMMARIES[command]
DESCRIPTION = """Fair, kernel-enforced GPU sharing.

for users:   run, jupyter, whoami, status, request, release, cancel, env, fairshare, report, events, quota show,
             prefs
for admins:  grant, revoke, drain, resume, hold, cancel --user, reload, quota set, config check, doctor, gate,
             acl, daemon, enable, disable, web, backup, restore, fleet remove
tools:       replay, trace, sim, completion, gpus"""
EPILOG = """examples:
  gpuguard run --wait -- python train.py
                                   run a job on a GPU taken for it, given back when it ends
  gpuguard jupyter install-kernel  a notebook kernel that starts with your GPUs
  gpuguard whoami                  your GPUs, quota, place in the queue and why
  eval "$(gpuguard request --wait)"
                                   get GPUs for this shell, waiting in the queue if none is free
  eval "$(gpuguard env)"           set CUDA_VISIBLE_DEVICES in an older shell (tmux, screen)
  gpuguard COMMAND --help          what a command does, with an example

exit codes: 0 ok, 1 refused or failed, 2 bad usage or input, 3 daemon unreachable (tell your admin)"""
PAM_HOOK = "pam-hook"
PAM_HOOK_HELP = "pam_exec session hook (fallback for pam_gpuguard.so; always exits 0; see pam/README)"
CONFIG_HELP = "config file (default: $GPUGUARD_CONFIG or {})"  # the default: daemon_socket.DEFAULT_CONFIG


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with `command`'s module registered, or every `*_cmd` module's (help, a typo,
    completion and the man page: None)."""
    import argparse
    import importlib

    from gpuguard import __version__
    from gpuguard.daemon_socket import DEFAULT_CONFIG

    parser = _parser_class()(prog="gpuguard", description=DESCRIPTION, epilog=EPILOG,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"gpuguard {__version__}")
    parser.add_argument("--config", metavar="PATH", help=CONFIG_HELP.format(DEFAULT_CONFIG))
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    order = list(dict.fromkeys(module for _, module, _, _ in TABLE))  # the table's
    modules = ([COMMANDS[command]] if command in COMMANDS
               else sorted(_every_command_module(),
                           key=lambda name: (order.index(name) if name in order else len(order), name)))
    for module in modules:
        importlib.import_module(f"{__name__}.{module}").register(subparsers)
    if command not in COMMANDS:  # listed for help; main runs it before any parser
        subparsers.add_parser(PAM_HOOK, help=PAM_HOOK_HELP)
    return parser


def _parser_class() -> type[argparse.ArgumentParser]:
    import argparse
    import re

    from gpuguard.cli.argv import meant, no_command, no_option

    class Parser(argparse.ArgumentParser):
        """argparse with one-line errors, as every other gpuguard error (its usage block is --help's),
        that say what an unknown command or option most likely meant."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # `--timeout -5m` is a value (refused as negative by the command), not an unknown option
            # with --timeout left without one: no gpuguard option starts with a digit.
            self._negative_number_matcher = re.compile(r"^-\d")

        def error(self, message: str) -> typing.NoReturn:
            from gpuguard.core.escape import printable
            self.exit(2, f"gpuguard: {printable(message)} (see {self.prog} --help)\n")

        def _check_value(self, action: argparse.Action, value: Any) -> None:
            if action.choices is None or value in action.choices:
                return
            if isinstance(action, argparse._SubParsersAction):
                raise argparse.ArgumentError(None, no_command(f"{self.prog.removeprefix('gpuguard ')} {value}",
                                                              action.choices))
            guess = meant(str(value), map(str, action.choices))
            name = "/".join(action.option_strings) or action.metavar or action.dest
            raise argparse.ArgumentError(None, f"{name} {value}: choose from {', '.join(map(str, action.choices))}"
                                               + (f"; did you mean {guess!r}?" if guess else ""))

        def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
            parsed, extras = self.parse_known_args(args, namespace)
            if extras:
                chosen = _chosen(self, parsed)
                unknown = next((word for word in extras if word.startswith("-")), None)
                if unknown is None:
                    chosen.error(f"unexpected {' '.join(extras)!r}")
                chosen.error(no_option(unknown, chosen.prog, chosen._option_string_actions))
            return parsed

    return Parser


def _chosen(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command's parser that `parsed` went down to: the one whose options a typo meant."""
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get(getattr(parsed, action.dest, None) or "")
            return parser if sub is None else _chosen(sub, parsed)
    return parser


def _every_command_module() -> list[str]:
    import pkgutil  # only for the full parser: a command's own needs none of it
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.endswith("_cmd"))


def split_command(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """(--config given before the command, the command, what follows it), without a parser."""
    config_path = None
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            config_path = arg.partition("=")[2]
        elif arg == "--config" and i + 1 < len(argv):
            config_path = argv[i + 1]
        elif not arg.startswith("-") and argv[i - 1:i] != ["--config"]:
            return config_path, arg, argv[i + 1:]
    return config_path, None, []


# Commands users run at every prompt, with the only options that skip argparse (importing and
# building it is a third of their start-up): (function, flags, options taking a value, defaults).
# Anything else (--help, a typo, another option) goes through the full parser, which tests
# (tests/system/test_cli_startup.py; for quota show, tests/unit/test_cli_fast_help.py) check
# reads every argv accepted here the same way.
QUICK: dict[str, tuple[str, dict[str, str], dict[str, str], dict[str, object]]] = {
    "whoami": ("show_whoami", {"--json": "json"}, {"--user": "user"}, {"json": False, "user": None}),
    "env": ("show_env", {"--json": "json"}, {}, {"json": False}),
    "status": ("show_status", {"--json": "json", "--csv": "csv", "--no-header": "no_header", "--fleet": "fleet",
                               "--cluster": "old_fleet"},
               {"--user": "user", "-u": "user"},
               {"json": False, "csv": False, "no_header": False, "fleet": False, "old_fleet": False, "user": None,
                "watch": None}),
    "fairshare": ("show_fairshare", {"--json": "json"}, {}, {"json": False}),
    "events": ("show_events", {"--json": "json"}, {"--since": "since", "--until": "until", "--user": "user",
                                                 "--rule": "rule"},
               {"json": False, "since": None, "until": None, "user": None, "rule": None, "limit": 200}),
    "report": ("show_report", {"--json": "json", "--csv": "csv"}, {"--since": "since", "--until": "until",
                                                                 "--user": "user"},
               {"json": False, "csv": False, "since": None, "until": None, "user": None, "by": "user"}),
    "gpus": ("show_gpus", {"--json": "json", "--csv": "csv"}, {}, {"json": False, "csv": False}),
    "quota": ("run_show", {"--json": "json"}, {"--user": "user", "--group": "group"},
              {"action": "show", "json": False, "user": None, "group": None}),
}
# The word after the command that its QUICK entry is for (`quota show`; `quota set` edits files: argparse).
QUICK_ACTIONS = {"quota": "show"}
EXCLUSIVE = (("json", "csv"), ("user", "group"))  # argparse's mutually exclusive groups (for quota: show's)


def quick_arguments(config_path: str | None, command: str | None, rest: list[str]) -> SimpleNamespace | None:
    """The parsed arguments of a QUICK command whose options are all plain, without argparse;
    None for anything the full parser must read."""
    if command not in QUICK:
        return None
    function, flags, valued, defaults = QUICK[command]
    if command in QUICK_ACTIONS:
        if rest[:1] != [QUICK_ACTIONS[command]]:
            return None
        rest = rest[1:]
    values = dict(defaults)
    words = iter(rest)
    for word in words:
        name, has_value, value = word.partition("=")
        if word in flags and not values[flags[word]]:
            values[flags[word]] = True
        elif name in valued and (value if has_value else (value := next(words, ""))) and not value.startswith("-"):
            values[valued[name]] = value
        else:
            return None
    if any(values.get(one) and values.get(other) for one, other in EXCLUSIVE):
        return None  # argparse's mutually exclusive group says why
    from types import SimpleNamespace  # loaded already (by enum, dataclasses); importlib is not
    name = f"{__name__}.{COMMANDS[command]}"
    __import__(name)
    return SimpleNamespace(config=config_path, command=command, func=getattr(sys.modules[name], function), **values)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        # `gpuguard status | head -1`: the reader has what it wanted. Python's "Note on SIGPIPE":
        # stdout to /dev/null, so that the flush at exit raises no second error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def _main(argv: list[str]) -> int:
    from gpuguard.cli.argv import arrange, no_command
    arranged = arrange(argv)
    if arranged is None:  # --version, before or after the command
        from gpuguard import __version__
        print(f"gpuguard {__version__}")
        return EXIT_OK
    config_path, command, rest = split_command(arranged)
    if command is None:  # --help, or nothing: the table's, without argparse (or argparse's, see top_help)
        from gpuguard.cli import top_help
        if (code := top_help.answer(arranged)) is not None:
            return code
    if command == PAM_HOOK:
        from gpuguard import pam_hook
        return pam_hook.main(rest, config_path)
    if command is not None and command not in COMMANDS:  # one line, not argparse's list of every command
        return _fail(no_command(command, COMMANDS, "gpuguard --help"), EXIT_USAGE)
    args = quick_arguments(config_path, command, rest) or build_parser(command).parse_args(arranged)
    from gpuguard.cli.output import PrintableOutput  # not before: pam-hook needs none of it
    sys.stdout = PrintableOutput(sys.stdout)
    # each command's set_defaults(func=...): it reads attributes only, so the quick parse's namespace serves too
    run: Callable[[argparse.Namespace | SimpleNamespace], int] = args.func
    try:
        code = run(args)
        sys.stdout.flush()  # a closed pipe is told here, not at exit
        return code
    except GpuguardError as exc:
        return _fail(exc.line(), exc.code)  # a verifier log or a multi-line cause goes to the daemon's log
    except KeyboardInterrupt:
        return 130


def _fail(message: str, code: int) -> int:
    from gpuguard.core.escape import printable
    print(f"gpuguard: {printable(message)}", file=sys.stderr)
    return code
