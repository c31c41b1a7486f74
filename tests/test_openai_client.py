"""The official OpenAI Python client against a real reference-runtime server (stories260K, the `final` arm with
n-gram speculation, on a loopback port): chat and completions, streamed and not, with logprobs, as a new user
calls them. The oracles are llama2.c's greedy continuation (golden_greedy.json) for the text and transformers'
own forward for the logprobs; an unknown model is openai.NotFoundError, a parameter the server cannot honour
openai.BadRequestError naming it. Two fast tests check the token texts, bytes and offsets the logprobs carry
on a sentencepiece (byte fallback) and a byte-level BPE tokenizer, where a character spans several tokens.
"""

from __future__ import annotations

import pytest
from reference_runtime_helpers import (
    STORY_PROMPTS,
    engine_config,
    free_port,
    hf_model,
    launch,
    stop,
    wait_healthy,
    write_engine,
)

from specpilot_runtime.openai_logprobs import TokenTexts, chat_logprobs, completion_logprobs, entries

openai = pytest.importorskip("openai")
slow = pytest.mark.slow  # each test that talks to the server the module starts

ENGINE_ID = "id-openai"
NEW_TOKENS = 24
PROMPT = "Once upon a time"  # the golden prompt; the chat has no template here, so its prompt is the same text


@pytest.fixture(scope="module")
def client(tmp_path_factory, stories_dir):
    engine = write_engine(tmp_path_factory.mktemp("engine"), engine_config("final", k=8, max_n=8))
    port = free_port()
    proc = launch(engine, ENGINE_ID, port, stories_dir)
    try:
        url = wait_healthy(proc, port)
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def tokenizer(stories_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(stories_dir))


@pytest.fixture(scope="module")
def oracle(golden, stories_dir):
    """transformers' log-softmax over the golden sequence: row i scores token i+1."""
    import torch

    ids = golden["sequence_ids"]
    with torch.no_grad():
        logits = hf_model(stories_dir)(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def ask(client, endpoint: str, stream: bool, **kw) -> dict:
    """One call through the client, its answer flattened: text, finish reason, usage, and per token
    (token, logprob, [(top token, top logprob)]) when logprobs were asked for."""
    if endpoint == "chat":
        kw.setdefault("messages", [{"role": "user", "content": PROMPT}])
        create = client.chat.completions.create
    else:
        kw.setdefault("prompt", PROMPT)
        create = client.completions.create
    kw = {"model": "stories260K", "temperature": 0, **kw}
    if not stream:
        choice, usage = (answer := create(**kw)).choices[0], answer.usage
        text = choice.message.content if endpoint == "chat" else choice.text
        return {"text": text, "finish": choice.finish_reason, "usage": usage, "logprobs": _logprobs(choice.logprobs)}
    parts, finish, usage, logprobs, usage_chunks = [], None, None, None, 0
    for chunk in create(stream=True, stream_options={"include_usage": True}, **kw):
        if not chunk.choices:  # the usage chunk, last
            usage, usage_chunks = chunk.usage, usage_chunks + 1
            continue
        choice = chunk.choices[0]
        parts.append((choice.delta.content if endpoint == "chat" else choice.text) or "")
        finish = choice.finish_reason or finish
        if choice.logprobs is not None:
            logprobs = (logprobs or []) + _logprobs(choice.logprobs)
    assert usage_chunks == 1
    return {"text": "".join(parts), "finish": finish, "usage": usage, "logprobs": logprobs}


def _logprobs(logprobs) -> list | None:
    if logprobs is None:
        return None
    if hasattr(logprobs, "content"):  # chat
        for item in logprobs.content:
            assert item.bytes == list(item.token.encode("utf-8"))
        return [(i.token, i.logprob, [(t.token, t.logprob) for t in i.top_logprobs]) for i in logprobs.content]
    assert (
        len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset)
    )
    return [
        (token, logprob, sorted(top.items(), key=lambda kv: -kv[1]))
        for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)
    ]


