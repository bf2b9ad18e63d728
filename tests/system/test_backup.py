"""`gpuguard backup` and `restore` with a real daemon (issue 39, item 6): a backup taken while it
serves brings the grants, the queue, a drain and a hold back into a wiped state directory; a
restore is refused while the daemon runs, and for a bad file or a newer schema, changing nothing."""
from __future__ import annotations

import hashlib
import io
import json
import shutil
import sqlite3
import stat
import tarfile
from pathlib import Path

from gpuguard.services.store import MIGRATIONS


def files(directory: Path) -> dict[str, str]:
    """Every file in the directory, by name, with a hash of its contents."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_a_backup_taken_while_the_daemon_serves_brings_grants_queue_drains_and_holds_back(start_daemon, sandbox):
    d = start_daemon(count=2, gate=False)
    alice, bob = d.add_member(), d.add_member()
    assert d.cli("grant", alice.name, "--gpu", "0").returncode == 0
    assert d.cli("drain", "1", "--reason", "ggt fan").returncode == 0
    d.open_session(bob)  # GPU 0 is alice's, 1 drained: bob waits
    assert d.cli("hold", bob.name).returncode == 0
    before = {"alice": d.grants(alice), "status": d.call("status")}
    backup = sandbox / "ggt-state.tar.gz"

    made = d.cli("backup", str(backup))

    assert made.returncode == 0, made.stderr
    assert made.stdout == (f"gpuguard: backed up {d.config.paths.state_dir} (schema {len(MIGRATIONS)}: state.db, "
                           f"drained.json, queue_holds.json) to {backup}\n")
    assert stat.S_IMODE(backup.stat().st_mode) == 0o600  # the state names users
    with tarfile.open(backup) as tar:
        assert tar.getnames() == ["manifest.json", "state.db", "drained.json", "queue_holds.json"]
    # Changed after the backup, then the state directory wiped: the restore brings back the backup's.
    assert d.cli("revoke", alice.name).returncode == 0
    assert d.cli("resume", "1").returncode == 0
    assert d.stop() == 0
    shutil.rmtree(d.config.paths.state_dir)

    restored = d.cli("restore", str(backup))

    assert restored.returncode == 0, restored.stderr
    assert restored.stdout.startswith(f"gpuguard: restored {d.config.paths.state_dir} from {backup} (made ")
    assert restored.stdout.endswith(f"schema {len(MIGRATIONS)}); start the daemon\n")
    d.start()
    keep = ("minor", "granted_at", "expires_at", "origin", "uuid")
    assert [{k: g[k] for k in keep} for g in d.grants(alice)] == [{k: g[k] for k in keep} for g in before["alice"]]
    status = d.call("status")
    assert [gpu["drained"] for gpu in status["gpus"]] == [gpu["drained"] for gpu in before["status"]["gpus"]]
    assert status["gpus"][1]["drained"]["reason"] == "ggt fan"
    assert [(q["user"], q["reason"]) for q in status["queue"]] == [(bob.name, "Held")]


def test_restore_is_refused_while_the_daemon_runs(start_daemon, sandbox):
    d = start_daemon(count=1, gate=False)
    backup = sandbox / "ggt-state.tar.gz"
    assert d.cli("backup", str(backup)).returncode == 0

    refused = d.cli("restore", str(backup))

    assert (refused.returncode, refused.stderr) == (
        1, f"gpuguard: the gpuguard daemon is running (it answers on {d.socket}): stop it first "
           "(systemctl stop gpuguard), restore, then start it\n")


def archive(path: Path, members: dict[str, bytes | tarfile.TarInfo], manifest: dict | None = None) -> Path:
    """A tar.gz of these members (contents, or a TarInfo of no contents: a link, a directory), the
    manifest (as JSON) first when given."""
    with tarfile.open(path, "w:gz") as tar:
        first = {"manifest.json": json.dumps(manifest).encode()} if manifest else {}
        for name, content in {**first, **members}.items():
            if isinstance(content, tarfile.TarInfo):
                tar.addfile(content)
            else:
                info = tarfile.TarInfo(name)
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return path


def database(path: Path, schema: int) -> bytes:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE ggt (x)")
    db.execute(f"PRAGMA user_version={schema}")
    db.close()
    return path.read_bytes()


def manifest(schema: int, files: list[str], version: int = 1) -> dict:
    return {"format": "gpuguard-backup", "version": version, "schema": schema, "gpuguard": "9.9", "created": 0,
            "host": "ggt-host", "files": files}


def test_a_bad_backup_or_one_of_a_newer_schema_is_refused_and_changes_nothing(start_daemon, sandbox):
    d = start_daemon(count=2, gate=False)
    alice = d.add_member()
    assert d.cli("grant", alice.name, "--gpu", "0").returncode == 0
    assert d.cli("drain", "1", "--reason", "ggt fan").returncode == 0
    assert d.stop() == 0
    state_dir = d.config.paths.state_dir
    before = files(state_dir)
    newest = len(MIGRATIONS)
    current = database(sandbox / "ggt-current.db", newest)
    link = tarfile.TarInfo("state.db")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/shadow"
    dot = tarfile.TarInfo("../state.db")
    cases = {
        "not a tar": (sandbox / "ggt-plain", 2, "not a gpuguard backup (no tar.gz, or one cut short or damaged)"),
        "no manifest": (archive(sandbox / "ggt-bare.tgz", {"state.db": current}), 2,
                        "not a gpuguard backup (no manifest.json)"),
        "another format": (archive(sandbox / "ggt-other.tgz", {"state.db": current}, {"format": "ggt"}), 2,
                           "not a gpuguard backup (its manifest.json names another format)"),
        "a link for the store": (archive(sandbox / "ggt-link.tgz", {"state.db": link}, manifest(newest, ["state.db"])),
                                 2, "its member 'state.db' is not a file of ours"),
        "a member outside": (archive(sandbox / "ggt-dot.tgz", {"state.db": current, "../state.db": dot},
                                     manifest(newest, ["state.db"])),
                             2, "its members are not those its manifest lists"),
        "a damaged store": (archive(sandbox / "ggt-damaged.tgz", {"state.db": current[:100] + b"\xff" * 4000},
                                    manifest(newest, ["state.db"])), 2, None),
        "a drain file not JSON": (archive(sandbox / "ggt-json.tgz", {"state.db": current, "drained.json": b"{"},
                                          manifest(newest, ["state.db", "drained.json"])),
                                  2, "its drained.json is not JSON"),
        "a newer schema": (archive(sandbox / "ggt-newer.tgz", {"state.db": database(sandbox / "ggt-n.db", newest + 1)},
                                   manifest(newest + 1, ["state.db"])),
                           1, f"schema version {newest + 1} is newer than this gpuguard ({newest}); "
                              "restore it with a gpuguard at least as new as the one that made it"),
        "a newer format": (archive(sandbox / "ggt-format.tgz", {"state.db": current}, manifest(newest, ["state.db"], 2)),
                           1, "backup format 2, this gpuguard reads 1; restore it with the gpuguard that made it, "
                              "or a newer one"),
    }
    (sandbox / "ggt-plain").write_text("ggt: not a backup\n")
    cut = sandbox / "ggt-cut.tgz"
    assert d.cli("backup", str(cut)).returncode == 0  # a good one, cut short
    cut.write_bytes(cut.read_bytes()[:len(cut.read_bytes()) // 2])
    cases["cut short"] = (cut, 2, "not a gpuguard backup (no tar.gz, or one cut short or damaged)")

    for case, (path, code, message) in cases.items():
        refused = d.cli("restore", str(path))
        assert refused.returncode == code, (case, refused.stderr)
        assert refused.stderr.startswith(f"gpuguard: {path}: ") and refused.stderr.count("\n") == 1, (case, refused.stderr)
        assert message is None or refused.stderr == f"gpuguard: {path}: {message}\n", case
        assert files(state_dir) == before, case  # nothing replaced, nothing left behind
    aside = state_dir.rename(sandbox / "ggt-state-aside")  # a wiped state directory stays wiped
    assert d.cli("restore", str(cases["a newer schema"][0])).returncode == 1
    assert not state_dir.exists()
    aside.rename(state_dir)

    d.start()
    assert d.granted_minors(alice) == [0]
    assert d.call("status")["gpus"][1]["drained"]["reason"] == "ggt fan"
