"""Request parsing and validation for the native (/generate) and OpenAI-style endpoints.

Every malformed request becomes an `ApiError` (a 4xx with a message), never an exception in the engine.
Decoding is greedy only: temperature 0 (or absent) is accepted, anything that would change the argmax
(temperature > 0, penalties, min_new_tokens) is refused with 400. The OpenAI endpoints refuse, naming it, a
parameter this server cannot honour (tools, response_format, n > 1, ...) or does not know (as OpenAI does),
and a `model` other than the served name or the engine id with 404 (`check_model`).

`load_json` turns the raw body into plain JSON values and refuses, with 400, what the parsers below must
never see: invalid UTF-8 or JSON, NaN/Infinity, integers longer than Python's 4,300-digit conversion limit,
nesting deeper than MAX_JSON_DEPTH, and strings (keys included) holding lone UTF-16 surrogates (they cannot
be tokenized or written back as UTF-8). `request_schemas` describes the three request bodies as pydantic
models for the OpenAPI schema; the validation itself stays here, with its messages.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Literal, Union

from .engine import GenerationRequest

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for /generate
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat's top_logprobs (its completions allow 5; here 20 too)
GREEDY_TEMPERATURE = 1e-5  # SGLang treats temperatures this small as greedy

# Sampling parameters that are meaningless under greedy decoding whatever their value.
IGNORED_SAMPLING = {
    "top_p",
    "top_k",
    "min_p",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "seed",
    "sampling_seed",
}
# Parameters that would change the argmax unless they have their neutral value.
NEUTRAL_SAMPLING = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
}
GENERATE_KEYS = {
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "stream",
    "rid",
    "token_ids_logprob",
}
# OpenAI request fields: the ones honoured, and the ones accepted without effect (bookkeeping for OpenAI's own
# service, or sampling knobs that greedy decoding makes moot).
OPENAI_KEYS = {
    "model",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "stream_options",
    "max_tokens",
    "logprobs",
    "temperature",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    *IGNORED_SAMPLING,
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "parallel_tool_calls",
}
COMPLETION_KEYS = OPENAI_KEYS | {"prompt", "echo", "best_of", "suffix", "logit_bias"}
CHAT_KEYS = OPENAI_KEYS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "logit_bias",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
}
# Known OpenAI parameters that would change the answer: accepted only at these values (or null).
UNHONOURED = {
    "best_of": (1,),
    "suffix": ("",),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
}
MAX_JSON_DEPTH = 32  # the deepest valid body nests 4 levels (messages[i].content[j].text)
COUNT_FIRST_CHARS = 4096  # texts longer than this are counted before they are tokenized into a list
MAX_INT_DIGITS = 4300  # Python's default int_max_str_digits: longer integers cannot even be printed


class ApiError(Exception):
    """A refused request: the HTTP status, a message, and (OpenAI's error fields) the parameter and a code."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    context_length: int
    eos_token_ids: frozenset[int]


def load_json(raw: bytes):
    """The request body's JSON value, or ApiError (400) for anything that is not plain, printable JSON."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_int=_bounded_int, parse_float=_finite_float)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise ApiError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # what parse_int / parse_float leave to Python (never expected)
        raise ApiError(f"the request body is not valid JSON ({exc})") from None
    _check_tree(body)
    return body


def _no_constant(name: str):
    raise ApiError(f"the request body is not valid JSON ({name} is not a JSON number)")


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise ApiError(
            f"the request body holds an integer of {len(digits.lstrip('-'))} digits; "
            f"at most {MAX_INT_DIGITS} are accepted"
        )
    return int(digits)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ApiError(f"the request body holds the number {text[:40]}, which is out of range")
    return value


def _check_tree(body) -> None:
    """Nesting depth and lone surrogates, checked without recursion (so any depth json accepted is safe)."""
    stack = [(body, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ApiError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_text(key, f"{where}.{_ascii(key)}" if where else _ascii(key), key=True)
                    stack.append((item, depth + 1, f"{where}.{_ascii(key)}" if where else _ascii(key)))
            else:
                stack.extend((item, depth + 1, f"{where}[{i}]") for i, item in enumerate(value))


def _check_text(text: str, where: str, key: bool = False) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        what = "the key" if key else "the string"
        raise ApiError(
            f"{what} at '{where or '(body)'}' holds a lone UTF-16 surrogate "
            f"({_ascii(text[exc.start : exc.end])} at index {exc.start}); it is not valid Unicode"
        ) from None


def _ascii(text: str, limit: int = 60) -> str:
    """Text quoted for an error message: printable ASCII whatever it holds, and short."""
    shown = text.encode("ascii", "backslashreplace").decode("ascii")
    return shown if len(shown) <= limit else shown[:limit] + "..."


def parse_generate(body, tokenizer, limits: ModelLimits) -> tuple[GenerationRequest, bool]:
    """A native /generate body -> (request, return_text_in_logprobs)."""
    _require(isinstance(body, dict), "the request body must be a JSON object")
    for key, value in body.items():
        _require(key in GENERATE_KEYS or value is None, f"unknown field '{_ascii(key)}'")
    text, input_ids = body.get("text"), body.get("input_ids")
    _require((text is None) != (input_ids is None), "give exactly one of 'text' and 'input_ids'")
    if text is not None:
        _require(isinstance(text, str), "'text' must be a string (batched requests are not supported)")
        input_ids = encode_text(tokenizer, text, limits.context_length)
    else:
        input_ids = _token_ids(input_ids, "input_ids", limits)
    _require(body.get("token_ids_logprob") is None, "'token_ids_logprob' is not supported")
    params = body.get("sampling_params")
    params = {} if params is None else params
    _require(isinstance(params, dict), "'sampling_params' must be a JSON object")
    max_new = _int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS), "sampling_params.max_new_tokens")
    return_logprob = _bool(body.get("return_logprob", False), "return_logprob")
    start = _int(body.get("logprob_start_len", -1), "logprob_start_len", minimum=-1)
    _require(
        start < len(input_ids), f"logprob_start_len {_count(start)} must be less than the input length {len(input_ids)}"
    )
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
    _check_sampling(
        params,
        "sampling_params",
        extra_allowed={"max_new_tokens", "stop", "stop_token_ids", "ignore_eos", "temperature"},
    )
    _check_length(request, limits)
    return request, _bool(body.get("return_text_in_logprobs", False), "return_text_in_logprobs")


def parse_completion(body, tokenizer, limits: ModelLimits) -> GenerationRequest:
    """An OpenAI /v1/completions body."""
    _require(isinstance(body, dict), "the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        input_ids = encode_text(tokenizer, prompt, limits.context_length)
    elif isinstance(prompt, list):
        input_ids = _token_ids(prompt, "prompt", limits)
    else:
        raise ApiError("'prompt' must be a string or a list of token ids (one prompt per request)", param="prompt")
    _known_keys(body, COMPLETION_KEYS)
    echo = body.get("echo") is not None and _bool(body["echo"], "echo")
    top_n = body.get("logprobs")
    if top_n is not None:
        top_n = _int(top_n, "logprobs")
        _require(top_n <= MAX_TOP_LOGPROBS, f"'logprobs' must be at most {MAX_TOP_LOGPROBS}", param="logprobs")
        _require(
            not (echo and body.get("stream") is True),
            "'echo' with 'logprobs' is not streamed: send stream=false (the prompt's logprobs come at the end)",
            param="echo",
        )
    return _openai_request(body, input_ids, limits, "max_tokens", top_n, echo)


def parse_chat(body, tokenizer, limits: ModelLimits) -> GenerationRequest:
    """An OpenAI /v1/chat/completions body; the chat template is the tokenizer's, else plain text."""
    _require(isinstance(body, dict), "the request body must be a JSON object")
    messages = body.get("messages")
    _require(isinstance(messages, list) and messages, "'messages' must be a non-empty list")
    plain = []
    for i, message in enumerate(messages):
        _require(
            isinstance(message, dict) and isinstance(message.get("role"), str),
            f"messages[{i}] must be an object with a string 'role'",
        )
        content = message.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            _require(
                all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
                ),
                f"messages[{i}].content: only text parts are supported",
            )
            content = "".join(p["text"] for p in content)
        _require(isinstance(content, str), f"messages[{i}].content must be a string")
        plain.append({"role": message["role"], "content": content})
    _known_keys(body, CHAT_KEYS)
    top_n = None
    if body.get("logprobs") is not None and _bool(body["logprobs"], "logprobs"):
        top_n = 0 if body.get("top_logprobs") is None else _int(body["top_logprobs"], "top_logprobs")
        _require(top_n <= MAX_TOP_LOGPROBS, f"'top_logprobs' must be at most {MAX_TOP_LOGPROBS}", param="top_logprobs")
    else:
        _require(body.get("top_logprobs") is None, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if getattr(tokenizer, "chat_template", None):
        input_ids = list(
            tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
    else:
        input_ids = encode_text(tokenizer, "\n".join(m["content"] for m in plain), limits.context_length)
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _openai_request(body, input_ids, limits, max_key, top_n)


def check_model(body, served: tuple[str, ...]) -> None:
    """An OpenAI body's `model`, when given, must be one of the names this server answers to (else 404)."""
    if not isinstance(body, dict) or body.get("model") is None:
        return
    model = body["model"]
    _require(isinstance(model, str), "'model' must be a string", param="model")
    if model not in served:
        raise ApiError(
            f"The model '{_ascii(model)}' does not exist on this server; it serves '{_ascii(served[0])}' "
            "(GET /v1/models)",
            status=404,
            param="model",
            code="model_not_found",
        )


def encode_text(tokenizer, text: str, context_length: int | None = None) -> list[int]:
    """The text's token ids. A long text is first only counted by the Rust tokenizer (which releases the GIL
    and builds no Python list): one that cannot fit the context is refused without materializing its ids."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if context_length is not None and len(text) > COUNT_FIRST_CHARS and hasattr(backend, "encode_batch"):
        count = len(backend.encode_batch([text], add_special_tokens=True)[0])
        if count >= context_length:
            raise ApiError(
                f"Requested token count exceeds the model's maximum context length of {context_length} "
                f"tokens. The input alone is {count} tokens."
            )
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


# ------------------------------------------------------------------ helpers
def _openai_request(
    body: dict, input_ids: list[int], limits: ModelLimits, max_key: str, top_logprobs: int | None, echo: bool = False
) -> GenerationRequest:
    """The engine request of an OpenAI body; `top_logprobs` None: no logprobs; `echo`: the prompt's too."""
    _require(body.get("model") is None or isinstance(body["model"], str), "'model' must be a string", param="model")
    for key, accepted in UNHONOURED.items():
        _require(
            body.get(key) is None or any(body[key] == a for a in accepted),
            f"'{key}' is not supported by this server (greedy text generation only)",
            param=key,
        )
    options = body.get("stream_options")
    _require(options is None or isinstance(options, dict), "'stream_options' must be a JSON object")
    if options is not None:
        _require(
            options.get("include_usage") is None or isinstance(options["include_usage"], bool),
            "'stream_options.include_usage' must be true or false",
        )
    max_tokens = body.get(max_key)
    if max_tokens is None:  # a prompt longer than the context gets the context-length error, not "max_tokens < 0"
        max_tokens = (
            DEFAULT_MAX_TOKENS
            if max_key == "max_tokens" and "messages" not in body
            else max(limits.context_length - len(input_ids), 0)
        )
    request = GenerationRequest(
        input_ids=input_ids,
        max_new_tokens=_int(max_tokens, max_key),
        stop_token_ids=_stop_ids(body, limits),
        stop_strings=_stop_strings(body.get("stop"), "stop"),
        return_logprob=top_logprobs is not None,
        logprob_start_len=0 if echo and top_logprobs is not None else -1,
        top_logprobs_num=top_logprobs or 0,
        stream=_bool(body.get("stream", False), "stream"),
    )
    _check_sampling(
        {
            k: body[k]
            for k in (
                "temperature",
                "frequency_penalty",
                "presence_penalty",
                "repetition_penalty",
                "n",
                "min_new_tokens",
            )
            if k in body
        },
        "body",
    )
    _check_length(request, limits)
    return request


def _known_keys(body: dict, known: set[str]) -> None:
    for key, value in body.items():
        _require(key in known or value is None, f"unknown parameter '{_ascii(key)}'", param=_ascii(key))


def _check_sampling(params: dict, where: str, extra_allowed: set[str] = frozenset()) -> None:
    for key, value in params.items():
        if key == "temperature":
            _require(
                value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0),
                f"{where}.temperature must be a number >= 0",
                param=key,
            )
            _require(
                value is None or value <= GREEDY_TEMPERATURE,
                "only greedy decoding is supported: set temperature to 0",
                param=key,
            )
        elif key in NEUTRAL_SAMPLING:
            _require(
                value is None or value == NEUTRAL_SAMPLING[key],
                f"{where}.{key}={_ascii(repr(value))} is not supported (greedy decoding only)",
                param=key,
            )
        elif key not in IGNORED_SAMPLING and key not in extra_allowed:
            raise ApiError(f"unknown sampling parameter {where}.{_ascii(key)}")


def _check_length(request: GenerationRequest, limits: ModelLimits) -> None:
    total = len(request.input_ids) + request.max_new_tokens
    if len(request.input_ids) >= limits.context_length or total > limits.context_length:
        raise ApiError(
            f"Requested token count exceeds the model's maximum context length of {limits.context_length} "
            f"tokens. You requested a total of {_count(total)} tokens: {len(request.input_ids)} tokens from the "
            f"input and {_count(request.max_new_tokens)} tokens for the completion."
        )


def _count(n: int) -> str:
    """A count for a message: a client's 4,300-digit integer (plus the prompt) would not even print."""
    return str(n) if n < 10**18 else f"about 10^{n.bit_length() * 30103 // 100000}"


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
    _require(
        isinstance(stop, list) and all(isinstance(s, str) and s for s in stop),
        f"'{where}' must be a non-empty string or a list of them",
    )
    return tuple(stop)


def _token_ids(ids, where: str, limits: ModelLimits, allow_empty: bool = False) -> list[int]:
    _require(isinstance(ids, list), f"'{where}' must be a list of token ids")
    _require(allow_empty or ids, f"'{where}' must not be empty")
    for token in ids:
        _require(
            isinstance(token, int) and not isinstance(token, bool),
            f"'{where}' must hold integers (batched requests are not supported)",
        )
        _require(
            0 <= token < limits.vocab_size,
            f"'{where}' holds {_count(token) if token >= 0 else '-' + _count(-token)}, outside the "
            f"vocabulary 0..{limits.vocab_size - 1}",
        )
    return list(ids)


def _int(value, where: str, minimum: int = 0) -> int:
    _require(isinstance(value, int) and not isinstance(value, bool), f"'{where}' must be an integer", param=where)
    _require(value >= minimum, f"'{where}' must be >= {minimum}", param=where)
    return value


def _bool(value, where: str) -> bool:
    _require(isinstance(value, bool), f"'{where}' must be true or false", param=where)
    return value


def _require(condition, message: str, param: str | None = None) -> None:
    if not condition:
        raise ApiError(message, param=param)


# ------------------------------------------------------------------ OpenAPI description
def request_schemas(limits: ModelLimits, served: tuple[str, ...]) -> dict[str, type]:
    """Pydantic models of the three request bodies, bounded by this model's limits and naming the models
    served (`served`: the names an OpenAI body's `model` may give), for the OpenAPI schema.

    They describe what the parsers above accept (a body the model validates may still be refused for its
    length: prompt plus new tokens must fit the context); they are documentation and fuzzing input, the
    parsers stay the validation.
    """
    from typing import Any

    from pydantic import BaseModel, ConfigDict, Field

    TokenId = Annotated[int, Field(ge=0, lt=limits.vocab_size)]
    TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=limits.context_length - 1)]
    NewTokens = Annotated[int, Field(ge=0, le=limits.context_length)]
    Stop = Union[Annotated[str, Field(min_length=1)], list[Annotated[str, Field(min_length=1)]], None]  # noqa: UP007
    Temperature = Annotated[float, Field(ge=0, le=GREEDY_TEMPERATURE)]
    Ignored = Union[float, bool, None]  # noqa: UP007 (a runtime alias pydantic reads); parameters without effect under greedy decoding

    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid")

    class SamplingParams(Strict):
        max_new_tokens: NewTokens = DEFAULT_MAX_NEW_TOKENS
        temperature: Temperature | None = None
        stop: Stop = None
        stop_token_ids: list[TokenId] | None = None
        ignore_eos: bool = False
        top_p: Ignored = None
        top_k: Ignored = None
        min_p: Ignored = None
        seed: Ignored = None
        frequency_penalty: Literal[0] | None = None
        presence_penalty: Literal[0] | None = None
        repetition_penalty: Literal[1] | None = None
        min_new_tokens: Literal[0] | None = None
        n: Literal[1] | None = None

    class GenerateRequest(Strict):
        """SGLang's native /generate body: exactly one of `text` and `input_ids`."""

        text: str | None = None
        input_ids: TokenIds | None = None
        sampling_params: SamplingParams | None = None
        return_logprob: bool = False
        logprob_start_len: Annotated[int, Field(ge=-1, lt=limits.context_length)] = -1
        top_logprobs_num: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0
        return_text_in_logprobs: bool = False
        stream: bool = False
        rid: str | None = None

    class StreamOptions(BaseModel):
        include_usage: bool | None = None

    TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]

    class OpenAIRequest(Strict):  # an unknown field is refused, as OpenAI refuses one
        model: Literal[served] | None = None  # type: ignore[valid-type]
        stop: Stop = None
        stop_token_ids: list[TokenId] | None = None
        ignore_eos: bool = False
        temperature: Temperature | None = None
        top_p: Ignored = None
        seed: Ignored = None
        frequency_penalty: Literal[0] | None = None
        presence_penalty: Literal[0] | None = None
        n: Literal[1] | None = None
        stream: bool = False
        stream_options: StreamOptions | None = None
        parallel_tool_calls: Any = None  # accepted without effect, as these below
        user: Any = None
        metadata: Any = None
        store: Any = None
        service_tier: Any = None
        prompt_cache_key: Any = None
        safety_identifier: Any = None

    class CompletionRequest(OpenAIRequest):
        """OpenAI /v1/completions: one prompt, as text or token ids."""

        prompt: str | TokenIds
        max_tokens: NewTokens | None = DEFAULT_MAX_TOKENS
        echo: bool | None = None
        best_of: Literal[1] | None = None
        logprobs: TopLogprobs | None = None

    class TextPart(BaseModel):
        type: Literal["text"]
        text: str

    class ChatMessage(BaseModel):
        role: str
        content: str | list[TextPart]

    class ChatCompletionRequest(OpenAIRequest):
        """OpenAI /v1/chat/completions: text messages; the tokenizer's chat template, else the joined text."""

        messages: Annotated[list[ChatMessage], Field(min_length=1)]
        max_tokens: NewTokens | None = None
        max_completion_tokens: NewTokens | None = None
        logprobs: bool | None = None
        top_logprobs: TopLogprobs | None = None
        tool_choice: Literal["none"] | None = None

    return {
        "/generate": GenerateRequest,
        "/v1/completions": CompletionRequest,
        "/v1/chat/completions": ChatCompletionRequest,
    }
