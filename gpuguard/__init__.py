"""gpuguard: fair, kernel-enforced GPU sharing for multi-user Linux servers."""

__version__ = "0.1.1"
