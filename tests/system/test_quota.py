"""`gpuguard quota set` and `quota show`: real files, the real CLI, real users and a real daemon.

The files start as the shipped examples (etc/gpuguard.toml, etc/quotas.toml) plus a few
commented entries, because what matters most is that an edit leaves the admin's file alone
apart from the keys it changes. Names of entries that are not real accounts start with
`ggt-` and are not hex, so they never collide with conftest's ggt-xxxxxx users.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from conftest import REPO
from sim_helpers import cli

from gpuguard import config
from gpuguard.core.compat import tomllib
from gpuguard.quota_file import edit

ENTRIES = """
[groups.ggt-interns]   # summer interns
max_time = "4h"        # they log out anyway
gpu_memory = "20GiB"

# alice runs the group's big jobs
[users.ggt-alice]
gpus = 2                 # two for now

[groups.ggt-staff]
gpus = 2
"""


def make_files(directory: Path, entries: str = ENTRIES) -> Path:
    """The shipped examples with state and socket inside `directory` (no daemon listens there)."""
    text = (REPO / "etc" / "gpuguard.toml").read_text()
    for old, new in (('"/run/gpuguard/gpuguard.sock"', f'"{directory}/run/gpuguard.sock"'),
                     ('"/var/lib/gpuguard"', f'"{directory}/state"')):
        assert text.count(old) == 1
        text = text.replace(old, new)
    path = directory / "gpuguard.toml"
    path.write_text(text)
    (directory / "quotas.toml").write_text((REPO / "etc" / "quotas.toml").read_text() + entries)
    for name in ("gpuguard.toml", "quotas.toml"):
        (directory / name).chmod(0o644)  # world-readable, as installed
    return path


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file in the directory with its bytes and mtime: 'untouched' means equal snapshots."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir()) if p.is_file()}


# --- quota set: what changes in the file, and what does not

def test_setting_a_key_changes_only_its_value(sandbox):
    config_path = make_files(sandbox)
    quotas = sandbox / "quotas.toml"
    before, main_before = quotas.read_text(), config_path.read_bytes()

    result = cli(config_path, "quota", "set", "--user", "ggt-alice", "gpus=3")

    assert result.returncode == 0, result.stderr
    # The trailing comment, the comments around it and every other line stay byte for byte.
    assert quotas.read_text() == before.replace("gpus = 2                 # two for now",
                                                "gpus = 3                 # two for now")
    assert config_path.read_bytes() == main_before
    assert result.stdout == (f"ggt-alice: gpus=3 gpu_memory=unlimited max_time=none idle_timeout=none sharing=false "
                             "priority=0 share=1 reclaim_after=10m fleet_gpus=none max_sharers=2 slices=any "
                             "whole_gpus=true slice_profiles=[] fraction_memory=unlimited max_fractions=any "
                             "min_fraction_memory=unlimited max_fraction_memory=unlimited "
                             f"(written to {quotas}; "
                             "the daemon is not running, it takes effect when it starts)\n")
    # Not an account here: a warning, and the quota is written all the same.
    assert result.stderr.startswith("gpuguard: warning: no user named ggt-alice")


def test_a_new_entry_is_appended_as_an_admin_would_write_it(sandbox):
    config_path = make_files(sandbox)
    quotas = sandbox / "quotas.toml"
    before = quotas.read_text()

    result = cli(config_path, "quota", "set", "--user", "ggt-bob",
                 "gpus=2", "gpu_memory=40GiB", "max_time=24h", "idle_timeout=none", "sharing=true")

    assert result.returncode == 0, result.stderr
    assert quotas.read_text() == before + ('\n[users.ggt-bob]\ngpus = 2\ngpu_memory = "40GiB"\nmax_time = "24h"\n'
                                           'idle_timeout = "none"\nsharing = true\n')
    assert config.load(config_path).quotas.users["ggt-bob"] == {
        "gpus": 2, "gpu_memory": 40 << 30, "max_time": 86400.0, "idle_timeout": None, "sharing": True}


def test_unset_removes_keys_and_an_emptied_entry(sandbox):
    config_path = make_files(sandbox)
    quotas = sandbox / "quotas.toml"
    before = quotas.read_text()

    assert cli(config_path, "quota", "set", "--group", "ggt-interns", "--unset", "gpu_memory").returncode == 0
    assert quotas.read_text() == before.replace('gpu_memory = "20GiB"\n', "")

    # KEY= is the other spelling. An entry left with nothing in it goes; one whose header
    # carries the admin's comment stays, empty.
    assert cli(config_path, "quota", "set", "--group", "ggt-staff", "gpus=").returncode == 0
    assert cli(config_path, "quota", "set", "--group", "ggt-interns", "max_time=").returncode == 0
    assert quotas.read_text() == (before.replace('gpu_memory = "20GiB"\n', "")
                                  .replace("[groups.ggt-staff]\ngpus = 2\n", "")
                                  .replace('max_time = "4h"        # they log out anyway\n', ""))
    loaded = config.load(config_path)
    assert loaded.quotas.groups == {"ggt-interns": {}}
    assert loaded.quotas.users == {"ggt-alice": {"gpus": 2}}


def test_defaults_edit_the_main_config(sandbox):
    config_path = make_files(sandbox)
    quotas = sandbox / "quotas.toml"
    before, quotas_before = config_path.read_text(), quotas.read_bytes()
    assert before.count("\ngpus = 1\n") == 1 and before.count("\nsharing = false\n") == 1

    result = cli(config_path, "quota", "set", "--defaults", "gpus=2", "sharing=true")

    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert config_path.read_text() == (before.replace("\ngpus = 1\n", "\ngpus = 2\n")
                                       .replace("\nsharing = false\n", "\nsharing = true\n"))
    assert quotas.read_bytes() == quotas_before
    assert result.stdout.startswith("defaults: gpus=2 gpu_memory=unlimited max_time=none idle_timeout=none "
                                    "sharing=true priority=0 share=1 reclaim_after=10m fleet_gpus=none max_sharers=2 "
                                    "slices=any whole_gpus=true slice_profiles=[] fraction_memory=unlimited "
                                    "max_fractions=any min_fraction_memory=unlimited "
                                    "max_fraction_memory=unlimited (written to ")


def test_mode_owner_and_symlink_are_kept(sandbox, make_user):
    config_path = make_files(sandbox)
    owner = make_user()
    real = sandbox / "managed" / "quotas.toml"
    real.parent.mkdir()
    (sandbox / "quotas.toml").rename(real)
    (sandbox / "quotas.toml").symlink_to(real)
    os.chown(real, owner.uid, owner.gid)
    real.chmod(0o640)

    assert cli(config_path, "quota", "set", "--user", "ggt-alice", "gpus=4").returncode == 0

    assert (sandbox / "quotas.toml").is_symlink()
    status = real.stat()
    assert (status.st_mode & 0o7777, status.st_uid, status.st_gid) == (0o640, owner.uid, owner.gid)
    assert config.load(config_path).quotas.users["ggt-alice"] == {"gpus": 4}
    assert [p.name for p in real.parent.iterdir()] == ["quotas.toml"]  # no temporary file left


# --- quota set: refusals leave every file untouched

@pytest.mark.parametrize("args", [
    ["--user", "ggt-alice", "gpus=100"],
    ["--user", "ggt-alice", "gpus=two"],
    ["--user", "ggt-alice", "gpus=1.5"],
    ["--user", "ggt-alice", "gpu_memory=lots"],
    ["--group", "ggt-interns", "max_time=forever"],
    ["--group", "ggt-interns", "idle_timeout=-5m"],
    ["--user", "ggt-alice", "sharing=yes"],
    ["--user", "ggt-alice", "colour=blue"],
    ["--user", "ggt-alice", "--unset", "colour"],
    ["--user", "ggt-alice", "gpus"],
    ["--user", "ggt-alice", "gpus=1", "gpus=2"],
    ["--user", "ggt-alice"],
    ["--user", "", "gpus=1"],
    ["--defaults", "gpus=-1"],
    ["--user", "ggt-alice", "gpu_memory=20"],   # 20 bytes: did you mean 20GiB?
    ["--user", "ggt-alice", "gpu_memory=0"],
    ["--user", "ggt-alice", "max_time=0s"],
    ["--user", "ggt-alice", "idle_timeout=3600"],
], ids=lambda args: " ".join(args))
def test_bad_input_exits_2_with_one_line_and_touches_nothing(sandbox, args):
    config_path = make_files(sandbox)
    before = snapshot(sandbox)

    result = cli(config_path, "quota", "set", *args)

    assert result.returncode == 2, result
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("gpuguard: "), result.stderr
    assert snapshot(sandbox) == before


def test_a_size_without_a_unit_is_refused_with_the_fix_and_gb_is_binary(sandbox):
    config_path = make_files(sandbox)

    result = cli(config_path, "quota", "set", "--user", "ggt-alice", "gpu_memory=20")

    assert (result.returncode, result.stderr) == (2, "gpuguard: gpu_memory: 20 has no unit; did you mean 20GiB? "
                                                      "(sizes: 512MiB, 20GiB, unlimited)\n")
    assert cli(config_path, "quota", "set", "--user", "ggt-alice", "gpu_memory=40GB").returncode == 0
    shown = cli(config_path, "quota", "show", "--user", "ggt-alice")
    assert re.search(r"gpu_memory +40GiB \(42949672960 bytes\) +user ggt-alice", shown.stdout), shown.stdout


def test_the_whole_file_is_checked_before_it_replaces_the_old_one(sandbox):
    # Each value is fine, but appending [users.ggt-dave] to a file that wrote `users` as an
    # inline table is not valid TOML: only loading the result, as the daemon would, finds that.
    config_path = make_files(sandbox, entries="")
    (sandbox / "quotas.toml").write_text("users = {ggt-carol = {gpus = 1}}\n")
    before = snapshot(sandbox)

    result = cli(config_path, "quota", "set", "--user", "ggt-dave", "gpus=2")

    assert result.returncode == 2
    error = result.stderr.splitlines()[-1]
    assert error.startswith(f"gpuguard: {sandbox / 'quotas.toml'}: not valid TOML") and "(nothing written)" in error
    assert ".tmp" not in result.stderr
    assert snapshot(sandbox) == before


def test_a_config_that_does_not_load_now_is_refused(sandbox):
    # The current configuration names the quotas file, so it has to load before anything is edited.
    config_path = make_files(sandbox, entries="[users.ggt-eve]\ngpus = 100\n")
    before = snapshot(sandbox)

    result = cli(config_path, "quota", "set", "--user", "ggt-alice", "gpus=2")

    assert result.returncode == 2
    assert result.stderr == f"gpuguard: {sandbox / 'quotas.toml'}: users.ggt-eve.gpus: must be between 0 and 64, got 100\n"
    assert snapshot(sandbox) == before


def test_quota_set_needs_root(sandbox, make_user):
    config_path = make_files(sandbox)
    before = snapshot(sandbox)

    result = cli(config_path, "quota", "set", "--user", "ggt-alice", "gpus=4", user=make_user())

    assert (result.returncode, result.stderr) == (1, "gpuguard: quota set needs root\n")
    assert snapshot(sandbox) == before


# --- quota show

def test_show_lists_defaults_users_and_groups_in_file_order(sandbox, make_user):
    config_path = make_files(sandbox)

    result = cli(config_path, "quota", "show", user=make_user())  # anyone may look

    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"defaults ({config_path}): gpus=1 gpu_memory=unlimited max_time=none idle_timeout=none sharing=false "
        "priority=0 share=1 reclaim_after=10m fleet_gpus=none max_sharers=2 slices=any whole_gpus=true "
        "slice_profiles=[] fraction_memory=unlimited max_fractions=any min_fraction_memory=unlimited "
        "max_fraction_memory=unlimited\n"
        f"users ({sandbox / 'quotas.toml'}):\n"
        "  ggt-alice: gpus=2\n"
        "groups (for a key set by several of a user's groups, the first listed wins):\n"
        "  ggt-interns: gpu_memory=20GiB (21474836480 bytes) max_time=4h\n"
        "  ggt-staff: gpus=2\n")
    listed = json.loads(cli(config_path, "quota", "show", "--json").stdout)
    assert [g["name"] for g in listed["groups"]] == ["ggt-interns", "ggt-staff"]
    assert listed["groups"][0]["quota"] == {"max_time": 14400.0, "gpu_memory": 20 << 30}


def test_show_user_gives_the_effective_quota_and_where_each_key_comes_from(sandbox, make_user, make_group):
    first, second = make_group(), make_group()
    user = make_user(groups=[first, second])
    # `second` is listed first, so its max_time wins over `first`'s.
    config_path = make_files(sandbox, entries=(
        f'[groups.{second}]\ngpus = 3\nmax_time = "8h"\n\n'
        f'[groups.{first}]\nmax_time = "4h"\ngpu_memory = "20GiB"\n\n'
        f'[users.{user.name}]\ngpus = 2\n'))

    result = cli(config_path, "quota", "show", "--user", user.name, "--json", user=user)

    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["quota"] == {"gpus": 2, "gpu_memory": 20 << 30, "max_time": 28800.0, "idle_timeout": None,
                              "sharing": False, "priority": 0, "share": 1.0, "reclaim_after": 600.0,
                              "fleet_gpus": None, "max_sharers": 2, "slices": None, "whole_gpus": True,
                              "slice_profiles": [], "fraction_memory": None, "max_fractions": None,
                              "min_fraction_memory": None, "max_fraction_memory": None, "fraction": None}
    assert shown["source"] == {"gpus": f"user {user.name}", "gpu_memory": f"group {first}",
                               "max_time": f"group {second}", "idle_timeout": "defaults", "sharing": "defaults",
                               "priority": "defaults", "share": "defaults", "reclaim_after": "defaults",
                               "fleet_gpus": "defaults", "max_sharers": "defaults", "slices": "defaults",
                               "whole_gpus": "defaults", "slice_profiles": "defaults",
                               "fraction_memory": "defaults", "max_fractions": "defaults",
                               "min_fraction_memory": "defaults", "max_fraction_memory": "defaults"}
    assert {first, second} <= set(shown["groups"])

    lines = cli(config_path, "quota", "show", "--user", user.name).stdout.splitlines()
    assert re.fullmatch(rf"\s+max_time\s+8h\s+group {second}", lines[4]), lines
    assert re.fullmatch(r"\s+idle_timeout\s+none\s+defaults", lines[5]), lines


def test_show_group(sandbox):
    config_path = make_files(sandbox)
    assert cli(config_path, "quota", "show", "--group", "ggt-staff").stdout == "group ggt-staff: gpus=2\n"
    assert cli(config_path, "quota", "show", "--group", "ggt-none").stdout == "group ggt-none: no entry\n"


# --- the pure edit, on shapes admins write by hand

def test_edit_handles_out_of_order_and_inline_tables():
    text = '[users.a]\ngpus = 1\n\n[groups.x]\ngpus = 2\n\n[users.b]\ngpus = 3\n'
    assert edit(text, ("users", "b"), {"gpus": 5}) == text.replace("gpus = 3", "gpus = 5")
    assert edit(text, ("users", "b"), {"gpus": None}) == '[users.a]\ngpus = 1\n\n[groups.x]\ngpus = 2\n\n'
    inline = "[users]\nalice = {gpus = 1}\n"
    assert tomllib.loads(edit(inline, ("users", "alice"), {"max_time": "4h"})) == {
        "users": {"alice": {"gpus": 1, "max_time": "4h"}}}
    # tomlkit files the comment above a header under the table before it: emptying that
    # table keeps it, so the comment stays where the admin wrote it.
    commented = "[users.a]\ngpus = 1\n\n# about b\n[users.b]\ngpus = 2\n"
    assert edit(commented, ("users", "a"), {"gpus": None}) == commented.replace("gpus = 1\n", "")
    # Nothing to remove from an entry that does not exist: no change at all.
    assert edit(text, ("users", "c"), {"gpus": None}) == text


# --- with a running daemon

@pytest.mark.gate
def test_quota_set_reaches_the_running_daemon(start_daemon):
    d = start_daemon()  # 1 GPU per member by default
    member = d.add_member()

    result = d.cli("quota", "set", "--user", member.name, "gpus=2")

    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("(the daemon reloaded)\n")
    assert result.stderr == ""  # a real account: no warning
    assert d.whoami(member)["quota"]["gpus"] == 2
    assert len(d.open_session(member)["gpus"]) == 2


@pytest.mark.gate
def test_a_broken_edit_never_reaches_the_daemon(start_daemon):
    d = start_daemon()
    member = d.add_member()
    quotas = d.sandbox / "quotas.toml"
    quotas.write_text("users = {}\n")  # valid, and the same quotas as before: nothing to reload
    before = quotas.read_bytes(), quotas.stat().st_mtime_ns

    bad_value = d.cli("quota", "set", "--user", member.name, "gpus=100")
    bad_file = d.cli("quota", "set", "--user", member.name, "gpus=2")  # would append to an inline table

    assert (bad_value.returncode, bad_file.returncode) == (2, 2)
    assert (quotas.read_bytes(), quotas.stat().st_mtime_ns) == before
    assert not re.search(r"event=reload(\s|$)", d.log()), d.log()
    assert d.whoami(member)["quota"]["gpus"] == 1
    assert len(d.open_session(member)["gpus"]) == 1
