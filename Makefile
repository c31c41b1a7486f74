# SpecPilot's verbs. Every verb after `engine` takes an engine id (or a unique prefix of one).
#   make demo                                   build, serve, bench, compare, score and verify the embedded default
#   make test / make test-fast                  the whole suite (CI) / the unit tier (under a minute)
#   make engine [SETTING=...] [ARM=final] [OVERRIDES='drafter.num_draft_tokens=6 ...']
# README.md lists every verb and every option.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
SP := $(VENV)/bin/specpilot
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

SETTING ?= cpu_c1_stories260k_ngram
ARM ?= final
PORT ?= 30000
VERIFY_PORT ?= 30001
GPU ?= 0
LIMIT ?= 0
MAX_NEW_TOKENS ?= 2048
ARMS ?= ar,stock,final
SETTINGS ?= $(SETTING)
FAST_MARKERS := not slow and not gpu and not sglang

.PHONY: setup demo test test-fast fuzz engine show verify-engine ls sweep lock env-lock models serve stop bench compare score verify diff bundle

$(STAMP): pyproject.toml
	@echo "installing SpecPilot and its pinned dependencies into $(VENV) (first time: a few minutes)"
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	set -o pipefail; $(VENV)/bin/pip install -e '.[test]' | { grep -E --line-buffered '^(Collecting|Successfully)' || true; }
	rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP)

demo: $(STAMP)
	$(SP) demo --port $(PORT) $(if $(filter-out 0,$(LIMIT)),--limit $(LIMIT)) $(if $(DATASETS),--datasets $(DATASETS)) $(if $(REPEAT),--repeat $(REPEAT))

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "$(FAST_MARKERS)"

fuzz: $(STAMP)
	$(VENV)/bin/python benchmarks/server_fuzz.py --seconds $(or $(SECONDS),300) $(if $(URL),--url $(URL))

engine: $(STAMP)
	$(SP) engine build --setting $(SETTING) --arm $(ARM) $(OVERRIDES)

show: $(STAMP)
	$(SP) engine show $(ENGINE)

verify-engine: $(STAMP)
	$(SP) engine verify $(ENGINE)

ls: $(STAMP)
	$(SP) engine ls

sweep: $(STAMP)
	$(SP) sweep --settings $(SETTINGS) --arms $(ARMS) $(if $(LAUNCHER),--launcher $(LAUNCHER)) $(OVERRIDES)

lock: $(STAMP)
	$(SP) lock --setting $(SETTING) $(if $(UPDATE),--update)

env-lock: $(STAMP)
	$(SP) env lock --runtime $(RUNTIME) --host $(HOST)

models: $(STAMP)
	$(SP) models --setting $(SETTING) $(if $(MIRROR),--mirror $(MIRROR))

serve: $(STAMP)
	$(SP) serve $(if $(ENGINE),--engine $(ENGINE),--setting $(SETTING) --arm $(ARM)) --port $(PORT) --gpu $(GPU) $(SERVE_FLAGS)

stop: $(STAMP)
	$(SP) stop --port $(PORT)

bench: $(STAMP)
	$(SP) bench --engine $(ENGINE) --name $(NAME) --port $(PORT) --max-new-tokens $(MAX_NEW_TOKENS) $(if $(filter-out 0,$(LIMIT)),--limit $(LIMIT)) $(if $(DATASETS),--datasets $(DATASETS)) $(if $(OVERWRITE),--overwrite) $(if $(ORACLE),--oracle $(ORACLE))

compare: $(STAMP)
	$(SP) compare --ar $(AR) --stock $(STOCK) --final $(FINAL) $(if $(NAME),--name $(NAME)) $(if $(OVERWRITE),--overwrite)

score: $(STAMP)
	$(SP) score $(RUN) $(if $(WORKERS),--workers $(WORKERS))

verify: $(STAMP)
	$(SP) verify $(RUN) $(if $(ORACLE),--oracle $(ORACLE)) --port $(VERIFY_PORT)

diff: $(STAMP)
	$(SP) diff $(A) $(B) $(DIFF_FLAGS)

bundle: $(STAMP)
	$(SP) bundle $(ENGINE) $(if $(HOST),--host $(HOST)) $(if $(ENV_DIR),--env $(ENV_DIR)) --part-mb $(or $(PART_MB),60) $(if $(OUT),--out $(OUT))
