"""Running a user's command as a child that gets the signals meant for it (`gpuguard run`).

The child stays in the caller's process group, so a terminal's job control (^C, ^Z, reading
the terminal) works on it as on any command. A signal the terminal sends (si_code SI_KERNEL)
reaches the whole foreground group, the child included, and is not sent again: a program that
cleans up on SIGINT sees one ^C, not two. A signal sent to `gpuguard run` itself (kill, a batch
system, the shell's SIGHUP at logout) is passed on to the child. Until the child has ended and
the caller has done what it does after it (give its GPUs back), those signals are blocked here
and taken with sigwaitinfo, so none interrupts that step half-way.
"""
from __future__ import annotations

import os
import signal

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

FORWARDED = frozenset({signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1,
                       signal.SIGUSR2, signal.SIGALRM})
SI_KERNEL = 0x80  # Linux's si_code for a signal the kernel raised (a terminal's ^C, ^\)
# Python ignores these for itself; a program it starts gets them back at their defaults (as subprocess does).
RESTORED = (signal.SIGPIPE, signal.SIGXFSZ)
EXIT_NOT_FOUND, EXIT_NOT_EXECUTABLE = 127, 126  # what a shell says for each


class Blocked:
    """The forwarded signals (and SIGCHLD) blocked for the block's duration; whatever of them is
    still pending at its end is taken and dropped, so none fires once they are unblocked."""

    def __enter__(self) -> Blocked:
        self.waited = FORWARDED | {signal.SIGCHLD}
        self._before = signal.pthread_sigmask(signal.SIG_BLOCK, self.waited)
        return self

    def __exit__(self, *exc: object) -> None:
        while signal.sigtimedwait(self.waited, 0) is not None:
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, self._before)

    def run(self, argv: Sequence[str], env: Mapping[str, str], forward: bool = True) -> int:
        """Start argv (found on PATH) and wait for it, passing signals on (see the module's
        docstring): its exit code, 128 + N for a child ended by signal N (as a shell says it).
        forward=False passes none on: for a caller whose signals all come to its process group
        (Jupyter signals a kernel's), which the child shares, so that it gets each one once.
        Raises FileNotFoundError or PermissionError when it cannot be started."""
        import shutil
        # found as a shell finds it: a directory of PATH this user may not search is passed over
        # (execvp would say EACCES for it), not taken for a command that will not run
        path = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=env.get("PATH", os.defpath))
        if path is None:
            raise FileNotFoundError(argv[0])
        pid = os.posix_spawn(path, list(argv), dict(env), setsigmask=self._before, setsigdef=RESTORED)
        while True:
            info = signal.sigwaitinfo(self.waited)
            if info.si_signo == signal.SIGCHLD:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    exit_code = os.waitstatus_to_exitcode(status)
                    return 128 - exit_code if exit_code < 0 else exit_code
            elif forward and info.si_code != SI_KERNEL:
                try:
                    os.kill(pid, info.si_signo)
                except ProcessLookupError:
                    pass  # it is ending: its SIGCHLD comes next
