#!/bin/sh
# build-deb.sh [--source] OUTDIR [VERSION]: gpuguard_<version>_<arch>.deb in OUTDIR (`make deb`), built by
# dpkg-buildpackage from debian/ (debhelper, dh-python) in a copy of this checkout, so that no
# build output lands in it and two builds never meet. --source: the source package instead
# (`make deb-source`: gpuguard_<version>.dsc, its tarball, the _source.changes and .buildinfo), which
# builds anywhere with Debian's archive alone, offline: nvidia-ml-py's pynvml.py, which Debian does
# not ship, is in debian/vendor/ (packaging/vendor-nvml.sh). Prints the .deb's (or the .dsc's) path.
# VERSION (e.g. for a test's upgrade) becomes a changelog entry of the copy; by default the
# version is debian/changelog's.
set -eu
kind=-b
if [ "${1:-}" = --source ]; then
    kind=-S
    shift
fi
outdir=$(cd "$1" && pwd)
version=${2:-}
repo=$(cd "$(dirname "$0")/.." && pwd)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
src=$work/gpuguard
mkdir "$src"
# What the checkout tracks (and new files not yet committed), never its venvs or builds.
(cd "$repo" && git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null) \
    | tar -C "$src" -xf -

if [ -n "$version" ]; then
    { printf 'gpuguard (%s) unstable; urgency=medium\n\n  * Local build.\n\n -- %s  %s\n\n' \
        "$version" "$(dpkg-parsechangelog -l "$src/debian/changelog" -S Maintainer)" "$(date -R)"
      cat "$src/debian/changelog"; } > "$work/changelog"
    mv "$work/changelog" "$src/debian/changelog"
fi

# The distribution's own tools only: a python3 of pyenv or a venv first on PATH is not what the
# package will run on.
(cd "$src" && PATH=/usr/sbin:/usr/bin:/sbin:/bin dpkg-buildpackage -us -uc "$kind" >"$work/build.log" 2>&1) || { tail -40 "$work/build.log" >&2; exit 1; }
if [ "$kind" = -S ]; then
    for made in "$work"/gpuguard_*; do
        mv "$made" "$outdir/"
    done
    dsc=$(cd "$outdir" && ls gpuguard_*.dsc)
    echo "$outdir/$dsc"
else
    deb=$(ls "$work"/gpuguard_*.deb)
    mv "$deb" "$outdir/"
    echo "$outdir/$(basename "$deb")"
fi
