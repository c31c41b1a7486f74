"""The reference runtime behind real HTTP: servers started as `make serve` starts them, on loopback ports.

Three servers start once for the module (in parallel): the `ar` and `final` arms of the c1 setting, and the
`final` arm with continuous batching (max_running_requests 16).
"""

from __future__ import annotations

import asyncio
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from reference_runtime_helpers import STORY_PROMPTS, engine_config, free_port, launch, stop, wait_healthy, write_engine

pytestmark = pytest.mark.slow  # every test talks to the three servers the module starts

SERVERS = {
    "ar": engine_config("ar"),
    "final": engine_config("final", k=8, max_n=8),
    "final_c16": engine_config("final", k=8, max_n=8, max_running=16),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, stories_dir):
    root = tmp_path_factory.mktemp("engines")
    procs = {}
    try:
        for name, config in SERVERS.items():
            port = free_port()
            procs[name] = (launch(write_engine(root / name, config), f"id-{name}", port, stories_dir), port)
        with ThreadPoolExecutor(len(procs)) as pool:
            urls = dict(zip(procs, pool.map(lambda pp: wait_healthy(*pp), procs.values())))
        yield urls
    finally:
        for proc, _ in procs.values():
            stop(proc)


def generate(url: str, timeout: float = 120, **body) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=timeout)


def greedy_ids(url: str, prompt: str | list[int], max_new_tokens: int) -> list[int]:
    key = "text" if isinstance(prompt, str) else "input_ids"
    r = generate(url, **{key: prompt}, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@pytest.mark.parametrize("name", list(SERVERS))
def test_golden_prompt_ids_give_llama2c_continuation(servers, name, golden):
    prompt, sequence = golden["prompt_ids"], golden["sequence_ids"]
    r = generate(
        servers[name],
        input_ids=prompt,
        sampling_params={"max_new_tokens": len(sequence) - len(prompt), "temperature": 0},
    )
    body = r.json()
    assert prompt + body["output_ids"] == sequence
    assert body["text"] == golden["decoded_text_without_bos"][len(golden["prompt"]) :]
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": len(sequence) - len(prompt)}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), len(sequence) - len(prompt))


def test_twenty_prompts_identical_across_ar_and_final(servers):
    for prompt in STORY_PROMPTS:
        ar = greedy_ids(servers["ar"], prompt, 150)
        assert len(ar) == 150
        assert greedy_ids(servers["final"], prompt, 150) == ar, prompt
    info = httpx.get(servers["final"] + "/server_info").json()
    assert info["avg_spec_accept_length"] > 1.5  # the shared cache pays off across these requests


def test_sixteen_concurrent_requests_all_correct(servers):
    prompts = STORY_PROMPTS[:16]
    lengths = [40 + 9 * i for i in range(16)]
    expected = [greedy_ids(servers["ar"], p, n) for p, n in zip(prompts, lengths)]

    async def all_at_once():
        async with httpx.AsyncClient(timeout=300) as client:
            replies = await asyncio.gather(
                *[
                    client.post(
                        servers["final_c16"] + "/generate",
                        json={"text": p, "sampling_params": {"max_new_tokens": n, "temperature": 0}},
                    )
                    for p, n in zip(prompts, lengths)
                ]
            )
        return [r.json()["output_ids"] for r in replies]

    assert asyncio.run(all_at_once()) == expected


def test_token_forcing_recipe_scores_every_forced_token(servers, golden):
    """verify's recipe: input = prompt + continuation, no new tokens, top-2 logprobs from the last prompt token."""
    prompt, sequence = golden["prompt_ids"], golden["sequence_ids"][:60]
    r = generate(
        servers["final"],
        input_ids=sequence,
        sampling_params={"max_new_tokens": 0, "temperature": 0},
        return_logprob=True,
        logprob_start_len=len(prompt) - 1,
        top_logprobs_num=2,
    )
    meta = r.json()["meta_info"]
    assert r.json()["output_ids"] == [] and meta["completion_tokens"] == 0
    tokens = meta["input_token_logprobs"]
    tops = meta["input_top_logprobs"]
    assert [t[1] for t in tokens] == sequence[len(prompt) - 1 :]
    for (logprob, token, _), top in zip(tokens[1:], tops[1:]):  # the continuation positions
        assert len(top) == 2 and top[0][1] == token  # greedy continuation: the forced id is the top-1
        assert top[0][0] == pytest.approx(logprob, abs=1e-6) and top[0][0] >= top[1][0]
    # From position 0 the first entry has no logprob, as in SGLang.
    whole = generate(
        servers["ar"],
        input_ids=sequence[:8],
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
    ).json()["meta_info"]
    assert whole["input_token_logprobs"][0] == [None, sequence[0], None]
    assert whole["input_top_logprobs"][0] is None and len(whole["input_token_logprobs"]) == 8


def test_output_logprobs_agree_with_forced_scoring(servers, golden):
    prompt = golden["prompt_ids"]
    out = generate(
        servers["final"],
        input_ids=prompt,
        sampling_params={"max_new_tokens": 20, "temperature": 0},
        return_logprob=True,
        top_logprobs_num=2,
    ).json()
    forced = generate(
        servers["ar"],
        input_ids=prompt + out["output_ids"],
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=len(prompt),
    ).json()["meta_info"]
    ours = out["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in ours] == out["output_ids"] == golden["sequence_ids"][5:25]
    assert [t[0] for t in ours] == pytest.approx([t[0] for t in forced["input_token_logprobs"]], abs=1e-4)


def test_stop_token_ids_and_stop_strings(servers, golden):
    prompt, sequence = golden["prompt_ids"], golden["sequence_ids"]
    newline_at = sequence.index(13)
    body = generate(
        servers["final"], input_ids=prompt, sampling_params={"max_new_tokens": 150, "stop_token_ids": [13]}
    ).json()
    assert prompt + body["output_ids"] == sequence[: newline_at + 1]
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": 13}
    body = generate(servers["ar"], input_ids=prompt, sampling_params={"max_new_tokens": 150, "stop": ["ball"]}).json()
    golden_text = golden["decoded_text_without_bos"][len(golden["prompt"]) :]
    assert body["text"] == golden_text[: golden_text.index("ball")]
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": "ball"}


def test_openai_completions_and_chat(servers):
    url = servers["final"]
    native = generate(url, text="Once upon a time", sampling_params={"max_new_tokens": 40}).json()["text"]
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0},
        timeout=60,
    ).json()
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == native
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 40, "total_tokens": 45}
    chat = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 40, "temperature": 0},
        timeout=60,
    ).json()
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": native}  # no template: plain text
    models = httpx.get(url + "/v1/models").json()
    assert models["data"][0]["id"] == "stories260K"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_streaming_concatenates_to_the_full_answer(servers, path):
    url = servers["final"]
    full = generate(url, text="Tim had a red ball", sampling_params={"max_new_tokens": 60}).json()["text"]
    if path == "/generate":
        body = {"text": "Tim had a red ball", "sampling_params": {"max_new_tokens": 60}, "stream": True}
    elif path == "/v1/completions":
        body = {"prompt": "Tim had a red ball", "max_tokens": 60, "stream": True}
    else:
        body = {"messages": [{"role": "user", "content": "Tim had a red ball"}], "max_tokens": 60, "stream": True}
    events = []
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 3
    if path == "/generate":  # SGLang streams the cumulative text
        assert chunks[-1]["text"] == full and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    elif path == "/v1/completions":
        assert "".join(c["choices"][0]["text"] for c in chunks) == full
    else:
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == full
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


