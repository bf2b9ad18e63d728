"""`gpuguard sim burn`: a stand-in for a CUDA program on simulated GPUs.

It does what matters to gpuguard about a CUDA program: it opens its GPU's device node first
(so file modes, ACLs and the BPF gate decide, exactly as they do for CUDA), keeps the node
open while it runs (so revocation finds it in /proc/*/fd), and is listed by NVML with its
memory and utilization until it exits, however it exits.
"""
from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import time
from pathlib import Path

from gpuguard.cli import CommandError, load_config
from gpuguard.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from gpuguard.units import UnitError, format_size, parse_duration, parse_size


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sim", help="programs for simulated GPUs (gpu.backend = \"simulated\")")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    burn = actions.add_parser("burn", help="act like a CUDA program using a GPU")
    burn.add_argument("--gpu", type=int, required=True, metavar="MINOR",
                      help="the GPU's minor number (the N of nvidiaN)")
    burn.add_argument("--mem", type=_memory, required=True, metavar="SIZE",
                      help="GPU memory in use, e.g. 4GiB, or `unknown` (NVML cannot tell)")
    burn.add_argument("--util", type=_percent, default=100, metavar="PCT",
                      help="GPU utilization in percent (default 100)")
    burn.add_argument("--seconds", type=_duration, metavar="N",
                      help="exit after N seconds, or a duration like 2m (default: run until killed)")
    burn.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM: only SIGKILL ends it")
    burn.set_defaults(func=run_burn)


def _memory(text: str) -> int | None:
    if text == "unknown":
        return None
    try:
        size = parse_size(text)
    except UnitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size is None:
        raise argparse.ArgumentTypeError("a program cannot use unlimited memory (write a size or unknown)")
    return size


def _duration(text: str) -> float | None:
    try:
        return parse_duration(text)
    except UnitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _percent(text: str) -> int:
    if not text.isdigit() or int(text) > 100:
        raise argparse.ArgumentTypeError(f"expected a percentage from 0 to 100, got {text!r}")
    return int(text)


class _Terminated(BaseException):
    """SIGTERM arrived (a BaseException so that nothing on the way swallows it)."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def run_burn(args: argparse.Namespace) -> int:
    config = load_config(args)
    if config.gpu.backend != "simulated":
        raise CommandError('sim burn needs simulated GPUs (gpu.backend = "simulated")', EXIT_USAGE)
    device_dir = config.paths.device_dir
    node = device_dir / f"nvidia{args.gpu}"
    try:
        os.close(os.open(node, os.O_RDWR | os.O_CLOEXEC))  # a real driver would answer here
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # ENXIO: the kernel let us through to the absent driver
            print(f"CUDA error: no CUDA-capable device is detected (cannot open {node}: {exc.strerror})",
                  file=sys.stderr)
            return EXIT_FAILED
    # Hold the node as CUDA holds its fd, for the /proc/*/fd scan that revocation relies on.
    # O_PATH skips the driver's open, which cannot succeed without a driver.
    os.open(node, os.O_PATH | os.O_CLOEXEC)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_term else _on_sigterm)
    try:
        _burn(args, device_dir)
    except _Terminated:
        # Die of SIGTERM like a CUDA program, so a parent sees the signal and not an exit code.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    return EXIT_OK


def _burn(args: argparse.Namespace, device_dir: Path) -> None:
    from gpuguard.backends.simulated import register_process  # imports pynvml: only when needed

    try:
        record = register_process(device_dir, os.getpid(), args.gpu, args.mem, args.util)
    except FileNotFoundError:
        raise CommandError(f"no simulated GPUs in {device_dir} (run `gpuguard gpus` as root once)") from None
    try:
        using = "unknown memory" if args.mem is None else format_size(args.mem)
        print(f"burn: pid {os.getpid()} on GPU {args.gpu} using {using}", flush=True)
        if args.seconds is None:
            while True:
                signal.pause()
        time.sleep(args.seconds)
    finally:
        record.unlink(missing_ok=True)  # after SIGKILL readers drop the record by start time
