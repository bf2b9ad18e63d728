"""`gpuguard jupyter`: notebook kernels that start with the user's GPUs (issue 38, 3).

`install-kernel` writes a kernelspec whose argv puts `gpuguard jupyter kernel [OPTIONS] --` in
front of an existing kernel's argv (python3's by default, any kernel's with --from). It asks the
Python that runs the user's Jupyter (--python) for that kernel and to install the new one, since
only it knows where its kernelspecs live and which interpreter a kernel's "python" means.

`kernel` is what Jupyter then runs: it finds the user's GPUs in the held-devices file (no daemon
round trip), asks the daemon for them when the file names too few (waiting in the queue, its
words on stderr, which Jupyter writes to the server's log), sets CUDA_VISIBLE_DEVICES and execs
the kernel, which so keeps its pid, its signals and its lifetime. With --release-on-exit and GPUs
taken, it stays as the kernel's parent instead and gives them back when the kernel ends, as
`gpuguard run` does. When the daemon is down or refuses, the kernel starts all the same (with
the GPUs the file names, or none) and the log says why: a kernel that died at start would only be
started again by Jupyter, over and over.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from gpuguard.cli import CommandError, gpu_count, summary
from gpuguard.cli.calls import held_devices, held_path
from gpuguard.cli.child import EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, RESTORED
from gpuguard.cli.run_cmd import DEFAULT_GPUS, run_then_give_back, take_into
from gpuguard.client import DaemonUnreachable
from gpuguard.core.errors import EXIT_USAGE, GpuguardError

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from typing import Any

DEFAULT_SOURCE = "python3"
NAME = re.compile(r"^[a-z0-9._-]+$", re.IGNORECASE)  # what jupyter_client accepts as a kernel name
WHAT = "jupyter kernel"  # how the wrapper names itself on stderr

# Run by the Jupyter's Python: `find NAME` prints the kernel's spec, its directory and that
# Python's own executable and version; `install DIR NAME WHERE [PREFIX]` installs DIR as NAME
# and prints where it went. A failure is one line on stderr, exit 3 for a kernel not found.
# `-c` puts the working directory first on sys.path (unless -P or PYTHONSAFEPATH, 3.11+): in /tmp or
# a shared project, another user's json.py would run as whoever installs. sys is built in.
HELPER = """
import sys
if sys.path[:1] == [""]:
    del sys.path[0]
import json
try:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
except ImportError as exc:
    sys.exit(f"{sys.executable} cannot import jupyter_client ({exc}): give --python the Python that runs your Jupyter")
manager = KernelSpecManager()
if sys.argv[1] == "find":
    try:
        spec = manager.get_kernel_spec(sys.argv[2])
    except NoSuchKernel:
        print(f"no kernel named {sys.argv[2]!r} (jupyter kernelspec list shows the kernels)", file=sys.stderr)
        sys.exit(3)
    print(json.dumps({"spec": spec.to_dict(), "resource_dir": spec.resource_dir, "executable": sys.executable,
                      "version": list(sys.version_info[:2])}))
else:
    source, name, where = sys.argv[2:5]
    prefix = {"user": None, "sys-prefix": sys.prefix, "prefix": sys.argv[5:6] and sys.argv[5]}[where]
    print(manager.install_kernel_spec(source, name, user=where == "user", prefix=prefix))
