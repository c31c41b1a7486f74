# SpecPilot's verbs. Every verb after `engine` takes an engine id (or a unique prefix of one).
#   make demo                                   build, serve, bench, compare, score and verify the embedded default
#   make test                                   the test suite
#   make engine [SETTING=...] [ARM=final]       build (or find) an engine; prints its id and path
# See README.md for the rest.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
SP := $(VENV)/bin/specpilot
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

SETTING ?= cpu_c1_stories260k_ngram
ARM ?= final
PORT ?= 30000
GPU ?= 0
LIMIT ?= 0
MAX_NEW_TOKENS ?= 2048
ARMS ?= ar,stock,final
SETTINGS ?= $(SETTING)

.PHONY: setup demo test engine show verify-engine ls sweep lock models serve stop bench compare score verify diff

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP)

demo: $(STAMP)
	$(SP) demo $(if $(filter-out 0,$(LIMIT)),--limit $(LIMIT))

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

engine: $(STAMP)
	$(SP) engine build --setting $(SETTING) --arm $(ARM)

show: $(STAMP)
	$(SP) engine show $(ENGINE)

verify-engine: $(STAMP)
	$(SP) engine verify $(ENGINE)

ls: $(STAMP)
	$(SP) engine ls

sweep: $(STAMP)
	$(SP) sweep --settings $(SETTINGS) --arms $(ARMS) $(if $(LAUNCHER),--launcher $(LAUNCHER))

lock: $(STAMP)
	$(SP) lock --setting $(SETTING) $(if $(UPDATE),--update)

models: $(STAMP)
	$(SP) models --setting $(SETTING) $(if $(MIRROR),--mirror $(MIRROR))

serve: $(STAMP)
	$(SP) serve $(if $(ENGINE),--engine $(ENGINE),--setting $(SETTING) --arm $(ARM)) --port $(PORT) --gpu $(GPU) $(SERVE_FLAGS)

stop: $(STAMP)
	$(SP) stop --port $(PORT)

bench: $(STAMP)
	$(SP) bench --engine $(ENGINE) --name $(NAME) --port $(PORT) --max-new-tokens $(MAX_NEW_TOKENS) $(if $(filter-out 0,$(LIMIT)),--limit $(LIMIT)) $(if $(DATASETS),--datasets $(DATASETS))

compare: $(STAMP)
	$(SP) compare --ar $(AR) --stock $(STOCK) --final $(FINAL)

score: $(STAMP)
	$(SP) score $(RUN) $(if $(WORKERS),--workers $(WORKERS))

verify: $(STAMP)
	$(SP) verify $(RUN) $(if $(ORACLE),--oracle $(ORACLE)) $(if $(VERIFY_PORT),--port $(VERIFY_PORT))

diff: $(STAMP)
	$(SP) diff $(A) $(B) $(DIFF_FLAGS)
