"""`gpuguard quota set` (root) and `gpuguard quota show` (anyone): quotas without a text editor.

`set` edits [users.NAME] / [groups.NAME] in quotas.toml, or [defaults] in gpuguard.toml,
keeping the admin's comments and layout (gpuguard.quota_file), refuses any edit after which
the configuration would not load, and asks the daemon to reload. `show` reads the files
themselves, so it needs no daemon and shows what the daemon will use after its next reload.

A plain `quota show` skips argparse (cli.QUICK) and loads what it prints with: the config loader,
most of its start-up. The accounts, the policy, the daemon's client and tomlkit are imported
where `--user` and `set` use them.
"""
from __future__ import annotations

import sys
from dataclasses import asdict  # the config's dataclasses loaded it already

from gpuguard import config, quota_file
from gpuguard.cli import CommandError, load_config, no_such_user, print_json, print_rows, require_root, summary
from gpuguard.core.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UnknownUser

TYPE_CHECKING = False  # argparse for the annotations only: a plain `quota show` skips it
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable
    from pathlib import Path
    from typing import Any


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("quota", help=summary("quota"))
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    change = actions.add_parser(
        "set", help="change a quota and reload the daemon (root)",
        description="Set or remove quota keys, e.g. `quota set --user alice gpus=2 gpu_memory=40GiB max_time=24h`. "
                    f"Keys: {', '.join(config.QUOTA_KEYS)}. Values as written in the TOML files "
                    "(2, 40GiB, 24h, none, unlimited, true, false); KEY= removes the key, so it "
                    "comes from the next layer (the user's groups, then the defaults). Give the options first. "
                    "Example: sudo gpuguard quota set --group phd max_time=48h")
    which = change.add_mutually_exclusive_group(required=True)
    which.add_argument("--user", metavar="NAME", help="the user's entry in quotas.toml")
    which.add_argument("--group", metavar="NAME", help="the group's entry in quotas.toml")
    which.add_argument("--defaults", action="store_true", help="[defaults] in gpuguard.toml")
    change.add_argument("assignments", nargs="*", metavar="KEY=VALUE")
    change.add_argument("--unset", action="append", default=[], metavar="KEY", help="remove KEY (repeatable)")
    change.set_defaults(func=run_set)

    show = actions.add_parser("show", help="the defaults and every entry, or one user's effective quota",
                              description="The defaults and every entry, or one user's quota key by key with "
                                          "where each value comes from. Examples: gpuguard quota show; "
                                          "gpuguard quota show --user alice")
    whom = show.add_mutually_exclusive_group()
    whom.add_argument("--user", metavar="NAME", help="the user's quota, field by field with where it comes from")
    whom.add_argument("--group", metavar="NAME", help="the group's entry")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=run_show)


# --- quota set

def run_set(args: argparse.Namespace) -> int:
    require_root("quota set")
    changes = _changes(args.assignments, args.unset)
    # The current configuration must load: it names the quotas file, and the edit is checked against it.
    current = load_config(args)
    table: tuple[str, ...]
    check: Callable[[Path], object]  # loads the edited file, raising ConfigError when it is wrong
    if args.defaults:
        table, path, check = quota_file.DEFAULTS, current.source, config.load
    else:
        kind, name = ("users", args.user) if args.user is not None else ("groups", args.group)
        if not name:
            raise CommandError(f"--{kind[:-1]}: expected a name", EXIT_USAGE)
        _warn_if_unknown(kind, name)
        # config.load reads nothing else from quotas.toml, so the loaded config plus this file
        # is the whole configuration the daemon would load.
        floors = current.gpu.backend == config.GpuBackend.NVML
        table, path, check = (kind, name), current.paths.quotas, lambda p: config.load_quotas(p, floors)
    assert path is not None  # load() always sets source

    old = path.read_bytes().decode("utf-8") if path.exists() else ""  # bytes: keep CRLF files as they are
    try:
        new = quota_file.edit(old, table, changes)
    except quota_file.QuotaEditError as exc:
        raise CommandError(f"{path}: {exc}", EXIT_USAGE) from None
    if new == old:
        print(f"{_summary(args, load_config(args))} (unchanged)")
        return EXIT_OK
    _write(path, new, check)
    print(f"{_summary(args, load_config(args))} ({_reload(args, path)})")
    return EXIT_OK


def _changes(assignments: list[str], unset: list[str]) -> dict[str, Any]:
    """{key: TOML value, or None to remove it}; every key named once. Bad input exits 2."""
    if not assignments and not unset:
        raise CommandError("nothing to change: give KEY=VALUE, KEY= or --unset KEY", EXIT_USAGE)
    changes: dict[str, Any] = {}
    try:
        parsed = [quota_file.parse_assignment(text) for text in assignments]
        for key in unset:
            quota_file.check_key(key)
            parsed.append((key, None))
    except quota_file.QuotaEditError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    for key, value in parsed:
        if key in changes:  # which one was meant is a guess: refuse
            raise CommandError(f"{key}: given twice", EXIT_USAGE)
        changes[key] = value
    return changes


