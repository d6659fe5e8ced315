# The README's two commands: `make book` (execute the whole book) and `make test` (the test suite).
# Both do all set-up themselves: a virtual environment in .venv with the pinned requirements.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
JOBS   ?= 2

.PHONY: setup book test lab clean
setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

book: setup          ## execute every chapter; executed notebooks land in _build/book/
	$(PY) tools/build_book.py

test: setup          ## library tests, graders, and every chapter/workbook under nbval
	$(PY) -m pytest -n $(JOBS) --dist loadfile

lab: setup           ## read the book in JupyterLab (installs it into the venv)
	$(PY) -m pip install -q jupyterlab
	$(PY) -m jupyter lab book/

clean:
	rm -rf $(VENV) _build
