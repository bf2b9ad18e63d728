#!/bin/sh
# build-deb.sh OUTDIR [VERSION]: gpuguard_<version>_<arch>.deb in OUTDIR (`make deb`), built by
# dpkg-buildpackage from debian/ (debhelper, dh-python) in a copy of this checkout, so that no
# build output lands in it and two builds never meet.
#
# The one thing a Debian build cannot do offline is fetch nvidia-ml-py, which Debian does not
# ship: its wheel is downloaded here, checked against the hash pinned in requirements.lock
# (--require-hashes), into debian/vendor/ of the copy, where debian/rules unpacks it.
# VERSION (e.g. for a test's upgrade) becomes a changelog entry of the copy; by default the
# version is debian/changelog's.
set -eu
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

/usr/bin/python3 -m venv "$work/pip"
sed -n '/^nvidia-ml-py==/,/^ *#/p' "$repo/requirements.lock" | grep -v '^ *#' > "$work/nvml.txt"
"$work/pip/bin/python" -m pip download --quiet --no-cache-dir --disable-pip-version-check --no-deps --require-hashes \
    --only-binary :all: -r "$work/nvml.txt" -d "$src/debian/vendor"

if [ -n "$version" ]; then
    { printf 'gpuguard (%s) unstable; urgency=medium\n\n  * Local build.\n\n -- %s  %s\n\n' \
        "$version" "$(dpkg-parsechangelog -l "$src/debian/changelog" -S Maintainer)" "$(date -R)"
      cat "$src/debian/changelog"; } > "$work/changelog"
    mv "$work/changelog" "$src/debian/changelog"
fi

# The distribution's own tools only: a python3 of pyenv or a venv first on PATH is not what the
# package will run on.
(cd "$src" && PATH=/usr/sbin:/usr/bin:/sbin:/bin dpkg-buildpackage -us -uc -b >"$work/build.log" 2>&1) || { tail -40 "$work/build.log" >&2; exit 1; }
deb=$(ls "$work"/gpuguard_*.deb)
mv "$deb" "$outdir/"
echo "$outdir/$(basename "$deb")"
