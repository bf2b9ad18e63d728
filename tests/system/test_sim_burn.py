"""`gpuguard sim burn`, the stand-in for a CUDA program: real users, real file permissions,
real signals; the root-side NVML view comes from pynvml over the simulated library."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from conftest import run_as
from sim_helpers import GiB, burn, gpuguard, open_backend, start_burn, stop_burn, write_config

from gpuguard.backends.nvml import NvmlBackend
from gpuguard.backends.sim_registry import REGISTRY_DIR
from gpuguard.core.model import GpuProcess

if TYPE_CHECKING:
    from conftest import TestUser  # not at run time: pytest would try to collect it



pytestmark = pytest.mark.usefixtures("without_gates")


@pytest.fixture
def config(sandbox: Path) -> Path:
    return write_config(sandbox, count=4)


@pytest.fixture
def gpus(config: Path) -> Iterator[NvmlBackend]:
    """What the root daemon sees; opening it creates the device nodes (mode 0666)."""
    with open_backend(config) as backend:
        yield backend


@pytest.fixture
def user(make_user) -> TestUser:
    return make_user()


def records(sandbox: Path) -> list[str]:
    """The process records (<pid>-*.json; the MIG layout and capability table sit next to them)."""
    return sorted(name for name in os.listdir(sandbox / "dev" / REGISTRY_DIR) if name[:1].isdigit())


def holds_node(pid: int, node: Path) -> bool:
    """Whether the process has the node open, found the way revocation finds it."""
    fd_dir = Path(f"/proc/{pid}/fd")
    return any(os.stat(fd_dir / fd).st_rdev == os.stat(node).st_rdev for fd in os.listdir(fd_dir))


def test_burn_is_denied_by_file_permissions(gpus: NvmlBackend, config: Path, sandbox: Path, user: TestUser) -> None:
    node = sandbox / "dev" / "nvidia1"
    os.chmod(node, 0o600)  # root:root, like a GPU nobody was granted
    result = run_as(user, gpuguard(config, "sim", "burn", "--gpu", "1", "--mem", "1GiB", "--seconds", "30"))
    assert result.returncode == 1
    assert result.stderr == f"CUDA error: no CUDA-capable device is detected (cannot open {node}: Permission denied)\n"
    assert result.stdout == ""
    assert gpus.processes() == [] and records(sandbox) == []


def test_allowed_burn_is_visible_until_it_is_terminated(gpus: NvmlBackend, config: Path, sandbox: Path,
                                                        user: TestUser) -> None:
    os.chmod(sandbox / "dev" / "nvidia1", 0o600)  # other GPUs' modes do not matter
    proc = start_burn(config, gpu=2, mem="4GiB", util=40, user=user)
    try:
        assert gpus.processes() == [GpuProcess(proc.pid, 2, 4 * GiB)]
        assert {gpu.unit: (gpu.memory_used, gpu.utilization) for gpu in gpus.gpus()}[2] == (4 * GiB, 40)
        assert holds_node(proc.pid, sandbox / "dev" / "nvidia2")
        [record] = records(sandbox)
        assert os.stat(sandbox / "dev" / REGISTRY_DIR / record).st_uid == user.uid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == -signal.SIGTERM  # dies of the signal, like a CUDA program
    finally:
        stop_burn(proc)
    assert gpus.processes() == []
    assert records(sandbox) == []  # it deregistered itself


def test_burn_prints_its_pid_gpu_and_memory(gpus: NvmlBackend, config: Path, user: TestUser) -> None:
    result = run_as(user, gpuguard(config, "sim", "burn", "--gpu", "3", "--mem", "512MiB", "--seconds", "0"))
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"burn: pid \d+ on GPU 3 using 512MiB\n", result.stdout)


def test_unknown_memory_is_reported_as_unknown(gpus: NvmlBackend, config: Path, user: TestUser) -> None:
    with burn(config, gpu=0, mem="unknown", user=user) as proc:
        assert gpus.processes() == [GpuProcess(proc.pid, 0, None)]
        assert {gpu.unit: gpu.memory_used for gpu in gpus.gpus()}[0] == 0  # unknown is not counted


def test_ignore_term_needs_sigkill_and_the_dead_burn_disappears(gpus: NvmlBackend, config: Path, sandbox: Path,
                                                                 user: TestUser) -> None:
    with burn(config, gpu=1, mem="2GiB", user=user, ignore_term=True) as proc:
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1)
        assert gpus.processes() == [GpuProcess(proc.pid, 1, 2 * GiB)]
        proc.kill()
        assert proc.wait(timeout=15) == -signal.SIGKILL
        assert len(records(sandbox)) == 1  # SIGKILL leaves its record behind...
        assert gpus.processes() == []      # ...which readers see is stale
    assert records(sandbox) == []


def test_burn_with_seconds_ends_by_itself(gpus: NvmlBackend, config: Path, sandbox: Path, user: TestUser) -> None:
    started = time.monotonic()
    proc = start_burn(config, gpu=0, mem="1GiB", user=user, seconds=1)
    assert gpus.processes() == [GpuProcess(proc.pid, 0, GiB)]
    assert proc.wait(timeout=15) == 0
    assert time.monotonic() - started >= 1
    stop_burn(proc)
    assert gpus.processes() == [] and records(sandbox) == []


def test_burn_on_a_missing_gpu_fails_like_cuda(gpus: NvmlBackend, config: Path, sandbox: Path) -> None:
    result = subprocess.run(gpuguard(config, "sim", "burn", "--gpu", "7", "--mem", "1GiB"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr == (f"CUDA error: no CUDA-capable device is detected "
                             f"(cannot open {sandbox / 'dev' / 'nvidia7'}: No such file or directory)\n")


@pytest.mark.parametrize("args, error", [
    (["--mem", "lots"], "not a size: 'lots'"),
    (["--mem", "unlimited"], "cannot use unlimited memory"),
    (["--mem", "1GiB", "--util", "150"], "expected a percentage from 0 to 100"),
    (["--mem", "1GiB", "--seconds", "-1"], "not a duration"),
])
def test_bad_burn_arguments_exit_2(config: Path, args: list[str], error: str) -> None:
    result = subprocess.run(gpuguard(config, "sim", "burn", "--gpu", "0", *args),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert error in result.stderr


def test_burn_needs_the_simulated_backend(sandbox: Path) -> None:
    config = sandbox / "nvml.toml"
    config.write_text('[gpu]\nbackend = "nvml"\n')
    result = subprocess.run(gpuguard(config, "sim", "burn", "--gpu", "0", "--mem", "1GiB"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == 'gpuguard: sim burn needs simulated GPUs (gpu.backend = "simulated")\n'
