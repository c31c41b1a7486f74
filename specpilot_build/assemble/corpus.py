"""A corpus drafter (recipe (d)) as SGLang NGRAM's external corpus: corpus/<lock key>.jsonl in the engine tree.

SGLang 0.5.17 reads `--speculative-ngram-external-corpus-path` as JSONL, one JSON string per line
(sglang/srt/speculative/cpp_ngram/external_corpus.py), re-tokenizes each line with the target's tokenizer
(add_special_tokens=False) and loads the documents, separated, into the suffix automaton whose matches fill
`--speculative-ngram-external-sam-budget` nodes of each draft tree. The pinned corpus holds tokens, so every row
(prompt then the target's greedy output, in the corpus's order: what the reference runtime seeds) is decoded with
the tokenizer files the corpus carries (byte-identical to the target's, checked when it was made), special tokens
kept and spaces not cleaned up, and written as one ASCII-escaped JSON string per line. The file is an ordinary tree
file (hashed in the manifest, so the engine id covers it); its inputs are the corpus's pin and the decoder's version
(the manifest's inputs.corpus). Re-tokenizing may merge or split a few tokens where decode-then-encode does not
round-trip: that changes which drafts are proposed (acceptance), never an emitted token (verification keeps the
target's)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from specpilot_build.config.effective import CORPUS_MAX_TOKENS_FLAG, is_corpus
from specpilot_build.errors import ConfigError, SpecPilotError
from specpilot_build.pins.lockfile import CheckpointPin

CORPUS_DIR = "corpus"
SGLANG_MAX_TOKENS = 10_000_000  # SGLang 0.5.17's --speculative-ngram-external-corpus-max-tokens default
TOKENIZER = "tokenizer.json"


def external_corpus_path(cfg: dict) -> str | None:
    """The tree path of an SGLang engine's external corpus (named by the corpus's lock key), or None."""
    if cfg["runtime"]["name"] == "reference" or not is_corpus(cfg["drafter"]):
        return None
    from specpilot_build.models.drafters import lock_key

    key = lock_key(cfg["drafter"].get("made_for") or cfg["model"]["name"], cfg["drafter"]["recipe"])
    return f"{CORPUS_DIR}/{key}.jsonl"


def decoder_record() -> dict:
    """What turns the corpus's tokens into text, part of the build's inputs."""
    import tokenizers

    return {"tokenizers": tokenizers.__version__, "decode": {"skip_special_tokens": False}}


def write_external_corpus(tree: Path, cfg: dict, pin: CheckpointPin) -> dict:
    """Write the JSONL for the pinned corpus `pin` (its store directory re-hashed against the pin first) at
    external_corpus_path(cfg) in `tree`; return {documents, tokens}: the rows and the tokens SGLang's reader will
    count after re-tokenizing (separators included), refused in one line above the max-tokens flag."""
    from tokenizers import Tokenizer

    from specpilot_build.models.drafters import corpus_rows, stored_drafter

    relpath = external_corpus_path(cfg)
    assert relpath is not None
    directory = stored_drafter(pin.as_record(), cfg)
    if not (directory / TOKENIZER).is_file():
        raise SpecPilotError(f"{directory}: no {TOKENIZER} to decode the corpus with")
    tokenizer = Tokenizer.from_file(str(directory / TOKENIZER))
    rows = corpus_rows(directory, tokenizer.get_vocab_size(with_added_tokens=True))
    lines, counted = [], 0
    for row in rows:
        text = tokenizer.decode(row, skip_special_tokens=False)
        lines.append(json.dumps(text, ensure_ascii=True))
        tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
        counted += tokens + (1 if counted and tokens else 0)  # SGLang's separator between documents
    limit = cfg["runtime"]["launch_args"].get(CORPUS_MAX_TOKENS_FLAG, SGLANG_MAX_TOKENS)
    if counted > limit:
        raise ConfigError(
            f"launch_args.{CORPUS_MAX_TOKENS_FLAG} {limit}: the corpus {pin.repo} is {counted} tokens once SGLang "
            "re-tokenizes it (separators included); SGLang would refuse to start"
        )
    path = tree / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(("\n".join(lines) + "\n").encode("ascii"))
    os.chmod(path, 0o644)
    return {"documents": len(lines), "tokens": counted}
