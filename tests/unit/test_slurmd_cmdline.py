"""Where a slurmd's config comes from, read from its command line and environment as slurmd(8) takes them."""
from __future__ import annotations

from gpuguard.backends.slurm import Slurmd, _parse_slurmd
from gpuguard.config import CoexistConfig
from gpuguard.core.coexist import Owner, SlurmFacts, decide
from gpuguard.core.gres import NodeGpus


def test_conf_server_makes_it_configless_and_n_names_the_node():
    assert _parse_slurmd(["-D", "-s", "--conf-server", "ctl1:6817", "-N", "gpu07"], {}) == \
        Slurmd(conf_server="ctl1:6817", node="gpu07")
    assert _parse_slurmd(["--conf-server=ctl1,ctl2", "-Ngpu07"], {}).configless()
    assert _parse_slurmd(["-D", "--conf-server", "ctl1"], {}).node is None


def test_a_slurm_conf_given_by_f_or_slurm_conf_is_not_configless():
    assert _parse_slurmd(["-f", "/opt/slurm/etc/slurm.conf"], {}) == Slurmd(conf_file="/opt/slurm/etc/slurm.conf")
    assert _parse_slurmd(["-f/opt/s.conf"], {}).conf_file == "/opt/s.conf"
    assert not _parse_slurmd([], {"SLURM_CONF": "/srv/slurm.conf"}).configless()
    # --conf-server wins over a file, as in slurmd's own precedence
    assert _parse_slurmd(["--conf-server", "ctl1", "-f", "/x.conf"], {}).configless()


def test_messages_name_the_gres_conf_slurmd_reads():
    cache = "/var/spool/slurmd/conf-cache/gres.conf"
    facts = SlurmFacts(node="gpu07", slurmd_running=True, gres_conf_present=True,
                       gres=NodeGpus(False, frozenset({0, 1})), gres_conf=cache)
    owned = decide(CoexistConfig(slurm="auto"), facts, range(4))
    assert owned.foreign == {0: Owner.SLURM, 1: Owner.SLURM}
    assert owned.summary() == f"Slurm: GPUs 0,1 ({cache}, node gpu07)"