"""
EXIT_NO_SUCH_KERNEL = 3  # HELPER's


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    import argparse
    jupyter = subparsers.add_parser("jupyter", help=summary("jupyter"),
                                    description="Jupyter kernels that start with CUDA_VISIBLE_DEVICES set to your "
                                                "GPUs, taking one when you hold none.")
    commands = jupyter.add_subparsers(dest="jupyter_command", metavar="COMMAND", required=True)

    install = commands.add_parser(
        "install-kernel", help="add a kernel that starts with your GPUs (gpuguard jupyter kernel in front)",
        description="Install a kernelspec that runs an existing kernel (--from, default python3) through gpuguard "
                    "jupyter kernel: the kernel starts with your GPUs, or waits in the queue for one when you hold "
                    "none. It is installed by the Python that runs your Jupyter (--python). Examples: gpuguard "
                    "jupyter install-kernel; gpuguard jupyter install-kernel --sys-prefix --release-on-exit")
    where = install.add_mutually_exclusive_group()
    where.add_argument("--user", dest="where", action="store_const", const="user",
                       help="for you alone, in ~/.local/share/jupyter (the default)")
    where.add_argument("--sys-prefix", dest="where", action="store_const", const="sys-prefix",
                       help="in the environment of --python (a venv or conda env)")
    where.add_argument("--prefix", metavar="PATH", help="under PATH/share/jupyter")
    install.add_argument("--name", type=kernel_name, metavar="NAME",
                         help="the new kernel's name (default: the --from kernel's, then -gpuguard)")
    install.add_argument("--display-name", metavar="TEXT", help="its name in the launcher and kernel menu")
    install.add_argument("--from", dest="source", type=kernel_name, default=DEFAULT_SOURCE, metavar="KERNEL",
                         help=f"the kernel to run (default: {DEFAULT_SOURCE}; jupyter kernelspec list shows them)")
    install.add_argument("--python", default="python3", metavar="PATH",
                         help="the Python that runs your Jupyter (default: python3 on your PATH)")
    _kernel_options(install)
    install.set_defaults(func=install_kernel)

    kernel = commands.add_parser(
        "kernel", help="what the installed kernelspec runs: the kernel, with your GPUs",
        description="Run a kernel's command with CUDA_VISIBLE_DEVICES set to your GPUs: from the file gpuguard "
                    "keeps for you, or taken from the daemon (waiting in the queue) when you hold too few. Jupyter "
                    "runs it (install-kernel writes it into kernel.json). Example: gpuguard jupyter kernel -- "
                    "python3 -m ipykernel_launcher -f /tmp/kernel.json")
    _kernel_options(kernel)
    kernel.add_argument("command", nargs=argparse.REMAINDER, metavar="-- KERNEL [ARGS]", help="the kernel's command")
    kernel.set_defaults(func=run_kernel)


def _kernel_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=gpu_count, metavar="N",
                        help=f"how many GPUs in all, the ones you hold included (default: {DEFAULT_GPUS})")
    parser.add_argument("--release-on-exit", action="store_true",
                        help="give back the GPUs taken for the kernel when it ends (the ones you held stay yours)")


def kernel_name(text: str) -> str:
    """argparse type of a kernel's name: letters, digits, '.', '_' and '-', as Jupyter allows."""
    import argparse
    if not NAME.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a kernel name: use letters, digits, '.', '_' and '-'")
    return text


# --- install-kernel


def install_kernel(args: argparse.Namespace) -> int:
    import shutil
    import tempfile
    from pathlib import Path

    found = json.loads(_helper(args.python, "find", args.source))
    spec = kernelspec(found["spec"], found["executable"], found["version"], wrapper_argv(args),
                      args.display_name)
    with tempfile.TemporaryDirectory(prefix="gpuguard-kernel.") as directory:
        (Path(directory) / "kernel.json").write_text(json.dumps(spec, indent=1) + "\n")
        for logo in Path(found["resource_dir"]).glob("logo-*"):
            shutil.copy(logo, directory)  # the launcher shows the kernel's own icon
        where = "prefix" if args.prefix is not None else args.where or "user"
        installed = _helper(args.python, "install", directory, args.name or f"{args.source}-gpuguard", where,
                            *([str(Path(args.prefix).absolute())] if args.prefix is not None else []))
    print(f"installed kernel {spec['display_name']!r} in {installed.strip()}")
    return 0


def _helper(python: str, *argv: str) -> str:
    """HELPER's stdout, run by the Jupyter's Python; its one-line failure as a CommandError."""
    try:
        done = subprocess.run([python, "-c", HELPER, *argv], capture_output=True, text=True)
    except OSError as exc:
        raise CommandError(f"install-kernel: --python {python}: {exc.strerror}", EXIT_USAGE) from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise CommandError(f"install-kernel: {why}", EXIT_USAGE if done.returncode == EXIT_NO_SUCH_KERNEL else 1)
    return done.stdout


