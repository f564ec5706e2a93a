# The two entry points of the README. Each one sets the machine up first (idempotent).
VENV ?= .venv

.PHONY: setup demo test bench lint

setup:
	bash tools/setup.sh

demo: setup
	$(VENV)/bin/ssl-vit demo $(ARGS)

test: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -n 2 --durations=15 $(ARGS)

bench: setup
	$(VENV)/bin/ssl-vit benchmark $(ARGS)

lint: setup
	$(VENV)/bin/ruff check ssl_vit tests tools
