# The README's two commands: `make book` (execute the whole book) and `make test` (the test suite).
# Both do all set-up themselves: a virtual environment in .venv with the pinned requirements.
# More: `make site` (the book as a website), `make lab` (read it in JupyterLab), `make wheel` (the
# library as a wheel, for Colab), `make browser-check` (the site and JupyterLab in headless Chromium).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
JOBS   ?= 2
PORT   ?= 8888

.PHONY: setup book test site notebooks wheel lab browser-check clean
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

site: setup          ## the executed book (run `make book` first) as a website: _build/site/_build/html/
	$(PY) tools/site_book.py

notebooks: setup     ## every chapter and workbook as an unexecuted .ipynb for Colab: _build/notebooks/
	$(PY) tools/colab.py --notebooks _build/notebooks book/[0-9][0-9]_*.py exercises/[0-9][0-9]_*.py

wheel: setup         ## the library as a wheel in dist/ (upload it to Colab when the first cell asks)
	$(PY) -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w dist .
	rm -rf build

lab: setup           ## JupyterLab on the book: chapters and workbooks (.py) open as notebooks
	$(PY) tools/lab.py --setup
	$(PY) -m jupyter lab --ServerApp.root_dir=. --ServerApp.port=$(PORT) $(if $(filter 0,$(shell id -u)),--allow-root) book/

browser-check: setup ## headless Chromium: screenshots of a chapter page, missing images, broken links
	$(PY) tools/browser_check.py --site _build/site/_build/html --lab

clean:
	rm -rf $(VENV) _build dist build
