"""The HTTP server: SGLang's native and OpenAI-style endpoints over the reference engine.

Launch (what `make serve` runs from the engine tree):
  PYTHONPATH=<engine>/runtime python -m specpilot_runtime.server --engine <engine_dir> --engine-id <id> \
      --model <hf_model_dir> [--draft-model <dir>] --host 127.0.0.1 --port <port> [--device cpu|cuda:0]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .config import RuntimeConfigError
from .engine import GenerationRequest
from .protocol import ApiError, parse_chat, parse_completion, parse_generate
from .runtime import Runtime, load_runtime

HEALTH_GENERATE_TIMEOUT_S = 30


def build_app(runtime: Runtime) -> FastAPI:
    app = FastAPI(title="specpilot reference runtime")
    tokenizer, limits = runtime.tokenizer, runtime.limits

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        if request.url.path.startswith("/v1/"):
            body = {"object": "error", "message": exc.message, "type": "BadRequestError", "param": None,
                    "code": exc.status}
        else:
            body = {"error": {"message": exc.message, "code": exc.status}}
        return JSONResponse(body, status_code=exc.status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logging.getLogger("specpilot_runtime").exception("request failed")
        return JSONResponse({"error": {"message": f"internal error: {exc}", "code": 500}}, status_code=500)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if runtime.engine.thread.is_alive() else 503)

    @app.get("/health_generate")
    async def health_generate():
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
        try:
            await asyncio.wait_for(_generate(runtime, GenerationRequest([bos], 1)), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, ApiError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return runtime.server_info()

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return runtime.model_info()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": runtime.config.model_name, "object": "model", "created": int(runtime_started),
            "owned_by": "specpilot", "root": runtime.config.model_name, "max_model_len": limits.context_length}]}

    @app.post("/generate")
    async def generate(request: Request):
        req, text_in_logprobs = parse_generate(await _json(request), tokenizer, limits)
        if req.stream:
            return _sse(_stream_generate(runtime, req, text_in_logprobs))
        result = await _generate(runtime, req)
        if text_in_logprobs:
            _add_logprob_text(result["meta_info"], tokenizer)
        return result

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        req = parse_completion(body, tokenizer, limits)
        return await _openai(runtime, req, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json(request)
        req = parse_chat(body, tokenizer, limits)
        return await _openai(runtime, req, body, chat=True)

    runtime_started = time.time()
    return app


# ------------------------------------------------------------------ engine bridge
def _submit(runtime: Runtime, req: GenerationRequest) -> asyncio.Queue:
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    req.emit = lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
    runtime.engine.submit(req)
    return events


async def _generate(runtime: Runtime, req: GenerationRequest) -> dict:
    events = _submit(runtime, req)
    while True:
        kind, payload = await events.get()
        if kind == "done":
            return payload
        if kind == "error":
            raise RuntimeError(payload)


async def _events(runtime: Runtime, req: GenerationRequest):
    """Yield ("text", cumulative_text) events, then ("done", result); cancels the request if abandoned."""
    events = _submit(runtime, req)
    try:
        while True:
            kind, payload = await events.get()
            if kind == "error":
                raise RuntimeError(payload)
            yield kind, payload
            if kind == "done":
                return
    finally:
        req.cancelled = True


async def _stream_generate(runtime: Runtime, req: GenerationRequest, text_in_logprobs: bool):
    async for kind, payload in _events(runtime, req):
        if kind == "text":
            yield {"text": payload, "meta_info": {"finish_reason": None}}
        else:
            if text_in_logprobs:
                _add_logprob_text(payload["meta_info"], runtime.tokenizer)
            yield payload


async def _openai(runtime: Runtime, req: GenerationRequest, body: dict, chat: bool):
    model = body.get("model") or runtime.config.model_name
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    if not req.stream:
        result = await _generate(runtime, req)
        meta = result["meta_info"]
        choice = {"index": 0, "finish_reason": _openai_finish(meta), "matched_stop": _matched(meta)}
        if chat:
            choice["message"] = {"role": "assistant", "content": result["text"]}
        else:
            choice.update(text=result["text"], logprobs=None)
        return {"id": ident, "object": obj, "created": created, "model": model, "choices": [choice],
                "usage": _usage(meta)}

    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def chunk(delta: str | None, finish: str | None = None, first: bool = False) -> dict:
        if chat:
            piece = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": piece, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return {"id": ident, "object": obj + ".chunk" if chat else obj, "created": created, "model": model,
                "choices": [choice]}

    async def stream():
        sent = ""
        if chat:
            yield chunk(None, first=True)
        async for kind, payload in _events(runtime, req):
            text = payload if kind == "text" else payload["text"]
            if len(text) > len(sent):
                yield chunk(text[len(sent):])
                sent = text
            if kind == "done":
                meta = payload["meta_info"]
                yield chunk(None, _openai_finish(meta))
                if include_usage:
                    yield {"id": ident, "object": obj + ".chunk" if chat else obj, "created": created,
                           "model": model, "choices": [], "usage": _usage(meta)}

    return _sse(stream())


def _sse(chunks) -> StreamingResponse:
    async def body():
        try:
            async for item in chunks:
                yield f"data: {json.dumps(item)}\n\n"
        except Exception as exc:  # the status line is gone already; report in-band
            yield f"data: {json.dumps({'error': {'message': f'internal error: {exc}', 'code': 500}})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _openai_finish(meta: dict) -> str:
    return (meta.get("finish_reason") or {}).get("type", "stop")


def _matched(meta: dict):
    return (meta.get("finish_reason") or {}).get("matched")


def _usage(meta: dict) -> dict:
    return {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": meta["completion_tokens"],
            "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"]}


def _add_logprob_text(meta: dict, tokenizer) -> None:
    def with_text(entry):
        return None if entry is None else (entry[0], entry[1], tokenizer.decode([entry[1]]))

    for key in ("input_token_logprobs", "output_token_logprobs"):
        if key in meta:
            meta[key] = [with_text(e) for e in meta[key]]
    for key in ("input_top_logprobs", "output_top_logprobs"):
        if key in meta:
            meta[key] = [None if top is None else [with_text(e) for e in top] for top in meta[key]]


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON ({exc})") from None


# ------------------------------------------------------------------ command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specpilot_runtime.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, help="the engine directory (holds config.json)")
    parser.add_argument("--engine-id", required=True, help="reported by /server_info")
    parser.add_argument("--model", required=True, help="Hugging Face model directory of the target")
    parser.add_argument("--draft-model", help="Hugging Face model directory of the draft (draft_model only)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", help="cpu or cuda:N (default: from the config's hardware.device)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        runtime = load_runtime(args.engine, args.engine_id, args.model, args.draft_model, args.device)
    except RuntimeConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.getLogger("specpilot_runtime").info(
        "engine %s (%s/%s) on %s, %d thread(s); listening on %s:%d", args.engine_id, runtime.config.setting,
        runtime.config.arm, runtime.device, runtime.num_threads, args.host, args.port)
    uvicorn.run(build_app(runtime), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
