"""The one error hierarchy, and the exit codes the command line uses for it.

Every error gpuguard raises on purpose is a GpuguardError: a one-line message and the exit
code a command ends with when it reaches the top (cli.main catches this class alone).
Each subclass names where it comes from and its usual code; a raise may give another.
"""
from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
# LSB's "program is not configured": the daemon will not start until the admin decides something
# (etc/gpuguard.service names it in RestartPreventExitStatus=, so systemd does not retry it)
EXIT_NOT_CONFIGURED = 6


class GpuguardError(Exception):
    code = EXIT_FAILED

    def __init__(self, message: str = "", code: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code

    def line(self) -> str:
        """The first line only: a BPF verifier log or a traceback-like detail goes to the log."""
        return (str(self).splitlines() or [""])[0]


class Refusal(GpuguardError):
    """A request to the daemon that cannot be done, with the CLI exit code the caller should use:
    the operations and the services they call raise it, and the reply says it in one line."""


class UsageError(GpuguardError, ValueError):
    """Bad input: a malformed value, file, argument or request (exit 2)."""

    code = EXIT_USAGE


class UnknownUser(GpuguardError, LookupError):
    """No such account (or NSS could not say in time)."""


class NssFailure(UnknownUser):
    """NSS failed to answer (out of descriptors or memory, a directory server down): not the
    same as "no such user", and said as such; callers still give no GPUs on it."""


class LookupTimeout(UnknownUser):
    """NSS did not answer in time: treated like an unknown user (no GPUs), never like a member."""
