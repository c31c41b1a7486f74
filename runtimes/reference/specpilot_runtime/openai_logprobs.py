"""OpenAI's logprobs objects from the engine's (logprob, token id, _) triples.

Chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`. Completions:
`{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`, where each top_logprobs dict holds
the n best tokens and always the chosen one (OpenAI's "up to logprobs+1 elements").

A token's text is what it adds to the decoded text after the tokens before it: decoded alone, a sentencepiece
token loses its leading space ("▁upon" -> "upon"), so each token (and each alternative) is decoded after a
few tokens of context and the context's own text cut off. A special token (BOS, EOS, <|im_end|>) is shown by
its name and adds nothing to the text, so `text_offset` indexes the choice's text. A token that ends inside
a UTF-8 character shows U+FFFD there and the token that completes it the whole character; `bytes` are each
token's own bytes (a byte-fallback piece `<0xF0>`, a byte-level BPE piece decoded), so the bytes of
consecutive tokens join into the text's UTF-8, as OpenAI's do.
"""

from __future__ import annotations

import re

CONTEXT_TOKENS = 6  # enough to settle a token's leading space and a split UTF-8 character
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for themselves, the others for
    256 + their rank."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


BYTE_LEVEL = _byte_level_decoder()


class TokenTexts:
    """Token texts in context, for one sequence: feed the tokens in order with `advance`."""

    def __init__(self, tokenizer, context: list[int]):
        self.tokenizer = tokenizer
        self.special = set(tokenizer.all_special_ids)
        self.context = list(context[-CONTEXT_TOKENS:])
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = backend is not None and "ByteLevel" in str(backend.decoder)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            # what tokenizer.decode does then, without its per-id Python conversions; one at a time (decode_batch's
            # thread pool only adds contention for two dozen short sequences)
            self.decode_batch = lambda seqs: [backend.decode(ids, skip_special_tokens=True) for ids in seqs]
        else:
            self.decode_batch = lambda seqs: tokenizer.batch_decode(seqs, skip_special_tokens=True)

    def token_bytes(self, token: int, text: str) -> list[int]:
        """The token's own bytes: its raw byte for a byte-fallback piece, its BPE bytes for a byte-level piece,
        else its text's UTF-8."""
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if token in self.special or not isinstance(piece, str):
            return list(text.encode("utf-8"))
        if match := BYTE_PIECE.fullmatch(piece):
            return [int(match[1], 16)]
        if self.byte_level and all(c in BYTE_LEVEL for c in piece):
            return [BYTE_LEVEL[c] for c in piece]
        return list(text.encode("utf-8"))

    def texts(self, candidates: list[int]) -> list[str]:
        """What each candidate token would add after the context."""
        plain = [c for c in candidates if c not in self.special]
        decoded = dict(zip(plain, self._after(plain)))
        return [self.tokenizer.convert_ids_to_tokens(c) if c in self.special else decoded[c] for c in candidates]

    def advance(self, token: int) -> None:
        self.context = (self.context + [token])[-CONTEXT_TOKENS:]

    def _after(self, candidates: list[int]) -> list[str]:
        if not candidates:
            return []
        before, *after = self.decode_batch([self.context] + [self.context + [c] for c in candidates])
        settled = before.rstrip("\ufffd")  # a character the candidate may complete
        return [text[len(before) :] if text.startswith(before) else text[len(settled) :] for text in after]


def entries(texts: TokenTexts, chosen: list, tops: list) -> list[dict]:
    """One dict per token: its text, logprob (None for a prompt's first token) and best alternatives in
    engine order, advancing `texts` past each token."""
    out = []
    for (logprob, token, _), top in zip(chosen, tops):
        top = top or []
        candidates = [token] + [alt for _, alt, _ in top]
        token_text, *alt_texts = texts.texts(candidates)
        out.append(
            {
                "token": token_text,
                "logprob": logprob,
                "bytes": texts.token_bytes(token, token_text),
                # a split character is counted with the token that completes it
                "adds": 0 if token in texts.special else len(token_text.rstrip("\ufffd")),
                "top": [
                    (text, alt_logprob, texts.token_bytes(alt, text))
                    for text, (alt_logprob, alt, _) in zip(alt_texts, top)
                ],
            }
        )
        texts.advance(token)
    return out


def chat_logprobs(items: list[dict]) -> dict:
    return {
        "content": [
            {
                "token": item["token"],
                "logprob": item["logprob"],
                "bytes": item["bytes"],
                "top_logprobs": [
                    {"token": text, "logprob": logprob, "bytes": raw} for text, logprob, raw in item["top"]
                ],
            }
            for item in items
        ],
        "refusal": None,
    }


def completion_logprobs(items: list[dict], offset: int) -> tuple[dict, int]:
    """The completions logprobs object for `items`, their text offsets counted from `offset`; and the offset
    after them (for the next streamed chunk)."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for item in items:
        tokens.append(item["token"])
        logprobs.append(item["logprob"])
        offsets.append(offset)
        offset += item["adds"]
        if item["logprob"] is None:  # a prompt's first token: nothing scored it
            tops.append(None)
            continue
        best: dict[str, float] = {}
        for text, logprob, _ in item["top"]:
            best.setdefault(text, logprob)  # two ids with one text: the likelier (they come best first)
        best.setdefault(item["token"], item["logprob"])
        tops.append(best)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}, offset
