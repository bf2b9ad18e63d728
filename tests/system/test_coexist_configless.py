"""Configless Slurm beside gpuguard: gres.conf only in slurmd's cache, and GPUs that become Slurm's at a restart.

A configless slurmd (`slurmd --conf-server HOST -N NODE`, no slurm.conf or gres.conf in /etc/slurm)
fetches its files from slurmctld into SlurmdSpoolDir/conf-cache (and links /run/slurm/conf there).
Here: a real root process named slurmd with that command line (a compiled stand-in: a real slurmd
exits without a slurmctld to fetch from), its cache in the sandbox, and a stub `scontrol` answering
`show config` (SlurmdSpoolDir) and `show node` as Slurm 22.05 does (no slurmctld runs here).
gpuguard reads the cache's gres.conf: the daemon, `config check` and `doctor` leave Slurm's GPUs
alone. When gres.conf gives Slurm a GPU a user of gpuguard's holds and the daemon restarts, the
grant ends and the node is as Slurm's jobs need it (0666, no ACL: getfacl shows no named user),
and `doctor` judges each node against its owner.
"""
from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
from probes import ALLOWED, FILE_DENIED, GATE_DENIED, opens
from sim_helpers import cli, gpuguard, write_config

from devtools.harness import gate_test_lock
from gpuguard.backends.gate import Gate
from gpuguard.backends.posix_acl import acl_users

RUN_CONF = Path("/run/slurm/conf")  # where a configless slurmd links its cache
pytestmark = [pytest.mark.gate,
              pytest.mark.skipif(RUN_CONF.exists(), reason="a real configless slurmd's cache is on this host")]

NODE = "ggt-cfgless2"  # this host's NodeName, given to slurmd with -N only
STANDIN = "#include <unistd.h>\nint main(void) { for (;;) pause(); }\n"


def root_file(path: Path, text: str, mode: int = 0o644) -> Path:
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def start_slurmd(sandbox: Path) -> subprocess.Popen:
    """A root process named slurmd, command line as systemd starts a configless one."""
    source = root_file(sandbox / "standin.c", STANDIN)
    binary = sandbox / "sbin" / "slurmd"
    binary.parent.mkdir(mode=0o755, exist_ok=True)
    subprocess.run(["gcc", "-o", str(binary), str(source)], check=True)
    return subprocess.Popen([str(binary), "-D", "-s", "--conf-server", "ggt-ctl.invalid:6817", "-N", NODE])


def cache(sandbox: Path, files: str) -> Path:
    """slurmd's configless cache in the sandbox's SlurmdSpoolDir, with this gres.conf."""
    spool = sandbox / "spool"
    root_file(spool / "conf-cache" / "slurm.conf", f"ClusterName=ggt\nSlurmctldHost=ggt-ctl\nSlurmdSpoolDir={spool}\n"
                                                   f"NodeName={NODE} Gres=gpu:2\n")
    return root_file(spool / "conf-cache" / "gres.conf", f"AutoDetect=off\nNodeName={NODE} Name=gpu File={files}\n")


def stub_scontrol(sandbox: Path, gpus: int) -> Path:
    """`scontrol show config` and `show node NODE` as Slurm 22.05 prints them; anything else fails."""
    return root_file(sandbox / "bin" / "scontrol", f"""#!/bin/sh
case "$*" in
"show config") cat <<EOF
Configuration data as of 2026-12-06T19:00:00
AccountingStorageType   = accounting_storage/none
ClusterName             = ggt
GresTypes               = gpu
SLURM_CONF              = /run/slurm/conf/slurm.conf
SLURM_VERSION           = 22.05.8
SlurmctldHost[0]        = ggt-ctl
SlurmdSpoolDir          = {sandbox / 'spool'}
EOF
;;
"show node {NODE}") cat <<EOF
NodeName={NODE} Arch=x86_64 CoresPerSocket=16
   Gres=gpu:{gpus}
   NodeAddr={NODE} NodeHostName={NODE} Version=22.05.8
   State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1
EOF
;;
*) echo "unexpected: $*" >&2; exit 1;;
esac
""", 0o755)


def getfacl_users(path: Path) -> list[str]:
    listed = subprocess.run(["getfacl", "-cn", str(path)], capture_output=True, text=True, check=True).stdout
    return [line for line in listed.splitlines() if re.match(r"user:\d+:", line)]


def doctor(d) -> dict[str, str]:
    return {line.split()[1]: line for line in d.cli("doctor", env={**os.environ, **d.env}).stdout.splitlines()}


@pytest.fixture
def slurmd(sandbox):
    proc = start_slurmd(sandbox)
    yield proc
    proc.kill()
    proc.wait()


