"""The HTTP server: SGLang's native and OpenAI-style endpoints over the reference engine.

Launch (what `make serve` runs from the engine tree):
  PYTHONPATH=<engine>/runtime python -m specpilot_runtime.server --engine <engine_dir> --engine-id <id> \
      --model <hf_model_dir> [--draft-model <dir>] --host 127.0.0.1 --port <port> [--device cpu|cuda:0]

Hostile input: a body over --max-body-bytes is refused with 413 before it is kept (Content-Length) or as
soon as it grows past the limit. The rest of the body, up to DRAIN_BYTES, is read and dropped before the
answer goes out, so that a client that sends its whole body before reading (urllib, most SDKs) gets the 413
instead of a connection reset; the body must arrive within --body-timeout (else 408) and the request head
within --header-timeout (else the connection is closed). JSON decoding, validation and tokenizing run in a
worker thread (bodies over HEAVY_BODY_BYTES one at a time, in a thread of lower priority), so the event loop
keeps answering /health.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import json
import logging
import os
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import h11
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import RuntimeConfigError
from .engine import GenerationRequest
from .openai_logprobs import TokenTexts, chat_logprobs, completion_logprobs, entries
from .protocol import (
    ApiError,
    check_model,
    load_json,
    parse_chat,
    parse_completion,
    parse_generate,
    request_schemas,
)
from .runtime import Runtime, load_runtime

HEALTH_GENERATE_TIMEOUT_S = 30
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
DRAIN_BYTES = 64 * 1024 * 1024  # an oversized body up to this is read and dropped so the 413 reaches the client
HEAVY_BODY_BYTES = 64 * 1024  # bodies this large are parsed and tokenized one at a time, in a niced thread
HEAVY_PARSE_NICE = 10
TRIM_DELAY_S = 1.0  # after a big body: malloc_trim, whatever else runs
IDLE_TRIM_S = 1.0  # after the last request in flight: malloc_trim if still idle


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: always encodable, whatever a string holds."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def build_app(
    runtime: Runtime, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout: float = DEFAULT_BODY_TIMEOUT_S
) -> FastAPI:
    app = FastAPI(title="specpilot reference runtime", default_response_class=AsciiJSONResponse)
    tokenizer, limits = runtime.tokenizer, runtime.limits
    served = (runtime.config.model_name, runtime.engine_id)  # what an OpenAI body's `model` may name
    heavy = ThreadPoolExecutor(1, thread_name_prefix="heavy-parse", initializer=_lower_priority)
    app.add_middleware(TrimWhenIdle)

    async def parsed(request: Request, parse):
        """The body read under the size and time limits, then decoded, validated and tokenized off the loop."""
        loop = asyncio.get_running_loop()

        def trim_soon():
            loop.call_later(TRIM_DELAY_S, lambda: loop.run_in_executor(heavy, _release_free_memory))

        try:
            raw = await _read_body(request, max_body_bytes, body_timeout)
        except ApiError as exc:
            if exc.status == 413:
                trim_soon()
            raise

        def work():
            body = load_json(raw)
            return body, parse(body, tokenizer, limits)

        if len(raw) <= HEAVY_BODY_BYTES:
            return await run_in_threadpool(work)
        try:
            return await loop.run_in_executor(heavy, work)
        finally:  # tokenizing megabytes leaves hundreds of MB in malloc's free lists: give them back once the
            trim_soon()  # body and what was made of it are dropped (the answer sent)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        if request.url.path.startswith("/v1/"):  # OpenAI's shape: what its clients read into their exceptions
            body = {
                "error": {"message": exc.message, "type": "invalid_request_error", "param": exc.param, "code": exc.code}
            }
        else:
            body = {"error": {"message": exc.message, "code": exc.status}}
        return AsciiJSONResponse(body, status_code=exc.status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logging.getLogger("specpilot_runtime").exception("request failed")
        error = {"message": f"internal error: {exc!r}"[:2000], "code": 500}
        if request.url.path.startswith("/v1/"):
            error.update(type="server_error", param=None, code=None)
        return AsciiJSONResponse({"error": error}, status_code=500)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if runtime.engine.thread.is_alive() else 503)

    @app.get("/health_generate")
    async def health_generate():
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
        try:
            await asyncio.wait_for(_generate(runtime, GenerationRequest([bos], 1)), HEALTH_GENERATE_TIMEOUT_S)
        except (TimeoutError, ApiError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return runtime.server_info()

    @app.get("/metrics")
    async def metrics():
        return Response(runtime.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return runtime.model_info()

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": runtime.config.model_name,
                    "object": "model",
                    "created": int(runtime_started),
                    "owned_by": "specpilot",
                    "root": runtime.config.model_name,
                    "max_model_len": limits.context_length,
                }
            ],
        }

    schemas = request_schemas(limits, served)

    def documented(path: str) -> dict:
        """The route's OpenAPI extras: its request model and the error answers it gives."""
        ref = {"$ref": f"#/components/schemas/{schemas[path].__name__}"}
        error = {"content": {"application/json": {"schema": {"type": "object"}}}}
        return {
            "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}},
            "responses": {
                400: {"description": "malformed request", **error},
                404: {"description": "the model named is not served here (OpenAI routes)", **error},
                408: {"description": "the body did not arrive in time", **error},
                413: {"description": "the body is over the size limit", **error},
            },
        }

    @app.post("/generate", **documented("/generate"))
    async def generate(request: Request):
        _, (req, text_in_logprobs) = await parsed(request, parse_generate)
        if req.stream:
            return _sse(_stream_generate(runtime, req, text_in_logprobs))
        result = await _generate(runtime, req)
        if text_in_logprobs:
            _add_logprob_text(result["meta_info"], tokenizer)
        return result

    def for_model(parse):
        """An OpenAI parser that first answers 404 for a model this server does not serve."""

        def checked(body, tokenizer, limits):
            check_model(body, served)
            return parse(body, tokenizer, limits)

        return checked

    @app.post("/v1/completions", **documented("/v1/completions"))
    async def completions(request: Request):
        body, req = await parsed(request, for_model(parse_completion))
        return await _openai(runtime, req, body, chat=False)

    @app.post("/v1/chat/completions", **documented("/v1/chat/completions"))
    async def chat_completions(request: Request):
        body, req = await parsed(request, for_model(parse_chat))
        return await _openai(runtime, req, body, chat=True)

    def openapi() -> dict:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi
            from pydantic.json_schema import models_json_schema

            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema(
                [(model, "validation") for model in schemas.values()], ref_template="#/components/schemas/{model}"
            )
            spec.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi
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
        if kind == "logprobs":  # SGLang streams them in meta_info; here they come with the final result
            continue
        if kind == "text":
            yield {"text": payload, "meta_info": {"finish_reason": None}}
        else:
            if text_in_logprobs:
                _add_logprob_text(payload["meta_info"], runtime.tokenizer)
            yield payload


