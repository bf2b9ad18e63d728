"""The CLI starts lazily: a command loads only its own module, and `gpuguard pam-hook`, run by
pam_exec at every login and logout, loads none of the CLI's machinery (argparse, typing, the
config validator). Checked on what a fresh interpreter has imported, not on timings."""
from __future__ import annotations

import json
import subprocess

import pytest
from conftest import PYTHON

from gpuguard.cli import COMMANDS, PAM_HOOK, build_parser, quick_arguments, split_command

# Run a command in a fresh interpreter and print the gpuguard and heavy stdlib modules it loaded.
LOADED = """
import json, sys
from gpuguard.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.startswith("gpuguard") or m in ("argparse", "typing", "tomllib"))))
"""


def loaded_by(*argv: str, **pam: str) -> set[str]:
    env = {"PATH": "/usr/bin:/bin", **pam}
    result = subprocess.run([PYTHON, "-I", "-c", LOADED, *argv], capture_output=True, text=True, env=env,
                            timeout=60)
    return set(json.loads(result.stdout.splitlines()[-1]))


def test_pam_hook_loads_no_cli_machinery(sandbox) -> None:
    config = sandbox / "gpuguard.toml"
    config.write_text(f'[paths]\nsocket = "{sandbox / "x.sock"}"\n')
    # A logout with no daemon there: the socket is read from the config, the call fails (logged).
    loaded = loaded_by("--config", str(config), PAM_HOOK, PAM_TYPE="close_session", PAM_USER="ggt-nobody")
    assert "gpuguard.pam_hook" in loaded
    assert not loaded & {"argparse", "typing", "tomllib", "gpuguard.config", "gpuguard.backends", "gpuguard.core.model"}, loaded
    assert not any(module.endswith("_cmd") for module in loaded), loaded


def test_a_command_loads_only_its_own_module() -> None:
    loaded = loaded_by("whoami", "--help")
    assert {m for m in loaded if m.endswith("_cmd")} == {"gpuguard.cli.user_cmd"}


def test_a_typo_loads_no_command_module_nor_argparse() -> None:
    """`gpuguard stauts` is one line from the table of commands, not the full parser's every module."""
    loaded = loaded_by("stauts")
    assert not loaded & {"argparse", "typing"} and not any(m.endswith("_cmd") for m in loaded), loaded


def commands_of(parser) -> set[str]:
    return set(next(a for a in parser._actions if a.dest == "command").choices)


def test_every_registered_command_is_in_the_table() -> None:
    """COMMANDS decides which module a command loads: it must name every command's own module."""
    assert commands_of(build_parser()) == set(COMMANDS) | {PAM_HOOK}
    for name in COMMANDS:
        assert name in commands_of(build_parser(name)), f"{COMMANDS[name]} does not register {name}"


@pytest.mark.parametrize("argv, expected", [
    (["pam-hook", "--quiet"], (None, "pam-hook", ["--quiet"])),
    (["--config", "/x.toml", "pam-hook"], ("/x.toml", "pam-hook", [])),
    (["--config=/x.toml", "status", "--json"], ("/x.toml", "status", ["--json"])),
    (["--version"], (None, None, [])),
    (["--config", "pam-hook"], ("pam-hook", None, [])),  # the path, not the command
])
def test_split_command(argv, expected) -> None:
    assert split_command(argv) == expected


QUICK_ARGV = [["whoami"], ["whoami", "--json"], ["whoami", "--user", "bob"], ["whoami", "--user=bob", "--json"],
              ["--config", "/x.toml", "status", "-u", "bob", "--csv"], ["status", "--json", "--user", "a"], ["env"],
              ["--config=/y.toml", "env"], ["env", "--json"], ["whoami", "--user", "a", "--user", "b"], ["status", "--fleet"],
              ["status", "--cluster"], ["status", "--csv", "--no-header"], ["status", "--cluster", "--json"],
              ["fairshare"], ["fairshare", "--json"], ["events"], ["events", "--since", "today", "--json"],
              ["events", "--user", "bob", "--rule=memory", "--until", "7d"], ["report"],
              ["report", "--csv", "--since", "2026-11"], ["report", "--user=bob", "--json"], ["gpus"], ["gpus", "--csv"]]


@pytest.mark.parametrize("argv", QUICK_ARGV)
def test_the_quick_path_reads_argv_as_the_full_parser_does(argv) -> None:
    """whoami, status and env skip argparse for their plain options: what they get must be what
    the full parser (the one help, completion and the man page come from) would give them."""
    quick = quick_arguments(*split_command(argv))
    assert quick is not None
    assert vars(quick) == vars(build_parser(split_command(argv)[1]).parse_args(argv))


@pytest.mark.parametrize("argv", [["whoami", "--help"], ["whoami", "--jsn"], ["status", "--json", "--csv"],
                                  ["whoami", "--user"], ["whoami", "--user", "--json"], ["status", "-ubob"],
                                  ["whoami", "--json", "--json"], ["request"], ["env", "x"], ["status", "--watch"],
                                  ["status", "--watch", "5"], ["events", "--limit", "5"], ["report", "--by", "gpu"],
                                  ["gpus", "--json", "--csv"], ["report", "--csv", "--json"]])
def test_anything_else_goes_to_the_full_parser(argv) -> None:
    assert quick_arguments(*split_command(argv)) is None
