"""`gpuguard config check` warnings: a configuration that loads but will not do what was meant
(exit 0, one `warning:` line each on stderr)."""
from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO
from sim_helpers import cli

from gpuguard import config
from gpuguard.core.config_warnings import UNIT_WRITABLE, warnings


def write(directory: Path, text: str, quotas: str | None = "") -> Path:
    path = directory / "gpuguard.toml"
    path.write_text(text)
    if quotas is not None:
        (directory / "quotas.toml").write_text(quotas)
    return path


def test_a_sound_configuration_has_nothing_to_say(tmp_path) -> None:
    loaded = config.load(write(tmp_path, '[access]\ngroup = "gpu"\n[defaults]\nsharing = true\ngpu_memory = "20GiB"\n'))
    assert warnings(loaded, lambda name: True, lambda name: True) == []


def test_missing_accounts_files_and_sharing_without_memory(tmp_path) -> None:
    loaded = config.load(write(
        tmp_path,
        '[access]\ngroup = "gpu"\nexempt_users = ["nvidia-persistenced", "bob"]\nexempt_groups = ["admins"]\n'
        '[defaults]\nsharing = true\n',
        quotas='[users.carol]\ngpus = 2\n[groups.interns]\nsharing = true\n[groups.staff]\nsharing = true\n'
               'gpu_memory = "10GiB"\n'))
    users, groups = {"carol"}, {"staff"}
    found = warnings(loaded, users.__contains__, groups.__contains__)
    quotas = tmp_path / "quotas.toml"
    assert found == [
        "access.group: no group named gpu on this host (yet): nobody gets GPUs until it exists",
        "access.exempt_users: no user named bob on this host (yet)",  # nvidia-persistenced: only where present
        "access.exempt_groups: no group named admins on this host (yet)",
        f"{quotas}: no group named interns on this host (yet)",
        "defaults.sharing: has no effect without a gpu_memory limit (nobody shares a GPU)",
        f"{quotas}: groups.interns.sharing: has no effect without a gpu_memory limit",
    ]


def test_a_missing_quotas_file(tmp_path) -> None:
    loaded = config.load(write(tmp_path, "", quotas=None))
    assert warnings(loaded, lambda name: True, lambda name: True) == [
        f"paths.quotas: {tmp_path / 'quotas.toml'} does not exist: every member gets the [defaults]"]


def test_persistenced_is_exempt_by_default() -> None:
    assert config.AccessConfig().exempt_users == ("nvidia-persistenced",)


def test_config_check_warns_and_still_exits_0(sandbox) -> None:
    path = write(sandbox, '[access]\ngroup = "ggt-g-nosuch"\n[defaults]\nsharing = true\n', quotas=None)
    result = cli(None, "config", "check", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{path}: ok")
    lines = result.stderr.splitlines()
    assert lines[0] == ("gpuguard: warning: access.group: no group named ggt-g-nosuch on this host (yet): "
                        "nobody gets GPUs until it exists")
    assert len(lines) == 3 and all(line.startswith("gpuguard: warning: ") for line in lines)


def test_metrics_the_systemd_unit_blocks_are_named_with_their_drop_in(tmp_path) -> None:
    loopback = config.load(write(tmp_path, '[metrics]\nlisten = "127.0.0.1:9447"\n'
                                           'dcgm_job_mapping_dir = "/run/gpuguard/dcgm-job-mapping"\n'))
    assert warnings(loopback, lambda name: True, lambda name: True) == []
    opened = config.load(write(tmp_path, '[metrics]\nlisten = "0.0.0.0:9447"\n'
                                         'textfile = "/var/lib/node_exporter/textfile_collector/gpuguard.prom"\n'))
    assert warnings(opened, lambda name: True, lambda name: True) == [
        "metrics.listen: 0.0.0.0:9447 is not loopback, and the systemd unit lets only localhost connect "
        "(IPAddressAllow=localhost): open it with a drop-in (docs/admin.md, The systemd unit)",
        "metrics.textfile: the systemd unit makes /var/lib/node_exporter/textfile_collector read-only "
        "(ProtectSystem=strict): add ReadWritePaths=/var/lib/node_exporter/textfile_collector with a drop-in "
        "(docs/admin.md, The systemd unit)"]


def test_the_writable_directories_and_the_address_allowed_are_the_units() -> None:
    unit = (REPO / "etc" / "gpuguard.service").read_text()
    value = {key: re.search(rf"^{key}=(.*)$", unit, re.MULTILINE)[1]
             for key in ("RuntimeDirectory", "StateDirectory", "ReadWritePaths", "IPAddressAllow", "ProtectSystem")}
    assert UNIT_WRITABLE == (Path("/run") / value["RuntimeDirectory"], Path("/var/lib") / value["StateDirectory"])
    assert (value["ReadWritePaths"], value["IPAddressAllow"], value["ProtectSystem"]) == ("/sys/fs/bpf", "localhost", "strict")
