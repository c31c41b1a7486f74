"""OpenAI's logprobs objects from the engine's (logprob, token id, _) triples.

Chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`. Completions:
`{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`, where each top_logprobs dict holds
the n best tokens and always the chosen one (OpenAI's "up to logprobs+1 elements").

A token's text is what it adds to the decoded text after the tokens before it: decoded alone, a sentencepiece
token loses its leading space ("▁upon" -> "upon"), so each token (and each alternative) is decoded after a
few tokens of context and the context's own text cut off. A special token (BOS, EOS, <|im_end|>) is shown by
its name and adds nothing to the text, so `text_offset` indexes the choice's text. A token that ends inside
a UTF-8 character shows U+FFFD; the token that completes it carries the whole character.
"""

from __future__ import annotations

CONTEXT_TOKENS = 6  # enough to settle a token's leading space and a split UTF-8 character


class TokenTexts:
    """Token texts in context, for one sequence: feed the tokens in order with `advance`."""

    def __init__(self, tokenizer, context: list[int]):
        self.tokenizer = tokenizer
        self.special = set(tokenizer.all_special_ids)
        self.context = list(context[-CONTEXT_TOKENS:])

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
        decode = self.tokenizer.batch_decode
        before, *after = decode([self.context] + [self.context + [c] for c in candidates], skip_special_tokens=True)
        settled = before.rstrip("\ufffd")  # a character the candidate may complete
        return [text[len(before) :] if text.startswith(before) else text[len(settled) :] for text in after]


def adds_text(texts: TokenTexts, token: int) -> bool:
    return token not in texts.special


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
                "adds": len(token_text) if adds_text(texts, token) else 0,
                "top": [(text, alt_logprob) for text, (alt_logprob, _, _) in zip(alt_texts, top)],
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
                "bytes": list(item["token"].encode("utf-8")),
                "top_logprobs": [
                    {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
                    for text, logprob in item["top"]
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
        for text, logprob in item["top"]:
            best.setdefault(text, logprob)  # two ids with one text: the likelier (they come best first)
        best.setdefault(item["token"], item["logprob"])
        tops.append(best)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}, offset
