# The two commands README.md promises: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
DISTS := core plugins/models plugins/quant plugins/parsers plugins/gguf plugins/rocm plugins/xpu examples/third-party-plugin
PYPROJECTS := $(addsuffix /pyproject.toml,$(DISTS))
TEST_DEPS := pytest pytest-xdist hypothesis httpx openai triton accelerate compressed-tensors jsonschema schemathesis peft ray

# Test processes side by side (pytest-xdist), each test file on one worker (its module fixtures,
# a server or a model, start once). Many tests wait on subprocesses and servers, so two workers
# on CI's two cores took the suite from 13.9 to 8.6 minutes; TEST_WORKERS=0 runs it in-process.
TEST_WORKERS ?= 2

.PHONY: setup test demo clean

setup: $(VENV)/.installed

$(VENV)/.installed: $(PYPROJECTS) Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> installing torch==2.13.0 (CPU build) into $(VENV)"
	$(PIP) install torch==2.13.0
	@echo "==> installing every distribution (editable) and the test tools"
	$(PIP) install $(addprefix -e ./,$(DISTS)) $(TEST_DEPS)
	@touch $@

test: setup
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

demo: setup
	$(PY) scripts/demo.py

clean:
	rm -rf $(VENV) .pytest_cache
