# SpecPilot's verbs: a thin layer over the CLI. `make help` lists them; `make <verb>` runs `specpilot <verb>`,
# `make <group>-<verb>` runs `specpilot <group> <verb>`, with one variable name per thing: SETTING, ARM, ENGINE (an
# engine id or unique prefix), RUN (a bench run's name), PORT. docs/verbs.md has every option.
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
LINTED := specpilot_build runtimes kernels lab benchmarks tests
flag = $(if $(filter-out 0,$($(1))),$(2))

.PHONY: help setup demo test test-fast lint fuzz engine engine-build engine-check engine-show engine-ls engine-fsck \
	engine-rm engine-gc sweep tune lock env-lock env-host-profile env-install models draft draft-import serve stop bench compare score \
	verify attest-check diff bundle push pull cache-ls cache-check cache-gc cache-keygen cache-import w12-promote gaps

help: ## this list
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z0-9-]+):.*## (.*)/\1\t\2/' | \
		awk -F'\t' '{printf "  make %-17s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@echo "installing SpecPilot and its pinned dependencies into $(VENV) (first time: a few minutes)"
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	set -o pipefail; $(VENV)/bin/pip install -e '.[test]' | { grep -E --line-buffered '^(Collecting|Successfully)' || true; }
	rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP) ## install SpecPilot and its pinned dependencies into .venv

demo: $(STAMP) ## build, serve, bench, compare, score and verify the embedded default [LIMIT DATASETS REPEAT PORT]
	$(SP) demo --port $(PORT) $(call flag,LIMIT,--limit $(LIMIT)) $(if $(DATASETS),--datasets $(DATASETS)) $(if $(REPEAT),--repeat $(REPEAT))

test: $(STAMP) lint ## lint, types and the whole suite (what CI runs)
	$(VENV)/bin/python -m pytest -q

test-fast: $(STAMP) lint ## lint, types and the unit tier (no served engines, SGLang builds or GPU)
	$(VENV)/bin/python -m pytest -q -m "$(FAST_MARKERS)"

lint: $(STAMP) ## ruff (lint and format check) over the code, mypy over specpilot_build
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy specpilot_build

fuzz: $(STAMP) ## a longer hostile-client run against the reference runtime [SECONDS URL]
	$(VENV)/bin/python benchmarks/server_fuzz.py --seconds $(or $(SECONDS),300) $(if $(URL),--url $(URL))

engine-build: $(STAMP) ## build (or find) the engine of SETTING and ARM [OVERRIDES]; prints id and path
	$(SP) engine build --setting $(SETTING) --arm $(ARM) $(OVERRIDES)

engine: engine-build ## the same as engine-build

engine-check: $(STAMP) ## re-hash ENGINE against its manifest [REPAIR=1 mends it]
	$(SP) engine check $(ENGINE) $(call flag,REPAIR,--repair)

engine-show: $(STAMP) ## setting, arm, pins, mechanisms and size of ENGINE
	$(SP) engine show $(ENGINE)

engine-ls: $(STAMP) ## list the store, damaged directories with the reason
	$(SP) engine ls

engine-fsck: $(STAMP) ## hash every object and engine of the store [REPAIR=1]
	$(SP) engine fsck $(call flag,REPAIR,--repair)

engine-rm: $(STAMP) ## remove ENGINE (one or more ids) [FORCE=1]
	$(SP) engine rm $(ENGINE) $(call flag,FORCE,--force)

engine-gc: $(STAMP) ## remove unreferenced objects and temporaries [DRY_RUN=1] [ENGINES=1: unrooted engines too]
	$(SP) engine gc $(call flag,DRY_RUN,--dry-run) $(call flag,ENGINES,--engines)

sweep: $(STAMP) ## build SETTINGS x ARMS as one Hydra multirun [LAUNCHER=local|slurm OVERRIDES]
	$(SP) sweep --settings $(SETTINGS) --arms $(ARMS) $(if $(LAUNCHER),--launcher $(LAUNCHER)) $(OVERRIDES)

