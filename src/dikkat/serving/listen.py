"""How the server listens: its sockets, and uvicorn's settings for them (docs/server.md, "Running
it safely"). ``dikkat serve`` and the tests serve with :func:`uvicorn_settings`, so that the tests
exercise the real configuration.

uvicorn bounds an idle kept-alive connection (``timeout_keep_alive``), the size of a request's
head (h11's ``max_incomplete_event_size``) and the connections served at once
(``limit_concurrency``: past it, a request gets 503), but not the time a request's head may take
to arrive: a connection that sends a byte now and then is held open for ever (uvicorn's
``H11Protocol`` arms its only timer once a response is sent). :func:`bounded_h11` adds that
deadline. The body's deadline is :class:`~dikkat.serving.guard.Guard`'s.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from copy import deepcopy
from typing import Any

import h11
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.h11_impl import H11Protocol

from dikkat.serving.limits import Limits

log = logging.getLogger("dikkat.serving")

GRACEFUL_SHUTDOWN = 5  # seconds a stop (Ctrl-C) waits for answers under way, then cuts them


def uvicorn_settings(limits: Limits | None = None, log_level: str = "info") -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.Config`` (or ``uvicorn.run``) for an app of
    :func:`~dikkat.serving.server.create_app` made with the same ``limits``."""
    limits = limits or Limits()
    return {
        "http": bounded_h11(limits.head_timeout),  # h11 always, even where httptools is installed
        "h11_max_incomplete_event_size": limits.max_head_bytes,
        "timeout_keep_alive": limits.keep_alive,
        "limit_concurrency": limits.max_connections,
        "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN,
        "ws": "none",  # no route takes a WebSocket
        "lifespan": "on",  # the engine's worker starts and stops with it
        "log_level": log_level,
        "log_config": log_config(log_level),
    }


def log_config(log_level: str) -> dict[str, Any]:
    """uvicorn's logging, with dikkat's server lines (``dikkat.serving``) through its handler."""
    config = deepcopy(LOGGING_CONFIG)
    config["loggers"]["dikkat"] = {"handlers": ["default"], "level": log_level.upper()}
    return config


def bounded_h11(head_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head (its line and headers) is
    not whole ``head_timeout`` seconds after the connection opened or after the head's first
    byte (a kept-alive connection between requests is uvicorn's ``timeout_keep_alive``'s)."""

    class BoundedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the head is in
                self._disarm()
            elif self._head_timer is None:  # the first bytes of a kept-alive connection's next
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(head_timeout, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.debug("closed a connection whose request head took over %g s", head_timeout)
                self.transport.close()

    return BoundedH11Protocol


def listen(host: str, port: int, backlog: int = 2048) -> list[socket.socket]:
    """Listening sockets on every address of ``host`` (as asyncio's ``create_server`` makes
    them), before the model loads: an address in use or not this machine's is a ``ValueError``
    naming it at once. Port 0: one the system chooses (``getsockname`` says which)."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"cannot listen on {where}: {getattr(e, 'strerror', None) or e}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(found):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio does: IPv4 has a socket of its own
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise ValueError(f"cannot listen on {where}: {e.strerror or e}") from None
    return sockets
