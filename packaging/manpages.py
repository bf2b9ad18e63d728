#!/usr/bin/env python3
"""manpages.py OUTDIR: gpuguard(1), gpuguard(8), gpuguard.toml(5) and pam_gpuguard(8) in OUTDIR.

Run with the sources on PYTHONPATH (`make man`, debian/rules). What can drift is generated:
every command with its usage, options and help text from the argparse definitions (the same
words as --help), split between the users' page (1) and the admins' page (8); every key of
gpuguard.toml, its default and how it is written from the loader's own table (config.SCHEMA)
and its dataclasses, with the words of gpuguard/config_doc.py. A command in neither page, or a
key without its words, stops the build. The rest (exit status, files, environment, examples,
the PAM module's options) is prose kept here.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gpuguard import __version__, config, config_doc
from gpuguard.cli import PAM_HOOK, build_parser
from gpuguard.core.quantities import format_duration, format_size

DATE = "2026-12-01"
SOURCE = f"gpuguard {__version__}"
# Which page documents which command: the users' page holds what anyone runs (a few with
# root-only options), the admins' page what only root runs. Every command is in exactly one.
USER_COMMANDS = ("run", "jupyter", "whoami", "env", "status", "request", "release", "cancel", "fairshare", "gpus", "where",
                 "report", "events", "quota", "config", "completion", "replay", "trace", "sim",
                 "prefs")
ADMIN_COMMANDS = ("enable", "disable", "daemon", "web", "doctor", "grant", "revoke", "drain", "resume", "hold", "reload",
                  "gate", "acl", "backup", "restore", "fleet", PAM_HOOK)


def roff(text: str) -> str:
    """Text as roff reads it literally: backslashes, hyphens, and a leading dot or quote."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in text.split("\n"))


def header(name: str, section: int, title: str, summary: str) -> list[str]:
    return [f'.TH {name.upper()} {section} "{DATE}" "{SOURCE}" "{title}"', ".SH NAME", f"{roff(name)} \\- {roff(summary)}"]


def paragraphs(*texts: str) -> list[str]:
    out: list[str] = []
    for text in texts:
        out += [".PP", roff(text)]
    return out


def items(pairs: list[tuple[str, str]]) -> list[str]:
    """A .TP list: a bold tag, then its text."""
    out: list[str] = []
    for tag, text in pairs:
        out += [".TP", f"\\fB{roff(tag)}\\fR", roff(text)]
    return out


def example(*lines: str) -> list[str]:
    return [".PP", ".nf", ".RS 4", *(roff(line) for line in lines), ".RE", ".fi"]


# --- commands, from the argparse definitions

