"""Shell completion and the man page, both generated from the argparse definitions: every
command `gpuguard --help` knows is completed and documented, with the same help text."""
from __future__ import annotations

import argparse
import json
import os
import subprocess

from conftest import BIN, PYTHON, REPO
from sim_helpers import gpuguard

from gpuguard.cli import build_parser


def commands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def complete(script: str, line: str) -> list[str]:
    """What bash completes at the end of `line`, with the generated script loaded."""
    words = line.split(" ")
    program = (f'{script}\nCOMP_LINE="{line}"; COMP_POINT=${{#COMP_LINE}}\n'
               f'COMP_WORDS=({" ".join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}\n'
               '_shtab_gpuguard; printf "%s\\n" "${COMPREPLY[@]}"')
    result = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True)
    return result.stdout.split()


def test_bash_completion_knows_every_command_and_the_choices_of_options(tmp_path):
    result = subprocess.run(gpuguard(None, "completion", "bash"), capture_output=True, text=True,
                            env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})  # no cache left behind
    assert result.returncode == 0, result.stderr
    script = result.stdout
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid bash
    assert sorted(complete(script, "gpuguard ")) == sorted(commands())
    assert complete(script, "gpuguard rep") == ["report"]
    assert complete(script, "gpuguard report --by ") == ["user", "gpu", "day"]
    assert "--csv" in complete(script, "gpuguard status --")
    refused = subprocess.run(gpuguard(None, "completion", "ksh"), capture_output=True, text=True)
    assert refused.returncode == 2 and "invalid choice" in refused.stderr


def test_fish_completion_knows_every_command_and_each_commands_options(tmp_path):
    result = subprocess.run(gpuguard(None, "completion", "fish"), capture_output=True, text=True,
                            env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    script = tmp_path / "gpuguard.fish"
    script.write_text(result.stdout)

    def complete_fish(line: str) -> list[str]:
        done = subprocess.run(["fish", "--no-config", "-c", f"source {script}; complete -C '{line}'"],
                              capture_output=True, text=True, check=True)
        return [entry.split("\t")[0] for entry in done.stdout.splitlines()]

    assert sorted(complete_fish("gpuguard ")) == sorted(commands())
    assert complete_fish("gpuguard canc") == ["cancel"]
    assert {"--csv", "--no-header", "--user"} <= set(complete_fish("gpuguard status --"))


def test_completion_is_cached_and_a_cached_run_loads_no_command_module(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    first = subprocess.run(gpuguard(None, "completion", "bash"), capture_output=True, text=True, env=env)
    (cached,) = (tmp_path / "gpuguard").iterdir()
    assert cached.read_text() == first.stdout
    probe = ("import json, sys\nfrom gpuguard.cli import main\nmain(['completion', 'bash'])\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.endswith('_cmd') or m == 'shtab')), file=sys.stderr)")
    second = subprocess.run([PYTHON, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO)
    assert second.stdout == first.stdout
    assert json.loads(second.stderr.splitlines()[-1]) == ["gpuguard.cli.completion_cmd"]  # no shtab, no parser


def test_the_man_page_documents_every_command_with_its_help_text(tmp_path):
    page = tmp_path / "gpuguard.1"
    subprocess.run([str(BIN / "argparse-manpage"), "--module", "gpuguard.cli", "--function", "build_parser",
                    "--prog", "gpuguard", "--output", str(page)], check=True, cwd=REPO)
    text = page.read_text().replace("\\-", "-")
    assert text.startswith(".TH GPUGUARD")
    for name in commands():
        assert f"gpuguard {name}" in text or f"\\fI\\,{name}\\/" in text, name
    report = commands()["report"]
    (by,) = [a for a in report._actions if "--by" in a.option_strings]
    assert by.help in text  # the same words as --help, not a copy kept by hand
    # make man, make install and make deb build this one, with the same arguments.
    assert "argparse-manpage --module gpuguard.cli --function build_parser" in (REPO / "packaging/build-docs.sh").read_text()
    assert "packaging/build-docs.sh" in (REPO / "Makefile").read_text()
    assert "build-docs.sh" in (REPO / "packaging/build-deb.sh").read_text()
