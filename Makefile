PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.attnspec-installed

.PHONY: verify install test lint typecheck format docs docs-check clean matrix FORCE

EXTRAS ?= test,torch,jax,flax,bench,docs,hf
# Triton kernels run under its interpreter on machines without a GPU (set before triton loads).
export TRITON_INTERPRET ?= $(shell nvidia-smi -L >/dev/null 2>&1 || echo 1)
# Material for MkDocs prints a banner about its successor on every build unless this is set.
export NO_MKDOCS_2_WARNING ?= 1

# The code folders (each holds a py.typed) and the list of their files. Strict editable mode
# links each file into build/__editable__.*/attnspec/, a plain tree that type checkers and IDEs
# follow; a file added or removed later needs a re-install, so the list is a prerequisite of the
# install and is rewritten only when it changes (editing a file re-installs nothing), or when the
# links are gone (rm -rf build).
PACKAGE_DIRS := $(patsubst %/py.typed,%,$(wildcard */py.typed src/*/py.typed))
FILE_LIST    := $(VENV)/.attnspec-files

$(FILE_LIST): FORCE
	@mkdir -p $(VENV)
	@ls -d build/__editable__.* >/dev/null 2>&1 || rm -f $@
	@find $(PACKAGE_DIRS) -name __pycache__ -prune -o -type f -print | LC_ALL=C sort > $@.new
	@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi

FORCE:

# Create the virtual environment and install the package with its extras (exact CI pins).
$(STAMP): pyproject.toml requirements-ci.txt $(FILE_LIST)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c requirements-ci.txt -e ".[$(EXTRAS)]" \
		--config-settings editable_mode=strict
	touch $(STAMP)

install: $(STAMP)

# The main job (attnspec verify): the theorem checks and the conformance kit on every backend
# available here (or a comma-separated list: make verify BACKENDS=numpy,torch,jax), as many
# commands at a time as there are CPUs. Backends that run natively get the full kit; without a
# GPU the Triton and Pallas kernels run under an interpreter and get the smoke subset (the first
# case of every family, float32 and bfloat16, outputs and VJPs): FULL=1 runs them in full too.
# JAX keeps its compiled programs in build/jax-cache, so a second run compiles less.
BACKENDS ?= available
verify: export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/build/jax-cache
verify: export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS ?= 0
verify: $(STAMP)
	$(VENV)/bin/attnspec verify --backend $(BACKENDS) $(if $(FULL),--full)

# The strict docs build is one of the tests (tests/test_docs_site.py builds the site and reads it).
test: lint typecheck
	$(PY) -m pytest -n auto --dist load --maxschedchunk 1

# The version matrix (bench/matrix.py): Python 3.12 with JAX 0.12 and 0.11, Triton 3.6 and 3.7.1,
# the GPU machine's image (gpu-image: the GPU check's dry run), Python 3.13, each in its own venv
# under build/matrix/ (reused while its pins are unchanged), and newest: every extra's range
# resolved from the package index on each run, without pins or the local pip configuration (its
# versions in build/matrix/newest-versions.txt).
# A subset: make matrix LEGS=triton-3.6,jax-0.12 (python -m bench.matrix --list names them).
LEGS ?=
matrix: $(STAMP)
	$(PY) -m bench.matrix $(if $(LEGS),--legs $(LEGS))

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# mypy over the code folders (configuration in pyproject.toml; incremental cache in .mypy_cache).
# It names files by their links in build/__editable__.*/attnspec/<package>/; sed names them by
# the folder each link points to (every subpackage's folder carries its name).
typecheck: $(STAMP)
	@echo "$(PY) -m mypy"
	@$(PY) -m mypy > $(VENV)/.mypy-report; status=$$?; \
		sed 's|^build/__editable__[^/]*/attnspec/||' $(VENV)/.mypy-report; exit $$status

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .ruff_cache .hypothesis .mypy_cache

# The documentation site, into site/ (open site/index.html; no network needed to read it).
# Math is rendered by the KaTeX release vendored in docs/assets/katex/ (checked by docs/hooks/katex.py).
docs: $(STAMP)
	$(PY) -m mkdocs build --strict

# Headless Chromium (Debian: apt-get install chromium) loads the built pages from local files
# with the network blocked; screenshots go to build/docs-check/. Skipped without Chromium.
docs-check: $(STAMP)
	$(PY) -m pytest -rs tests/test_docs_site.py -k chromium
	@ls build/docs-check/*.png 2>/dev/null || true

# Wheels the GPU check needs on a machine without network (bench/gpu_check.sh installs them from
# .whl/ into a temporary folder): flash-linear-attention, the timing peer, and what it imports.
.PHONY: wheels
WHEELS ?= fla-core==0.6.0 einops==0.8.2 packaging==26.4
wheels:
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: -d .whl $(WHEELS)
