# gpuguard: the two quick-start targets are `make demo` and `make test`, as root; a server gets
# the Debian package (`make deb`) or, elsewhere, `make install`.
# Everything runs from a virtual environment built with the system Python, so that
# the non-root test users (and researchers, for `gpuguard whoami`) can execute it.

PYTHON    ?= /usr/bin/python3
VENV      ?= .venv
PY         = $(VENV)/bin/python
# The oldest Python gpuguard supports (Ubuntu 22.04's); `make test-py310` runs the pure tests with it.
PYTHON310 ?= $(HOME)/.pyenv/versions/3.10.13/bin/python3
VENV310   ?= .venv310

# Debian/Ubuntu packages, installed only when missing: what building needs (`make build-deps`),
# and what only the tests and the demo need (`make deps`). A server needs neither list.
# The Debian package's build (debian/control's Build-Depends) and its checker (lintian) are build tools too.
BUILD_PACKAGES = python3-venv gcc make libpam0g-dev dpkg-dev debhelper dh-python pybuild-plugin-pyproject \
	python3-all python3-setuptools python3-shtab python3-tomlkit lintian
# tests/system/test_deb.py installs the package with dpkg, which needs its Depends installed (debian/control),
# reads `modprobe -c` (kmod) and finds the man pages with man-db; the cluster tests run a private PostgreSQL.
TEST_PACKAGES  = pamtester acl openssh-server openssh-client util-linux passwd libpam-runtime systemd \
	python3-aiohttp python3-pampy python3-prometheus-client python3-psutil python3-pyroute2 python3-shtab python3-tomlkit \
	kmod man-db chromium chromium-driver uidmap \
	postgresql
TEST_PACKAGES += fish  # the fish completion script is loaded by fish itself in the tests
TEST_PACKAGES += zsh tmux  # tests/system/test_login_shells.py: the login snippets in zsh and a tmux pane
# tests/system/test_jupyter.py: a real kernel start, by Debian's Python (the venv does not see these)
TEST_PACKAGES += python3-jupyter-client python3-ipykernel
# tests/system/test_fleet_patroni.py: the fleet's PostgreSQL under Patroni, with etcd as its store
TEST_PACKAGES += patroni etcd-server

# `make install` (other distributions): the application's venv in APPDIR (the unit and the udev rule
# name $(APPDIR)/bin/gpuguard), the command in $(PREFIX)/bin, the unit where systemd reads it, the
# modprobe.d option and the udev rule inert in LIBDIR (`gpuguard enable` links them into /etc, as
# for the Debian package). Everything under $(DESTDIR) when it is set.
PREFIX     ?= /usr/local
APPDIR     ?= /opt/gpuguard
SYSCONFDIR ?= /etc
UNITDIR    ?= /usr/lib/systemd/system
LIBDIR     ?= /usr/lib/gpuguard
MANDIR     ?= $(PREFIX)/share/man
# bash-completion looks in $XDG_DATA_DIRS (/usr/local/share:/usr/share) too.
BASHCOMPDIR ?= $(PREFIX)/share/bash-completion/completions
DESTDIR    ?=

# The pure level (tests/unit): no root, users, PAM, gate or daemon; any user runs it in seconds.
UNIT_TESTS = tests/unit

.PHONY: all build-deps deps venv pam lint test test-unit test-py310 demo demo-mig bench gpu-smoke man deb deb-source lock install uninstall clean

all: venv pam