def wrapper_argv(args: argparse.Namespace) -> list[str]:
    """The argv of `gpuguard jupyter kernel` with install-kernel's options, up to its `--`: this
    gpuguard's own Python (users run it), with the config it was given."""
    from pathlib import Path
    return [sys.executable, "-m", "gpuguard", *(["--config", str(Path(args.config).absolute())] if args.config else []),
            "jupyter", "kernel", *(["--gpus", str(args.gpus)] if args.gpus else []),
            *(["--release-on-exit"] if args.release_on_exit else []), "--"]


def kernelspec(source: dict[str, Any], executable: str, version: list[int], wrapper: list[str],
               display_name: str | None) -> dict[str, Any]:
    """kernel.json of the kernel `source` (a kernelspec's dict) run through `wrapper`. jupyter_client
    replaces a kernel argv's leading "python" by its own interpreter; behind the wrapper it would not,
    so that is done here with the Jupyter's (`executable`, of Python `version`)."""
    argv = list(source["argv"])
    if argv and argv[0] in {"python", f"python{version[0]}", f"python{version[0]}.{version[1]}"}:
        argv[0] = executable
    spec = {key: value for key, value in source.items() if value and key != "argv"}
    return {"argv": [*wrapper, *argv], **spec,
            "display_name": display_name or f"{source['display_name']} with your GPUs"}


# --- kernel


def run_kernel(args: argparse.Namespace) -> int:
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not argv:
        raise CommandError(f"{WHAT}: name the kernel's command, e.g. gpuguard jupyter kernel -- python3 -m "
                           "ipykernel_launcher -f FILE", EXIT_USAGE)
    env = dict(os.environ)
    granted = gpus_into(args, env, args.gpus)
    if granted and args.release_on_exit:
        # Jupyter signals the kernel's process group, which the kernel shares with this parent: none passed on
        return run_then_give_back(args, argv, env, granted, WHAT, forward=False)
    return _exec(argv, env)


def gpus_into(args: argparse.Namespace, env: dict[str, str], wanted: int | None) -> list[int]:
    """Set env's CUDA_VISIBLE_DEVICES to the user's GPUs (the file's when it names `wanted`, or
    any when wanted is None, the daemon's after taking them otherwise: `wanted`, or the quota's
    fraction_memory, else DEFAULT_GPUS); what was taken. A failure is said on stderr,
    and the kernel gets the GPUs the file names (none: an empty CUDA_VISIBLE_DEVICES, which CUDA
    reads as no GPU, rather than a stale value inherited from the shell that started Jupyter)."""
    held = held_devices(args)
    if held is not None and len(held) >= (wanted or DEFAULT_GPUS):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(held)
        return []
    try:
        return take_into(args, env, wanted, wait=True, timeout=None, give_back=args.release_on_exit)
    except DaemonUnreachable as exc:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(held or [])
        _say(f"the gpuguard service is down ({exc.line()}); " + (
            f"this kernel has the GPUs you hold, from {held_path(args)}" if held else
            "this kernel has no GPU (you hold none): restart it once the service is back"))
    except GpuguardError as exc:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(held or [])
        _say(f"{exc.line()}; this kernel starts with {'the GPUs you hold' if held else 'no GPU'} "
             "(restart it to ask again)")
    return []


def _say(line: str) -> None:
    print(f"gpuguard: {line}", file=sys.stderr, flush=True)


def _exec(argv: list[str], env: dict[str, str]) -> int:
    """Become the kernel (its exit code is then the process's); 127 or 126 when it cannot start."""
    import signal
    for signo in RESTORED:  # Python ignores these; an ignored signal stays ignored across exec
        signal.signal(signo, signal.SIG_DFL)
    try:
        os.execvpe(argv[0], argv, env)
    except FileNotFoundError:
        _say(f"{WHAT}: {argv[0]}: command not found")
        return EXIT_NOT_FOUND
    except PermissionError:
        _say(f"{WHAT}: {argv[0]}: permission denied")
        return EXIT_NOT_EXECUTABLE
