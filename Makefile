# gpuguard: the two quick-start targets are `sudo make demo` and `sudo make test`.
# Everything runs from a virtual environment built with the system Python, so that
# the non-root test users (and researchers, for `gpuguard whoami`) can execute it.

PYTHON ?= /usr/bin/python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
APT_PACKAGES = python3-venv gcc make libpam0g-dev pamtester acl openssh-server openssh-client util-linux passwd

.PHONY: all deps venv pam test demo bench gpu-smoke man install clean

all: venv pam

# Debian/Ubuntu packages the build, the tests and the demo need (installed only when missing).
deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

$(PY): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# compat: a plain path in a .pth; the default editable finder adds ~12 ms to every Python start,
	# the pam_exec hook's at each login included.
	$(PY) -m pip install -q -e '.[test]' --config-settings editable_mode=compat
	@touch $(PY)

venv: $(PY)

pam:
	$(MAKE) -C pam

test: deps venv pam
	$(PY) -m pytest $(PYTEST_ARGS)

demo: deps venv pam
	$(PY) -m devtools.demo

bench: deps venv pam
	$(PY) bench/run.py

# On a machine with a real NVIDIA GPU (skips cleanly without one): NVML, nodes, a CUDA program, the gate, MIG.
gpu-smoke: venv
	$(PY) bench/gpu-smoke

# The man page, generated from the argparse definitions (argparse-manpage): the help text has one copy.
man: venv
	mkdir -p build
	$(VENV)/bin/argparse-manpage --module gpuguard.cli --function build_parser --prog gpuguard \
		--project-name gpuguard --version "$$($(PY) -c 'import gpuguard; print(gpuguard.__version__)')" \
		--description "fair, kernel-enforced GPU sharing" --manual-title "gpuguard manual" --output build/gpuguard.1

# Install on a real server: package into /opt/gpuguard, module into the PAM directory,
# example configuration into /etc/gpuguard (never overwriting an admin's files). The command
# goes into /usr/local/bin, not sbin: users run `gpuguard whoami` too.
install: deps man
	$(PYTHON) -m venv /opt/gpuguard
	/opt/gpuguard/bin/pip install -q .
	ln -sf /opt/gpuguard/bin/gpuguard /usr/local/bin/gpuguard
	$(MAKE) -C pam install
	install -d -m 0755 /etc/gpuguard
	[ -e /etc/gpuguard/gpuguard.toml ] || install -m 0644 etc/gpuguard.toml /etc/gpuguard/gpuguard.toml
	[ -e /etc/gpuguard/quotas.toml ] || install -m 0644 etc/quotas.toml /etc/gpuguard/quotas.toml
	install -m 0644 etc/gpuguard.service /etc/systemd/system/gpuguard.service
	install -m 0644 etc/modprobe.d/gpuguard.conf /etc/modprobe.d/gpuguard.conf
	install -m 0644 udev/70-gpuguard.rules /etc/udev/rules.d/70-gpuguard.rules
	install -D -m 0644 build/gpuguard.1 /usr/local/share/man/man1/gpuguard.1
	install -d -m 0755 /usr/share/bash-completion/completions
	/opt/gpuguard/bin/gpuguard completion bash > /usr/share/bash-completion/completions/gpuguard

clean:
	rm -rf $(VENV) *.egg-info build
	$(MAKE) -C pam clean