def golden_text(tokenizer, golden, n: int) -> str:
    return tokenizer.decode(golden["sequence_ids"][5 : 5 + n], skip_special_tokens=True)


# The twelve calls a new user tries: {chat, completions} x {plain, streamed} x {no logprobs, logprobs with
# top_logprobs, a model this server does not serve}.
TWELVE = [(e, s, v) for e in ("chat", "completions") for s in (False, True) for v in ("plain", "logprobs", "unknown")]


@slow
@pytest.mark.parametrize("endpoint,stream,variant", TWELVE, ids=["-".join(map(str, c)) for c in TWELVE])
def test_the_twelve_calls_a_new_user_tries(client, tokenizer, golden, oracle, endpoint, stream, variant):
    if variant == "unknown":
        with pytest.raises(openai.NotFoundError) as raised:
            ask(client, endpoint, stream, model="gpt-4o", max_tokens=NEW_TOKENS)
        assert (raised.value.code, raised.value.param) == ("model_not_found", "model")
        assert "gpt-4o" in raised.value.message and "stories260K" in raised.value.message
        return
    options = {"logprobs": True, "top_logprobs": 3} if endpoint == "chat" else {"logprobs": 3}
    answer = ask(client, endpoint, stream, max_tokens=NEW_TOKENS, **(options if variant == "logprobs" else {}))
    assert answer["text"] == golden_text(tokenizer, golden, NEW_TOKENS)
    assert answer["finish"] == "length"
    usage = answer["usage"]
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (5, NEW_TOKENS, 5 + NEW_TOKENS)
    if variant == "plain":
        assert answer["logprobs"] is None
        return
    tokens = answer["logprobs"]
    assert len(tokens) == usage.completion_tokens
    assert "".join(token for token, _, _ in tokens) == answer["text"]
    for i, (token, logprob, top) in enumerate(tokens):
        assert logprob <= 0
        assert top[0] == (token, logprob)  # greedy: the best alternative is the emitted token
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert len(top) == 3
        assert logprob == pytest.approx(float(oracle[4 + i, golden["sequence_ids"][5 + i]]), abs=1e-4)
        assert top[1][1] == pytest.approx(float(oracle[4 + i].topk(2).values[1]), abs=1e-4)


@slow
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("prompt", STORY_PROMPTS[1:5])
def test_streamed_answers_equal_the_whole_answer(client, endpoint, prompt):
    """Speculation accepts several tokens a step and a stop string holds text back: the streamed text and
    logprobs still add up to the non-streamed answer."""
    options = {"logprobs": True, "top_logprobs": 2} if endpoint == "chat" else {"logprobs": 2}
    key = "messages" if endpoint == "chat" else "prompt"
    body = {key: [{"role": "user", "content": prompt}] if endpoint == "chat" else prompt, "max_tokens": 80}
    whole = ask(client, endpoint, False, stop=["play with"], **body, **options)
    streamed = ask(client, endpoint, True, stop=["play with"], **body, **options)
    assert streamed["text"] == whole["text"] and streamed["finish"] == whole["finish"]
    assert streamed["usage"] == whole["usage"]
    assert [t for t, _, _ in streamed["logprobs"]] == [t for t, _, _ in whole["logprobs"]]
    assert [lp for _, lp, _ in streamed["logprobs"]] == pytest.approx([lp for _, lp, _ in whole["logprobs"]], abs=1e-5)
    assert len(whole["logprobs"]) == whole["usage"].completion_tokens


@slow
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_answer_before_it(client, tokenizer, golden, endpoint, stream):
    answer = ask(client, endpoint, stream, stop=["Lily", "zebra"], max_tokens=60)
    full = golden_text(tokenizer, golden, 60)
    assert answer["text"] == full[: full.index("Lily")]
    assert answer["finish"] == "stop"


