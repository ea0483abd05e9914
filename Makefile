PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.attnspec-installed

.PHONY: verify test lint format docs clean

EXTRAS ?= test,torch,jax,bench
# Triton kernels run under its interpreter on machines without a GPU (set before triton loads).
export TRITON_INTERPRET ?= $(shell nvidia-smi -L >/dev/null 2>&1 || echo 1)

# Create the virtual environment and install the package with its extras (exact CI pins).
$(STAMP): pyproject.toml requirements-ci.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c requirements-ci.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

# The main job: theorem checks, then the conformance report of every backend available here.
verify: $(STAMP)
	$(PY) -m attnspec.theory
	$(PY) -m attnspec.conformance --backend available

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis

# The documentation site (needs the docs extra; not part of CI).
docs: $(STAMP)
	$(PY) -m pip install --quiet -e ".[docs]"
	$(PY) -m mkdocs build --strict
