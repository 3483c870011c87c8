"""The FastAPI app: OpenAI-compatible routes over one Engine, a health and a metrics route, and the chat page.

Bodies are read and validated here (protocol.py) rather than by FastAPI's own parsing, so that every failure is
an OpenAI error object with the right status (400 bad body, 401 auth, 404 model, 413 size, 429 queue full) and
never a traceback."""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ConfigError, OffloadEngineError
from ..generate.decoder import FinishEvent, TokenEvent
from .metrics import Metrics
from .protocol import ApiError, ChatRequest, CompletionRequest, Sampling, parse_body
from .queue import DONE, EngineWorker, Job, QueueFull

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # the engine's reasons in OpenAI's words


@dataclass(frozen=True)
class ServerSettings:
    model_id: str
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_tokens_limit: int = 4096
    max_queue: int = 64
    # False only in tests: a server that ignores a client leaving, which the disconnect test must catch
    cancel_on_disconnect: bool = True


def create_app(engine: Any, settings: ServerSettings) -> FastAPI:
    metrics = Metrics()
    worker = EngineWorker(settings.max_queue, on_finish=metrics.record, on_token=metrics.count_token)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        worker.stop()  # after the last response: no thread left behind

    app = FastAPI(title="offload-engine", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        if e.status >= 500 or e.status == 429:
            metrics.errors += 1
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        metrics.errors += 1
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}", "server_error").body(),
                            status_code=500)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if settings.api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            expected = f"Bearer {settings.api_key}"
            if not hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode()):
                err = ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", "authentication_error",
                               code="invalid_api_key")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(resources.files(__package__).joinpath("static/chat.html").read_text(encoding="utf-8"))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": settings.model_id, "concurrency": 1, "busy": worker.busy,
                "queue_length": worker.queue_length, "max_queue": settings.max_queue, "context": engine.context}

    @app.get("/metrics")
    async def metrics_text() -> PlainTextResponse:
        return PlainTextResponse(metrics.text(worker.queue_length, worker.busy),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": settings.model_id, "object": "model", "created": 0,
                                            "owned_by": "offload-engine"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = parse_body(await read_body(request, settings.max_body_bytes), ChatRequest)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        if engine.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: use /v1/completions with token ids", param="messages")
        try:
            ids = engine.tokenizer.encode_chat(messages)
        except Exception as e:  # a template that refuses the message order (e.g. two system turns)
            raise ApiError(400, f"the chat template refused these messages: {e}", param="messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await respond(request, body, ids, limit, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_body(await read_body(request, settings.max_body_bytes), CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: a list of several prompts is not supported (one per request)",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
            ids = engine.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ApiError(400, "prompt is empty", param="prompt")
        if any(not 0 <= t < engine.model.vocab_size for t in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {engine.model.vocab_size})", param="prompt")
        return await respond(request, body, ids, body.max_tokens, chat=False)

    async def respond(request: Request, body: Sampling, ids: list[int], limit: int | None, chat: bool) -> Response:
        if body.model is not None and body.model != settings.model_id:
            raise ApiError(404, f"model {body.model!r} is not served here (this server serves "
                                f"{settings.model_id!r})", "not_found_error", param="model", code="model_not_found")
        if body.n != 1:
            raise ApiError(400, f"n: only n=1 is supported, got {body.n}", param="n")
        room = engine.context - len(ids)
        if room < 1:
            raise ApiError(400, f"prompt has {len(ids)} tokens, the context reserved is {engine.context} tokens",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        if limit is not None and limit > settings.max_tokens_limit:
            raise ApiError(400, f"max_tokens {limit} is over this server's limit of {settings.max_tokens_limit} "
                                "(--max-tokens-limit)", param="max_tokens")
        if limit is not None and len(ids) + limit > engine.context:
            raise ApiError(400, f"prompt ({len(ids)} tokens) + max_tokens ({limit}) exceed the context reserved "
                                f"({engine.context} tokens)", param="max_tokens", code="context_length_exceeded")
        max_new = limit if limit is not None else min(room, settings.max_tokens_limit)
        sampling = dict(max_new_tokens=max_new, temperature=float(body.temperature), top_p=float(body.top_p),
                        seed=body.seed, stop=body.stops())
        try:  # checks the arguments (sampling, spec) before the request waits in the queue
            spec = {} if body.spec is None else {"spec": body.spec}
            start = _checked_start(engine, ids, spec, sampling)
        except (ConfigError, OffloadEngineError) as e:
            raise ApiError(400, str(e)) from None
        job = Job(start=start, loop=asyncio.get_running_loop())

        def client_left() -> None:  # the worker stops the job at its next step
            if settings.cancel_on_disconnect:
                job.cancelled.set()
        try:
            worker.submit(job)
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error", code="queue_full") from None
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": settings.model_id}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return StreamingResponse(_sse(job, meta, chat, len(ids), include_usage, client_left),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watch = asyncio.create_task(_on_disconnect(request, client_left))
        try:
            finish = await _finish(job)
        finally:
            watch.cancel()
            client_left()  # also when this handler is cancelled: its client is gone
        return JSONResponse(_complete(meta, chat, finish, len(ids)))

    return app


def _checked_start(engine: Any, ids: list[int], spec: dict, sampling: dict):
    """engine.stream checks its arguments when called: call it on the worker, but check them here first by
    validating the sampling parameters and the speculative mode without taking the engine."""
    from ..generate.sampling import SamplingParams
    from ..speculative.stepper import check_spec

    SamplingParams(**sampling)
    if spec:
        check_spec(spec["spec"], None, None)
    return lambda: engine.stream(ids, **spec, **sampling)


async def read_body(request: Request, cap: int) -> bytes:
    """The body, refused with 413 once it passes `cap` bytes (by its Content-Length or as it arrives)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise ApiError(413, f"request body of {int(length)} bytes is over the limit of {cap} bytes "
                            "(--max-body-bytes)", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise ApiError(413, f"request body is over the limit of {cap} bytes (--max-body-bytes)",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _on_disconnect(request: Request, client_left: Callable[[], None]) -> None:
    """A non-streamed answer sends nothing before its end, so nothing fails when its client leaves: listen for the
    disconnect instead (the body is read by now, so `receive` returns only when the client goes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    client_left()


async def _finish(job: Job) -> FinishEvent:
    finish = None
    while (item := await job.events.get()) is not DONE:
        if isinstance(item, Exception):
            raise _as_api_error(item)
        if isinstance(item, FinishEvent):
            finish = item
    if finish is None:
        raise ApiError(500, "the generation ended without a result", "server_error")
    return finish


def _as_api_error(e: Exception) -> ApiError:
    if isinstance(e, ConfigError):
        return ApiError(400, str(e))
    if isinstance(e, OffloadEngineError):
        return ApiError(500, str(e), "server_error")
    return ApiError(500, f"internal error: {type(e).__name__}", "server_error")


def _usage(prompt_tokens: int, finish: FinishEvent) -> dict:
    n = len(finish.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}


def _complete(meta: dict, chat: bool, finish: FinishEvent, prompt_tokens: int) -> dict:
    reason = FINISH.get(finish.reason, finish.reason)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": finish.text}, "logprobs": None,
                  "finish_reason": reason}
    else:
        choice = {"index": 0, "text": finish.text, "logprobs": None, "finish_reason": reason}
    return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
            "usage": _usage(prompt_tokens, finish), "offload_engine": _jsonable(finish.stats)}


def _chunk(meta: dict, chat: bool, text: str | None, reason: str | None, first: bool = False) -> dict:
    if chat:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {**meta, "object": "chat.completion.chunk", "choices": [choice]}
    return {**meta, "object": "text_completion", "choices": [{"index": 0, "text": text or "", "logprobs": None,
                                                               "finish_reason": reason}]}


def _sse_line(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _sse(job: Job, meta: dict, chat: bool, prompt_tokens: int, include_usage: bool,
               client_left: Callable[[], None]) -> AsyncIterator[str]:
    """SSE chunks: a role chunk (chat), one per token text, a finish chunk, the usage chunk if asked, [DONE].
    Cancelled (the client disconnected), it calls `client_left`, which stops the job at the worker's next step."""
    try:
        if chat:
            yield _sse_line(_chunk(meta, chat, "", None, first=True))
        while (item := await job.events.get()) is not DONE:
            if isinstance(item, Exception):
                yield _sse_line(_as_api_error(item).body())
                continue
            if isinstance(item, TokenEvent):
                if item.text:
                    yield _sse_line(_chunk(meta, chat, item.text, None))
            elif isinstance(item, FinishEvent):
                last = _chunk(meta, chat, None, FINISH.get(item.reason, item.reason))
                last["offload_engine"] = _jsonable(item.stats)
                if not include_usage:
                    last["usage"] = _usage(prompt_tokens, item)
                yield _sse_line(last)
                if include_usage:
                    yield _sse_line({**meta, "object": last["object"], "choices": [],
                                     "usage": _usage(prompt_tokens, item)})
        yield "data: [DONE]\n\n"
    finally:
        client_left()


def _jsonable(stats: dict) -> dict:
    return json.loads(json.dumps(stats, default=str))
