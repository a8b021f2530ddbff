"""An OpenAI-compatible HTTP server over :class:`dikkat.serving.Engine` (docs/server.md).

Routes: ``GET /v1/models``, ``POST /v1/completions`` (whole, or streamed as server-sent events),
``POST /v1/chat/completions`` (404: no dikkat model has a chat format), ``GET /health`` and
``GET /metrics`` (Prometheus text). Every error is OpenAI's error object. fastapi is an optional
dependency (``pip install dikkat[serve]``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dikkat.serving import EngineFull
from dikkat.serving.completions import (
    Completion,
    EngineFailedError,
    Piece,
    RequestError,
    end_of_text_ids,
    prompt_ids,
    sampling_params,
    stops_of,
)
from dikkat.serving.metrics import RequestCounter, render
from dikkat.serving.protocol import CompletionRequest, completion, error_body, usage
from dikkat.serving.protocol import validation_message as _validation_message
from dikkat.serving.runner import EngineLike, EngineRunner

CHAT = "/v1/chat/completions"
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
) -> FastAPI:
    """The server's ASGI app over ``engine`` (``uvicorn.run(app)`` serves it).

    ``tokenizer`` encodes prompts and decodes tokens (``dikkat.text.load_tokenizer``);
    ``model_name`` is the one model ``/v1/models`` lists and requests must name; ``api_key``
    makes every route need ``Authorization: Bearer KEY``; ``stop_ids`` end every request (the
    default: the tokenizer's end-of-text token, if it has one). The engine is stepped by a
    worker thread from the app's startup to its shutdown.
    """
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty string or None")
    stops = end_of_text_ids(tokenizer) if stop_ids is None else tuple(stop_ids)
    vocab_size = int(engine.model.config.vocab_size)  # type: ignore[attr-defined]
    runner = EngineRunner(engine)
    counter = RequestCounter()
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        yield
        runner.stop()

    app = FastAPI(title="dikkat", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runner = runner
    routes = frozenset(("/health", "/metrics", "/v1/models", "/v1/completions", CHAT))
    app.add_middleware(Gate, api_key=api_key, counter=counter, routes=routes)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

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
        card = {"id": model_name, "object": "model", "created": started, "owned_by": "dikkat"}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post(CHAT)
    async def chat() -> JSONResponse:
        return error_response(
            404,
            f"{model_name} has no chat format (no dikkat model has one yet): "
            "use /v1/completions with a text prompt",
            code="chat_not_supported",
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            body = CompletionRequest.model_validate_json(await request.body())
        except ValidationError as e:
            message, param = _validation_message(e.errors(include_url=False))
            return error_response(400, message, param=param)
        try:
            if body.model != model_name:
                raise RequestError(
                    f"the model {body.model!r} does not exist; this server has {model_name!r}",
                    param="model", status=404, code="model_not_found",
                )  # fmt: skip
            prompt = prompt_ids(body, tokenizer, vocab_size)
            params = sampling_params(body, len(prompt), engine.max_len, stops)
            job = Completion(runner, tokenizer, prompt, params, stops_of(body))
        except RequestError as e:
            return error_response(e.status, str(e), param=e.param, code=e.code)
        except EngineFull as e:
            return JSONResponse(
                error_body(f"the server is full, retry later ({e})", "server_error",
                           code="engine_overloaded"),
                status_code=503, headers={"Retry-After": "1"},
            )  # fmt: skip
        except ValueError as e:  # the engine's own check of the prompt and parameters
            return error_response(400, str(e))
        reply = _Reply(job, model_name, body)
        if body.stream:
            return StreamingResponse(
                reply.events(), media_type="text/event-stream", headers=SSE_HEADERS
            )
        return await reply.whole(request)

    return app


class _Reply:
    """A completion's answer: one JSON object, or server-sent events."""

    def __init__(self, job: Completion, model_name: str, body: CompletionRequest) -> None:
        self.job, self.model = job, model_name
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = body.stream_options is not None and body.stream_options.include_usage

    def _usage(self) -> dict[str, int]:
        return usage(self.job.prompt_tokens, self.job.tokens)

    async def whole(self, request: Request) -> Response:
        """Collect the text; a client that hangs up first aborts the request."""

        async def collect() -> list[Piece]:
            return [piece async for piece in self.job.pieces()]

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not work.done():  # the client left: cancelling runs pieces()' abort
            work.cancel()
            with suppress(asyncio.CancelledError, EngineFailedError):
                await work
            return Response(status_code=499)
        try:
            pieces = work.result()
        except EngineFailedError as e:
            return error_response(500, f"the engine failed: {e}")
        text = "".join(p.text for p in pieces)
        finish = pieces[-1].finish_reason
        body = completion(self.id, self.created, self.model, text, finish, self._usage())  # type: ignore[arg-type]
        return JSONResponse(body)

    async def events(self) -> AsyncIterator[str]:
        """``data: {chunk}`` per piece of text, the last with its finish reason; with
        ``include_usage`` every chunk has ``"usage": null`` and one more chunk (no choices)
        carries the counts; then ``data: [DONE]``."""
        try:
            async for piece in self.job.pieces():
                if not piece.text and piece.finish_reason is None:
                    continue
                chunk = completion(
                    self.id, self.created, self.model, piece.text, piece.finish_reason, None
                )  # type: ignore[arg-type]
                if self.include_usage:
                    chunk["usage"] = None
                yield _sse(chunk)
        except EngineFailedError as e:
            yield _sse(error_body(f"the engine failed: {e}", "server_error"))
            return
        if self.include_usage:
            last = completion(self.id, self.created, self.model, "", None, self._usage())
            last["choices"] = []
            yield _sse(last)
        yield "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body is already read, so the next
    ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
