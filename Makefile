PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.attnspec-installed

.PHONY: verify test lint format docs docs-check clean

EXTRAS ?= test,torch,jax,bench,docs
# Triton kernels run under its interpreter on machines without a GPU (set before triton loads).
export TRITON_INTERPRET ?= $(shell nvidia-smi -L >/dev/null 2>&1 || echo 1)
# Material for MkDocs prints a banner about its successor on every build unless this is set.
export NO_MKDOCS_2_WARNING ?= 1

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
	$(PY) -m mkdocs build --strict --quiet
	$(PY) -m pytest -n auto

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .ruff_cache .hypothesis

# The documentation site, into site/ (open site/index.html; no network needed to read it).
# The first build fetches the pinned KaTeX package with npm into build/katex/.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict

# Headless Chromium (Debian: apt-get install chromium) loads the built pages from local files
# with the network blocked; screenshots go to build/docs-check/. Skipped without Chromium.
docs-check: $(STAMP)
	$(PY) -m pytest -rs tests/test_docs_site.py -k chromium
	@ls build/docs-check/*.png 2>/dev/null || true
