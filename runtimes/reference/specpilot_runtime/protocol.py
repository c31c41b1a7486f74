"""Request parsing and validation for the native (/generate) and OpenAI-style endpoints.

Every malformed request becomes an `ApiError` (a 4xx with a message), never an exception in the engine.
Decoding is greedy only: temperature 0 (or absent) is accepted, anything that would change the argmax
(temperature > 0, penalties, min_new_tokens) is refused with 400.
"""
from __future__ import annotations

from dataclasses import dataclass

from .engine import GenerationRequest

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for /generate
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TOP_LOGPROBS = 20
GREEDY_TEMPERATURE = 1e-5  # SGLang treats temperatures this small as greedy

# Sampling parameters that are meaningless under greedy decoding whatever their value.
IGNORED_SAMPLING = {"top_p", "top_k", "min_p", "skip_special_tokens", "spaces_between_special_tokens",
                    "no_stop_trim", "seed", "sampling_seed"}
# Parameters that would change the argmax unless they have their neutral value.
NEUTRAL_SAMPLING = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                    "min_new_tokens": 0, "n": 1}
GENERATE_KEYS = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                 "top_logprobs_num", "return_text_in_logprobs", "stream", "rid", "token_ids_logprob"}


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    context_length: int
    eos_token_ids: frozenset[int]


def parse_generate(body, tokenizer, limits: ModelLimits) -> tuple[GenerationRequest, bool]:
    """A native /generate body -> (request, return_text_in_logprobs)."""
    _require(isinstance(body, dict), "the request body must be a JSON object")
    for key, value in body.items():
        _require(key in GENERATE_KEYS or value is None, f"unknown field {key!r}")
    text, input_ids = body.get("text"), body.get("input_ids")
    _require((text is None) != (input_ids is None), "give exactly one of 'text' and 'input_ids'")
    if text is not None:
        _require(isinstance(text, str), "'text' must be a string (batched requests are not supported)")
        input_ids = encode_text(tokenizer, text)
    else:
        input_ids = _token_ids(input_ids, "input_ids", limits)
    _require(body.get("token_ids_logprob") is None, "'token_ids_logprob' is not supported")
    params = body.get("sampling_params")
    params = {} if params is None else params
    _require(isinstance(params, dict), "'sampling_params' must be a JSON object")
    max_new = _int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS), "sampling_params.max_new_tokens")
    return_logprob = _bool(body.get("return_logprob", False), "return_logprob")
    start = _int(body.get("logprob_start_len", -1), "logprob_start_len", minimum=-1)
    _require(start < len(input_ids), f"logprob_start_len {start} must be less than the input length "
                                     f"{len(input_ids)}")
    top_n = _int(body.get("top_logprobs_num", 0), "top_logprobs_num")
    _require(top_n <= MAX_TOP_LOGPROBS, f"top_logprobs_num must be at most {MAX_TOP_LOGPROBS}")
    request = GenerationRequest(
        input_ids=input_ids,
        max_new_tokens=max_new,
        stop_token_ids=_stop_ids(params, limits),
        stop_strings=_stop_strings(params.get("stop"), "sampling_params.stop"),
        return_logprob=return_logprob,
        logprob_start_len=start if return_logprob else -1,
        top_logprobs_num=top_n if return_logprob else 0,
        stream=_bool(body.get("stream", False), "stream"),
    )
    _check_sampling(params, "sampling_params", extra_allowed={"max_new_tokens", "stop", "stop_token_ids",
                                                              "ignore_eos", "temperature"})
    _check_length(request, limits)
    return request, _bool(body.get("return_text_in_logprobs", False), "return_text_in_logprobs")


