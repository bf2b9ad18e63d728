"""Config loading and validation, including every kind of bad input, through the real CLI too."""
import os
import socket
import subprocess
from pathlib import Path

import pytest
from sim_helpers import cli, write_config

from gpuguard import config
from gpuguard.config import ConfigError
from gpuguard.core.model import Quota

GOOD = """
[access]
group = "ml"
exempt_users = ["admin"]

[defaults]
gpus = 2
gpu_memory = "20GiB"
max_time = "24h"
idle_timeout = "1h"
sharing = false

[watcher]
interval = "2s"
grace = "30s"
kill_wait = "10s"

[paths]
state_dir = "/var/lib/gpuguard"

[gpu]
backend = "simulated"

[gpu.simulated]
count = 8
memory = "80GiB"
nvlink_groups = [[0, 1], [2, 3]]

[metrics]
listen = "[::1]:9447"
textfile = "/var/lib/node_exporter/textfile_collector/gpuguard.prom"
dcgm_job_mapping_dir = "/run/dcgm-job-map"
"""

QUOTAS = """
[users.alice]
gpus = 4
gpu_memory = "unlimited"

[groups.interns]
max_time = "4h"
"""


def write(tmp_path: Path, text: str, quotas: str | None = None) -> Path:
    path = tmp_path / "gpuguard.toml"
    path.write_text(text)
    if quotas is not None:
        (tmp_path / "quotas.toml").write_text(quotas)
    return path


def test_good_config_is_typed(tmp_path):
    loaded = config.load(write(tmp_path, GOOD, QUOTAS))
    assert loaded.access.group == "ml" and loaded.access.exempt_users == ("admin",)
    assert loaded.defaults == Quota(gpus=2, gpu_memory=20 << 30, max_time=86400, idle_timeout=3600, sharing=False,
                                    reclaim_after=600)  # not written: the default, 10 minutes
    assert loaded.watcher.interval == 2 and loaded.watcher.kill_wait == 10
    assert loaded.gpu.simulated.count == 8
    assert loaded.gpu.simulated.groups("nvlink_groups") == ((0, 1), (2, 3))
    assert loaded.gpu.simulated.groups("pcie_switches") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert loaded.paths.quotas == tmp_path / "quotas.toml"
    assert loaded.quotas.users == {"alice": {"gpus": 4, "gpu_memory": None}}
    assert loaded.quotas.groups == {"interns": {"max_time": 14400}}
    assert loaded.metrics.listen == ("::1", 9447)
    assert loaded.metrics.textfile == Path("/var/lib/node_exporter/textfile_collector/gpuguard.prom")
    assert loaded.metrics.dcgm_job_mapping_dir == Path("/run/dcgm-job-map")


def test_event_retention(tmp_path):
    loaded = config.load(write(tmp_path, '[events]\nmax_age = "7d"\nper_user = 50'))
    assert loaded.events == config.EventsConfig(max_age=7 * 86400, per_user=50)
    assert config.load(write(tmp_path, '[events]\nmax_age = "none"')).events.max_age is None


def test_empty_file_gives_defaults(tmp_path):
    loaded = config.load(write(tmp_path, ""))
    assert loaded.events == config.EventsConfig(max_age=90 * 86400, per_user=1000)
    assert loaded.access.group == "gpugroup"
    assert loaded.defaults == Quota(reclaim_after=600)  # reclaim on demand after 10 minutes; the rest Quota's own
    assert loaded.gpu.backend == "nvml"
    assert loaded.metrics == config.MetricsConfig()  # every exporter off


def test_environment_variable_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUGUARD_CONFIG", str(write(tmp_path, GOOD)))
    assert config.load().access.group == "ml"


