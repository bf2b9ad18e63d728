#!/bin/sh
# vendor-nvml.sh: debian/vendor/nvidia-ml-py/pynvml.py from the nvidia-ml-py wheel pinned in
# requirements.lock (checked against its hashes there). Debian does not package nvidia-ml-py, so
# its one module is part of the source package, which then builds offline; run this after
# `make lock` moves the pin, and commit the result (its licence is in the file's header and in
# debian/copyright).
set -eu
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sed -n '/^nvidia-ml-py==/,/^ *#/p' "$repo/requirements.lock" | grep -v '^ *#' > "$work/nvml.txt"
/usr/bin/python3 -m venv "$work/pip"
"$work/pip/bin/python" -m pip download --quiet --no-cache-dir --disable-pip-version-check --no-deps --require-hashes \
    --only-binary :all: -r "$work/nvml.txt" -d "$work"
wheel=$(ls "$work"/nvidia_ml_py-*.whl)
(cd "$work" && python3 -m zipfile -e "$wheel" unpacked)
install -D -m 0644 "$work/unpacked/pynvml.py" "$repo/debian/vendor/nvidia-ml-py/pynvml.py"
echo "debian/vendor/nvidia-ml-py/pynvml.py: from $(basename "$wheel")"