async def _openai(runtime: Runtime, req: GenerationRequest, body: dict, chat: bool):
    """An OpenAI completion or chat answer (or its SSE stream) for the parsed request."""
    tokenizer = runtime.tokenizer
    model = runtime.config.model_name  # also when the body named the engine id
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    echo = not chat and body.get("echo") is True
    prompt = _prompt_text(tokenizer, body, req.input_ids) if echo else ""
    # With echo the prompt's own tokens are scored too, from its first token on.
    texts = TokenTexts(tokenizer, [] if req.logprob_start_len == 0 else req.input_ids)

    def logprobs_of(chosen: list, tops: list, offset: int = 0) -> tuple[dict, int]:
        items = entries(texts, chosen, tops)
        return (chat_logprobs(items), 0) if chat else completion_logprobs(items, offset)

    if not req.stream:
        result = await _generate(runtime, req)
        meta = result["meta_info"]
        logprobs = None
        if req.return_logprob:
            chosen, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
            if req.logprob_start_len == 0:
                chosen, tops = meta["input_token_logprobs"] + chosen, meta["input_top_logprobs"] + tops
            logprobs, _ = await run_in_threadpool(logprobs_of, chosen, tops)
        choice = {"index": 0, "finish_reason": _openai_finish(meta), "matched_stop": _matched(meta)}
        if chat:
            choice.update(message={"role": "assistant", "content": result["text"]}, logprobs=logprobs)
        else:
            choice.update(text=prompt + result["text"], logprobs=logprobs)
        return {
            "id": ident,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(meta),
        }

    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def chunk(delta: str | None, finish: str | None = None, first: bool = False, logprobs=None) -> dict:
        if chat:
            piece = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": piece, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
        return {
            "id": ident,
            "object": obj + ".chunk" if chat else obj,
            "created": created,
            "model": model,
            "choices": [choice],
        }

    async def stream():
        sent, offset, streamed, pending = "", 0, 0, ([], [])
        if chat:
            yield chunk(None, first=True)
        if prompt:
            yield chunk(prompt)
        async for kind, payload in _events(runtime, req):
            if kind == "logprobs":  # this step's tokens: sent with the text that follows (held back text waits)
                pending[0].extend(payload[0])
                pending[1].extend(payload[1])
                continue
            text = payload if kind == "text" else payload["text"]
            if kind == "done" and req.return_logprob:  # the tokens no step streamed (the last step's)
                meta = payload["meta_info"]
                pending = (meta["output_token_logprobs"][streamed:], meta["output_top_logprobs"][streamed:])
            delta = text[len(sent) :] if len(text) > len(sent) else ""
            if delta or pending[0]:
                logprobs = None
                if req.return_logprob:
                    logprobs, offset = logprobs_of(*pending, offset)  # (echo with logprobs is not streamed)
                    streamed += len(pending[0])
                    pending = ([], [])
                yield chunk(delta, logprobs=logprobs)
                sent = text if delta else sent
            if kind == "done":
                meta = payload["meta_info"]
                yield chunk(None, _openai_finish(meta))
                if include_usage:
                    yield {
                        "id": ident,
                        "object": obj + ".chunk" if chat else obj,
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": _usage(meta),
                    }

    return _sse(stream())