def test_configless_gpus_are_slurms_and_a_gpu_given_to_slurm_at_a_restart_is_opened_to_its_jobs(
        start_daemon, sandbox, slurmd):
    gres_conf = cache(sandbox, "/dev/nvidia0")
    stub_scontrol(sandbox, 1)
    env = {"PATH": f"{sandbox / 'bin'}:{os.environ['PATH']}"}
    d = start_daemon(count=4, coexist={"slurm": "auto"}, env=env)  # no gres_conf, no slurm_node: slurmd's own
    alice, bob = d.add_member(), d.add_member()
    where = f"{gres_conf}, node {NODE}"
    assert [(g["minor"], g["owner"]) for g in d.call("status")["gpus"]] == [
        (0, "slurm"), (1, "gpuguard"), (2, "gpuguard"), (3, "gpuguard")]
    checked = d.cli("config", "check", env={**os.environ, **env})
    assert checked.returncode == 0 and f"coexist: Slurm: GPUs 0 ({where})" in checked.stdout, checked
    assert doctor(d)["coexist"] == f"ok    coexist       Slurm: GPUs 0 ({where}); gpuguard manages the other GPUs"

    [held] = d.open_session(alice)["gpus"]
    assert stat.S_IMODE(os.stat(d.node(held)).st_mode) == 0o660 and acl_users(d.node(held)) == {alice.uid}
    assert opens(bob, {held: d.node(held)}) == {held: FILE_DENIED}

    # slurmctld now gives this node the GPU alice holds; slurmd fetched the new gres.conf; gpuguard restarts.
    cache(sandbox, f"/dev/nvidia0,/dev/nvidia{held}")
    stub_scontrol(sandbox, 2)
    d.restart()
    assert d.granted_minors(alice) == []
    assert [g["owner"] for g in d.call("status")["gpus"] if g["minor"] == held] == ["slurm"]
    # As Slurm's jobs need it: 0666 root:root, no named ACL entry (alice's is gone); the gate leaves it alone.
    node = os.stat(d.node(held))
    assert (stat.S_IMODE(node.st_mode), node.st_uid, node.st_gid) == (0o666, 0, 0)
    assert getfacl_users(d.node(held)) == [] and acl_users(d.node(held)) == set()
    assert opens(bob, {held: d.node(held)}) == {held: ALLOWED}
    assert re.search(rf"event=coexist_node .*{re.escape(str(d.node(held)))}: ACL users \[{alice.uid}\], mode 0660",
                     d.log()), d.log()
    assert doctor(d)["nodes"].startswith("ok"), doctor(d)["nodes"]
    # gpuguard's own GPUs stay closed to those without a grant.
    mine = next(m for m in range(4) if m not in (0, held))
    assert opens(bob, {mine: d.node(mine)})[mine] in (FILE_DENIED, GATE_DENIED)

    # doctor judges Slurm's nodes by Slurm's needs: a stale ACL entry or gpuguard's 0660 there is a FAIL.
    subprocess.run(["setfacl", "-m", f"u:{alice.uid}:rw", str(d.node(held))], check=True)
    line = doctor(d)["nodes"]
    assert line.startswith("FAIL") and f"{d.node(held)} is another system's (coexist) but keeps ACL users " \
                                         f"[{alice.uid}]" in line, line
    subprocess.run(["setfacl", "-b", str(d.node(held))], check=True)
    os.chmod(d.node(held), 0o660)
    line = doctor(d)["nodes"]
    assert line.startswith("FAIL") and "whose jobs get EACCES (want 0666" in line, line
    d.restart()  # the fix doctor names
    assert doctor(d)["nodes"].startswith("ok") and stat.S_IMODE(os.stat(d.node(held)).st_mode) == 0o666


def test_a_configless_slurm_node_without_coexist_config_refuses_to_start(sandbox, slurmd):
    """[coexist] slurm not set: a configless slurmd with GPUs in its cache's gres.conf is a Slurm node (exit 6)."""
    gres_conf = cache(sandbox, "/dev/nvidia[0-1]")
    stub_scontrol(sandbox, 2)
    config = write_config(sandbox, count=2)
    env = {**os.environ, "PATH": f"{sandbox / 'bin'}:{os.environ['PATH']}"}
    checked = cli(config, "config", "check", env=env)
    assert checked.returncode == 6 and f"this is a Slurm node (slurmd runs, {gres_conf} exists)" in checked.stderr
    lines = {line.split()[1]: line for line in cli(config, "doctor", env=env).stdout.splitlines()}
    assert lines["coexist"].startswith("FAIL  coexist       the daemon will not start: this is a Slurm node")
    with gate_test_lock():  # should it start after all, its gate must not deny another test's users
        try:
            result = subprocess.run([*gpuguard(config, "daemon", "--gate-name", "ggt-never")], capture_output=True,
                                    text=True, timeout=60, env=env)
        finally:
            Gate("ggt-never").detach()
    assert result.returncode == 6, result.stderr
    assert f"this is a Slurm node (slurmd runs, {gres_conf} exists)" in result.stderr, result.stderr


def test_a_cache_others_can_write_to_is_not_believed(sandbox, slurmd):
    gres_conf = cache(sandbox, "/dev/nvidia0")
    stub_scontrol(sandbox, 1)
    gres_conf.parent.chmod(0o777)
    config = write_config(sandbox, count=2, extra='[coexist]\nslurm = "auto"\n')
    result = cli(config, "config", "check", env={**os.environ, "PATH": f"{sandbox / 'bin'}:{os.environ['PATH']}"})
    assert result.returncode == 6
    assert f"{gres_conf.parent}: not believed: a directory on the way to Slurm's gres.conf must be root's" \
        in result.stderr, result.stderr


def test_the_way_to_a_found_gres_conf_is_checked_through_symlinks(sandbox):
    """/run/slurm/conf is a symlink to the cache: every directory on the way, the link's own included, must be root's."""
    from gpuguard.backends.slurm import _check_directories
    from gpuguard.core.gres import GresError
    gres_conf = cache(sandbox, "/dev/nvidia0")
    run = sandbox / "run" / "slurm"
    run.mkdir(mode=0o755, parents=True)
    (run / "conf").symlink_to(gres_conf.parent)
    _check_directories(run / "conf" / "gres.conf")  # root's all the way: believed
    run.chmod(0o777)  # anyone could point the link elsewhere
    with pytest.raises(GresError, match=rf"{run}: not believed"):
        _check_directories(run / "conf" / "gres.conf")
    run.chmod(0o755)
    (sandbox / "spool").chmod(0o775)  # the link's target is on a way others can write
    with pytest.raises(GresError, match=rf"{sandbox / 'spool'}: not believed"):
        _check_directories(run / "conf" / "gres.conf")
