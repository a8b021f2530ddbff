"""An OpenAI-compatible HTTP server over :class:`dikkat.serving.Engine` (docs/server.md).

Routes: ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` (whole,
or streamed as server-sent events), ``POST /tokenize`` and ``POST /detokenize`` (vLLM's),
``GET /health`` and ``GET /metrics`` (Prometheus text). Every refusal is OpenAI's error object
naming the field; nothing a client sends is answered with 500. Every request passes the
:class:`~dikkat.serving.guard.Guard` first (the Host, the origin, the API key, the body's type,
size and time). A request's CPU work (parsing its body, rendering the chat template,
tokenising) runs on a worker thread, so that one long prompt never stalls the event loop and
the other clients; its submission to the engine runs on the loop (``runner.submit`` registers
the request's queue there). fastapi is an optional dependency (``pip install dikkat[serve]``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from dikkat.serving.chat import ChatCompletion
from dikkat.serving.choices import EngineFailedError, Served, unless_disconnected
from dikkat.serving.completions import Completion
from dikkat.serving.guard import Guard, error_response
from dikkat.serving.limits import Access, Limits, check_api_key
from dikkat.serving.metrics import RequestCounter, render
from dikkat.serving.params import ChatIds
from dikkat.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    TokenizeRequest,
    error_body,
    validation_message,
)
from dikkat.serving.requests import EngineFull
from dikkat.serving.runner import EngineLike, EngineRunner
from dikkat.serving.structured import ServedGrammars
from dikkat.serving.tokenize import detokenize, tokenize
from dikkat.serving.tokens import Vocabulary

log = logging.getLogger("dikkat.serving")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(
    engine: EngineLike,
    tokenizer: Any,
    model_name: str,
    *,
    api_key: str | None = None,
    stop_ids: tuple[int, ...] | None = None,
    chat_ids: ChatIds | None = None,
    max_model_len: int | None = None,
    executor: Executor | None = None,
    limits: Limits | None = None,
    allowed_hosts: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
    chat_template: str | None = None,
) -> FastAPI:
    """The server's ASGI app over ``engine``; serve it with uvicorn and
    :func:`~dikkat.serving.listen.uvicorn_settings` of the same ``limits``.

    ``tokenizer`` encodes prompts and decodes tokens (``dikkat.text.load_tokenizer``, or a
    pretrained model's ``.tokenizer``); ``model_name`` is the one model ``/v1/models`` lists and
    requests must name; ``api_key`` makes every route need ``Authorization: Bearer KEY``;
    ``stop_ids`` end every answer (the default: the tokenizer's end-of-generation ids, if it has
    any); ``chat_ids`` turns a conversation (a list of ``{"role", "content"}``) into the token
    ids of the model's chat template, ready for the assistant's turn (``Pretrained.chat_ids``,
    which tokenises the contents as text; None: the model has no chat template and
    ``/v1/chat/completions`` answers 400). The engine is stepped by a worker thread from the
    app's startup to its shutdown. ``max_model_len`` caps the context a request may use (prompt
    and answer; default: the model's, ``engine.max_len``), as vLLM's flag does: how many
    blocks one request may grow to hold. ``executor``: where the engine's loop
    runs (:class:`~dikkat.serving.runner.EngineRunner`); None: a thread of its own. ``limits``
    bound a request's body (default :class:`~dikkat.serving.limits.Limits`);
    ``allowed_hosts`` are names a request's ``Host`` may give besides the loopback names and
    the address it arrived at, and ``allowed_origins`` the browser origins answered, with CORS
    headers (``"*"``: any; docs/server.md, "Running it safely"). ``chat_template`` is the text
    of the template behind ``chat_ids``, which says whether it renders tools itself and whether
    the model thinks in ``<think>`` tags (docs/server.md, "Tools", "Reasoning"); None: that of
    the model whose method ``chat_ids`` is (``Pretrained.chat_ids``, or a partial of it).
    """
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
    if api_key is not None:
        check_api_key(api_key)
    if chat_ids is not None and not callable(chat_ids):
        raise TypeError(f"chat_ids must be callable or None, got {type(chat_ids).__name__}")
    access = Access.of(allowed_hosts, allowed_origins)
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
    template = chat_template if chat_template is not None else _template_of(chat_ids)
    knows_tools = isinstance(template, str) and "tools" in template
    thinks = isinstance(template, str) and "<think>" in template
    grammars = ServedGrammars(engine, vocab)
    served = Served(
        runner, vocab, model_name, context, queue, chat_ids, grammars, knows_tools, thinks
    )
    counter = RequestCounter()
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        yield
        runner.stop()

    app = FastAPI(title="dikkat", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runner = runner
    app.state.limits = limits = limits or Limits()  # (uvicorn_settings needs the same)

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

    # the routes above, counted by path in /metrics (FastAPI's own /openapi.json is no APIRoute)
    routes = frozenset(r.path for r in app.routes if isinstance(r, APIRoute))
    app.add_middleware(
        Guard, access=access, limits=limits, api_key=api_key, counter=counter, routes=routes
    )
    return app


def _prepare(raw: bytes, kind: type[BaseModel], work: Callable[[Any], Any]) -> Any:
    """``work`` of the body parsed as ``kind``, or the refusal (on a worker thread)."""
    try:
        body = kind.model_validate_json(raw)
    except ValidationError as e:
        message, param = validation_message(e.errors(include_url=False))
        return error_response(400, message, param=param)
    try:
        return work(body)
    except RequestError as e:
        return error_response(e.status, str(e), param=e.param, code=e.code)
    except ValueError as e:  # a tokenizer's own refusal of a text
        return error_response(400, str(e))


async def _answer(request: Request, kind: type[BaseModel], work: Callable[[Any], Any]) -> Response:
    answer = await asyncio.to_thread(_prepare, await request.body(), kind, work)
    return answer if isinstance(answer, Response) else JSONResponse(answer)


def _job(body: Any, job_of: Callable[[Any, Served], Any], served: Served) -> Any:
    if body.model != served.name:
        raise RequestError(
            f"the model {body.model!r} does not exist; this server has {served.name!r}",
            param="model", status=404, code="model_not_found",
        )  # fmt: skip
    return job_of(body, served)


async def _generate(
    request: Request, kind: type[BaseModel], job_of: Callable[[Any, Served], Any], served: Served
) -> Response:
    """Check a completions or chat request and tokenise it (on a worker thread), submit its
    choices (on the loop), answer whole or streamed."""
    job = await asyncio.to_thread(
        _prepare, await request.body(), kind, lambda body: _job(body, job_of, served)
    )
    if isinstance(job, Response):
        return job
    try:
        job.submit()
    except EngineFull as e:
        return JSONResponse(
            error_body(f"the server is full, retry later ({e})", "server_error",
                       code="engine_overloaded"),
            status_code=503, headers={"Retry-After": "1"},
        )  # fmt: skip
    except ValueError as e:  # the engine's own check of a prompt and its parameters
        return error_response(400, str(e))
    where = f"{request.method} {request.url.path}"
    if job.body.stream:
        events = _logged(job.events(), where)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        answer = await unless_disconnected(job.whole(), request.receive)
    except EngineFailedError as e:
        return error_response(500, f"the engine failed: {e}")
    if answer is None:  # the client left: its choices were aborted
        log.info("%s: the client left before its answer; its request was aborted", where)
        return Response(status_code=499)
    return JSONResponse(answer)


async def _logged(events: AsyncIterator[str], where: str) -> AsyncIterator[str]:
    """``events``, and a line in the log when the client leaves mid-stream (the stream is
    cancelled, which aborts the request's choices)."""
    try:
        async for event in events:
            yield event
    except (asyncio.CancelledError, GeneratorExit):
        log.info("%s: the client left mid-stream; its request was aborted", where)
        raise


def _template_of(chat_ids: Any) -> str | None:
    """The chat template of the model whose method ``chat_ids`` is (bound, or in a partial)."""
    method = getattr(chat_ids, "func", chat_ids)  # functools.partial keeps it as .func
    template = getattr(getattr(method, "__self__", None), "chat_template", None)
    return template if isinstance(template, str) else None
