"""The pure level, tests/unit, runs as any user: no root, no daemon, no GPU (what `make test-unit` promises)."""
from __future__ import annotations

import os
import re

from conftest import PYTHON, REPO, run_as


def test_the_unit_tests_pass_as_an_ordinary_user(make_user):
    user = make_user()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(user.home), "PYTHONDONTWRITEBYTECODE": "1"}
    result = run_as(user, [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(REPO),
                           "-c", str(REPO / "setup.cfg"), str(REPO / "tests" / "unit")], env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) > 100 and "error" not in result.stdout.splitlines()[-1]