def parse_completion(body, tokenizer, limits: ModelLimits) -> GenerationRequest:
    """An OpenAI /v1/completions body."""
    _require(isinstance(body, dict), "the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        input_ids = encode_text(tokenizer, prompt)
    elif isinstance(prompt, list):
        input_ids = _token_ids(prompt, "prompt", limits)
    else:
        raise ApiError("'prompt' must be a string or a list of token ids (one prompt per request)")
    _require(not body.get("echo"), "'echo' is not supported; use /generate with logprob_start_len")
    _require(body.get("logprobs") in (None, False, 0),
             "'logprobs' is not supported here; use /generate with return_logprob")
    return _openai_request(body, input_ids, limits, "max_tokens")


def parse_chat(body, tokenizer, limits: ModelLimits) -> GenerationRequest:
    """An OpenAI /v1/chat/completions body; the chat template is the tokenizer's, else plain text."""
    _require(isinstance(body, dict), "the request body must be a JSON object")
    messages = body.get("messages")
    _require(isinstance(messages, list) and messages, "'messages' must be a non-empty list")
    plain = []
    for i, message in enumerate(messages):
        _require(isinstance(message, dict) and isinstance(message.get("role"), str),
                 f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            _require(all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                         for p in content), f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        _require(isinstance(content, str), f"messages[{i}].content must be a string")
        plain.append({"role": message["role"], "content": content})
    _require(not body.get("logprobs"), "'logprobs' is not supported here; use /generate with return_logprob")
    if getattr(tokenizer, "chat_template", None):
        input_ids = list(tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))
    else:
        input_ids = encode_text(tokenizer, "\n".join(m["content"] for m in plain))
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _openai_request(body, input_ids, limits, max_key)


def encode_text(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


# ------------------------------------------------------------------ helpers
def _openai_request(body: dict, input_ids: list[int], limits: ModelLimits, max_key: str) -> GenerationRequest:
    max_tokens = body.get(max_key)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS if max_key == "max_tokens" and "messages" not in body else \
            limits.context_length - len(input_ids)
    request = GenerationRequest(
        input_ids=input_ids,
        max_new_tokens=_int(max_tokens, max_key),
        stop_token_ids=_stop_ids(body, limits),
        stop_strings=_stop_strings(body.get("stop"), "stop"),
        stream=_bool(body.get("stream", False), "stream"),
    )
    _check_sampling({k: body[k] for k in ("temperature", "frequency_penalty", "presence_penalty",
                                          "repetition_penalty", "n", "min_new_tokens") if k in body}, "body")
    _check_length(request, limits)
    return request


def _check_sampling(params: dict, where: str, extra_allowed: set[str] = frozenset()) -> None:
    for key, value in params.items():
        if key == "temperature":
            _require(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                       and value >= 0), f"{where}.temperature must be a number >= 0")
            _require(value is None or value <= GREEDY_TEMPERATURE,
                     "only greedy decoding is supported: set temperature to 0")
        elif key in NEUTRAL_SAMPLING:
            _require(value is None or value == NEUTRAL_SAMPLING[key],
                     f"{where}.{key}={value!r} is not supported (greedy decoding only)")
        elif key not in IGNORED_SAMPLING and key not in extra_allowed:
            raise ApiError(f"unknown sampling parameter {where}.{key}")


def _check_length(request: GenerationRequest, limits: ModelLimits) -> None:
    total = len(request.input_ids) + request.max_new_tokens
    if len(request.input_ids) >= limits.context_length or total > limits.context_length:
        raise ApiError(
            f"Requested token count exceeds the model's maximum context length of {limits.context_length} "
            f"tokens. You requested a total of {total} tokens: {len(request.input_ids)} tokens from the input "
            f"and {request.max_new_tokens} tokens for the completion.")


def _stop_ids(params: dict, limits: ModelLimits) -> frozenset[int]:
    ids = params.get("stop_token_ids") or []
    ids = set(_token_ids(ids, "stop_token_ids", limits, allow_empty=True))
    if not _bool(params.get("ignore_eos", False), "ignore_eos"):
        ids |= limits.eos_token_ids
    return frozenset(ids)


def _stop_strings(stop, where: str) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    _require(isinstance(stop, list) and all(isinstance(s, str) and s for s in stop),
             f"'{where}' must be a non-empty string or a list of them")
    return tuple(stop)


def _token_ids(ids, where: str, limits: ModelLimits, allow_empty: bool = False) -> list[int]:
    _require(isinstance(ids, list), f"'{where}' must be a list of token ids")
    _require(allow_empty or ids, f"'{where}' must not be empty")
    for token in ids:
        _require(isinstance(token, int) and not isinstance(token, bool),
                 f"'{where}' must hold integers (batched requests are not supported)")
        _require(0 <= token < limits.vocab_size,
                 f"'{where}' holds {token}, outside the vocabulary 0..{limits.vocab_size - 1}")
    return list(ids)


def _int(value, where: str, minimum: int = 0) -> int:
    _require(isinstance(value, int) and not isinstance(value, bool), f"'{where}' must be an integer")
    _require(value >= minimum, f"'{where}' must be >= {minimum}")
    return value


def _bool(value, where: str) -> bool:
    _require(isinstance(value, bool), f"'{where}' must be true or false")
    return value


def _require(condition, message: str) -> None:
    if not condition:
        raise ApiError(message)
