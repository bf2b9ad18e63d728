#!/bin/sh
# build-docs.sh PYTHON OUTDIR: gpuguard.1 (the man page) and gpuguard.bash (the bash completion)
# in OUTDIR (`make man`, `make install`, `make deb`), both generated from the argparse definitions
# of the sources next to this script: the help text has one copy.
#
# They run in a throwaway venv built with PYTHON from requirements.lock and the build tools'
# packaging/{build,docs}-requirements.lock (argparse-manpage), every file checked against its pinned hash,
# like the application's venv (build-venv.sh): nothing is resolved at build time, and no build
# tool ends up in the application.
set -eu
python=$1 out=$2
repo=$(cd "$(dirname "$0")/.." && pwd)
pip_install="-m pip install --quiet --no-compile --require-hashes --no-deps"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
"$work/venv/bin/python" $pip_install --only-binary :all: -r "$repo/requirements.lock" \
    -r "$repo/packaging/build-requirements.lock"
# argparse-manpage is published as source only: built here with the setuptools just installed.
"$work/venv/bin/python" $pip_install --no-build-isolation -r "$repo/packaging/docs-requirements.lock"

mkdir -p "$out"
# gpuguard itself from the sources (pure Python), writing no bytecode next to them.
export PYTHONPATH="$repo" PYTHONDONTWRITEBYTECODE=1 PATH="$work/venv/bin:$PATH"
version=$(python -c 'import gpuguard; print(gpuguard.__version__)')
argparse-manpage --module gpuguard.cli --function build_parser --prog gpuguard \
    --project-name gpuguard --version "$version" \
    --description "fair, kernel-enforced GPU sharing" --manual-title "gpuguard manual" --output "$out/gpuguard.1"
python -m gpuguard completion bash > "$out/gpuguard.bash"
