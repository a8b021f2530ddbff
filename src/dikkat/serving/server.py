"""An OpenAI-compatible HTTP server over :class:`dikkat.serving.Engine` (docs/server.md).

Routes: ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` (whole,
or streamed as server-sent events), ``POST /tokenize`` and ``POST /detokenize`` (vLLM's),
``GET /health`` and ``GET /metrics`` (Prometheus text). Every refusal is OpenAI's error object
naming the field; nothing a client sends is answered with 500. fastapi is an optional dependency
(``pip install dikkat[serve]``).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dikkat.serving.chat import ChatCompletion
from dikkat.serving.choices import EngineFailedError, Served, unless_disconnected
from dikkat.serving.completions import Completion
from dikkat.serving.metrics import RequestCounter, render
from dikkat.serving.params import ChatPrompt, RequestError
from dikkat.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    validation_message,
)
from dikkat.serving.requests import EngineFull
from dikkat.serving.runner import EngineLike, EngineRunner
from dikkat.serving.tokenize import detokenize, tokenize
from dikkat.serving.tokens import Vocabulary

log = logging.getLogger("dikkat.serving")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(status: int, message: str, **fields: Any) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error", 503: "server_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return JSONResponse(error_body(message, kind, **fields), status_code=status)


class Gate:
    """ASGI middleware: the API key check (``Authorization: Bearer KEY``) and the request count
    for ``/metrics``. Plain ASGI rather than ``BaseHTTPMiddleware``, so that a streamed
    response and its disconnect reach the route untouched."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, counter: RequestCounter, routes: frozenset[str]
    ) -> None:
        self.app, self.api_key, self.counter = app, api_key, counter
        self.routes = routes  # counted by path; any other path as "other" (bounded labels)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
        if self.api_key is not None and not self._authorized(scope):
            self.counter.add(route, 401)
            response = error_response(
                401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                code="invalid_api_key",
            )  # fmt: skip
            await response(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.add(route, message["status"])
            await send(message)

        await self.app(scope, receive, counted)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        expected = self.api_key or ""
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), expected)


def create_app(
    engine: EngineLike,
    tokenizer: Any,
    model_name: str,
    *,
    api_key: str | None = None,
    stop_ids: tuple[int, ...] | None = None,
    chat_prompt: ChatPrompt | None = None,
    max_model_len: int | None = None,
    executor: Executor | None = None,
) -> FastAPI:
    """The server's ASGI app over ``engine`` (``uvicorn.run(app)`` serves it).

    ``tokenizer`` encodes prompts and decodes tokens (``dikkat.text.load_tokenizer``, or a
    pretrained model's ``.tokenizer``); ``model_name`` is the one model ``/v1/models`` lists and
    requests must name; ``api_key`` makes every route need ``Authorization: Bearer KEY``;
    ``stop_ids`` end every answer (the default: the tokenizer's end-of-generation ids, if it has
    any); ``chat_prompt`` renders a conversation (a list of ``{"role", "content"}``) in the
    model's chat template, ready for the assistant's turn (``Pretrained.chat_prompt``; None: the
    model has no chat template and ``/v1/chat/completions`` answers 400). The engine is stepped
    by a worker thread from the app's startup to its shutdown. ``max_model_len`` caps the
    context a request may use (prompt and answer; default: the model's, ``engine.max_len``),
    as vLLM's flag does: the engine promises a request the blocks of its whole length.
    ``executor``: where the engine's loop runs (:class:`~dikkat.serving.runner.EngineRunner`);
    None: a thread of its own.
    """
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty string or None")
    if chat_prompt is not None and not callable(chat_prompt):
        raise TypeError(f"chat_prompt must be callable or None, got {type(chat_prompt).__name__}")
    context = int(engine.max_len)
    if max_model_len is not None:
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int):
            raise TypeError(f"max_model_len must be an int or None, got {max_model_len!r}")
        if not 1 <= max_model_len <= context:
            raise ValueError(
                f"max_model_len must be in [1, {context}] (the model's context), "
                f"got {max_model_len}"
            )
        context = max_model_len
    vocab_size = int(engine.model.config.vocab_size)  # type: ignore[attr-defined]
    vocab = Vocabulary(tokenizer, vocab_size, stop_ids)
    runner = EngineRunner(engine, executor=executor)
    queue = getattr(engine, "max_queue", None)
    served = Served(runner, vocab, model_name, context, queue, chat_prompt)
    counter = RequestCounter()
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        yield
        runner.stop()

    app = FastAPI(title="dikkat", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runner = runner
    routes = frozenset(
        ("/health", "/metrics", "/v1/models", COMPLETIONS, CHAT, "/tokenize", "/detokenize")
    )
    app.add_middleware(Gate, api_key=api_key, counter=counter, routes=routes)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:  # never a client's doing
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"the server failed on this request: {type(exc).__name__}")

    @app.get("/health")
    async def health() -> JSONResponse:
        if not runner.alive:
            return error_response(503, "the engine's worker thread is not running")
        return JSONResponse({"status": "ok", "model": model_name})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = render(engine.stats(), counter)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": model_name, "object": "model", "created": started, "owned_by": "dikkat",
                "max_model_len": served.max_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await _generate(request, CompletionRequest, Completion, served)

    @app.post(CHAT)
    async def chat(request: Request) -> Response:
        return await _generate(request, ChatRequest, ChatCompletion, served)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await _answer(request, TokenizeRequest, lambda body: tokenize(body, served))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await _answer(request, DetokenizeRequest, lambda body: detokenize(body, served))

    return app


async def _parse(request: Request, kind: type[BaseModel]) -> Any:
    """The body as ``kind``, or an error response naming what is wrong."""
    try:
        return kind.model_validate_json(await request.body())
    except ValidationError as e:
        message, param = validation_message(e.errors(include_url=False))
        return error_response(400, message, param=param)


def _refused(e: RequestError) -> JSONResponse:
    return error_response(e.status, str(e), param=e.param, code=e.code)


async def _answer(request: Request, kind: type[BaseModel], work: Callable[[Any], Any]) -> Response:
    body = await _parse(request, kind)
    if isinstance(body, Response):
        return body
    try:
        return JSONResponse(work(body))
    except RequestError as e:
        return _refused(e)


async def _generate(
    request: Request, kind: type[BaseModel], job_of: Callable[[Any, Served], Any], served: Served
) -> Response:
    """Check a completions or chat request, submit its choices, answer whole or streamed."""
    body = await _parse(request, kind)
    if isinstance(body, Response):
        return body
    try:
        if body.model != served.name:
            raise RequestError(
                f"the model {body.model!r} does not exist; this server has {served.name!r}",
                param="model", status=404, code="model_not_found",
            )  # fmt: skip
        job = job_of(body, served)
    except RequestError as e:
        return _refused(e)
    except EngineFull as e:
        return JSONResponse(
            error_body(f"the server is full, retry later ({e})", "server_error",
                       code="engine_overloaded"),
            status_code=503, headers={"Retry-After": "1"},
        )  # fmt: skip
    except ValueError as e:  # the engine's own check of a prompt and its parameters
        return error_response(400, str(e))
    if body.stream:
        return StreamingResponse(job.events(), media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        answer = await unless_disconnected(job.whole(), request.receive)
    except EngineFailedError as e:
        return error_response(500, f"the engine failed: {e}")
    if answer is None:  # the client left: its choices were aborted
        return Response(status_code=499)
    return JSONResponse(answer)