def _warn_if_unknown(kind: str, name: str) -> None:
    from gpuguard.backends import accounts
    # A warning, not a refusal: admins set quotas ahead of creating accounts (or LDAP is slow to show them).
    if not (accounts.user_exists if kind == "users" else accounts.group_exists)(name):
        print(f"gpuguard: warning: no {kind[:-1]} named {name} on this host (yet); "
              "the quota applies once it exists", file=sys.stderr)


def _write(path: Path, text: str, load: Callable[[Path], object]) -> None:
    def check(temporary: Path) -> None:
        try:
            load(temporary)
        except config.ConfigError as exc:
            # Name the admin's file, not our temporary one.
            raise config.ConfigError(f"{str(exc).replace(str(temporary), str(path))} (nothing written)") from None

    try:
        quota_file.replace_file(path, text, check)
    except OSError as exc:
        raise CommandError(f"cannot write {path}: {exc.strerror or exc}", EXIT_FAILED) from None


def _reload(args: argparse.Namespace, path: Path) -> str:
    from gpuguard.cli.calls import ask
    from gpuguard.client import DaemonUnreachable, Refused
    try:
        ask(args, "reload")
    except DaemonUnreachable:
        return f"written to {path}; the daemon is not running, it takes effect when it starts"
    except Refused as exc:
        raise CommandError(f"wrote {path}, but the daemon refused to reload: {exc}", exc.code) from None
    return "the daemon reloaded"


def _summary(args: argparse.Namespace, loaded: config.Config) -> str:
    if args.defaults:
        return f"defaults: {quota_file.show_fields(asdict(loaded.defaults))}"
    if args.group is not None:
        return f"group {args.group}: {_entry_text(loaded.quotas.groups.get(args.group))}"
    from gpuguard.core.policy import quota_for
    quota = quota_for(args.user, _groups_of(args.user), loaded)
    return f"{args.user}: {quota_file.show_fields(asdict(quota))}"


# --- quota show

def run_show(args: argparse.Namespace) -> int:
    loaded = load_config(args)
    if args.user is not None:
        _show_user(args, loaded)
    elif args.group is not None:
        entry = loaded.quotas.groups.get(args.group)
        if args.json:
            print_json({"group": args.group, "quota": entry})
        else:
            print(f"group {args.group}: {_entry_text(entry)}")
    elif args.json:
        print_json({"config": loaded.source, "quotas_file": loaded.paths.quotas,
                    "defaults": asdict(loaded.defaults),
                    "users": [{"name": name, "quota": entry} for name, entry in loaded.quotas.users.items()],
                    "groups": [{"name": name, "quota": entry} for name, entry in loaded.quotas.groups.items()]})
    else:
        print(f"defaults ({loaded.source}): {quota_file.show_fields(asdict(loaded.defaults))}")
        _print_entries(f"users ({loaded.paths.quotas}):", loaded.quotas.users)
        _print_entries("groups (for a key set by several of a user's groups, the first listed wins):",
                       loaded.quotas.groups)
    return EXIT_OK


def _show_user(args: argparse.Namespace, loaded: config.Config) -> None:
    from gpuguard.backends import accounts
    from gpuguard.core.policy import quota_for, quota_sources
    if args.user not in loaded.quotas.users and not accounts.user_exists(args.user):
        # no account and no entry set ahead of one: most likely a typo, not a quota to show
        raise no_such_user(args.user, "--user")
    groups = _groups_of(args.user, warn=True)
    quota = quota_for(args.user, groups, loaded)
    origin = quota_sources(args.user, groups, loaded)
    values = asdict(quota)
    if args.json:
        print_json({"user": args.user, "groups": sorted(groups), "quota": values, "source": origin})
        return
    print(f"{args.user} (groups: {', '.join(sorted(groups)) or 'none known'})")
    print_rows([["  KEY", "VALUE", "FROM"]] + [[f"  {key}", quota_file.show_value(key, values[key]), origin[key]]
                                               for key in config.QUOTA_KEYS])


def _print_entries(title: str, entries: dict[str, dict[str, Any]]) -> None:
    print(title if entries else f"{title} none")
    for name, entry in entries.items():
        print(f"  {name}: {_entry_text(entry)}")


def _entry_text(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "no entry"
    return quota_file.show_fields(entry) or "empty entry (sets nothing)"


def _groups_of(user: str, warn: bool = False) -> frozenset[str]:
    """The user's groups, as the daemon resolves them; none for an account that does not exist (yet)."""
    from gpuguard.backends import accounts
    try:
        return accounts.by_name(user).groups
    except UnknownUser:
        if warn:
            print(f"gpuguard: warning: no user named {user} on this host; showing the quota without "
                  "group entries", file=sys.stderr)
        return frozenset()
