"""The kernelspec `gpuguard jupyter install-kernel` writes: the wrapper in front of the source
kernel's argv, whose leading "python" (which jupyter_client would replace by its own interpreter,
but not behind the wrapper) is the Jupyter's Python, and the source's other fields kept."""
from __future__ import annotations

import pytest

from gpuguard.cli.jupyter_cmd import kernelspec

WRAPPER = ["/opt/gpuguard/bin/python", "-m", "gpuguard", "jupyter", "kernel", "--"]
SOURCE = {"argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"], "display_name": "Python 3",
          "language": "python", "env": {}, "metadata": {"debugger": True}, "interrupt_mode": "signal"}


@pytest.mark.parametrize("first", ["python", "python3", "python3.11"])
def test_a_leading_python_becomes_the_jupyters_interpreter(first):
    spec = kernelspec({**SOURCE, "argv": [first, *SOURCE["argv"][1:]]}, "/srv/env/bin/python", [3, 11], WRAPPER, None)
    assert spec["argv"] == [*WRAPPER, "/srv/env/bin/python", "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    assert spec == {"argv": spec["argv"], "display_name": "Python 3 with your GPUs", "language": "python",
                    "metadata": {"debugger": True}, "interrupt_mode": "signal"}  # the empty env left out


def test_any_other_kernel_command_is_kept_as_it_is():
    source = {**SOURCE, "argv": ["/usr/bin/R", "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"]}
    spec = kernelspec(source, "/usr/bin/python3", [3, 11], WRAPPER, "R on GPUs")
    assert spec["argv"] == [*WRAPPER, *source["argv"]] and spec["display_name"] == "R on GPUs"
    python2 = kernelspec({**SOURCE, "argv": ["python2", "-m", "ipykernel"]}, "/usr/bin/python3", [3, 11], WRAPPER, None)
    assert python2["argv"][len(WRAPPER)] == "python2"
