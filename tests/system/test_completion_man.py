"""Shell completion and the man pages, generated from the argparse definitions and the config
loader's table: every command `gpuguard --help` knows is completed and documented, with the same
help text, and every key the loader knows is in gpuguard.toml(5)."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess

import pytest
from conftest import PYTHON, REPO
from sim_helpers import gpuguard

from gpuguard import config
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
    assert sorted(complete(script, "gpuguard rep")) == ["replay", "report"]
    assert complete(script, "gpuguard report --by ") == ["user", "gpu", "day"]
    assert "--csv" in complete(script, "gpuguard status --")
    refused = subprocess.run(gpuguard(None, "completion", "ksh"), capture_output=True, text=True)
    assert refused.returncode == 2 and "ksh: choose from bash" in refused.stderr


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


def man_pages(outdir) -> dict[str, str]:
    """packaging/manpages.py's pages (what `make man` and debian/rules build), as `man` shows them."""
    subprocess.run([PYTHON, str(REPO / "packaging/manpages.py"), str(outdir)], check=True, cwd=REPO,
                   env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    shown = {}
    for page in sorted(outdir.iterdir()):
        result = subprocess.run(["man", "--warnings", "-P", "cat", "-l", str(page)], capture_output=True, text=True,
                                env={"MANWIDTH": "250", "LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin"})
        assert result.returncode == 0 and result.stderr == "", (page.name, result.stderr)  # groff has nothing to say
        shown[page.name] = result.stdout
    return shown


@pytest.mark.skipif(shutil.which("man") is None, reason="man-db is not installed")
def test_every_command_is_documented_on_one_page_with_its_help_text(tmp_path):
    pages = man_pages(tmp_path)
    assert sorted(pages) == ["gpuguard.1", "gpuguard.8", "gpuguard.toml.5", "pam_gpuguard.8"]
    for name in pages:
        assert pages[name].split()[0] == name.rsplit(".", 1)[0].upper() + f"({name.rsplit('.', 1)[1]})"
    documented: list[argparse.ArgumentParser] = []
    for name, parser in commands().items():
        if any(parser is seen for seen in documented):
            continue  # an alias (`simulate`, replay's name before): documented under the command's name
        documented.append(parser)
        heading = re.compile(rf"^   gpuguard {re.escape(name)}$", re.MULTILINE)
        on = [page for page in ("gpuguard.1", "gpuguard.8") if heading.search(pages[page])]
        assert len(on) == 1, (name, on)
    for section in ("EXIT STATUS", "FILES", "ENVIRONMENT", "EXAMPLES"):
        assert f"\n{section}\n" in pages["gpuguard.1"] and f"\n{section}\n" in pages["gpuguard.8"], section
    report = commands()["report"]
    (by,) = [a for a in report._actions if "--by" in a.option_strings]
    assert by.help in pages["gpuguard.1"]  # the same words as --help, not a copy kept by hand
    assert 'eval "$(gpuguard env)"' in pages["gpuguard.1"]
    for option in ("socket=PATH", "grant=auto|always|never", "quiet", "debug"):
        assert re.search(rf"^       {re.escape(option)}(\s|$)", pages["pam_gpuguard.8"], re.MULTILINE), option
    # make man and the Debian build make these, with the same program.
    assert "packaging/manpages.py" in (REPO / "Makefile").read_text()
    assert "packaging/manpages.py" in (REPO / "debian/rules").read_text()


@pytest.mark.skipif(shutil.which("man") is None, reason="man-db is not installed")
def test_every_config_key_the_loader_knows_is_in_gpuguard_toml_5_with_its_default(tmp_path):
    page = man_pages(tmp_path)["gpuguard.toml.5"]
    for section, table in config.SCHEMA.items():
        start = page.index(f"\n[{section}]\n")
        body = page[start:page.find("\n[", start + 1)]
        for key in table:
            assert re.search(rf"^       {re.escape(key)} = \w+ \(default: ", body, re.MULTILINE), f"{section}.{key}"
    # Defaults are the loader's own, written as the file is.
    assert re.search(r"^       grace = duration \(default: 30s\)$", page, re.MULTILINE)
    assert re.search(r"^       group = string \(default: \"gpugroup\"\)$", page, re.MULTILINE)


def test_a_key_without_its_words_stops_the_man_page_build(tmp_path):
    """A key added to the loader's table with no description in gpuguard/config_doc.py fails the build."""
    code = ("import sys\nfrom gpuguard import config\n"
            "config.SCHEMA['watcher']['ggt_new_key'] = config._bool\n"
            "sys.argv = ['manpages.py', sys.argv[1]]\n"
            "exec(open('packaging/manpages.py').read())\n")
    result = subprocess.run([PYTHON, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                            env={"PYTHONPATH": str(REPO)})
    assert result.returncode != 0 and "watcher.ggt_new_key" in result.stderr, result
    assert not (tmp_path / "gpuguard.toml.5").exists()
