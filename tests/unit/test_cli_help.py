"""Every command's help shows how it is used: an example in each leaf subcommand's description
(issue 22: "every subcommand with a description and an example"), so `gpuguard X --help` and the
man pages built from the same definitions never leave a reader guessing."""
from __future__ import annotations

import argparse

from gpuguard import cli


def leaf_commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    found.update(leaf_commands(sub, (*prefix, name)))
                else:
                    found[" ".join((*prefix, name))] = sub
    return found


def test_every_subcommand_has_a_description_with_an_example() -> None:
    commands = leaf_commands(cli.build_parser())
    assert {"whoami", "status", "request", "quota set", "gate status", "trace generate"} <= commands.keys()
    # pam-hook is left out: PAM runs it, nobody types it.
    missing = sorted(name for name, sub in commands.items()
                     if name != cli.PAM_HOOK and "Example" not in (sub.description or ""))
    assert missing == []
