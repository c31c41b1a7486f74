"""The golden prompt through a served engine's /generate: how many tokens of llama2.c's greedy continuation came
back. Standard library only (runs on a host with an installed bundle and nothing else).

    python3 benchmarks/golden_generate.py <port> <golden_greedy.json>
    # prints "<tokens matching the golden>/<golden tokens> <tok/s> <output ids as json>"
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path


def golden_generate(port: int, golden_path: Path) -> tuple[int, int, float, list[int]]:
    """(matching tokens, golden tokens, tok/s of the request, output ids)."""
    golden = json.loads(Path(golden_path).read_text())
    prompt, want = golden["prompt_ids"], golden["sequence_ids"][len(golden["prompt_ids"]) :]
    body = json.dumps(
        {"input_ids": prompt, "sampling_params": {"max_new_tokens": len(want), "temperature": 0}}
    ).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    got = json.load(urllib.request.urlopen(request, timeout=300))["output_ids"]
    seconds = time.perf_counter() - start
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return same, len(want), len(got) / seconds, got


if __name__ == "__main__":
    same, total, tok_s, got = golden_generate(int(sys.argv[1]), Path(sys.argv[2]))
    print(f"{same}/{total} {tok_s:.1f} {json.dumps(got)}")
