#!/bin/sh
# SpecPilot from an installed bundle (bin/specpilot in the prefix): every verb, with the engine store, the
# data directory (models, run records, results) and the Hugging Face cache inside the prefix, the prefix's
# SpecPilot and environment first on PYTHONPATH, the hub offline and no mirror. PYTHON=... picks the interpreter.
set -e
prefix=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd -P)
SPECPILOT_ENGINES="$prefix/engines"
SPECPILOT_DATA="$prefix/data"
HF_HUB_CACHE="$prefix/data/huggingface/hub"
HF_HUB_OFFLINE=1
SPECPILOT_MIRROR=
PYTHONPATH="$prefix/specpilot"
if [ -d "$prefix/env" ]; then
    SPECPILOT_ENV="$prefix/env"   # serve puts it on the engine's PYTHONPATH, after the engine tree's own entries
    PYTHONPATH="$prefix/env:$PYTHONPATH"
    export SPECPILOT_ENV
else
    unset SPECPILOT_ENV
fi
export SPECPILOT_ENGINES SPECPILOT_DATA HF_HUB_CACHE HF_HUB_OFFLINE SPECPILOT_MIRROR PYTHONPATH
exec "${PYTHON:-python3}" -m specpilot_build.cli "$@"