tune: $(STAMP) ## search SETTING's final mechanism (Optuna, tune split, lossless only) [SPACE TRIALS SAMPLER=tpe|grid|random SEED STUDY LIMIT PROMOTE=1 EVAL_LIMIT LEADERS LAUNCHER MAX_NEW_TOKENS]
	$(SP) tune --setting $(SETTING) --port $(PORT) $(if $(filter command line environment,$(origin MAX_NEW_TOKENS)),--max-new-tokens $(MAX_NEW_TOKENS)) $(if $(SPACE),--space $(SPACE)) $(if $(TRIALS),--trials $(TRIALS)) $(if $(SAMPLER),--sampler $(SAMPLER)) $(if $(SEED),--seed $(SEED)) $(if $(STUDY),--study $(STUDY)) $(call flag,LIMIT,--limit $(LIMIT)) $(call flag,PROMOTE,--promote) $(if $(EVAL_LIMIT),--eval-limit $(EVAL_LIMIT)) $(if $(LEADERS),--leaders $(LEADERS)) $(if $(LAUNCHER),--launcher $(LAUNCHER))

lock: $(STAMP) ## pin SETTING's model and drafter repos to commits, files to sha256 [UPDATE=1]
	$(SP) lock --setting $(SETTING) $(call flag,UPDATE,--update)

env-lock: $(STAMP) ## resolve RUNTIME's wheels for HOST into lockfiles/envs/RUNTIME@HOST.toml
	$(SP) env lock --runtime $(RUNTIME) --host $(HOST)

env-host-profile: $(STAMP) ## write lockfiles/hosts/HOST.toml from FREEZE [PYTHON_VERSION GLIBC CUDA]
	$(SP) env host-profile --freeze $(FREEZE) --host $(HOST) --python $(PYTHON_VERSION) --glibc $(GLIBC) --cuda $(CUDA)

env-install: $(STAMP) ## install SETTING/ARM's host environment, pruned, into TARGET
	$(SP) env install --setting $(SETTING) --arm $(ARM) --target $(TARGET) $(OVERRIDES)

models: $(STAMP) ## fetch and verify SETTING's pinned checkpoint files [MIRROR]
	$(SP) models --setting $(SETTING) $(if $(MIRROR),--mirror $(MIRROR))

draft: $(STAMP) ## make SETTING's drafter by RECIPE (default: its final drafter's), store and pin it [RECIPE OVERRIDES]
	$(SP) draft --setting $(SETTING) $(if $(RECIPE),--recipe $(RECIPE)) $(OVERRIDES)

draft-import: $(STAMP) ## admit the drafter bundle DIR made elsewhere (id recomputed here), store and pin it [OVERRIDES]
	$(SP) draft-import $(DIR) $(OVERRIDES)

serve: $(STAMP) ## re-hash and serve ENGINE (or SETTING/ARM) on PORT [GPU SERVE_FLAGS=--dry-run]
	$(SP) serve $(if $(ENGINE),--engine $(ENGINE),--setting $(SETTING) --arm $(ARM)) --port $(PORT) --gpu $(GPU) $(SERVE_FLAGS)

stop: $(STAMP) ## stop the recorded server on PORT
	$(SP) stop --port $(PORT)

bench: $(STAMP) ## bench ENGINE (served on PORT) on the dev splits as RUN [LIMIT DATASETS MAX_NEW_TOKENS ORACLE OVERWRITE=1]
	$(SP) bench --engine $(ENGINE) --run $(RUN) --port $(PORT) --max-new-tokens $(MAX_NEW_TOKENS) $(call flag,LIMIT,--limit $(LIMIT)) $(if $(DATASETS),--datasets $(DATASETS)) $(call flag,OVERWRITE,--overwrite) $(if $(ORACLE),--oracle $(ORACLE))