define apt_install
	@missing=$$(for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
endef

build-deps:
	$(call apt_install,$(BUILD_PACKAGES))

deps: build-deps
	$(call apt_install,$(TEST_PACKAGES))

$(PY): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Editable: a plain path in a .pth (pyproject.toml's package-dir says why).
	$(PY) -m pip install -q -e '.[test]'
	@touch $(PY)

venv: $(PY)

pam:
	$(MAKE) -C pam

# Both levels: tests/unit, then tests/system as root on the real kernel.
test: deps venv pam
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: venv
	$(PY) -m pytest -p no:cacheprovider $(UNIT_TESTS) $(PYTEST_ARGS)

# ruff (pyflakes, pycodestyle, import order, pyupgrade, bugbear) and mypy, as configured in pyproject.toml
# (gpuguard/ under every flag of --strict, the tests under the project's settings).
lint: venv
	@# pytest imports test modules by basename (tests/ has no packages): two of one name stop collection.
	@dups=$$(ls tests/unit tests/system | grep '^test_.*\.py$$' | sort | uniq -d); \
	  [ -z "$$dups" ] || { echo "test modules share a basename: $$dups" >&2; exit 1; }
	$(VENV)/bin/ruff check gpuguard devtools bench tests packaging
	$(VENV)/bin/mypy

# The locked dependencies (tomli included) and the pure tests on Python 3.10.
$(VENV310)/bin/python: pyproject.toml requirements.lock
	$(PYTHON310) -m venv $(VENV310)
	$(VENV310)/bin/python -m pip install -q --require-hashes --no-deps -r requirements.lock
	@# The test tools (the [test] extra); the locked dependencies already satisfy the rest.
	$(VENV310)/bin/python -m pip install -q -e '.[test]'
	@touch $@

test-py310: $(VENV310)/bin/python
	$(VENV310)/bin/python -m pytest -p no:cacheprovider $(UNIT_TESTS) $(PYTEST_ARGS)

demo: deps venv pam
	$(PY) -m devtools.demo

demo-mig: deps venv pam
	$(PY) -m devtools.demo_mig

bench: deps venv pam
	$(PY) bench/run.py

# On a machine with a real NVIDIA GPU (skips cleanly without one): NVML, nodes, a CUDA program, the gate, MIG.
gpu-smoke: venv
	$(PY) bench/gpu-smoke

# gpuguard_<version>_<arch>.deb in the current directory: dpkg-buildpackage -us -uc -b on debian/,
# in a copy of the checkout (packaging/build-deb.sh; DEB_VERSION overrides the package version,
# e.g. for a local rebuild). Then `lintian gpuguard_*.deb` (docs/admin.md, Installing: what it still says, and why).
deb: build-deps
	packaging/build-deb.sh . $(DEB_VERSION)

# The source package in the current directory (gpuguard_<version>.dsc, .tar.xz, _source.changes):
# it builds offline on any Debian with its Build-Depends (sbuild, pbuilder, a PPA), since the one
# module Debian lacks (nvidia-ml-py's pynvml.py) is in debian/vendor/ (packaging/vendor-nvml.sh).
deb-source: build-deps
	packaging/build-deb.sh --source . $(DEB_VERSION)

# The man pages (gpuguard.1, gpuguard.8, gpuguard.toml.5, pam_gpuguard.8) and the bash completion
# in build/, generated from the argparse definitions and the config loader's table
# (packaging/manpages.py): the help text and the list of keys have one copy each.
man: venv
	PYTHONPATH=$(CURDIR) PYTHONDONTWRITEBYTECODE=1 $(PY) packaging/manpages.py build
	PYTHONPATH=$(CURDIR) PYTHONDONTWRITEBYTECODE=1 $(PY) -m gpuguard completion bash > build/gpuguard.bash

# requirements.lock: every dependency pinned, with the hashes of all its files on PyPI, solved on
# the oldest Python supported so that tomli (3.10 only) is in it, under its marker. The extras
# (test tools) stay out: a server runs none of them. packaging/build-requirements.lock: the same
# for the tools that build the wheel.
LOCK = CUSTOM_COMPILE_COMMAND="make lock" $(CURDIR)/.venv-lock/bin/pip-compile -q --generate-hashes --allow-unsafe \
	--strip-extras --no-emit-index-url --no-emit-find-links
lock:
	$(PYTHON310) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q pip-tools
	$(LOCK) --output-file requirements.lock pyproject.toml
	cd packaging && $(LOCK) --output-file build-requirements.lock build-requirements.in

install: pam man
	@test "$$(id -u)" = 0 || [ -n "$(DESTDIR)" ] || { echo "make install: run as root (or set DESTDIR)" >&2; exit 1; }
	packaging/build-venv.sh $(PYTHON) $(DESTDIR)$(APPDIR) $(APPDIR)
	install -d -m 0755 $(DESTDIR)$(PREFIX)/bin
	ln -sfn $(APPDIR)/bin/gpuguard $(DESTDIR)$(PREFIX)/bin/gpuguard
	$(MAKE) -C pam install DESTDIR=$(DESTDIR)
	@# The sources name the Debian package's /usr/bin/gpuguard; this install's is in APPDIR.
	install -d -m 0755 $(DESTDIR)$(UNITDIR) $(DESTDIR)$(LIBDIR)/modprobe.d $(DESTDIR)$(LIBDIR)/udev
	sed 's|/usr/bin/gpuguard|$(APPDIR)/bin/gpuguard|g' etc/gpuguard.service > $(DESTDIR)$(UNITDIR)/gpuguard.service
	sed 's|/usr/bin/gpuguard|$(APPDIR)/bin/gpuguard|g' udev/70-gpuguard.rules > $(DESTDIR)$(LIBDIR)/udev/70-gpuguard.rules
	install -m 0644 etc/modprobe.d/gpuguard.conf $(DESTDIR)$(LIBDIR)/modprobe.d/gpuguard.conf
	chmod 0644 $(DESTDIR)$(UNITDIR)/gpuguard.service $(DESTDIR)$(LIBDIR)/udev/70-gpuguard.rules
	sed 's|/usr/bin/gpuguard|$(APPDIR)/bin/gpuguard|g' etc/gpuguard-web.service > $(DESTDIR)$(UNITDIR)/gpuguard-web.service
	chmod 0644 $(DESTDIR)$(UNITDIR)/gpuguard-web.service
	@# The web view's password check, as root (etc/gpuguard-web-login.socket says why): this install's Python.
	install -m 0644 etc/gpuguard-web-login.socket $(DESTDIR)$(UNITDIR)/gpuguard-web-login.socket
	sed 's|/usr/bin/python3 |$(APPDIR)/bin/python |' 'etc/gpuguard-web-login@.service' > '$(DESTDIR)$(UNITDIR)/gpuguard-web-login@.service'
	chmod 0644 '$(DESTDIR)$(UNITDIR)/gpuguard-web-login@.service'
	[ -e $(DESTDIR)$(SYSCONFDIR)/pam.d/gpuguard-web ] || install -D -m 0644 etc/pam.d/gpuguard-web $(DESTDIR)$(SYSCONFDIR)/pam.d/gpuguard-web
	install -D -m 0644 build/gpuguard.1 $(DESTDIR)$(MANDIR)/man1/gpuguard.1
	install -D -m 0644 build/gpuguard.8 $(DESTDIR)$(MANDIR)/man8/gpuguard.8
	install -D -m 0644 build/pam_gpuguard.8 $(DESTDIR)$(MANDIR)/man8/pam_gpuguard.8
	install -D -m 0644 build/gpuguard.toml.5 $(DESTDIR)$(MANDIR)/man5/gpuguard.toml.5
	install -D -m 0644 build/gpuguard.bash $(DESTDIR)$(BASHCOMPDIR)/gpuguard
	@# Login shells' CUDA_VISIBLE_DEVICES from the held-devices file (docs/users.md, Any shell).
	install -D -m 0644 etc/profile.d/gpuguard.sh $(DESTDIR)$(SYSCONFDIR)/profile.d/gpuguard.sh
	install -D -m 0644 etc/profile.d/gpuguard.zsh $(DESTDIR)$(SYSCONFDIR)/profile.d/gpuguard.zsh
	install -D -m 0644 etc/fish/conf.d/gpuguard.fish $(DESTDIR)$(SYSCONFDIR)/fish/conf.d/gpuguard.fish
	install -d -m 0755 $(DESTDIR)$(SYSCONFDIR)/gpuguard
	@# The admin's configuration is never overwritten.
	[ -e $(DESTDIR)$(SYSCONFDIR)/gpuguard/gpuguard.toml ] || install -m 0644 etc/gpuguard.toml $(DESTDIR)$(SYSCONFDIR)/gpuguard/gpuguard.toml
	[ -e $(DESTDIR)$(SYSCONFDIR)/gpuguard/quotas.toml ] || install -m 0644 etc/quotas.toml $(DESTDIR)$(SYSCONFDIR)/gpuguard/quotas.toml
	@echo "installed, inert; next: configure $(SYSCONFDIR)/gpuguard, systemctl daemon-reload, then gpuguard enable"

# Removes what `make install` installed, never the configuration or the state (/var/lib/gpuguard);
# run `gpuguard disable` first (the gate outlives the daemon, the links in /etc outlive LIBDIR).
uninstall:
	rm -rf $(DESTDIR)$(APPDIR) $(DESTDIR)$(LIBDIR)
	rm -f $(DESTDIR)$(PREFIX)/bin/gpuguard $(DESTDIR)$(UNITDIR)/gpuguard.service $(DESTDIR)$(UNITDIR)/gpuguard-web.service \
		$(DESTDIR)$(UNITDIR)/gpuguard-web-login.socket '$(DESTDIR)$(UNITDIR)/gpuguard-web-login@.service' \
		$(DESTDIR)$(MANDIR)/man1/gpuguard.1 $(DESTDIR)$(MANDIR)/man8/gpuguard.8 \
		$(DESTDIR)$(MANDIR)/man8/pam_gpuguard.8 $(DESTDIR)$(MANDIR)/man5/gpuguard.toml.5 \
		$(DESTDIR)$(BASHCOMPDIR)/gpuguard $(DESTDIR)$(SYSCONFDIR)/profile.d/gpuguard.sh \
		$(DESTDIR)$(SYSCONFDIR)/profile.d/gpuguard.zsh $(DESTDIR)$(SYSCONFDIR)/fish/conf.d/gpuguard.fish
	$(MAKE) -C pam uninstall DESTDIR=$(DESTDIR)

clean:
	rm -rf $(VENV) $(VENV310) .venv-lock *.egg-info build
	$(MAKE) -C pam clean
