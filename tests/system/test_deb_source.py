"""The source package (`make deb-source`) builds anywhere, offline: what an autobuilder does with it.

Its .dsc is unpacked by `dpkg-source -x` in an empty directory and built there by `dpkg-buildpackage
-b` in a network namespace of its own with no interface but loopback (`unshare -n`), so the build has
only the source and the Build-Depends installed from Debian's archive (nvidia-ml-py's pynvml.py is in
the source: debian/vendor/); `debian/rules clean` then leaves the tree as it was unpacked; lintian
--pedantic says no error and no warning about the source, the binary or the changes. One build, for
every assertion (module fixture).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which("dpkg-buildpackage") is None or shutil.which("unshare") is None,
                                reason="not a Debian system with dpkg-dev and util-linux")

# The distribution's own tools, as an autobuilder has them (not a venv's python3 first on PATH).
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8", "HOME": "/nonexistent"}
VENDORED = REPO / "debian/vendor/nvidia-ml-py/pynvml.py"


def offline(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """argv in a new network namespace: loopback only, down; nothing outside can be reached."""
    return subprocess.run(["unshare", "-n", "--", *argv], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=1800)


def tree(top: Path) -> dict[str, str]:
    """Every path under top -> its type, mode and content (a file's sha256, a link's target)."""
    entries = {}
    for root, dirs, files in os.walk(top):
        for name in [*dirs, *files]:
            path = Path(root, name)
            st = path.lstat()
            if path.is_symlink():
                what = "-> " + os.readlink(path)
            elif path.is_dir():
                what = "dir"
            else:
                what = hashlib.sha256(path.read_bytes()).hexdigest()
            entries[str(path.relative_to(top))] = f"{oct(st.st_mode)} {what}"
    return entries


@dataclass
class SourceBuild:
    dsc: Path
    source_changes: Path
    unpacked: Path
    network: str            # /proc/net/dev as the build's namespace sees it
    built: subprocess.CompletedProcess
    debs: list[Path]
    changes: list[Path]
    as_unpacked: dict[str, str]
    after_clean: dict[str, str]


@pytest.fixture(scope="module")
def source_build(tmp_path_factory) -> SourceBuild:
    outdir = tmp_path_factory.mktemp("deb-source")
    made = subprocess.run([str(REPO / "packaging/build-deb.sh"), "--source", str(outdir)], capture_output=True,
                          text=True, timeout=900)
    assert made.returncode == 0, made.stderr
    dsc = Path(made.stdout.strip().splitlines()[-1])
    (source_changes,) = outdir.glob("gpuguard_*_source.changes")

    empty = tmp_path_factory.mktemp("offline-build")
    unpacked = empty / "gpuguard"
    extracted = subprocess.run(["dpkg-source", "-x", str(dsc), str(unpacked)], cwd=empty, env=ENV,
                               capture_output=True, text=True, timeout=300)
    assert extracted.returncode == 0, extracted.stderr
    as_unpacked = tree(unpacked)
    network = offline(["cat", "/proc/net/dev"], empty).stdout
    built = offline(["dpkg-buildpackage", "-us", "-uc", "-b"], unpacked)
    cleaned = offline(["debian/rules", "clean"], unpacked)
    assert cleaned.returncode == 0, cleaned.stdout + cleaned.stderr
    return SourceBuild(dsc, source_changes, unpacked, network, built, sorted(empty.glob("*.deb")),
                       sorted(empty.glob("*.changes")), as_unpacked, tree(unpacked))


def test_the_dsc_builds_offline_in_an_empty_directory(source_build) -> None:
    interfaces = [line.split(":")[0].strip() for line in source_build.network.splitlines() if ":" in line]
    assert interfaces == ["lo"], source_build.network  # the build's namespace reaches nothing
    assert source_build.built.returncode == 0, (source_build.built.stdout + source_build.built.stderr)[-6000:]
    (deb,) = [deb for deb in source_build.debs if deb.name.startswith("gpuguard_")]  # and its -dbgsym
    # The vendored bindings made it into the package, as they are in the source.
    unpacked = source_build.unpacked.parent / "contents"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], check=True)
    assert (unpacked / "usr/lib/gpuguard/vendor/pynvml.py").read_bytes() == VENDORED.read_bytes()
    assert (source_build.unpacked / "debian/vendor/nvidia-ml-py/pynvml.py").read_bytes() == VENDORED.read_bytes()


def test_clean_leaves_the_tree_as_it_was_unpacked(source_build) -> None:
    before, after = source_build.as_unpacked, source_build.after_clean
    changed = {path: (before.get(path), after.get(path)) for path in before.keys() | after.keys()
               if before.get(path) != after.get(path)}
    assert changed == {}


@pytest.mark.skipif(shutil.which("lintian") is None, reason="lintian is not installed (make build-deps)")
def test_lintian_pedantic_warns_of_nothing_in_the_source_the_binary_and_the_changes(source_build) -> None:
    """What lintian still says (information and pedantic tags, and the overrides, each with its reason
    in debian/source/lintian-overrides or debian/gpuguard.lintian-overrides) is in docs/admin.md."""
    assert source_build.built.returncode == 0, source_build.built.stderr[-3000:]
    targets = [source_build.dsc, source_build.source_changes, *source_build.debs, *source_build.changes]
    result = subprocess.run(["lintian", "--allow-root", "--pedantic", "--fail-on", "error,warning",
                             *map(str, targets)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not re.search(r"^[EW]: ", result.stdout, re.MULTILINE), result.stdout