@slow
def test_completion_text_offsets_index_the_text(client):
    answer = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=40, logprobs=0)
    text, lp = answer.choices[0].text, answer.choices[0].logprobs
    for token, offset in zip(lp.tokens, lp.text_offset):
        assert text[offset : offset + len(token)] == token
    assert all(top == {token: logprob} for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))


@slow
def test_echo_scores_the_prompt(client, golden, oracle):
    answer = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = answer.choices[0]
    assert choice.text == PROMPT and answer.usage.completion_tokens == 0
    assert choice.logprobs.tokens == ["<s>", "Once", " upon", " a", " time"]
    assert choice.logprobs.text_offset == [0, 0, 4, 9, 11]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    for i in range(1, 5):
        expected = float(oracle[i - 1, golden["prompt_ids"][i]])
        assert choice.logprobs.token_logprobs[i] == pytest.approx(expected, abs=1e-4)
    streamed = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=8, echo=True, stream=True)
    whole = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=8, echo=True)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert whole.choices[0].text.startswith(PROMPT + ",")


@slow
def test_the_engine_id_is_an_alias_of_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["stories260K"]
    answer = client.completions.create(model=ENGINE_ID, prompt=PROMPT, max_tokens=4)
    assert answer.model == "stories260K" and answer.usage.completion_tokens == 4


REFUSED = [
    ("chat", {"n": 2}, "n"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"temperature": 0.7}, "temperature"),
    ("chat", {"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"suffix": " The end."}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"echo": True, "logprobs": 1, "stream": True}, "echo"),
]


@slow
@pytest.mark.parametrize("endpoint,options,param", REFUSED, ids=[f"{e}-{p}" for e, _, p in REFUSED])
def test_a_parameter_the_server_cannot_honour_is_a_bad_request_naming_it(client, endpoint, options, param):
    options = dict(options)
    stream = options.pop("stream", False)
    with pytest.raises(openai.BadRequestError) as raised:
        ask(client, endpoint, stream, max_tokens=4, **options)
    assert raised.value.param == param
    assert param in raised.value.message


SPLIT_TEXT = "Once upon a café 😀 time"  # é and 😀 are several tokens (byte fallback / byte-level pieces)


def byte_level_tokenizer():
    """A small byte-level BPE (GPT-2's scheme, as SmolLM2's), trained here on a few words."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["Once upon a time there was a cat"] * 20, vocab_size=300, show_progress=False)
    bpe.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")


@pytest.mark.parametrize(
    "kind", [pytest.param("sentencepiece", marks=slow), "byte-level"]
)  # loading stories260K's: 4 s
def test_token_texts_bytes_and_offsets_add_up_to_the_text(kind, request):
    from transformers import AutoTokenizer

    if kind == "sentencepiece":
        tok = AutoTokenizer.from_pretrained(str(request.getfixturevalue("stories_dir")))
    else:
        tok = byte_level_tokenizer()
    ids = tok(SPLIT_TEXT)["input_ids"] + [tok.eos_token_id]
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == SPLIT_TEXT
    items = entries(TokenTexts(tok, []), [(-1.0, i, None) for i in ids], [None] * len(ids))
    content = chat_logprobs(items)["content"]
    plain = [c for c, i in zip(content, ids) if i not in tok.all_special_ids]
    assert b"".join(bytes(c["bytes"]) for c in plain) == SPLIT_TEXT.encode("utf-8")  # as OpenAI's bytes join
    assert content[-1]["token"] == tok.eos_token
    by_text = {c["token"] for c in plain}
    assert {" upon", " time"} <= by_text  # a word keeps its leading space, though decoded alone it may not
    offsets = completion_logprobs(items, 0)[0]["text_offset"]
    for c, offset in zip(content, offsets):
        token = c["token"].rstrip("\ufffd")
        if token and c["token"] != tok.eos_token and not tok.bos_token == c["token"]:
            assert text[offset : offset + len(token)] == token, (c["token"], offset)
    assert offsets[-1] == len(text)  # EOS adds nothing to the text
