#!/bin/sh
# build-venv.sh PYTHON STAGED_DIR FINAL_DIR: the application's virtual environment, built at
# STAGED_DIR (a package's staging tree, or DESTDIR) to run from FINAL_DIR (/opt/gpuguard).
#
# Nothing is resolved at build time: the dependencies come from requirements.lock and the
# wheel-building tools from packaging/build-requirements.lock, every file checked against its
# pinned hash (--require-hashes, --no-deps). A venv is not relocatable: the scripts' #! lines
# name STAGED_DIR, so they are rewritten to FINAL_DIR, and the bytecode is compiled with
# FINAL_DIR as its source path.
set -eu
python=$1 staged=$2 final=$3
repo=$(cd "$(dirname "$0")/.." && pwd)
pip_install="-m pip install --quiet --no-compile --require-hashes --no-deps --only-binary :all:"

# Only ever replace a directory that is a venv (a reinstall), never whatever else APPDIR names.
if [ -e "$staged" ] && ! [ -f "$staged/pyvenv.cfg" ]; then
    echo "build-venv.sh: $staged exists and is not a virtual environment; not touching it" >&2
    exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# gpuguard's wheel, built from a copy (a setuptools build writes build/ and *.egg-info next to
# its sources) in a venv of its own, so the application's venv carries no build tools.
mkdir "$work/src"
cp -r "$repo/pyproject.toml" "$repo/README.md" "$repo/gpuguard" "$work/src/"
"$python" -m venv "$work/build"
"$work/build/bin/python" $pip_install -r "$repo/packaging/build-requirements.lock"
"$work/build/bin/python" -m pip wheel --quiet --no-deps --no-build-isolation -w "$work/dist" "$work/src"

rm -rf "$staged"
"$python" -m venv "$staged"
"$staged/bin/python" $pip_install -r "$repo/requirements.lock"
"$staged/bin/python" -m pip install --quiet --no-compile --no-deps --no-index "$work"/dist/gpuguard-*.whl
# The installer goes too: nothing is ever pip-installed into a packaged application.
"$staged/bin/python" -m pip uninstall --quiet --yes setuptools pip

if [ "$staged" != "$final" ]; then
    grep -rlF "$staged" "$staged/bin" "$staged/pyvenv.cfg" | while read -r file; do
        sed -i "s|$staged|$final|g" "$file"
    done
fi
# Byte-compiled here, as root, all of it again (-f) with FINAL_DIR as the source path: users'
# imports never try to write bytecode next to the sources.
"$staged/bin/python" -m compileall -q -f -s "$staged" -p "$final" "$staged/lib" >/dev/null
