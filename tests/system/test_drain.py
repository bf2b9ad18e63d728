"""Draining a GPU in a real daemon (issue 22, §3): nobody new gets it, its holder keeps it and is told,
status, whoami and the metrics say so, the drain survives a restart, and resume serves the queue."""
from __future__ import annotations

from devtools.harness import wait_for


def test_a_drained_gpu_is_given_to_nobody_new_and_resume_serves_the_queue(start_daemon, sandbox):
    textfile = sandbox / "metrics.prom"
    d = start_daemon(count=2, gate=False, metrics={"textfile": str(textfile)})
    alice, bob, carol = d.add_member(), d.add_member(), d.add_member()
    assert d.cli("grant", alice.name, "--gpu", "0").returncode == 0

    drained = d.cli("drain", "0", "--reason", "ECC errors")

    assert (drained.returncode, drained.stdout) == (0, "gpuguard: drained GPU 0 (ECC errors); holders told\n")
    assert d.granted_minors(alice) == [0]  # the holder keeps it ...
    (told,) = [e for e in d.whoami(alice)["events"] if e["rule"] == "drain"]
    assert told["message"].startswith("gpuguard: GPU 0 is being drained by root (ECC errors): it stays yours")
    assert "GPU 0 is drained (ECC errors): yours until you release it" in d.cli_as(alice, "whoami").stdout
    line = next(line for line in d.cli_as(bob, "status").stdout.splitlines() if line.startswith("GPU 0 "))
    assert line.endswith("DRAINED (ECC errors)"), line
    # The file is rewritten each tick, also before the drain (0.0 then): wait for the tick after it.
    assert wait_for(lambda: textfile.exists() and any(
        line.startswith('gpuguard_gpu_drained{gpu="0"') and line.endswith(" 1.0")
        for line in textfile.read_text().splitlines()))

    assert d.cli_as(alice, "release").returncode == 0  # ... and when it is given back, nobody new gets it
    assert d.cli_as(bob, "request").returncode == 0 and d.granted_minors(bob) == [1]
    d.open_session(carol)  # GPU 0 free but drained, GPU 1 bob's: carol waits
    assert d.granted_minors(carol) == [] and [q["user"] for q in d.call("status")["queue"]] == [carol.name]

    d.restart()  # the drain is kept
    assert d.call("status")["gpus"][0]["drained"]["reason"] == "ECC errors"
    assert d.granted_minors(carol) == []

    resumed = d.cli("resume", "0")
    assert (resumed.returncode, resumed.stdout) == (0, "gpuguard: GPU 0 may be given again\n")
    assert d.granted_minors(carol) == [0]  # the queue first
    assert d.call("status")["gpus"][0]["drained"] is None
    again = d.cli("resume", "0")
    assert (again.returncode, again.stderr) == (1, "gpuguard: GPU 0 is not drained\n")


def test_only_root_drains(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice = d.add_member()
    refused = d.cli_as(alice, "drain", "0")
    assert (refused.returncode, refused.stderr) == (1, "gpuguard: drain is for root only\n")
