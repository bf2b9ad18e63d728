"""The torture runs of tests/torture.py, short (the long ones: bench/torture)."""
from __future__ import annotations

import signal

import pytest
from torture import Target, crash, storm

pytestmark = pytest.mark.gate


def target_of(d, users, attacker=None) -> Target:
    def restart() -> None:
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        d.start()

    return Target(socket=d.socket, store_path=d.config.paths.state_dir / "state.db", device_dir=d.device_dir,
                  gate_name=d.gate_name, users=[(u.name, u.uid) for u in users], restart=restart,
                  attacker_uid=attacker.uid if attacker else None,
                  callers={u.name: d.caller().pid for u in users})


def test_sigkill_during_logins_and_logouts_loses_nothing_and_leaves_all_layers_equal(start_daemon):
    d = start_daemon(defaults={"gpus": 1}, count=4)
    users = [d.add_member() for _ in range(6)]  # more users than GPUs: some logins get none
    report = crash(target_of(d, users), cycles=60, kills=3)
    assert report.kills == 3 and report.cycles > 0
    assert report.checks == []


def test_logins_keep_working_while_hostile_clients_attack(start_daemon):
    d = start_daemon(defaults={"gpus": 1}, count=4)
    users = [d.add_member() for _ in range(3)]
    result = storm(target_of(d, users, attacker=d.add_member()), logins=20, attackers=2, idle=100)
    print(f"login+logout median: {result['alone'] * 1000:.1f} ms alone, {result['attacked'] * 1000:.1f} ms "
          f"under attack (x{result['ratio']:.2f}); attacks sent: {result['sent']}")
    assert all(result["sent"].get(name, 0) > 0 for name in ("malformed JSON", "5 MB line", "half-sent"))
    assert "traceback=" not in d.log()
