"""The server's front door, an ASGI middleware ahead of every route (docs/server.md, "Running it
safely"): who may ask (the ``Host``, a browser's ``Origin``, the API key), what a request may
carry (a JSON body of bounded size that arrives in bounded time), CORS headers for the origins
allowed, and the count of answers by route and status for ``/metrics``.

Plain ASGI rather than ``BaseHTTPMiddleware``, so that a streamed response and its disconnect
reach the route untouched. The body is read here, whole, before any route runs (the route reads
it again from memory): a client that leaves mid-body or sends too slowly is one line in the log,
not an exception in a route. A request refused before its body is read is answered with
``Connection: close``, so that the body is never read at all.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dikkat.serving.limits import Access, Limits, check_api_key
from dikkat.serving.metrics import RequestCounter
from dikkat.serving.protocol import error_body

log = logging.getLogger("dikkat.serving")

BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
CLOSE = {"Connection": "close"}
KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


def error_response(
    status: int, message: str, *, headers: dict[str, str] | None = None, **fields: Any
) -> JSONResponse:
    """OpenAI's error object with an HTTP status (``fields``: ``param``, ``code``)."""
    kind = KINDS.get(status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(error_body(message, kind, **fields), status_code=status, headers=headers)


class _ClientLeftError(Exception):
    """The connection closed before the request's body was whole."""


class Guard:
    """Checks every HTTP request before the app sees it; see the module's docstring."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        access: Access,
        limits: Limits,
        api_key: str | None,
        counter: RequestCounter,
        routes: frozenset[str],
    ) -> None:
        self.app, self.access, self.limits, self.counter = app, access, limits, counter
        self.routes = routes  # counted by path; any other path as "other" (bounded labels)
        self.key = None if api_key is None else check_api_key(api_key).encode("ascii")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
        headers: dict[bytes, bytes] = dict(scope["headers"])
        origin = _text(headers.get(b"origin"))
        cors = origin is not None and self.access.origin_allowed(origin)

        async def answer(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.add(route, message["status"])
                if cors:
                    extra = [
                        (b"access-control-allow-origin", headers[b"origin"]),
                        (b"vary", b"Origin"),
                    ]
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        refusal = self._refusal(scope, headers, origin, cors)
        if refusal is None and scope["method"] in BODY_METHODS:
            try:
                body = await self._body(scope, headers, receive)
            except _ClientLeftError:
                return  # (uvicorn sends nothing to a closed connection, and logs nothing)
            if isinstance(body, Response):
                refusal = body
            else:
                receive = _replay(body, receive)
        if refusal is not None:
            await refusal(scope, receive, answer)
            return
        await self.app(scope, receive, answer)

    def _refusal(
        self, scope: Scope, headers: dict[bytes, bytes], origin: str | None, cors: bool
    ) -> Response | None:
        """The answer to a request refused on its head alone, else None."""
        host = _text(headers.get(b"host"))
        server = scope.get("server")
        if not self.access.host_allowed(host, server[0] if server else None):
            return error_response(
                400,
                f"the Host header {host!r} does not name this server (a page's request through "
                "DNS rebinding would); dikkat serve --allowed-hosts adds names",
                code="host_not_allowed", headers=CLOSE,
            )  # fmt: skip
        if origin is not None and not cors:
            return error_response(
                403,
                f"requests from the web origin {origin!r} are not allowed; dikkat serve "
                "--allowed-origins adds origins",
                code="origin_not_allowed", headers=CLOSE,
            )  # fmt: skip
        if cors and scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            asked = _text(headers.get(b"access-control-request-headers"))
            return Response(status_code=204, headers={
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": asked or "Authorization, Content-Type",
                "Access-Control-Max-Age": "600",
            })  # fmt: skip
        if self.key is not None and not self._authorized(headers):
            return error_response(
                401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                code="invalid_api_key", headers=CLOSE,
            )  # fmt: skip
        if scope["method"] not in BODY_METHODS:
            return None
        kind = _text(headers.get(b"content-type")) or ""
        if kind.partition(";")[0].strip().lower() != "application/json":
            return error_response(
                415,
                "the body must be JSON, sent with 'Content-Type: application/json'; got "
                f"{kind or 'no Content-Type'!r}",
                code="unsupported_media_type", headers=CLOSE,
            )  # fmt: skip
        length = _text(headers.get(b"content-length"))
        if length is not None and length.strip().isdigit():  # (h11 refused any other)
            return self._too_large(int(length), announced=True)
        return None

    def _too_large(self, size: int, *, announced: bool) -> Response | None:
        limit = self.limits.max_body_bytes
        if size <= limit:
            return None
        what = f"is {size:,} bytes" if announced else f"runs past {limit:,} bytes"
        return error_response(
            413,
            f"the body {what}; this server takes at most {limit:,} (dikkat serve --max-body-mb)",
            code="request_too_large", headers=CLOSE,
        )  # fmt: skip

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        # bytes, not str: hmac.compare_digest refuses a str that is not ASCII, and a header
        # may carry any byte
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key or b"")

    async def _body(
        self, scope: Scope, headers: dict[bytes, bytes], receive: Receive
    ) -> bytes | Response:
        """The whole body, or the refusal of one too large or too slow; raises
        :class:`_ClientLeftError` (after a line in the log) when the client leaves first."""
        parts: list[bytes] = []
        size = 0

        async def read() -> Response | None:
            nonlocal size
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _ClientLeftError
                chunk = message.get("body", b"")
                size += len(chunk)
                if (refusal := self._too_large(size, announced=False)) is not None:
                    return refusal
                parts.append(chunk)
                more = message.get("more_body", False)
            return None

        where = f"{scope['method']} {scope['path']}"
        try:
            refusal = await asyncio.wait_for(read(), self.limits.body_timeout)
        except _ClientLeftError:
            expected = _text(headers.get(b"content-length")) or "a chunked body"
            log.info("%s: the client left after %d bytes of %s", where, size, expected)
            raise
        except asyncio.TimeoutError:
            timeout = self.limits.body_timeout
            log.info(
                "%s: the body was not whole after %g s (%d bytes): refused", where, timeout, size
            )
            return error_response(
                408, f"the body did not arrive within {timeout:g} s", code="request_timeout",
                headers=CLOSE,
            )  # fmt: skip
        return refusal if refusal is not None else b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body read already, then the connection's own messages (its
    disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")
