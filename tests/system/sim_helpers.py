"""Helpers for tests on simulated GPUs: a config file, the CLI, the backend, `gpuguard sim burn` processes.

    config = write_config(sandbox, count=4)
    result = cli(config, "whoami", "--json", user=alice)   # CompletedProcess (text, 60 s limit)
    with open_backend(config) as gpus:           # creates sandbox/dev/nvidia0..3
        with burn(config, gpu=2, mem="4GiB", user=alice) as proc:
            assert GpuProcess(proc.pid, 2, 4 << 30) in gpus.processes()
"""
from __future__ import annotations

import json
import select
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pynvml
import pytest
from conftest import PYTHON, TestUser, popen_as, run_as

from devtools.harness import no_gate_attached
from gpuguard import config as gpuguard_config
from gpuguard.backends import open_gpu_backend
from gpuguard.backends.nvml import NvmlBackend
from gpuguard.backends.sim_registry import FAIL_FILE, REGISTRY_DIR
from gpuguard.backends.simulated import SimulatedBackend
from gpuguard.config import SimulatedConfig

GiB = 1 << 30


def write_config(directory: Path, count: int = 4, memory: str = "80GiB", extra: str = "") -> Path:
    """`directory/gpuguard.toml` for simulated GPUs, with device nodes (`directory/dev`), state
    and socket inside `directory`. `extra` is appended: more [gpu.simulated] keys, then tables."""
    path = directory / "gpuguard.toml"
    path.write_text(
        f'[paths]\ndevice_dir = "{directory / "dev"}"\nstate_dir = "{directory / "state"}"\n'
        f'socket = "{directory / "run" / "gpuguard.sock"}"\n\n'
        f'[gpu]\nbackend = "simulated"\n\n[gpu.simulated]\ncount = {count}\nmemory = "{memory}"\n{extra}')
    path.chmod(0o644)  # test users read it too
    return path


def gpuguard(config: Path | None, *args: str) -> list[str]:
    """argv running the gpuguard CLI from this checkout with this config (None: no --config)."""
    return [PYTHON, "-m", "gpuguard", *(["--config", str(config)] if config is not None else []), *args]


def cli(config: Path | None, *args: str, user: TestUser | None = None, **kwargs) -> subprocess.CompletedProcess:
    """Run `gpuguard [--config config] args` as root, or as `user`; output as text, 60 s at most.
    kwargs go to subprocess.run (env=..., input=...)."""
    if user is not None:
        return run_as(user, gpuguard(config, *args), **kwargs)
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", 60)
    return subprocess.run(gpuguard(config, *args), cwd="/", **kwargs)


def run_with_proc_devices(devices: str, code: str, directory: Path) -> Any:
    """Run Python `code` (as root) where /proc/devices reads `devices`, as it would with other
    drivers loaded: a private mount namespace with a file from `directory` bind-mounted over it,
    gone with the process. Returns what the code prints, decoded as JSON."""
    fake = directory / "proc-devices"
    fake.write_text(devices)
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount --bind "$1" /proc/devices && exec "$2" -c "$3"', "sh", str(fake), PYTHON, code],
        capture_output=True, text=True, cwd="/", timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def open_backend(config: Path) -> NvmlBackend:
    """The simulated backend of this config (creates its device nodes); close it, or use `with`."""
    return open_gpu_backend(gpuguard_config.load(config))


def start_burn(config: Path, gpu: int | None, mem: str = "1GiB", *, user: TestUser | None = None,
               util: int | None = None, seconds: float | None = None, ignore_term: bool = False,
               mig: str | None = None, timeout: float = 15) -> subprocess.Popen:
    """Start `gpuguard sim burn` (as `user`, or root) on GPU `gpu` or on the MIG slice whose UUID
    is `mig` (gpu None), and return once it is registered; raises AssertionError with its stderr
    if it fails to start. Stop it with stop_burn."""
    where = ["--slice", mig] if mig is not None else ["--gpu", str(gpu)]
    argv = gpuguard(config, "sim", "burn", *where, "--mem", mem)
    if util is not None:
        argv += ["--util", str(util)]
    if seconds is not None:
        argv += ["--seconds", str(seconds)]
    if ignore_term:
        argv.append("--ignore-term")
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    proc = popen_as(user, argv, **pipes) if user else subprocess.Popen(argv, cwd="/", **pipes)
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith(f"burn: pid {proc.pid} "):
        proc.kill()
        _, errors = proc.communicate(timeout=timeout)
        raise AssertionError(f"burn did not start: {line!r} {errors.strip()!r}")
    return proc


def stop_burn(proc: subprocess.Popen, timeout: float = 15) -> int:
    """SIGKILL the burn if it still runs, reap it and close its pipes; its exit status."""
    if proc.poll() is None:
        proc.kill()
    status = proc.wait(timeout)
    proc.stdout.close()
    proc.stderr.close()
    return status


@contextmanager
def burn(config: Path, gpu: int | None, mem: str = "1GiB", **options) -> Iterator[subprocess.Popen]:
    """A running burn for the duration of the block (options as for start_burn)."""
    proc = start_burn(config, gpu, mem, **options)
    try:
        yield proc
    finally:
        stop_burn(proc)


@pytest.fixture
def device_dir(sandbox: Path) -> Path:
    return sandbox / "dev"


@pytest.fixture
def backend(device_dir: Path) -> Iterator[SimulatedBackend]:
    """Four simulated 16 GiB GPUs, their nodes in device_dir."""
    with SimulatedBackend(SimulatedConfig(count=4, memory=16 * GiB), device_dir) as opened:
        yield opened


def set_fault(device_dir: Path, text: str | None) -> None:
    """Make the simulated NVML fail ("NVML_ERROR_GPU_IS_LOST", or "... 2" for GPU 2 alone) until
    called again with None (see gpuguard/backends/sim_registry.py)."""
    path = device_dir / REGISTRY_DIR / FAIL_FILE
    if text is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(text + "\n")


@pytest.fixture
def burns():
    """Burns started in a test are reaped (and killed if need be) at its end."""
    started: list[subprocess.Popen] = []

    def start(*args, **kwargs) -> subprocess.Popen:
        proc = start_burn(*args, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        stop_burn(proc)


@pytest.fixture
def without_gates() -> Iterator[None]:
    """No gate attached while the test runs (one left attached would refuse its users' burns)."""
    with no_gate_attached():
        yield


@pytest.fixture
def swap_library() -> Iterator:
    """Replace pynvml's library (the fake, wrapped) for the test, then put it back."""
    original = pynvml.nvmlLib

    def swap(library: object) -> None:
        pynvml.nvmlLib = library
        pynvml._nvmlGetFunctionPointer_cache.clear()

    yield swap
    swap(original)
