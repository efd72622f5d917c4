# Two entry points, each doing the whole set-up on a fresh Debian 12 / Ubuntu
# machine as root: `make demo` and `make test`. Set-up is idempotent and
# quick once done (stamps under .venv/).

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := iproute2 iputils-ping clang llvm libbpf-dev linux-libc-dev libc6-dev tcpdump iperf3 \
                ethtool python3-venv python3-pip
# perftest and the rxe verbs provider (ibverbs-providers): the kind `perftest` on rxe hosts,
# run natively on a kernel with rdma_rxe or inside the VM (which uses the host's binaries).
# VM mode installs qemu, busybox-static and kmod, and the guest kernel, on first use only.
APT_PACKAGES += perftest ibverbs-providers
# The RoCE transport's compiled fast path (agents/fast/_fastpath.c): Python.h and zlib.h.
APT_PACKAGES += python3-dev zlib1g-dev
# Packaged on Debian; on Ubuntu bpftool ships in linux-tools and is optional.
APT_OPTIONAL := bpftool
# Tests open the HTML report in a headless browser, and decode RoCE captures with tshark.
# Debian's Mininet (system Python) runs the exported fabric (testbed mininet); without
# recommends: its switches are routers (Mininet hosts), so no Open vSwitch is needed.
# python3-apt: Ansible's apt module runs under the system Python (tests/integration/test_ansible.py
# provisions this machine through the local inventory).
TEST_APT_PACKAGES := chromium tshark mininet python3-apt
BENCH_APT_PACKAGES := mininet

.PHONY: setup system-deps test-deps demo test test-unit lint docs bench clean

BPF_SRC := testbed/net/bpf/port.bpf.c

setup: $(VENV)/.installed $(VENV)/.bpf-built $(VENV)/.fastpath-built

# The RoCE transport's fast path, a CPython extension built with clang next to its source
# (agents/fast/build.py); rebuilt when the C source changes (the module also refuses a
# build older than its source, and the agents then say they ran the Python path).
FASTPATH_SRC := agents/fast/_fastpath.c

$(VENV)/.fastpath-built: $(VENV)/.installed $(FASTPATH_SRC) agents/fast/build.py
	$(PY) -m agents.fast
	@touch $@

# The tc-BPF port program, compiled with clang into /var/cache/testbed/bpf.
$(VENV)/.bpf-built: $(VENV)/.installed $(BPF_SRC)
	$(PY) -c "from testbed.net.portprog import ensure_object; print(ensure_object())"
	@touch $@

system-deps: $(VENV)/.apt-done

# The stamps depend on this file: a package added here is installed by the next make.
$(VENV)/.apt-done: Makefile
	@if [ "$$(id -u)" != 0 ]; then echo "make: run as root (apt packages, namespaces)"; exit 1; fi
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	 optional=$$(for p in $(APT_OPTIONAL); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	 if [ -n "$$missing$$optional" ]; then \
	   echo "installing system packages: $$missing $$optional"; \
	   apt-get update -qq && \
	   DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing && \
	   for p in $$optional; do \
	     DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$p \
	       || echo "note: optional package $$p is not available here"; \
	   done; \
	 fi
	@mkdir -p $(VENV) && touch $@

$(VENV)/.installed: $(VENV)/.apt-done pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip >/dev/null
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

demo: setup
	$(VENV)/bin/testbed run configs/default.yaml

# Lint first: a type or complexity error fails in seconds, not after the root suite.
test: setup test-deps lint
	$(VENV)/bin/pytest -q

test-deps: $(VENV)/.apt-test-done

$(VENV)/.apt-test-done: $(VENV)/.apt-done Makefile
	@missing=$$(for p in $(TEST_APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	 if [ -n "$$missing" ]; then \
	   echo "installing test packages: $$missing"; \
	   apt-get update -qq && \
	   DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	 fi
	@touch $@

# The quick loop: ruff only (about a second); mypy, at ten seconds or more, runs in lint.
test-unit: setup
	$(VENV)/bin/ruff check testbed agents tests bench
	$(VENV)/bin/pytest -q -m "not root"

# mypy's settings (plugins, per-module overrides) are in pyproject.toml.
lint: setup
	$(VENV)/bin/ruff check testbed agents tests bench
	$(VENV)/bin/mypy testbed agents

# Files generated from the config models; tests fail while the committed ones are stale.
docs: $(VENV)/.installed
	$(PY) -m testbed.config.docs --write docs/config.md
	$(PY) -m testbed.config.schema > configs/schema/fabric.schema.json
	$(PY) -m testbed.config.vms > configs/schema/vms.schema.json
	$(PY) -m testbed.workloads.docs --write docs/run-format.md

bench: setup
	@missing=$$(for p in $(BENCH_APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	 if [ -n "$$missing" ]; then apt-get update -qq && \
	   DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi
	$(PY) bench/bringup.py

clean:
	-$(VENV)/bin/testbed down --all
	rm -rf $(VENV) build *.egg-info agents/fast/_fastpath*.so agents/fast/_fastpath.stamp
