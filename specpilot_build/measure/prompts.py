"""Prompts: the engine's own tokenizer and chat template turn each first turn into prompt ids on the client.

Every arm of a comparison therefore receives byte-identical input ids. A model without a chat template (or a
setting that turns it off with `model.chat_template: none`) gets the plain text with the tokenizer's special
tokens (e.g. BOS). The digest of a prompt is sha256 of its ids written as comma-separated decimals; a chat
template that embeds the current date changes the digest, which is why results also record the UTC date.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from specpilot_build.errors import SpecPilotError

PLAIN = ("none", "plain", "off")


@dataclass(frozen=True)
class Prompt:
    dataset: str
    item_id: str
    ids: list[int]
    digest: str


class PromptRenderer:
    """Renders first turns with the tokenizer and chat template found in a local HF model dir."""

    def __init__(self, model_dir: Path, chat_template: object = None):
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        except (OSError, ValueError) as exc:
            raise SpecPilotError(f"{model_dir}: cannot load the tokenizer ({exc})") from None
        self.template_kwargs = chat_template if isinstance(chat_template, dict) else {}
        off = chat_template is False or (isinstance(chat_template, str) and chat_template.lower() in PLAIN)
        self.uses_chat_template = bool(self.tokenizer.chat_template) and not off
        self.context_length = _context_length(Path(model_dir), self.tokenizer)

    def render(self, text: str) -> list[int]:
        if not self.uses_chat_template:
            return list(self.tokenizer(text, verbose=False)["input_ids"])
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False, **self.template_kwargs
        )
        # The template already holds BOS and role markers: add no special tokens twice.
        return list(self.tokenizer(rendered, add_special_tokens=False, verbose=False)["input_ids"])

    def prompt(self, dataset: str, item_id: str, text: str) -> Prompt:
        ids = self.render(text)
        return Prompt(dataset, item_id, ids, prompt_digest(ids))


def prompt_digest(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def prompts_digest(prompts) -> str:
    """One digest over a whole run's (dataset, item id, prompt digest) triples, in order."""
    triples = [
        [p["dataset"], p["item_id"], p["prompt_digest"]] if isinstance(p, dict) else [p.dataset, p.item_id, p.digest]
        for p in prompts
    ]
    return hashlib.sha256(json.dumps(triples, separators=(",", ":")).encode()).hexdigest()


def _context_length(model_dir: Path, tokenizer) -> int | None:
    config = model_dir / "config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("max_position_embeddings")
        if isinstance(value, int):
            return value
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and value < 10**9 else None
