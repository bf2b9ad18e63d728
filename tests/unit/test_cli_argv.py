"""The CLI's pure decisions about what a user typed (issue 38, 7): where gpuguard's own options
went, what a typo meant, and the one-line errors that name the option and the fix."""
from __future__ import annotations

import argparse

import pytest

from gpuguard import cli
from gpuguard.cli.argv import arrange, meant, no_command, no_option
from gpuguard.cli.gpus_cmd import CSV_COLUMNS, csv_rows
from gpuguard.cli.report_cmd import event_limit
from gpuguard.cli.status_cmd import watch_interval
from gpuguard.cli.user_cmd import memory_against
from gpuguard.core.messages import in_use_message


@pytest.mark.parametrize("argv, arranged", [
    (["--help", "status"], ["status", "--help"]),
    (["-h", "quota", "show"], ["quota", "show", "--help"]),
    (["--help"], ["--help"]),
    (["--config", "x.toml", "--help", "whoami"], ["--config", "x.toml", "whoami", "--help"]),
    (["whoami", "--config", "x.toml", "--json"], ["--config", "x.toml", "whoami", "--json"]),
    (["status", "--config=x.toml"], ["--config=x.toml", "status"]),
    (["status", "--help"], ["status", "--help"]),
    (["--help", "run", "--", "python", "--help"], ["run", "--help", "--", "python", "--help"]),
    # another program's words and options are left alone
    (["run", "python", "--config", "x", "--version"], ["run", "python", "--config", "x", "--version"]),
    (["run", "--", "tool", "--version"], ["run", "--", "tool", "--version"]),
    (["replay", "t.csv", "--config", "policy.toml"], ["replay", "t.csv", "--config", "policy.toml"]),
    ([], []),
])
def test_arrange_puts_gpuguards_options_where_argparse_reads_them(argv, arranged):
    assert arrange(argv) == arranged


@pytest.mark.parametrize("argv", [["--version"], ["--version", "whoami"], ["whoami", "--version"],
                                  ["--config", "x", "status", "--json", "--version"]])
def test_version_anywhere_is_the_version(argv):
    assert arrange(argv) is None


def test_a_typo_or_a_slurm_habit_gets_one_guess():
    assert no_command("stauts", cli.COMMANDS) == "no command 'stauts'; did you mean 'status'?"
    assert no_command("squeue", cli.COMMANDS) == "no command 'squeue'; did you mean 'status'?"
    assert meant("scancel", cli.COMMANDS) == "cancel" and meant("srun", cli.COMMANDS) == "run"
    assert no_command("xyzzy", cli.COMMANDS, "gpuguard --help") == "no command 'xyzzy' (see gpuguard --help)"
    assert no_command("quota shwo", ["show", "set"]) == "no command 'quota shwo'; did you mean 'quota show'?"
    assert no_option("--jsn", "gpuguard status", ["-u", "--user", "--json", "--csv"]) == \
        "no option '--jsn' for gpuguard status; did you mean '--json'?"
    assert no_option("--usr=bob", "gpuguard whoami", ["--user", "--json"]).endswith("did you mean '--user=bob'?")
    assert no_option("--zzz", "gpuguard env", ["--json"]) == "no option '--zzz' for gpuguard env"


@pytest.mark.parametrize("argv, line", [
    (["status", "--jsn"], "gpuguard: no option '--jsn' for gpuguard status; did you mean '--json'? "
                          "(see gpuguard status --help)\n"),
    (["quota", "shwo"], "gpuguard: no command 'quota shwo'; did you mean 'quota show'? (see gpuguard quota --help)\n"),
    (["report", "--by", "usr"], "gpuguard: --by usr: choose from user, gpu, day; did you mean 'user'? "
                                "(see gpuguard report --help)\n"),
    (["whoami", "extra"], "gpuguard: unexpected 'extra' (see gpuguard whoami --help)\n"),
])
def test_the_parser_says_what_a_typo_meant(argv, line, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.build_parser(argv[0]).parse_args(argv)
    assert exited.value.code == 2 and capsys.readouterr().err == line


def test_a_negative_value_is_the_options_value_for_the_command_to_refuse():
    parsed = cli.build_parser("request").parse_args(["request", "--wait", "--timeout", "-5m"])
    assert parsed.timeout == "-5m"


def test_the_number_options_say_what_they_take():
    assert event_limit("5000") == 5000 and watch_interval("1") == 1.0
    for bad in ("-5", "0", "5001", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="give 1 to 5000"):
            event_limit(bad)
    for bad in ("0.5", "-1", "nan", "inf", "soon"):
        with pytest.raises(argparse.ArgumentTypeError, match="give 1 or more"):
            watch_interval(bad)


def test_a_busy_gpu_says_what_to_do_about_it():
    assert in_use_message([1], [11606]) == ("still in use by your process 11606: end it (kill 11606) or let it "
                                            "finish, then gpuguard release --gpu 1")
    assert in_use_message([1, 2], [7, 5]) == ("still in use by your processes 5,7: end them (kill 5 7) or let them "
                                              "finish, then gpuguard release --gpu 1 --gpu 2")


def test_memory_against_the_quota():
    gib = 1 << 30
    assert memory_against(None, gib) == "?"
    assert memory_against(2 * gib, None) == "2GiB"
    assert memory_against(gib // 2, gib) == "512MiB of 1GiB"
    assert memory_against(2 * gib, gib) == "2GiB of 1GiB: OVER"


def test_gpus_csv_has_a_row_per_gpu_and_per_slice():
    gpu = {"minor": 0, "index": 1, "name": "A100", "mig_unread": False, "mig_mode": True, "memory_used": None,
           "memory_total": 80, "utilization": 5, "numa_node": 0, "processes": 1, "pci_bus_id": "0:1",
           "uuid": "GPU-a", "owner": "gpuguard",
           "slices": [{"label": "0/gi7/ci0", "profile": "1g.10gb", "memory_used": 3, "memory_total": 10,
                       "utilization": None, "processes": 1, "uuid": "MIG-b"}]}
    rows = csv_rows([gpu])
    assert all(len(row) == len(CSV_COLUMNS) for row in rows)
    assert rows == [[0, 1, "A100", "mode", "", 80, 5, 0, 1, "0:1", "GPU-a", "gpuguard"],
                    ["0/gi7/ci0", "", "A100", "1g.10gb", 3, 10, "", "", 1, "", "MIG-b", "gpuguard"]]
