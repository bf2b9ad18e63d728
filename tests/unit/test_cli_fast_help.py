"""`gpuguard --help` and `gpuguard` alone come from the table of commands (cli.TABLE, laid out by
cli.top_help), not from the full parser that loads every command's module: what they print
must be what that parser prints, at every terminal width, so the two can never drift (a command
added, a help reworded, an order changed: this fails and says where)."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import textwrap

import pytest

from gpuguard import cli, daemon_socket
from gpuguard.cli import top_help
from gpuguard.cli.argv import arrange


def full_parser_says(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the full parser reading argv, as main did before the table."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(arrange(argv))
    return int(exited.value.code or 0), out.getvalue(), err.getvalue()


def main_says(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of gpuguard's main: the table's answer, or the full parser's exit."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exited:
            code = int(exited.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_the_table_is_the_full_parsers_commands_in_its_order() -> None:
    """The full parser registers the table's commands in its order, each with the table's help
    (each module's add_parser reads it: cli.summary)."""
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    registered = [(choice.dest, choice.metavar, choice.help) for choice in commands._choices_actions]
    table = [(name, f"{name} ({', '.join(aliases)})" if aliases else name, help) for name, _, aliases, help in cli.TABLE]
    assert registered == [*table, (cli.PAM_HOOK, cli.PAM_HOOK, cli.PAM_HOOK_HELP)]
    assert top_help.DEFAULT_CONFIG == daemon_socket.DEFAULT_CONFIG


def test_the_help_is_the_full_parsers_at_every_width(monkeypatch) -> None:
    for columns in range(20, 241):
        monkeypatch.setenv("COLUMNS", str(columns))
        text = top_help.render(columns)
        # narrower than the usage line, or another argparse, argparse prints it (the table's answer is None)
        laid_out = top_help.LAID_OUT[0] <= sys.version_info[:2] < top_help.LAID_OUT[1]
        assert text is not None or columns < len(top_help.USAGE) + 2 or not laid_out, columns
        assert text is None or text == cli.build_parser().format_help(), columns


@pytest.mark.parametrize("argv", [[], ["--help"], ["-h"], ["--config", "/x.toml"], ["--config=/x.toml"],
                                  ["--config", "/x.toml", "--help"], ["--help", "--config=/x.toml"],
                                  ["--help", "--help"], ["--config", "--help"], ["--config"], ["--bogus"],
                                  ["--help", "--bogus"], ["--config", "-x", "--help"]])
@pytest.mark.parametrize("columns", ["40", "80", "132"])
def test_main_answers_as_the_full_parser(argv, columns, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    assert main_says(argv) == full_parser_says(argv)


def test_help_loads_no_command_module_nor_argparse() -> None:
    script = ("import sys\nfrom gpuguard.cli import main\ncode = main(sys.argv[1:])\n"
              "loaded = sorted(m for m in sys.modules if m.startswith('gpuguard') "
              "or m in ('argparse', 're', 'textwrap', 'shutil'))\n"
              "import json\nprint(json.dumps([code, loaded]))")  # json loads re
    for argv in (["--help"], ["--config", "/x.toml", "-h"], []):
        result = subprocess.run([sys.executable, "-I", "-c", script, *argv], capture_output=True, text=True,
                                env={"PATH": "/usr/bin:/bin"}, timeout=60, check=True)
        code, loaded = json.loads(result.stdout.splitlines()[-1])
        assert code == (0 if argv else 2)
        assert not {"argparse", "re", "textwrap", "shutil"} & set(loaded), loaded
        assert not any(module.endswith("_cmd") for module in loaded), loaded


@pytest.mark.parametrize("text", [
    *(help for _, _, _, help in cli.TABLE), cli.PAM_HOOK_HELP,
    "GPU-hours per user-group and x86-64 a-b-c ab-c-d well-known", "see (--wait: queue) and -T or --x- y",
    "trailing- -leading - alone -- spaced", "Remote-SSH  and   VS-Code", "e-mail re-do aa-b a_b-c_d"])
def test_wrap_is_textwraps(text) -> None:
    for width in range(11, 90):
        assert top_help.wrap(text, width) in (None, textwrap.wrap(" ".join(text.split()), width)), width
    assert top_help.wrap(text, 40) is not None  # no long word, no em-dash: the table's own answer


@pytest.mark.parametrize("text", ["word--word", "a " + "x" * 30, "tab\there", "caf\u00e9 au lait"])
def test_wrap_leaves_what_it_does_not_know_to_textwrap(text) -> None:
    assert top_help.wrap(text + " and more words to wrap", 20) is None


@pytest.mark.parametrize("argv", [["quota", "show"], ["quota", "show", "--json"], ["quota", "show", "--user", "bob"],
                                  ["--config", "/x.toml", "quota", "show", "--group=phd", "--json"],
                                  ["quota", "show", "--user=a", "--user", "b"]])
def test_quota_show_skips_argparse_as_the_full_parser_reads_it(argv) -> None:
    quick = cli.quick_arguments(*cli.split_command(argv))
    assert quick is not None
    assert vars(quick) == vars(cli.build_parser("quota").parse_args(argv))


@pytest.mark.parametrize("argv", [["quota"], ["quota", "set", "--user", "bob", "gpus=2"], ["quota", "show", "--help"],
                                  ["quota", "show", "--user", "a", "--group", "b"], ["quota", "show", "x"],
                                  ["quota", "show", "--user="], ["quota", "--json", "show"]])
def test_quota_show_leaves_anything_else_to_the_full_parser(argv) -> None:
    assert cli.quick_arguments(*cli.split_command(argv)) is None
