"""Policy on its own: membership, exemption and quota precedence, over names only."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from gpuguard import config
from gpuguard.config import AccessConfig
from gpuguard.core import policy
from gpuguard.core.model import Quota

ACCESS = AccessConfig(group="gpugroup", exempt_users=("ops",), exempt_groups=("wheel",))


def load(tmp_path: Path, main: str, quotas: str) -> config.Config:
    (tmp_path / "gpuguard.toml").write_text(main)
    (tmp_path / "quotas.toml").write_text(quotas)
    return config.load(tmp_path / "gpuguard.toml")


def test_membership_is_the_configured_group():
    assert policy.is_member({"users", "gpugroup"}, ACCESS)
    assert not policy.is_member({"users", "gpugroup2"}, ACCESS)
    assert not policy.is_member(set(), ACCESS)


def test_root_exempt_users_and_exempt_groups_are_exempt():
    assert policy.is_exempt(0, "root", set(), ACCESS)
    assert policy.is_exempt(0, "toor", set(), ACCESS)  # by uid, whatever the name
    assert policy.is_exempt(1005, "ops", set(), ACCESS)
    assert policy.is_exempt(1006, "alice", {"gpugroup", "wheel"}, ACCESS)
    assert not policy.is_exempt(1006, "alice", {"gpugroup"}, ACCESS)


def test_eligibility_is_exempt_first_then_membership():
    E = policy.Eligibility
    assert policy.eligibility(1001, "alice", {"gpugroup"}, ACCESS) == E.MEMBER
    assert policy.eligibility(1002, "bob", {"users"}, ACCESS) == E.OUTSIDER
    assert policy.eligibility(1003, "ops", {"gpugroup"}, ACCESS) == E.EXEMPT  # an exempt member is exempt
    assert policy.eligibility(1004, "carol", {"wheel"}, ACCESS) == E.EXEMPT
    assert policy.eligibility(0, "root", set(), ACCESS) == E.EXEMPT


def test_defaults_when_nothing_else_applies(tmp_path):
    loaded = load(tmp_path, '[defaults]\ngpus = 2\nmax_time = "8h"\n', "")
    assert policy.quota_for("alice", {"gpugroup"}, loaded) == replace(config.DEFAULT_QUOTA, gpus=2, max_time=8 * 3600.0)


def test_user_over_group_over_defaults_field_by_field(tmp_path):
    loaded = load(tmp_path, '[defaults]\ngpus = 1\ngpu_memory = "10GiB"\nmax_time = "8h"\n',
                  '[groups.phd]\ngpus = 2\ngpu_memory = "20GiB"\n\n'
                  '[users.alice]\ngpu_memory = "40GiB"\n')
    alice = policy.quota_for("alice", {"gpugroup", "phd"}, loaded)
    # memory from her own entry, GPUs from her group, time from the defaults
    assert alice == replace(config.DEFAULT_QUOTA, gpus=2, gpu_memory=40 << 30, max_time=8 * 3600.0)
    bob = policy.quota_for("bob", {"gpugroup", "phd"}, loaded)
    assert bob == replace(config.DEFAULT_QUOTA, gpus=2, gpu_memory=20 << 30, max_time=8 * 3600.0)
    carol = policy.quota_for("carol", {"gpugroup"}, loaded)
    assert carol == replace(config.DEFAULT_QUOTA, gpus=1, gpu_memory=10 << 30, max_time=8 * 3600.0)


def test_between_groups_the_one_written_first_wins_per_field(tmp_path):
    loaded = load(tmp_path, "", '[groups.staff]\ngpus = 4\n\n[groups.phd]\ngpus = 2\nsharing = true\n')
    both = policy.quota_for("dave", {"phd", "staff"}, loaded)
    assert (both.gpus, both.sharing) == (4, True)
    loaded = load(tmp_path, "", '[groups.phd]\ngpus = 2\nsharing = true\n\n[groups.staff]\ngpus = 4\n')
    assert policy.quota_for("dave", {"staff", "phd"}, loaded).gpus == 2


def test_explicit_unlimited_in_a_user_entry_overrides_a_group_limit(tmp_path):
    loaded = load(tmp_path, "", '[groups.phd]\ngpu_memory = "20GiB"\n\n[users.alice]\ngpu_memory = "unlimited"\n')
    assert policy.quota_for("alice", {"phd"}, loaded).gpu_memory is None


def test_sharing_needs_a_memory_quota():
    assert not policy.may_share(Quota(sharing=True))
    assert policy.may_share(Quota(sharing=True, gpu_memory=20 << 30))
    assert not policy.may_share(Quota(sharing=False, gpu_memory=20 << 30))


def test_expiry_is_now_plus_max_time():
    assert policy.expires_at(Quota(max_time=3600.0), now=1000.0) == 4600.0
    assert policy.expires_at(Quota(), now=1000.0) is None


def test_which_logins_take_gpus():
    from gpuguard.config import SessionsConfig
    from gpuguard.core.policy import login_takes_gpus

    default = SessionsConfig()
    for tty in ("/dev/pts/3", "pts/3", "tty1", "/dev/tty2", "console"):  # su, login, sshd with a pty
        assert login_takes_gpus("sshd", tty, "auto", default), tty
    for service, tty in (("sshd", "ssh"), ("sshd", ""), ("cron", "cron"), ("jupyterhub", "")):
        assert not login_takes_gpus(service, tty, "auto", default), (service, tty)  # scp, ssh host cmd, ...
    assert login_takes_gpus("jupyterhub", "", "auto", SessionsConfig(services=("jupyterhub",)))
    assert login_takes_gpus("sshd", "ssh", "auto", SessionsConfig(grant="all"))
    assert not login_takes_gpus("login", "tty1", "never", SessionsConfig(grant="all"))  # the stack decides
    assert login_takes_gpus("sshd", "ssh", "always", default)