MALFORMED = [
    ("/generate", b"{not json"),
    ("/generate", b"[1, 2]"),
    ("/generate", {"input_ids": [1, 512]}),
    ("/generate", {"input_ids": [1, -3]}),
    ("/generate", {"input_ids": [1, "a"]}),
    ("/generate", {"input_ids": []}),
    ("/generate", {"text": 5}),
    ("/generate", {"text": "hi", "input_ids": [1]}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**9}}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "5"}}),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": 0.8}}),
    ("/generate", {"text": "hi", "sampling_params": {"frobnicate": 1}}),
    ("/generate", {"text": "hi", "sampling_params": []}),
    ("/generate", {"input_ids": [1] * 600, "sampling_params": {"max_new_tokens": 1}}),
    ("/generate", {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 3}),
    ("/generate", {"text": "hi", "return_logprob": "yes"}),
    ("/generate", {"text": "hi", "stop": 5, "sampling_params": {"stop": 5}}),
    ("/v1/completions", {"prompt": 5}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -2}),
    ("/v1/completions", {"prompt": "hi", "temperature": 1.0}),
    ("/v1/chat/completions", {"messages": "hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}),
    ("/v1/chat/completions", b"\xff\xfe"),
]


@pytest.mark.parametrize("path,body", MALFORMED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(MALFORMED)])
def test_malformed_request_is_a_4xx_and_the_server_stays_healthy(servers, path, body, golden):
    url = servers["final_c16"]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    payload = r.json()
    message = payload["error"]["message"]  # OpenAI's shape on /v1/, the same key path on /generate
    assert message
    assert httpx.get(url + "/health").status_code == 200
    assert greedy_ids(url, golden["prompt_ids"], 3) == golden["sequence_ids"][5:8]


def test_health_and_info_endpoints(servers):
    url = servers["final"]
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/health_generate", timeout=60).status_code == 200
    info = httpx.get(url + "/server_info").json()
    assert (info["engine_id"], info["arm"], info["setting"]) == ("id-final", "final", "cpu_c1_stories260k_ngram")
    assert info["speculative_algorithm"] == "ngram" and info["runtime_options"] == {"shared_ngram_cache": True}
    assert "avg_spec_accept_length" in info["internal_states"][0]
    model = httpx.get(url + "/model_info").json()
    assert model["is_generation"] and model["context_length"] == 512
    assert httpx.get(servers["ar"] + "/server_info").json()["arm"] == "ar"


def test_max_new_tokens_zero_returns_no_tokens(servers):
    body = generate(servers["ar"], text="Once upon a time", sampling_params={"max_new_tokens": 0}).json()
    assert body["output_ids"] == [] and body["text"] == ""
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_per_request_accept_statistics(servers, golden):
    meta = generate(servers["final"], input_ids=golden["prompt_ids"], sampling_params={"max_new_tokens": 196}).json()[
        "meta_info"
    ]
    # The golden story was served before (earlier tests): the shared cache proposes it back.
    assert meta["spec_accept_length"] > 3
    assert meta["spec_accept_token_num"] <= meta["spec_draft_token_num"]
    assert meta["spec_verify_ct"] * meta["spec_accept_length"] == pytest.approx(195)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