compare: $(STAMP) ## speedups with 95% CIs of the runs AR, STOCK and FINAL [REPORT OVERWRITE=1]
	$(SP) compare --ar $(AR) --stock $(STOCK) --final $(FINAL) $(if $(REPORT),--report $(REPORT)) $(call flag,OVERWRITE,--overwrite)

gaps: $(STAMP) ## the cost model of ENGINE's c1 bench run RUN: time per token by part, the ceilings, the gaps ranked
	$(SP) gaps --engine $(ENGINE) --run $(RUN)

score: $(STAMP) ## grade RUN: answers, and code in a sandbox [WORKERS]
	$(SP) score $(RUN) $(if $(WORKERS),--workers $(WORKERS))

verify: $(STAMP) ## force every token of RUN through its oracle [ORACLE VERIFY_PORT]
	$(SP) verify $(RUN) $(if $(ORACLE),--oracle $(ORACLE)) --port $(VERIFY_PORT)

attest-check: $(STAMP) ## re-hash every subject of the in-toto STATEMENT
	$(SP) attest check $(STATEMENT)

diff: $(STAMP) ## why engines A and B differ [DIFF_FLAGS=--json|--files]
	$(SP) diff $(A) $(B) $(DIFF_FLAGS)

bundle: $(STAMP) ## ENGINE (one or more ids) as one archive for an air-gapped host [HOST|ENV_DIR PART_MB OUT CACHE TRUST]
	$(SP) bundle $(ENGINE) $(if $(HOST),--host $(HOST)) $(if $(ENV_DIR),--env $(ENV_DIR)) --part-mb $(or $(PART_MB),60) $(if $(OUT),--out $(OUT)) $(if $(CACHE),--cache $(CACHE)) $(if $(TRUST),--trust $(TRUST))

push: $(STAMP) ## copy ENGINE to the binary cache CACHE (default: the first substituter), signed with KEY
	$(SP) push $(ENGINE) $(if $(CACHE),--cache $(CACHE)) $(if $(KEY),--key $(KEY)) $(OVERRIDES)

pull: $(STAMP) ## copy ENGINE from CACHE into the store: signature, manifest and every object checked [TRUST]
	$(SP) pull $(ENGINE) $(if $(CACHE),--cache $(CACHE)) $(if $(TRUST),--trust $(TRUST)) $(OVERRIDES)

cache-ls: $(STAMP) ## the signed entries of CACHE: build key, engine, setting, arm, signer [TRUST]
	$(SP) cache ls $(if $(CACHE),--cache $(CACHE)) $(if $(TRUST),--trust $(TRUST)) $(OVERRIDES)

cache-check: $(STAMP) ## re-check every entry, manifest and object of CACHE [TRUST]
	$(SP) cache check $(if $(CACHE),--cache $(CACHE)) $(if $(TRUST),--trust $(TRUST)) $(OVERRIDES)

cache-gc: $(STAMP) ## remove what no entry of CACHE reaches [DRY_RUN=1 GRACE=seconds]
	$(SP) cache gc $(if $(CACHE),--cache $(CACHE)) $(call flag,DRY_RUN,--dry-run) $(if $(GRACE),--grace $(GRACE)) $(OVERRIDES)

cache-keygen: $(STAMP) ## a new signing key pair NAME: writes the secret [OUT], prints the public key
	$(SP) cache keygen $(NAME) $(if $(OUT),--out $(OUT))

cache-import: $(STAMP) ## push the engines of the bundle BUNDLE (a folder) into CACHE, signed with KEY
	$(SP) cache import $(BUNDLE) $(if $(CACHE),--cache $(CACHE)) $(if $(KEY),--key $(KEY)) $(OVERRIDES)

w12-promote: $(STAMP) ## lab: check a measured W12 TABLE and copy it into kernels/w12/ (moves W12 engine ids)
	$(VENV)/bin/python -m specpilot_lab.w12_promote $(TABLE)
