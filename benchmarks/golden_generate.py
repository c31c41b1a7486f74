"""A golden set through a served engine's /generate: how many tokens of the oracle's greedy continuation came back.
Standard library only (runs on a host with an installed bundle and nothing else). Two golden formats:
llama2.c's `golden_greedy.json` (one prompt: `prompt_ids`, `sequence_ids`) and a checkpoint's golden set committed
with its lock (`lockfiles/golden/*.json`: `cases`, each with `prompt_ids` and `greedy_ids`).

    python3 benchmarks/golden_generate.py <port> <golden.json>
    # prints "<tokens matching the golden>/<golden tokens> <tok/s> <output ids as json>"
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path


def golden_cases(golden: dict) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, wanted continuation) per case, from either golden format."""
    if "cases" in golden:
        return [(case["prompt_ids"], case["greedy_ids"]) for case in golden["cases"]]
    return [(golden["prompt_ids"], golden["sequence_ids"][len(golden["prompt_ids"]) :])]


def generate(port: int, prompt: list[int], max_new_tokens: int) -> list[int]:
    body = json.dumps(
        {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    ).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=300))["output_ids"]


def matching_prefix(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def golden_generate(port: int, golden_path: Path) -> tuple[int, int, float, list]:
    """(matching tokens, golden tokens, tok/s over the requests, output ids: one list, or one per case)."""
    golden = json.loads(Path(golden_path).read_text())
    cases = golden_cases(golden)
    same = total = produced = 0
    outputs = []
    seconds = 0.0
    for prompt, want in cases:
        start = time.perf_counter()
        got = generate(port, prompt, len(want))
        seconds += time.perf_counter() - start
        same, total, produced = same + matching_prefix(got, want), total + len(want), produced + len(got)
        outputs.append(got)
    return same, total, produced / seconds, outputs if "cases" in golden else outputs[0]


if __name__ == "__main__":
    same, total, tok_s, got = golden_generate(int(sys.argv[1]), Path(sys.argv[2]))
    print(f"{same}/{total} {tok_s:.1f} {json.dumps(got)}")
