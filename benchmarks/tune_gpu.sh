#!/usr/bin/env bash
# `make tune` on a lent GPU (issue #39): SpecPilot runs from this checkout there, the arms' environment, model and
# datasets come from an installed bundle, trials are built there from the pinned SGLang wheel and served on the GPU.
# Run from the repo root on the device, in steps, because a call carries at most 64 MiB and lasts at most 10 minutes:
#
#   bash benchmarks/tune_gpu.sh stage           # copy what this call carried (KIT=.tunekit) into WORK; repeat per call
#   bash benchmarks/tune_gpu.sh start ARGS...   # install (wheels, bundle, SGLang wheel) and start `specpilot tune
#                                               # ARGS` detached (setsid): it outlives the call, not the lease
#   bash benchmarks/tune_gpu.sh wait [SECONDS]  # follow the tune until it ends or SECONDS (default 540) pass, then
#                                               # pack the study, reports, results, verify statements and the winner
#                                               # file into $OUT/tune-results.tar.xz (call again to keep waiting)
#
# Made here beforehand (all under .tunekit/, ignored by git):
#   make bundle ENGINE="<ar id> <stock id>" HOST=h200 PART_MB=40     # the setting's ar and stock arms (3 parts)
#   copy <data>/bundles/<archive id>/{index.json,install.py,part-*} and <data>/wheels/<the lock's SGLang wheel>
#   into .tunekit/<call>/ so that no call carries more than ~58 MiB, and the wheels SpecPilot needs that the host
#   lacks into .tunekit/whl/ (pip download --python-version 3.12 ...: hydra-core omegaconf antlr4-python3-runtime
#   blake3 optuna sqlalchemy alembic mako colorlog cryptography cffi pycparser zstandard; the host has numpy,
#   scipy, matplotlib, rich, httpx, tqdm, pyyaml, fsspec, filelock and prometheus-client)
#
# Dry run on a CPU (the same steps for the embedded default; no wheels, no GPU; the winner file lands in conf/, so
# point SPECPILOT_CONF at a scratch copy of conf/):
#   specpilot bundle <ar id> <stock id> --part-mb 1 --out /tmp/b          # of cpu_c1_stories260k_ngram
#   export WORK=/tmp/tg OUT=/tmp/tg_out PYTHON=.venv/bin/python; mkdir -p $OUT
#   KIT=/tmp/b bash benchmarks/tune_gpu.sh stage
#   bash benchmarks/tune_gpu.sh start --setting cpu_c1_stories260k_ngram --space ngram --trials 2 --limit 2 --leaders 0
#   bash benchmarks/tune_gpu.sh wait 300
#
# Environment: KIT=.tunekit  WORK=/tmp/tune_gpu  SITE=$WORK/site  PREFIX=$WORK/prefix  PYTHON=python3
set -euo pipefail

KIT=${KIT:-.tunekit}
WORK=${WORK:-/tmp/tune_gpu}
SITE=${SITE:-$WORK/site}
PREFIX=${PREFIX:-$WORK/prefix}
PYTHON=${PYTHON:-python3}
STAGED=$WORK/kit
LOG=$WORK/tune.log
PIDFILE=$WORK/tune.pid
mkdir -p "$STAGED"

environment() {
    # as the prefix's bin/specpilot runs SpecPilot (its env on the path), this checkout and the wheels first
    export PYTHONPATH=$PWD:$PWD/runtimes/reference:$PWD/kernels:$PWD/lab:$SITE:$PREFIX/env
    export SPECPILOT_DATA=$PREFIX/data SPECPILOT_ENGINES=$PREFIX/engines
    # a bundle made with HOST= carries the engines' environment (SGLang's); one of reference-runtime engines has none
    if [[ -d "$PREFIX/env" ]]; then export SPECPILOT_ENV=$PREFIX/env; fi
    export HF_HUB_CACHE=$PREFIX/data/huggingface/hub HF_HUB_OFFLINE=1 SPECPILOT_MIRROR=
    export PYTHONUNBUFFERED=1
}

stage() {
    # every carried file lands flat in STAGED (bundle parts, index.json, install.py, wheels)
    find "$KIT" -type f -exec cp -t "$STAGED" {} +
    ls -l "$STAGED"
}

start() {
    if [[ ! -d "$PREFIX" ]]; then
        echo "== bundle into $PREFIX"
        mkdir -p "$WORK/bundle"
        mv "$STAGED"/part-* "$STAGED"/index.json "$STAGED"/install.py "$WORK/bundle/"
        "$PYTHON" "$WORK/bundle/install.py" "$WORK/bundle" "$PREFIX"
        mkdir -p "$PREFIX/data/wheels"
        # the lock's SGLang wheel, which trials are built from (not installed here; a reference-runtime setting
        # needs none)
        if compgen -G "$STAGED/sglang-*.whl" > /dev/null; then mv "$STAGED"/sglang-*.whl "$PREFIX/data/wheels/"; fi
    fi
    if [[ ! -d "$SITE" ]] && compgen -G "$STAGED/*.whl" > /dev/null; then
        echo "== wheels into $SITE"
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
            "$STAGED"/*.whl 2>&1 | grep -v "^WARNING" || true
    fi
    environment
    "$PYTHON" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'
    echo "== specpilot tune $*"
    setsid nohup "$PYTHON" -m specpilot_build.cli tune "$@" > "$LOG" 2>&1 < /dev/null &
    echo $! > "$PIDFILE"
    sleep 5
    tail -n 20 "$LOG"
}

wait_and_pack() {
    local limit=${1:-540} pid
    pid=$(cat "$PIDFILE")
    local until=$((SECONDS + limit))
    while kill -0 "$pid" 2> /dev/null && ((SECONDS < until)); do sleep 10; done
    if kill -0 "$pid" 2> /dev/null; then echo "== tune still running (pid $pid)"; else echo "== tune ended"; fi
    environment
    # the log without its progress-bar redraws
    tr '\r' '\n' < "$LOG" | grep -v -E '^\s*$' | tail -n 120
    rm -rf "$WORK/pack" && mkdir -p "$WORK/pack"
    cp "$LOG" "$WORK/pack/"
    if [[ -d conf/mechanism/tuned ]]; then cp -r conf/mechanism/tuned "$WORK/pack/tuned-mechanisms"; fi
    # the study, its reports, every run's results and verify statement, the servers' logs
    for d in tune results runs; do
        if [[ -d "$PREFIX/data/$d" ]]; then cp -r "$PREFIX/data/$d" "$WORK/pack/$d"; fi
    done
    tar -C "$WORK" -cJf "$OUT/tune-results.tar.xz" pack
    ls -l "$OUT"
}

case ${1:-} in
    stage) stage ;;
    start) shift && start "$@" ;;
    wait) shift && wait_and_pack "$@" ;;
    *) echo "usage: $0 stage | start TUNE-ARGS... | wait [SECONDS]" >&2 && exit 2 ;;
esac