@pytest.mark.parametrize("text, fragment", [
    ('[access]\ngroup = "ml"\ncolour = "red"', "access.colour: unknown key"),
    ('[acess]\ngroup = "ml"', "acess: unknown section"),
    ('[defaults]\ngpus = "two"', "defaults.gpus: expected a whole number"),
    ('[defaults]\ngpus = -1', "defaults.gpus: must be between 0 and 64"),
    ('[defaults]\ngpus = 1000', "defaults.gpus: must be between 0 and 64"),
    ('[defaults]\ngpus = true', "defaults.gpus: expected a whole number"),
    ('[defaults]\ngpu_memory = "20 gigs"', "defaults.gpu_memory: not a size"),
    ('[defaults]\ngpu_memory = "-5GiB"', "defaults.gpu_memory: not a size"),
    ('[defaults]\nmax_time = "8 fortnights"', "defaults.max_time: not a duration"),
    # every size and duration takes a unit; zero and implausible values are refused with the likely fix
    ('[defaults]\ngpu_memory = 20', "defaults.gpu_memory: 20 has no unit; did you mean 20GiB?"),
    ('[defaults]\ngpu_memory = "0"', "defaults.gpu_memory: '0' has no unit"),
    ('[defaults]\ngpu_memory = "0GiB"', "defaults.gpu_memory: '0GiB' would leave no memory at all; write unlimited"),
    ('[defaults]\ngpu_memory = "20MiB"', "defaults.gpu_memory: '20MiB' is under 256MiB, too little for any GPU job; "
                                         "did you mean 20GiB?"),
    ('[defaults]\nmax_time = "0s"', "defaults.max_time: '0s' would end every grant at once; write none"),
    ('[defaults]\nmax_time = 3600', "defaults.max_time: 3600 has no unit; did you mean 3600s (1h)?"),
    ('[defaults]\nidle_timeout = 0', "defaults.idle_timeout: 0 would release every grant at once; write none"),
    ('[defaults]\nidle_timeout = "0m"', "defaults.idle_timeout: '0m' would release every grant at once"),
    ('[defaults]\nreclaim_after = "0s"', "defaults.reclaim_after: '0s' would take back every grant"),
    ('[defaults]\nmax_time = "30s"', "defaults.max_time: 30s is under a minute; did you mean 30m?"),
    ('[defaults]\nidle_timeout = "5s"', "defaults.idle_timeout: 5s is under a minute; did you mean 5m?"),
    ('[defaults]\nmax_time = "999d"', "defaults.max_time: duration '999d' is absurdly long"),
    ('[defaults]\nsharing = "yes"', "defaults.sharing: expected true or false"),
    ('[watcher]\ninterval = "0s"', "watcher.interval: must be a duration of at least 0.1s"),
    ('[watcher]\ninterval = "500ms"', "watcher.interval"),
    ('[watcher]\ninterval = nan', "watcher.interval: expected a duration like 30m, got nan"),
    ('[defaults]\ngpu_memory = 20.5', "defaults.gpu_memory: expected a size like 20GiB, got 20.5"),
    ('[defaults]\nmax_time = [1]', "defaults.max_time: expected a duration like 30m"),
    ('[gpu]\nbackend = "cuda"', "gpu.backend: must be one of nvml, simulated"),
    ('[watcher]\ninterval = "0.5s"', "watcher.interval: must be at least 1s with the nvml backend"),
    ('[gpu]\nbackend = "simulated"\n[gpu.simulated]\ncount = 2\nnvlink_groups = [[0, 5]]',
     "gpu.simulated.nvlink_groups: GPU 5 does not exist"),
    ('[gpu]\nbackend = "simulated"\n[gpu.simulated]\nnuma_nodes = [[0, 1], [1, 2]]',
     "gpu.simulated.numa_nodes: GPU 1 is listed twice"),
    ('[access]\nexempt_users = "root"', "access.exempt_users: expected a list of names"),
    ("[access\ngroup = 1", "not valid TOML"),
    ('access = 3', "access: expected a table"),
    ('[events]\nper_user = 0', "events.per_user: must be between 1 and 1000000"),
    ('[events]\nmax_age = "forever"', "events.max_age: not a duration"),
    ('[metrics]\nlisten = "9447"', "metrics.listen: expected ADDRESS:PORT like 127.0.0.1:9447"),
    ('[metrics]\nlisten = "127.0.0.1:99999"', "metrics.listen: expected ADDRESS:PORT"),
    ('[metrics]\nlisten = "gpu1.lab:9447"', "metrics.listen: not an IP address: 'gpu1.lab'"),
    ('[metrics]\ntextfile = "/var/lib/node_exporter/gpuguard.txt"', "metrics.textfile: must end in .prom"),
    ('[metrics]\ntextfile = "gpuguard.prom"', "metrics.textfile: expected an absolute path"),
    ('[metrics]\ndcgm_job_mapping_dir = "jobs"', "metrics.dcgm_job_mapping_dir: expected an absolute path"),
    ('[notify]\nwebhook = "ftp://chat/{user}"', "notify.webhook: not a http:// or https:// URL"),
    ('[notify]\nwebhook = "https://chat/{name}"', "notify.webhook: expected a http:// or https:// URL where only "
                                                  "{user} is replaced"),
    ('[notify]\nmail = "{user}"', "notify.mail: not a mail address"),
    ('[notify]\nmail = "-oX@lab"', "notify.mail: not a mail address"),
    ('[notify]\nper_user_hour = 0', "notify.per_user_hour: must be between 1 and 3600"),
    ('[coexist]\nslurm = "yes"', "coexist.slurm: must be one of auto, off, got 'yes'"),
    ('[coexist]\nslurm = [0, 0]', "coexist.slurm: a GPU is listed twice"),
    ('[coexist]\nk8s_gpus = [254]', "coexist.k8s_gpus: GPU minors are 0 to 253, got 254"),
    ('[coexist]\nk8s_gpus = "6,7"', "coexist.k8s_gpus: expected a list of GPU minors"),
    ('[coexist]\nslurm = [0, 1]\nk8s_gpus = [1]', "coexist.k8s_gpus: GPU 1 is also in coexist.slurm"),
    ('[coexist]\ngres_conf = "gres.conf"', "coexist.gres_conf: expected an absolute path"),
])
def test_bad_config_names_file_key_and_problem(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        config.load(path)
    message = str(error.value)
    assert message.startswith(f"{path}: ")
    assert fragment in message
    assert "\n" not in message


@pytest.mark.parametrize("quotas, fragment", [
    ('[users.bob]\ngpus = "x"', "users.bob.gpus: expected a whole number"),
    ('[users.bob]\nwalltime = "1h"', "users.bob.walltime: unknown key"),
    ('[teams.x]\ngpus = 1', "teams: unknown table"),
    ('users = 1', "users: expected tables like [users.NAME]"),
    ('[groups.x]\ngpu_memory = "4"', "groups.x.gpu_memory: '4' has no unit; did you mean 4GiB?"),
])
def test_bad_quotas_file(tmp_path, quotas, fragment):
    write(tmp_path, GOOD, quotas)
    with pytest.raises(ConfigError, match=r"quotas\.toml: ") as error:
        config.load(tmp_path / "gpuguard.toml")
    assert fragment in str(error.value)


def test_short_time_limits_are_for_simulated_gpus_only(tmp_path):
    """Tests and demos on simulated GPUs run limits of seconds; on real GPUs a limit under a minute is a typo."""
    quotas = '[users.bob]\nidle_timeout = "2s"\n'
    write(tmp_path, '[gpu]\nbackend = "simulated"\n[defaults]\nmax_time = "5s"\n', quotas)
    loaded = config.load(tmp_path / "gpuguard.toml")
    assert loaded.defaults.max_time == 5 and loaded.quotas.users["bob"] == {"idle_timeout": 2}
    write(tmp_path, "[defaults]\ngpus = 1\n", quotas)  # the nvml backend
    with pytest.raises(ConfigError, match=r"quotas\.toml: users\.bob\.idle_timeout: 2s is under a minute; "
                                          r"did you mean 2m\?"):
        config.load(tmp_path / "gpuguard.toml")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        config.load(tmp_path / "absent.toml")


def test_a_directory_or_a_file_not_utf8_is_a_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match="a directory, not a config file"):
        config.load(tmp_path)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('[access]\ngroup = "\u00e9quipe"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match="not valid TOML: not UTF-8 text"):
        config.load(latin1)


def test_config_check_command(tmp_path):
    path = write(tmp_path, GOOD, QUOTAS)
    result = cli(None, "config", "check", str(path))
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout and "1 user and 1 group quotas" in result.stdout

    path.write_text('[defaults]\ngpu_memory = "lots"')
    result = cli(path, "config", "check")
    assert result.returncode == 2
    assert result.stderr.startswith("gpuguard: ") and result.stderr.count("\n") == 1
    assert "defaults.gpu_memory" in result.stderr and "Traceback" not in result.stderr


def test_version_and_usage_errors():
    result = cli(None, "--version")
    assert result.returncode == 0 and result.stdout.startswith("gpuguard ")
    assert cli(None, "no-such-command").returncode == 2


def unreachable(result: subprocess.CompletedProcess, socket_path: Path) -> bool:
    """Exit status 3 with one line naming the socket: what every command says with no daemon."""
    return (result.returncode == 3 and result.stdout == ""
            and result.stderr.startswith(f"gpuguard: gpuguard daemon not reachable at {socket_path}: ")
            and result.stderr.count("\n") == 1)


def test_no_daemon_on_the_socket_exits_3(sandbox, make_user):
    config_path = write_config(sandbox)  # its socket is in the sandbox, and nothing listens there
    socket_path = config.load(config_path).paths.socket
    assert not socket_path.exists()
    for args in (["whoami"], ["status"], ["whoami", "--json"]):
        result = cli(config_path, *args)
        assert unreachable(result, socket_path), result
    assert unreachable(cli(config_path, "whoami", user=make_user()), socket_path)  # as a researcher

    # A socket file that nobody listens on any more (a daemon that died): refused, also 3.
    socket_path.parent.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(socket_path))
    result = cli(config_path, "whoami")
    assert unreachable(result, socket_path) and "Connection refused" in result.stderr, result


def test_config_option_overrides_the_environment(sandbox):
    """--config beats $GPUGUARD_CONFIG, which beats the default path; the socket named in the
    error shows which file was read."""
    first = sandbox / "first"
    second = sandbox / "second"
    first.mkdir()
    second.mkdir()
    first_socket = config.load(write_config(first)).paths.socket
    second_socket = config.load(write_config(second)).paths.socket
    env = {**os.environ, "GPUGUARD_CONFIG": str(first / "gpuguard.toml")}

    assert unreachable(cli(None, "whoami", env=env), first_socket)
    assert unreachable(cli(second / "gpuguard.toml", "whoami", env=env), second_socket)
    # Also for files that do not load: the one named by --config is the one reported.
    (second / "gpuguard.toml").write_text("[acess]\n")
    result = cli(second / "gpuguard.toml", "config", "check", env=env)
    assert result.returncode == 2 and result.stderr.startswith(f"gpuguard: {second / 'gpuguard.toml'}: ")
    result = cli(None, "config", "check", env=env)
    assert result.returncode == 0 and str(first / "gpuguard.toml") in result.stdout, result
