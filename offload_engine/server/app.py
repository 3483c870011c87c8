"""The FastAPI app: OpenAI-compatible routes over one Engine, a health and a metrics route, and the chat page.

Bodies are read and validated here (protocol.py) rather than by FastAPI's own parsing, so that every failure is
an OpenAI error object with the right status (400 bad body, 401 auth, 404 model, 413 size, 429 queue full) and
never a traceback. Every request field is implemented or refused by name (fields.py); /metrics counts the error
answers by status."""
from __future__ import annotations

import asyncio
import hmac
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
from ..generate.grammar import Grammar
from ..generate.request import PreparedRequest
from ..modes import SPEC_MODES
from . import fields, tools
from .metrics import Metrics
from .protocol import ApiError, ChatRequest, CompletionRequest, Sampling, parse_body
from .queue import DONE, EngineWorker, Job, QueueFull
from .responses import FINISH, Shape, chunk, complete, jsonable, logprobs_body, sse_line, token_text, usage


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
        metrics.count_error(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        metrics.count_error(e.status_code)
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        metrics.count_error(500)
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
                metrics.count_error(401)
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
        cache = getattr(engine, "prompt_cache", None)  # saved prefixes (--cache-ram)
        return PlainTextResponse(metrics.text(worker.queue_length, worker.busy,
                                              cache.snapshot() if cache is not None else None),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": settings.model_id, "object": "model", "created": 0,
                                            "owned_by": "offload-engine"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = parse_body(await read_body(request, settings.max_body_bytes), ChatRequest)
        fields.check_chat(body)
        if engine.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: use /v1/completions with token ids", param="messages")
        tool_plan = tools.plan(body, engine.tokenizer)  # None: no tools offered
        messages = tools.template_messages(body, engine.tokenizer)
        try:
            ids = engine.tokenizer.encode_chat(messages, **tools.template_vars(tool_plan))
        except Exception as e:  # a template that refuses the message order (e.g. two system turns)
            raise ApiError(400, f"the chat template refused these messages: {e}", param="messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        grammar = tool_plan.grammar if tool_plan is not None and tool_plan.grammar else fields.grammar(body)
        prepared = await prepare(body, ids, limit, top, grammar, chat=True)
        shape = Shape(chat=True, tokenizer=engine.tokenizer, logprobs=top is not None, tools=tool_plan)
        return await respond(request, body, prepared, shape)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_body(await read_body(request, settings.max_body_bytes), CompletionRequest)
        fields.check_completion(body)
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
        prepared = await prepare(body, ids, body.max_tokens, body.logprobs, fields.grammar(body), chat=False)
        echo = ""
        if body.echo:
            if engine.tokenizer is None:
                raise ApiError(400, "echo: this model has no tokenizer to return the prompt as text", param="echo")
            echo = prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids, skip_special_tokens=False)
        shape = Shape(chat=False, tokenizer=engine.tokenizer, logprobs=body.logprobs is not None, echo=echo)
        return await respond(request, body, prepared, shape)

    async def prepare(body: Sampling, ids: list[int], limit: int | None, top_logprobs: int | None,
                      grammar: Grammar | None, chat: bool) -> PreparedRequest:
        """The request checked once, by Engine.prepare (ids, sampling, spec, grammar, context), before it waits in
        the queue; its refusals answered as 400s in this API's words (_refusal)."""
        if body.model is not None and body.model != settings.model_id:
            raise ApiError(404, f"model {body.model!r} is not served here (this server serves "
                                f"{settings.model_id!r})", "not_found_error", param="model", code="model_not_found")
        if limit is not None and limit > settings.max_tokens_limit:
            raise ApiError(400, f"max_tokens {limit} is over this server's limit of {settings.max_tokens_limit} "
                                "(--max-tokens-limit)", param="max_tokens")
        # no max_tokens: what the context leaves (at least 1: a prompt that fills it is refused by prepare)
        max_new = limit if limit is not None else max(1, min(engine.context - len(ids), settings.max_tokens_limit))
        sampling = dict(max_new_tokens=max_new, seed=body.seed, stop=body.stops(), logprobs=top_logprobs,
                        temperature=float(1.0 if body.temperature is None else body.temperature),
                        top_p=float(1.0 if body.top_p is None else body.top_p), top_k=body.top_k or 0,
                        min_p=float(body.min_p or 0.0), presence_penalty=float(body.presence_penalty or 0.0),
                        frequency_penalty=float(body.frequency_penalty or 0.0),
                        logit_bias=fields.logit_bias(body.logit_bias, engine.model.vocab_size), grammar=grammar)
        try:  # on a thread: the first grammar for a tokenizer takes up to a second to set up
            spec = {} if body.spec is None else {"spec": body.spec}
            return await asyncio.to_thread(engine.prepare, ids, **spec, **sampling)
        except (ConfigError, OffloadEngineError) as e:
            raise _refusal(e, body, len(ids), limit, engine.context, chat, grammar) from None

    async def respond(request: Request, body: Sampling, prepared: PreparedRequest, shape: Shape) -> Response:
        chat, prompt_tokens = shape.chat, len(prepared.ids)
        # the worker runs the prepared request as it is: Engine.stream checks nothing again
        job = Job(start=lambda: engine.stream(prepared), loop=asyncio.get_running_loop())

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
            return StreamingResponse(_sse(job, meta, shape, prompt_tokens, include_usage, client_left, metrics),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watch = asyncio.create_task(_on_disconnect(request, client_left))
        try:
            finish = await _finish(job)
        finally:
            watch.cancel()
            client_left()  # also when this handler is cancelled: its client is gone
        return JSONResponse(complete(meta, shape, finish, prompt_tokens))

    return app


async def read_body(request: Request, cap: int) -> bytes:
    """The body, refused with 413 once it passes `cap` bytes (by its Content-Length or as it arrives)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise ApiError(413, f"request body of {int(length)} bytes is over the limit of {cap} bytes "
                            "(--max-body-bytes)", code="request_too_large")
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > cap:
            raise ApiError(413, f"request body is over the limit of {cap} bytes (--max-body-bytes)",
                           code="request_too_large")
        chunks.append(part)
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


def _refusal(e: OffloadEngineError, body: Sampling, prompt_tokens: int, limit: int | None, context: int, chat: bool,
             grammar: Grammar | None) -> ApiError:
    """Engine.prepare's refusal as a 400 naming the request field (RequestError.field: the API's argument)."""
    field = getattr(e, "field", None)
    if field == "context":
        if limit is None or prompt_tokens >= context:
            return ApiError(400, f"prompt has {prompt_tokens} tokens, the context reserved is {context} tokens",
                            param="messages" if chat else "prompt", code="context_length_exceeded")
        return ApiError(400, f"prompt ({prompt_tokens} tokens) + max_tokens ({limit}) exceed the context reserved "
                             f"({context} tokens)", param="max_tokens", code="context_length_exceeded")
    if field == "spec" and getattr(e, "code", None) == "unknown_mode":
        return ApiError(400, f"spec: must be one of {', '.join(SPEC_MODES)}, got {body.spec!r}", param="spec")
    if field in ("spec", "spec_depth", "spec_width", "prompt"):
        return ApiError(400, str(e), param="messages" if field == "prompt" and chat else field)
    if grammar is not None and str(e).startswith(f"{grammar.name}:"):
        return ApiError(400, str(e), param=grammar.name)
    return ApiError(400, str(e), param=fields.param_of(str(e)))


def _as_api_error(e: Exception) -> ApiError:
    if isinstance(e, ConfigError):
        return ApiError(400, str(e))
    if isinstance(e, OffloadEngineError):
        return ApiError(500, str(e), "server_error")
    return ApiError(500, f"internal error: {type(e).__name__}", "server_error")


async def _sse(job: Job, meta: dict, shape: Shape, prompt_tokens: int, include_usage: bool,
               client_left: Callable[[], None], metrics: Metrics) -> AsyncIterator[str]:
    """SSE chunks: a role chunk (chat) or the echoed prompt (completions, echo), one per token text with the
    logprobs of the tokens it completes, a finish chunk (with those of tokens that added no text), the usage chunk
    if asked, [DONE]. Cancelled (the client disconnected), it calls `client_left`, which stops the job at the
    worker's next step."""
    pending, offset = [], len(shape.echo)  # logprobs not sent yet; completions' text_offset of the next token
    answer = tools.ToolAnswer(shape.tools) if shape.tools is not None else None  # tool calls sent as deltas

    def take_logprobs() -> dict | None:
        nonlocal pending, offset
        body = logprobs_body(shape, pending, offset)
        offset += sum(len(token_text(shape.tokenizer, r.token_id)) for r in pending) if body is not None else 0
        pending = []
        return body
    try:
        if shape.chat or shape.echo:
            yield sse_line(chunk(meta, shape, shape.echo, None, first=True))
        while (item := await job.events.get()) is not DONE:
            if isinstance(item, Exception):
                error = _as_api_error(item)
                metrics.count_error(error.status)
                yield sse_line(error.body())
                continue
            if isinstance(item, TokenEvent):
                if item.logprob is not None:
                    pending.append(item.logprob)
                if answer is not None:
                    for delta in answer.token(item.token_id):
                        yield sse_line(chunk(meta, shape, None, None, logprobs=take_logprobs() if pending else None,
                                             delta=delta))
                elif item.text:
                    yield sse_line(chunk(meta, shape, item.text, None, logprobs=take_logprobs()))
            elif isinstance(item, FinishEvent):
                reason = FINISH.get(item.reason, item.reason)
                if answer is not None:
                    for delta in answer.finish():
                        yield sse_line(chunk(meta, shape, None, None, logprobs=take_logprobs() if pending else None,
                                             delta=delta))
                    reason = answer.reason(item.reason, answer.final())
                last = chunk(meta, shape, None, reason, logprobs=take_logprobs() if pending else None)
                last["offload_engine"] = jsonable(item.stats)
                if not include_usage:
                    last["usage"] = usage(prompt_tokens, item)
                yield sse_line(last)
                if include_usage:
                    yield sse_line({**meta, "object": last["object"], "choices": [],
                                    "usage": usage(prompt_tokens, item)})
        yield "data: [DONE]\n\n"
    finally:
        client_left()
