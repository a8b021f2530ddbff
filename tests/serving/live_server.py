"""Serve an app on a free loopback port from a thread, for the duration of a ``with`` block, with
``dikkat serve``'s uvicorn settings (``dikkat.serving.listen.uvicorn_settings``); every wait is
bounded."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from dikkat.serving.listen import uvicorn_settings
from dikkat.serving.metrics import parse

WAIT = 20.0  # seconds any test waits for a server to start, stop or settle


@contextmanager
def serving(app: Any, log_level: str = "warning") -> Iterator[str]:
    """The base URL (http://127.0.0.1:PORT) of ``app`` served by uvicorn in a thread, with the
    settings of ``dikkat serve`` for the app's limits."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    settings = uvicorn_settings(app.state.limits, log_level)
    server = uvicorn.Server(uvicorn.Config(app, **settings))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), "the server to start")
        assert server.started, "the server did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(WAIT)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


@contextmanager
def serving_model(
    lm: Any, name: str, chat_ids: Any = None, max_batch: int = 8, num_blocks: int = 256
) -> Iterator[str]:
    """:func:`serving` a pretrained model (``lm``, its ``chat_ids`` unless given) under
    ``name``, its engine of ``max_batch`` rows and ``num_blocks`` blocks of 16 slots."""
    from dikkat.serving import Engine, create_app

    engine = Engine(lm.model, block_size=16, num_blocks=num_blocks, max_batch=max_batch)
    chat_ids = lm.chat_ids if chat_ids is None else chat_ids
    with serving(create_app(engine, lm.tokenizer, name, chat_ids=chat_ids)) as base:
        yield base


def openai_client(url: str, timeout: float = 120) -> Any:
    """The official client of the server at ``url``, no retries."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def wait_for(done: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.01)


def request(
    url: str, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None
) -> tuple[int, Any]:
    """One raw HTTP request: (status, the JSON body, or the text if it is not JSON)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    try:
        return response.status, json.loads(text)
    except json.JSONDecodeError:
        return response.status, text


def metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    status, text = request(url, "GET", "/metrics", headers=headers)
    assert status == 200, text
    return parse(text)


def settled(url: str, headers: dict | None = None) -> dict[str, float]:
    """The metrics once nothing runs or waits and every cache block is free (bounded wait)."""
    seen: dict[str, float] = {}

    def idle() -> bool:
        seen.update(metrics(url, headers))
        return (
            seen["dikkat_requests_running"] == 0
            and seen["dikkat_requests_waiting"] == 0
            and seen["dikkat_cache_blocks_free"] == seen["dikkat_cache_blocks_total"]
        )

    try:
        wait_for(idle, "every request to end and every cache block to be free")
    except TimeoutError as e:
        raise AssertionError(f"{e}: {seen}") from None
    return seen


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def raw(url: str, data: bytes, timeout: float = WAIT) -> tuple[int, bytes]:
    """``data`` sent as it is on a new connection, then everything the server writes until it
    closes the connection: (the status, or 0 for none, and the bytes). Ask with ``Connection:
    close`` for an answer the server would keep the connection open after."""
    with socket.create_connection(address(url), timeout=timeout) as s:
        s.sendall(data)
        answer = read_to_close(s)
    return (int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0), answer


def read_to_close(s: socket.socket, limit: int = 2**20) -> bytes:
    """What the peer writes until it closes (at most ``limit`` bytes; the socket's timeout
    bounds each wait)."""
    parts: list[bytes] = []
    while sum(map(len, parts)) < limit:
        try:
            part = s.recv(65536)
        except ConnectionResetError:
            break
        if not part:
            break
        parts.append(part)
    return b"".join(parts)


def body_of(answer: bytes) -> Any:
    """The JSON body of a raw answer (Content-Length framed)."""
    return json.loads(answer.partition(b"\r\n\r\n")[2])
