# `make test` and `make demo` each do the whole set-up on a fresh Debian 12
# machine as root: apt packages, the venv, the native parts; then their job.
SHELL := /bin/bash
PYTHON ?= /usr/bin/python3
VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := gcc make libc6-dev binutils python3-venv python3-dev python3-pip libcap-dev libcap2-bin libb2-dev libjansson-dev strace \
                runc containerd docker.io busybox-static iproute2 util-linux podman \
                dpkg-dev lintian debootstrap umoci conmon libgpgme11 libseccomp2 libsqlite3-0 \
                prometheus chromium chromium-driver openssl
PYTEST_ARGS ?=

.PHONY: all setup apt venv native test lint unit integration e2e demo bench clean deb image reliability

all: setup

setup: apt venv native

apt:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "make: need root to install: $$missing" >&2; exit 1; fi; \
	  echo "installing: $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

# an editable install builds nvctk/_sys.c (and _sys_codec.c) in place, generates the device plugin's gRPC
# modules (the device plugin's, the DRA plugin's) beside their .proto and compiles the launchers into
# .venv/bin: again when they change
LAUNCHER_SOURCES := runtime_shim/launcher.c runtime_shim/nvctk-runtime.c hooks/nvctk-hook.c cli/nvctk.c
$(VENV)/.installed: pyproject.toml setup.py nvctk/_sys.c nvctk/_sys_codec.c nvctk/_sys.h $(LAUNCHER_SOURCES) nvctk/k8s/api.proto \
                    $(wildcard nvctk/dra/third_party/*.proto)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

native: venv
	$(MAKE) -C libvgpu

lint: setup
	$(VENV)/bin/ruff check nvctk tests bench
	$(VENV)/bin/mypy

# tests by kind (tests/README.md): unit = plain data, no root, no nvctk process (under a
# minute); integration = root, the simulated host, nvctk's executables, real runc;
# e2e = real engines and packages; `-m "not slow"` leaves out the cases of seconds
unit: setup
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/unit $(PYTEST_ARGS)

integration: setup
	$(VENV)/bin/pytest tests/integration $(PYTEST_ARGS)

e2e: setup
	$(VENV)/bin/pytest tests/e2e $(PYTEST_ARGS)

# two phases (tests/README.md): every test not marked exclusive on $(TEST_WORKERS) xdist
# workers (a test file stays on one worker: its module fixtures are built once), then the
# exclusive ones alone. Fails if either fails; a phase with nothing to run (pytest's 5) is
# no failure.
TEST_WORKERS ?= 2
test: setup lint
	@rc=0; \
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile --phase parallel $(PYTEST_ARGS) || \
	  { r=$$?; [ $$r = 5 ] || rc=$$r; }; \
	$(VENV)/bin/pytest --phase exclusive $(PYTEST_ARGS) || { r=$$?; [ $$r = 5 ] || rc=$$r; }; \
	if [ $$rc != 0 ]; then echo "make test: FAILED (a phase's pytest exited $$rc)" >&2; fi; \
	exit $$rc

demo: setup
	$(PY) -m nvctk.sim.demo

bench: setup
	$(PY) bench/container_start.py --out bench/results/container_start.txt
	$(PY) bench/deviceplugin.py --output bench/results/deviceplugin.txt
	$(MAKE) -C libvgpu bench

# the reliability suite at full scale (a short version runs in `make test`): writes
# bench/results/reliability.json and the table in docs/reliability.md
reliability: setup
	$(PY) bench/reliability.py

# dist/nvctk_<version>_<arch>.deb (packaging/deb/build.sh; lintian in tests/e2e/test_deb.py)
deb: apt
	bash packaging/deb/build.sh dist

# dist/nvctk-image.tar (localhost/nvctk:<version>, in dist/nvctk-image.name): the one image of
# every node role, an OCI image archive, from the .deb on a debootstrap'd Debian 12
image: deb
	bash packaging/image/build.sh dist

clean:
	rm -rf $(VENV) build dist *.egg-info
	$(MAKE) -C libvgpu clean
