#!/bin/sh
# build-deb.sh PYTHON OUTDIR [VERSION]: gpuguard_<version>_<arch>.deb in OUTDIR (`make deb`).
#
# A plain dpkg-deb staging tree: the application's venv in /opt/gpuguard (built with PYTHON, the
# system python3, from the hash-locked requirements), vendor files in /usr/lib, the PAM module in
# the multiarch security directory, the man page and the bash completion in /usr/share, the
# configuration in /etc/gpuguard as conffiles, and the maintainer scripts of packaging/debian.
# VERSION defaults to gpuguard's own version, -1.
set -eu
python=$1 outdir=$2
repo=$(cd "$(dirname "$0")/.." && pwd)
app_version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$repo/gpuguard/__init__.py")
version=${3:-$app_version-1}
arch=$(dpkg --print-architecture)
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null)
# The venv runs this very interpreter: the package is for one Python minor version (one release
# of the distribution), like any package with compiled Python extensions.
pyversion=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
pynext=$("$python" -c 'import sys; print("%d.%d" % (sys.version_info[0], sys.version_info[1] + 1))')

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$work/root

"$repo/packaging/build-venv.sh" "$python" "$root/opt/gpuguard" /opt/gpuguard
install -d -m 0755 "$root/usr/bin"
ln -s /opt/gpuguard/bin/gpuguard "$root/usr/bin/gpuguard"

make -s -C "$repo/pam" pam_gpuguard.so
install -D -m 0644 "$repo/pam/pam_gpuguard.so" "$root/usr/lib/$multiarch/security/pam_gpuguard.so"
install -D -m 0644 "$repo/pam/gpuguard" "$root/usr/share/pam-configs/gpuguard"
install -D -m 0644 "$repo/etc/gpuguard.service" "$root/usr/lib/systemd/system/gpuguard.service"
install -D -m 0644 "$repo/etc/gpuguard-web.service" "$root/usr/lib/systemd/system/gpuguard-web.service"
install -D -m 0644 "$repo/etc/pam.d/gpuguard-web" "$root/etc/pam.d/gpuguard-web"
install -D -m 0644 "$repo/udev/70-gpuguard.rules" "$root/usr/lib/udev/rules.d/70-gpuguard.rules"
install -D -m 0644 "$repo/etc/modprobe.d/gpuguard.conf" "$root/usr/lib/modprobe.d/gpuguard.conf"
install -D -m 0644 "$repo/etc/gpuguard.toml" "$root/etc/gpuguard/gpuguard.toml"
install -D -m 0644 "$repo/etc/quotas.toml" "$root/etc/gpuguard/quotas.toml"
install -D -m 0644 "$repo/README.md" "$root/usr/share/doc/gpuguard/README.md"
install -D -m 0644 "$repo/pam/README" "$root/usr/share/doc/gpuguard/README.pam"
install -D -m 0644 "$repo/packaging/debian/copyright" "$root/usr/share/doc/gpuguard/copyright"
"$repo/packaging/build-docs.sh" "$python" "$work/docs"
install -D -m 0644 "$work/docs/gpuguard.1" "$root/usr/share/man/man1/gpuguard.1"
gzip -9n "$root/usr/share/man/man1/gpuguard.1"  # Debian policy: man pages compressed, reproducibly
install -D -m 0644 "$work/docs/gpuguard.bash" "$root/usr/share/bash-completion/completions/gpuguard"

install -d -m 0755 "$root/DEBIAN"
for script in postinst prerm postrm; do
    install -m 0755 "$repo/packaging/debian/$script" "$root/DEBIAN/$script"
done
(cd "$root" && find etc -type f | sed 's|^|/|' | sort) > "$root/DEBIAN/conffiles"
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
sed -e "s/@VERSION@/$version/" -e "s/@ARCH@/$arch/" -e "s/@SIZE@/$size/" \
    -e "s/@PYTHON@/$pyversion/" -e "s/@PYNEXT@/$pynext/" \
    "$repo/packaging/debian/control" > "$root/DEBIAN/control"

deb="$outdir/gpuguard_${version}_${arch}.deb"
dpkg-deb --root-owner-group --build "$root" "$deb" >/dev/null
echo "$deb"