def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """name -> (parser, help) of a parser's subcommands, in the order --help lists them."""
    found: dict[str, tuple[argparse.ArgumentParser, str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if any(sub is seen for seen, _ in found.values()):
                    continue  # an alias (the former name of a command): documented under its name
                found[name] = (sub, helps.get(name, ""))
    return found


def options(parser: argparse.ArgumentParser) -> list[str]:
    out: list[str] = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.option_strings:
            metavar = "" if action.nargs == 0 else " " + (action.metavar or action.dest.upper())
            tag = ", ".join(action.option_strings) + str(metavar)
        else:
            tag = str(action.metavar or action.dest)
        text = (action.help or "") % {"default": action.default, "prog": parser.prog} if action.help else ""
        out += [".TP", ".B " + roff(tag), roff(text)]
    return out


def command_entries(parser: argparse.ArgumentParser, name: str, help_text: str) -> list[str]:
    """A command's usage line, its help and options; a command with subcommands, each of them."""
    children = subcommands(parser)
    if children:
        out = [".SS " + roff(f"gpuguard {name}"), roff(help_text)]
        for sub, sub_help in children.values():
            out += [".PP", "\\fB" + roff(usage(sub)) + "\\fR", ".RS 4", roff(sub_help), *options(sub), ".RE"]
        return out
    return [".SS " + roff(f"gpuguard {name}"), "\\fB" + roff(usage(parser)) + "\\fR", ".PP", roff(help_text),
            *options(parser)]


def usage(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_usage().removeprefix("usage: ").split())


def commands_section(names: tuple[str, ...]) -> list[str]:
    known = subcommands(build_parser())
    out = [".SH COMMANDS"]
    for name in names:
        parser, help_text = known[name]
        out += command_entries(parser, name, help_text)
    return out


def check_commands() -> None:
    known = set(subcommands(build_parser()))
    listed = USER_COMMANDS + ADMIN_COMMANDS
    if missing := known - set(listed):
        raise SystemExit(f"manpages.py: commands in no man page: {', '.join(sorted(missing))} "
                         "(add them to USER_COMMANDS or ADMIN_COMMANDS)")
    if unknown := set(listed) - known:
        raise SystemExit(f"manpages.py: no such commands: {', '.join(sorted(unknown))}")
    if twice := {name for name in listed if listed.count(name) > 1}:
        raise SystemExit(f"manpages.py: commands on both pages: {', '.join(sorted(twice))}")


EXIT_STATUS = items([("0", "success"), ("1", "refused or failed (and `gate status` or `doctor` found a problem)"),
                     ("2", "bad usage or input: an unknown option, a malformed value, a broken configuration file"),
                     ("3", "the daemon cannot be reached")]) + \
    paragraphs("Errors are one line on standard error, starting with \"gpuguard:\".")

COMMON_OPTIONS = items([("--config PATH", "the configuration file (default: $GPUGUARD_CONFIG, else "
                                          "/etc/gpuguard/gpuguard.toml)"),
                        ("--version", "print the version and exit"), ("-h, --help", "print the help of a command")])


def user_page() -> list[str]:
    return [
        *header("gpuguard", 1, "gpuguard manual", "your GPUs on a shared server: see, request and release them"),
        ".SH SYNOPSIS", "\\fBgpuguard\\fR [\\fB\\-\\-config\\fR \\fIPATH\\fR] \\fICOMMAND\\fR [\\fIOPTIONS\\fR]",
        ".SH DESCRIPTION",
        *paragraphs(
            "gpuguard hands out the GPUs of a shared Linux server. When you log in (ssh, su -, a console) and belong "
            "to the GPU group, you are given GPUs: CUDA_VISIBLE_DEVICES names them, a one-line message says which "
            "and until when, and the kernel refuses every other GPU to your processes, wherever they run (cron, "
            "nohup, tmux, containers). If none is free you join the queue and are told on your terminals when one "
            "is yours.",
            "A watcher enforces your quota: GPU memory per GPU, how long a grant lasts, and release when idle. It "
            "always warns on your terminals before it stops a process, and records every warning and action: "
            "gpuguard whoami shows them.",
            "This page lists what any user runs; the administrator's commands are in gpuguard(8)."),
        ".SH OPTIONS", *COMMON_OPTIONS,
        *commands_section(USER_COMMANDS),
        ".SH EXIT STATUS", *EXIT_STATUS,
        ".SH ENVIRONMENT",
        *items([("CUDA_VISIBLE_DEVICES", "set at login by the PAM module to the UUIDs of your granted GPUs; "
                                         "`gpuguard env` prints the current value as an export line"),
                ("GPUGUARD_CONFIG", "the configuration file, when --config is not given")]),
        ".SH FILES",
        *items([("/etc/gpuguard/gpuguard.toml", "the configuration (gpuguard.toml(5))"),
                ("/etc/gpuguard/quotas.toml", "per-user and per-group quotas (gpuguard quota show)"),
                ("/run/gpuguard/gpuguard.sock", "the daemon's socket, which every command talks to")]),
        ".SH EXAMPLES",
        *paragraphs("Your GPUs, quota, sessions and recent events:"), *example("gpuguard whoami"),
        *paragraphs("Set CUDA_VISIBLE_DEVICES in a shell that outlived your login (tmux, screen) or got none "
                    "(VS Code, a notebook):"),
        *example('eval "$(gpuguard env)"'),
        *paragraphs("Wait in the queue for two GPUs, at most an hour:"),
        *example("gpuguard request \\-\\-gpus 2 \\-\\-wait \\-\\-timeout 1h".replace("\\-", "-")),
        *paragraphs("Who uses which GPU, and your GPU-hours this month:"),
        *example("gpuguard status", "gpuguard report \\-\\-since 30d".replace("\\-", "-")),
        *paragraphs("Give your GPUs back early:"), *example("gpuguard release"),
        ".SH SEE ALSO", "\\fBgpuguard\\fR(8), \\fBgpuguard.toml\\fR(5), \\fBpam_gpuguard\\fR(8), \\fBnvidia\\-smi\\fR(1)",
    ]


def admin_page() -> list[str]:
    return [
        *header("gpuguard", 8, "gpuguard manual", "the GPU sharing agent and its administration"),
        ".SH SYNOPSIS", "\\fBgpuguard\\fR [\\fB\\-\\-config\\fR \\fIPATH\\fR] \\fICOMMAND\\fR [\\fIOPTIONS\\fR]",
        ".SH DESCRIPTION",
        *paragraphs(
            "The gpuguard daemon (gpuguard daemon, run by systemd as gpuguard.service) grants the GPUs of a shared "
            "server at login, through the PAM module pam_gpuguard(8), and enforces the grants in the kernel: a "
            "cgroup v2 BPF device program (the gate) at the root of the hierarchy refuses every GPU node to every "
            "process whose user holds no grant for it, and the nodes are 0660 root:root with one ACL entry per "
            "grantee. Its store (SQLite, in the state directory) is the truth; the gate and the ACLs are rebuilt "
            "from it at every start, and outlive the daemon: stopping it leaves the GPUs closed.",
            "Installing gpuguard changes nothing on the machine. Configure /etc/gpuguard (gpuguard.toml(5)), check it "
            "with gpuguard config check, then run gpuguard enable: it links the modprobe.d option (the driver no "
            "longer makes the GPU nodes itself, nor resets their modes) and the udev rule (gpuguard acl apply when "
            "the driver loads) into /etc, turns the PAM profile on (pam-auth-update) and enables and starts the "
            "daemon. gpuguard disable undoes all of it, detaches the gate and opens the GPU nodes as the driver "
            "makes them (0666 root:root, no ACL entries).",
            "This page lists the commands only root runs; those for everyone are in gpuguard(1)."),
        ".SH OPTIONS", *COMMON_OPTIONS,
        *commands_section(ADMIN_COMMANDS),
        ".SH EXIT STATUS", *EXIT_STATUS,
        ".SH ENVIRONMENT",
        *items([("GPUGUARD_CONFIG", "the configuration file, when --config is not given"),
                ("NOTIFY_SOCKET, WATCHDOG_USEC", "set by systemd: the daemon reports READY=1, STATUS= lines and "
                                                 "watchdog pings")]),
        ".SH FILES",
        *items([("/etc/gpuguard/gpuguard.toml, /etc/gpuguard/quotas.toml", "the configuration (gpuguard.toml(5))"),
                ("/var/lib/gpuguard", "the store: grants, sessions, the queue, events, usage"),
                ("/run/gpuguard/gpuguard.sock", "the daemon's socket"),
                ("/run/gpuguard/held/UID", "each holder's GPU UUIDs, for pam_gpuguard(8) while the daemon is down"),
                ("/var/lib/gpuguard/drained.json, /var/lib/gpuguard/queue_holds.json",
                 "the drained GPUs (gpuguard drain) and held queue requests (gpuguard hold), kept across restarts"),
                ("/sys/fs/bpf/gpuguard", "the gate's program and maps, pinned"),
                ("/usr/lib/gpuguard/modprobe.d/gpuguard.conf, /usr/lib/gpuguard/udev/70-gpuguard.rules",
                 "the inert copies gpuguard enable links to /etc/modprobe.d/gpuguard.conf and "
                 "/etc/udev/rules.d/70-gpuguard.rules"),
                ("/usr/share/pam-configs/gpuguard", "the pam-auth-update profile (off until gpuguard enable)"),
                ("/usr/lib/systemd/system/gpuguard.service", "the systemd unit")]),
        ".SH EXAMPLES",
        *paragraphs("Set up a server after installing the package:"),
        *example("editor /etc/gpuguard/gpuguard.toml", "gpuguard config check", "gpuguard enable", "gpuguard doctor"),
        *paragraphs("Give alice two GPUs for a day, then take them back:"),
        *example("gpuguard grant alice --gpus 2 --for 1d", "gpuguard revoke alice"),
        *paragraphs("Emergency: open every GPU to whatever the node permissions allow (the daemon attaches the gate "
                    "again when it starts):"),
        *example("gpuguard gate detach"),
        ".SH SEE ALSO",
        "\\fBgpuguard\\fR(1), \\fBgpuguard.toml\\fR(5), \\fBpam_gpuguard\\fR(8), \\fBpam\\-auth\\-update\\fR(8), "
        "\\fBsystemctl\\fR(1), \\fBmodprobe.d\\fR(5), \\fBudev\\fR(7)",
    ]


# --- gpuguard.toml(5), from the loader's table

# Sections that are off unless written (Config holds None for them): their dataclass's defaults.
OPTIONAL_SECTIONS: dict[str, Any] = {"fleet": config.FleetConfig}


def section_defaults(section: str) -> Any:
    """The dataclass instance holding a section's defaults, as the loader builds it (for a section
    off unless written: its dataclass's defaults, the keys it requires unset)."""
    node: Any = config.Config()
    for part in section.split("."):
        node = getattr(node, part)
    if node is None:
        return SimpleNamespace(**{f.name: None if f.default is dataclasses.MISSING else f.default
                                  for f in dataclasses.fields(OPTIONAL_SECTIONS[section])})
    return node


def render_default(kind: str, value: Any) -> str:
    if kind == "table":
        return "see below" if dataclasses.is_dataclass(value) else ("unset" if not value else str(value))
    if value is None:
        return {"size": "unlimited", "duration": "none", "count": '"any"'}.get(kind, "unset")
    if kind == "size":
        return format_size(value)
    if kind == "duration":
        return format_duration(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(f'"{v}"' for v in value) + "]"
    if isinstance(value, (str, Path)):
        return f'"{value}"'
    return f"{value:g}" if isinstance(value, float) else str(value)


def config_keys() -> list[tuple[str, str]]:
    """Every (section, key) the loader knows, in its order; stops when one has no words."""
    keys = [(section, key) for section, table in config.SCHEMA.items() for key in table]
    if missing := [f"{s}.{k}" for s, k in keys if (s, k) not in config_doc.KEYS]:
        raise SystemExit(f"manpages.py: config keys without a description in gpuguard/config_doc.py: {', '.join(missing)}")
    if stale := [f"{s}.{k}" for s, k in config_doc.KEYS if (s, k) not in keys]:
        raise SystemExit(f"manpages.py: gpuguard/config_doc.py describes keys the loader does not know: {', '.join(stale)}")
    if missing := [s for s in config.SCHEMA if s not in config_doc.SECTIONS]:
        raise SystemExit(f"manpages.py: sections without a description: {', '.join(missing)}")
    return keys


def config_page() -> list[str]:
    out = [
        *header("gpuguard.toml", 5, "gpuguard manual", "configuration of gpuguard"),
        ".SH SYNOPSIS", "/etc/gpuguard/gpuguard.toml, /etc/gpuguard/quotas.toml",
        ".SH DESCRIPTION",
        *paragraphs(
            "gpuguard reads its configuration from /etc/gpuguard/gpuguard.toml (or the file named by --config or "
            "$GPUGUARD_CONFIG), a TOML file of the tables below. Every key is optional. Unknown tables and keys, "
            "wrong types and absurd values are refused with one line naming the file, the key and the problem "
            "(exit status 2); gpuguard config check runs exactly that check. A broken file given to a running "
            "daemon (systemctl reload gpuguard) is refused and the daemon keeps its last good configuration.",
            "Sizes are written 512MiB, 20GiB or unlimited; durations 90s, 30m, 8h, 2d or none. Each key below shows "
            "its default."),
    ]
    keys = config_keys()
    for section in config.SCHEMA:
        out += [".SH " + roff(f"[{section}]"), roff(config_doc.SECTIONS[section])]
        defaults = section_defaults(section)
        for sec, key in keys:
            if sec != section:
                continue
            kind, meaning = config_doc.KEYS[(sec, key)]
            default = render_default(kind, getattr(defaults, key, None))
            out += [".TP", f"\\fB{roff(key)}\\fR = \\fI{roff(kind)}\\fR (default: {roff(default)})", roff(meaning)]
    out += [
        ".SH QUOTAS",
        *paragraphs("quotas.toml (next to gpuguard.toml unless paths.quotas names another) holds [users.NAME] and "
                    "[groups.NAME] tables of the keys of [defaults]. A user's own entry wins over their group's, which "
                    "wins over the defaults, key by key. gpuguard quota set edits it, keeping comments."),
        *example("[users.alice]", "gpus = 2", 'gpu_memory = "40GiB"', "", "[groups.interns]", 'max_time = "4h"'),
        ".SH EXAMPLE",
        *example("[access]", 'group = "gpugroup"', "", "[defaults]", "gpus = 1", 'gpu_memory = "20GiB"',
                 'max_time = "8h"', 'idle_timeout = "2h"'),
        ".SH FILES", *items([("/etc/gpuguard/gpuguard.toml", "this file"),
                             ("/usr/share/doc/gpuguard/README.md.gz", "what gpuguard is, a tour for users and admins, and where "
                              "each part of the documentation is (docs/ in the source)")]),
        ".SH SEE ALSO", "\\fBgpuguard\\fR(1), \\fBgpuguard\\fR(8), \\fBpam_gpuguard\\fR(8)",
    ]
    return out


# --- pam_gpuguard(8)

def pam_page() -> list[str]:
    return [
        *header("pam_gpuguard", 8, "gpuguard manual", "PAM session module that hands out GPUs at login"),
        ".SH SYNOPSIS", "session optional pam_gpuguard.so [socket=\\fIPATH\\fR] [grant=auto|always|never] [quiet] [debug]",
        ".SH DESCRIPTION",
        *paragraphs(
            "When a session opens, pam_gpuguard asks the gpuguard daemon (gpuguard(8)) for the user's GPUs. Members "
            "of the configured group get a grant, CUDA_VISIBLE_DEVICES set in the session's environment to the "
            "granted GPUs' UUIDs, and one line such as \"gpuguard: GPU 3 (NVIDIA H100 80GB HBM3) is yours until "
            "20:00\". Closing the session tells the daemon, which releases the grant once the user's last session "
            "is closed and no process of theirs still holds a granted GPU.",
            "Nothing here can block a login: the module always returns PAM_SUCCESS. If the daemon is down, slow (2 "
            "seconds at most) or refuses, the session opens as usual, one line goes to syslog, and GPU access stays "
            "as the gate holds it (it denies by default and keeps the grants it had). With no usable answer the user "
            "is told \"gpuguard: GPU service not answering: no new GPUs now, held ones stay yours; tell your admin "
            "(sudo gpuguard doctor says why)\", and a user "
            "who still holds GPUs gets CUDA_VISIBLE_DEVICES from the daemon's file /run/gpuguard/held/UID (used only "
            "when it is a root-owned regular file nobody else may write). It trusts only a daemon running as root: "
            "it checks the socket's peer (SO_PEERCRED) and otherwise sends and sets nothing."),
        ".SH OPTIONS",
        *items([("socket=PATH", "the daemon's socket (default /run/gpuguard/gpuguard.sock; must match paths.socket in "
                                "gpuguard.toml(5))"),
                ("grant=auto|always|never", "whether this stack's sessions may take GPUs: auto (the default) leaves it "
                                            "to the daemon ([sessions] in gpuguard.toml: by default sessions with a "
                                            "terminal); always; never. Sessions that take none still get "
                                            "CUDA_VISIBLE_DEVICES for the GPUs their user already holds."),
                ("quiet", "do not show the one-line message (CUDA_VISIBLE_DEVICES is still set)"),
                ("debug", "log requests and replies to syslog (LOG_DEBUG, authpriv)")]),
        ".SH MODULE TYPES PROVIDED", "Only the session module type is provided.",
        ".SH RETURN VALUES", *items([("PAM_SUCCESS", "always, whatever the daemon said")]),
        ".SH ENVIRONMENT",
        *items([("CUDA_VISIBLE_DEVICES", "set in the PAM environment to the UUIDs of the user's granted GPUs, "
                                         "comma-separated (unset when they hold none)")]),
        ".SH FILES",
        *items([("/run/gpuguard/held/UID", "the UUIDs of the GPUs the user holds, which the daemon rewrites after "
                                           "each grant change: CUDA_VISIBLE_DEVICES when the daemon does not answer"),
                ("/usr/share/pam-configs/gpuguard", "the pam-auth-update profile: gpuguard enable turns it on, which "
                                                    "adds the module to /etc/pam.d/common-session after pam_systemd "
                                                    "(not to common-session-noninteractive: cron uses the grant its "
                                                    "user holds)")]),
        ".SH EXAMPLES",
        *paragraphs("Debian and Ubuntu: gpuguard enable, or"), *example("pam-auth-update --enable gpuguard"),
        *paragraphs("Other systems: in the session stack of each login service that should hand out GPUs, after "
                    "pam_systemd:"),
        *example("session    optional     pam_gpuguard.so"),
        *paragraphs("Without a C compiler, the pam_exec fallback makes the same grants but cannot set "
                    "CUDA_VISIBLE_DEVICES (users run eval \"$(gpuguard env)\"); at open_session only, before any "
                    "pam_env user_readenv=1 line (pam_exec gives root's child the PAM environment, which the "
                    "user's ~/.pam_environment fills):"),
        *example("session    optional     pam_exec.so type=open_session quiet stdout /usr/bin/gpuguard pam-hook"),
        ".SH SEE ALSO", "\\fBgpuguard\\fR(8), \\fBgpuguard\\fR(1), \\fBpam\\fR(8), \\fBpam_exec\\fR(8), "
        "\\fBpam\\-auth\\-update\\fR(8)",
    ]


PAGES = {"gpuguard.1": user_page, "gpuguard.8": admin_page, "gpuguard.toml.5": config_page,
         "pam_gpuguard.8": pam_page}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: manpages.py OUTDIR", file=sys.stderr)
        return 2
    check_commands()
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name, page in PAGES.items():
        (out / name).write_text("\n".join(page()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