def _prompt_text(tokenizer, body: dict, input_ids: list[int]) -> str:
    """The prompt as `echo` gives it back: the text sent, else the token ids decoded."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else tokenizer.decode(input_ids, skip_special_tokens=True)


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
    return {
        "prompt_tokens": meta["prompt_tokens"],
        "completion_tokens": meta["completion_tokens"],
        "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"],
    }


def _add_logprob_text(meta: dict, tokenizer) -> None:
    def with_text(entry):
        return None if entry is None else (entry[0], entry[1], tokenizer.decode([entry[1]]))

    for key in ("input_token_logprobs", "output_token_logprobs"):
        if key in meta:
            meta[key] = [with_text(e) for e in meta[key]]
    for key in ("input_top_logprobs", "output_top_logprobs"):
        if key in meta:
            meta[key] = [None if top is None else [with_text(e) for e in top] for top in meta[key]]


def _lower_priority() -> None:
    """Nice the calling thread (Linux: per thread), so big bodies never take the CPU from the event loop."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HEAVY_PARSE_NICE)
    except (AttributeError, OSError):
        pass


class TrimWhenIdle:
    """ASGI middleware: once no POST has been in flight for IDLE_TRIM_S, give malloc's free pages back (a storm
    of requests over many worker threads leaves them spread over malloc's per-thread arenas)."""

    def __init__(self, app):
        self.app, self.active, self.timer = app, 0, None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
            if self.active == 0 and self.timer is None:
                loop = asyncio.get_running_loop()
                self.timer = loop.call_later(IDLE_TRIM_S, self._idle, loop)

    def _idle(self, loop) -> None:
        self.timer = None
        if self.active == 0:
            loop.run_in_executor(None, _release_free_memory)


def _release_free_memory() -> None:
    """glibc's malloc_trim(0): return free heap pages to the system (a no-op elsewhere)."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            _MALLOC_TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused with 413 past `limit` bytes (announced or received) and with 408 after `timeout` s."""
    declared = request.headers.get("content-length")
    too_large = declared is not None and declared.isdigit() and int(declared) > limit
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if too_large or size > limit:
                    chunks.clear()
                    too_large = True
                    if size > DRAIN_BYTES:
                        break
                    continue
                chunks.append(chunk)
    except TimeoutError:
        if not too_large:
            raise ApiError(f"the request body did not arrive within {timeout:g} s", status=408) from None
    except ClientDisconnect:
        if not too_large:
            raise ApiError("the client disconnected before its request body was complete") from None
    if too_large:
        if declared is not None and declared.isdigit():
            raise ApiError(f"the request body is {declared} bytes; the limit is {limit} bytes", status=413)
        raise ApiError(f"the request body is over the limit of {limit} bytes", status=413)
    return b"".join(chunks)


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for the request head (uvicorn has none: a client that sends
    its headers a byte at a time would hold the connection forever). Set by `serve` via `header_timeout`."""

    header_timeout = DEFAULT_HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = None
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # a new request head starts on a kept-alive connection
        super().data_received(data)

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out, self.cycle)

    def _head_timed_out(self, cycle) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is cycle:  # no request head completed since the timer started
            self.transport.close()
        else:
            self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


# ------------------------------------------------------------------ command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m specpilot_runtime.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--engine", required=True, help="the engine directory (holds config.json)")
    parser.add_argument("--engine-id", required=True, help="reported by /server_info")
    parser.add_argument("--model", required=True, help="Hugging Face model directory of the target")
    parser.add_argument("--draft-model", help="Hugging Face model directory of the draft (draft_model only)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", help="cpu or cuda:N (default: from the config's hardware.device)")
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused with 413 (default: %(default)s)",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request body may take to arrive, else 408 (default: %(default)s)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a request head may take to arrive, else the connection is closed (default: %(default)s)",
    )
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
        "engine %s (%s/%s) on %s, %d thread(s); listening on %s:%d",
        args.engine_id,
        runtime.config.setting,
        runtime.config.arm,
        runtime.device,
        runtime.num_threads,
        args.host,
        args.port,
    )
    HeaderTimeoutH11Protocol.header_timeout = args.header_timeout
    app = build_app(runtime, max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        http=HeaderTimeoutH11Protocol,
        timeout_keep_alive=5,
    )


if __name__ == "__main__":
    main()
