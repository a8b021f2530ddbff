"""What one client may hold of the server: a body's size (refused before it is read, or as soon as
a chunked one passes the limit), the time a request's head and body may take, the connections at
once, a prompt too long for the context (refused before it is tokenised), and the event loop,
which a long tokenisation never holds; a client that leaves is one line in the log, never a
traceback (docs/server.md, "Running it safely"). Real HTTP requests on a loopback port, with the
uvicorn settings of ``dikkat serve``."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from live_server import WAIT, address, body_of, raw, read_to_close, request, serving, wait_for

from conftest import chatml_ids
from dikkat.serving import Engine, create_app
from dikkat.serving.limits import Limits
from dikkat.text import ByteTokenizer

NAME = "tiny"
GOOD = {"model": NAME, "prompt": "hi", "max_tokens": 2}
SMALL = Limits(max_body_bytes=1000, head_timeout=0.5, body_timeout=0.5, max_connections=4)


class Recording(ByteTokenizer):
    """The byte tokenizer, noting the length of every text it encodes, and waiting for
    :attr:`gate` on a text holding ``WAIT`` (as a long prompt's tokenising takes its time)."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.gate, self.waiting = threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        self.lengths.append(len(text))
        if "WAIT" in text:
            self.waiting.set()
            assert self.gate.wait(WAIT)
        return super().encode(text)


@pytest.fixture(scope="module")
def small(tiny_gpt):
    """A server with small limits, and its tokenizer."""
    tokenizer = Recording()
    app = create_app(Engine(tiny_gpt), tokenizer, NAME, chat_ids=chatml_ids, limits=SMALL)
    with serving(app) as base:
        yield base, tokenizer


def head(method: str, length: int | None = None, **headers: str) -> bytes:
    lines = [f"{method} /v1/completions HTTP/1.1", f"Host: {headers.pop('Host', '127.0.0.1')}",
             "Connection: close", "Content-Type: application/json"]  # fmt: skip
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_body_past_the_limit_is_refused_before_it_is_read(small):
    base, _ = small
    started = time.monotonic()
    status, answer = raw(base, head("POST", 2**30) + b"{", timeout=10)  # a GiB announced
    assert status == 413 and body_of(answer)["error"]["code"] == "request_too_large"
    assert "1,000" in body_of(answer)["error"]["message"] and time.monotonic() - started < 5
    at_limit = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "user": "%s"}'
    at_limit %= b"x" * (1000 - len(at_limit) + 2)
    assert len(at_limit) == 1000
    assert raw(base, head("POST", 1000) + at_limit)[0] == 200


def test_a_chunked_body_is_refused_once_it_passes_the_limit(small):
    """No Content-Length to refuse on: reading stops at the limit, with the body unfinished
    (its last chunk never comes)."""
    base, _ = small
    with socket.create_connection(address(base), timeout=10) as s:
        s.sendall(head("POST", Transfer_Encoding="chunked") + b"64\r\n" + b" " * 100 + b"\r\n")
        s.sendall((b"64\r\n" + b" " * 100 + b"\r\n") * 10)  # 1100 bytes: past the limit of 1000
        answer = read_to_close(s)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert b"connection: close" in answer.lower() and b"runs past 1,000 bytes" in answer


def test_a_body_that_comes_too_slowly_is_refused(small):
    base, _ = small
    with socket.create_connection(address(base), timeout=10) as s:
        s.sendall(head("POST", 100) + b'{"model": ')  # and nothing more
        started = time.monotonic()
        answer = read_to_close(s)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert 0.4 < time.monotonic() - started < 5


@pytest.mark.parametrize("sent", [b"", b"GET /health HTTP/1.1\r\nHost: 12"])
def test_a_connection_whose_head_never_ends_is_closed(small, sent):
    """uvicorn alone holds such a connection for ever (its timer starts after a response)."""
    base, _ = small
    with socket.create_connection(address(base), timeout=10) as s:
        s.sendall(sent)
        started = time.monotonic()
        for _ in range(4):  # a byte now and then does not keep it open
            time.sleep(0.1)
            try:
                s.sendall(b"7")
            except (BrokenPipeError, ConnectionResetError):
                break
        assert read_to_close(s) == b""  # closed, no answer
    assert 0.4 < time.monotonic() - started < 5


def test_a_kept_alive_connection_is_bounded_between_requests(small):
    base, _ = small
    with socket.create_connection(address(base), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = b""
        for _ in range(100):  # the whole answer (its body is one JSON object)
            answer += s.recv(65536)
            if answer.endswith(b"}"):
                break
        assert answer.startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\nHo")  # the next request's head, never finished
        started = time.monotonic()
        assert read_to_close(s) == b""
    assert time.monotonic() - started < 5


def test_connections_past_the_limit_get_503(small):
    base, _ = small
    idle = [socket.create_connection(address(base), timeout=10) for _ in range(3)]
    try:  # with this request's own, 4 connections: the limit
        status, _ = raw(
            base, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
        assert status == 503
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: request(base, "GET", "/health")[0] == 200, "the idle connections to go")


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenising(small):
    """The tiny model's context is 64 tokens of one byte at most: 65 characters cannot fit."""
    base, tokenizer = small
    tokenizer.lengths.clear()
    for body, path in [
        ({**GOOD, "prompt": "x" * 65}, "/v1/completions"),
        ({**GOOD, "prompt": ["ok", "x" * 500]}, "/v1/completions"),
        ({"prompt": "x" * 65}, "/tokenize"),
    ]:
        status, answer = request(base, "POST", path, body)
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert "characters" in answer["error"]["message"] and answer["error"]["param"] == "prompt"
    assert max(tokenizer.lengths, default=0) <= 64  # only "ok" and the like were encoded
    status, answer = request(base, "POST", "/v1/completions", {**GOOD, "prompt": "x" * 64})
    assert answer["error"]["message"].startswith("the prompt has 64 tokens")  # tokenised


def test_a_conversation_too_long_is_refused_before_the_template_runs(tiny_gpt):
    calls: list[int] = []

    def chat_ids(messages: list[dict[str, Any]]) -> list[int]:
        calls.append(len(messages))
        return chatml_ids(messages)

    app = create_app(Engine(tiny_gpt), ByteTokenizer(), NAME, chat_ids=chat_ids)
    with serving(app) as base:
        long = [{"role": "user", "content": "x" * 40}, {"role": "user", "content": "y" * 25}]
        for path in ("/v1/chat/completions", "/tokenize"):
            body = {"messages": long} if path == "/tokenize" else {"model": NAME, "messages": long}
            status, answer = request(base, "POST", path, body)
            assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
            assert "the conversation's contents has 65 characters" in answer["error"]["message"]
    assert calls == []


def test_tokenising_runs_off_the_event_loop(small):
    """While one request's prompt is being tokenised, /health answers at once."""
    base, tokenizer = small
    tokenizer.gate.clear()
    tokenizer.waiting.clear()
    answers: list[Any] = []
    body = {**GOOD, "prompt": "WAIT"}
    slow = threading.Thread(
        target=lambda: answers.append(request(base, "POST", "/v1/completions", body))
    )
    slow.start()
    try:
        assert tokenizer.waiting.wait(WAIT)
        with socket.create_connection(address(base), timeout=2) as s:  # 2 s, not the gate's 20
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert read_to_close(s).startswith(b"HTTP/1.1 200")
    finally:
        tokenizer.gate.set()
        slow.join(WAIT)
    assert [status for status, _ in answers] == [200]


def test_rendering_runs_off_the_event_loop_and_its_failure_is_a_400(tiny_gpt):
    gate, waiting = threading.Event(), threading.Event()

    def chat_ids(messages: list[dict[str, Any]]) -> list[int]:
        if messages[0]["content"] == "loop":
            raise ValueError("the chat template ran past 1,000,000 steps")  # as a bound says
        if messages[0]["content"] == "odd":
            raise TypeError("'<' not supported between instances of 'str' and 'int'")
        waiting.set()
        assert gate.wait(WAIT)
        return chatml_ids(messages)

    app = create_app(Engine(tiny_gpt), ByteTokenizer(), NAME, chat_ids=chat_ids)
    with serving(app) as base:
        for content, words in [("loop", "the chat template ran past"),
                               ("odd", "the chat template refused the messages: '<'")]:  # fmt: skip
            body = {"model": NAME, "messages": [{"role": "user", "content": content}]}
            status, answer = request(base, "POST", "/v1/chat/completions", body)
            assert status == 400 and answer["error"]["message"].startswith(words), answer
            assert answer["error"]["param"] == "messages"
        answers: list[Any] = []
        body = {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        slow = threading.Thread(
            target=lambda: answers.append(request(base, "POST", "/v1/chat/completions", body))
        )
        slow.start()
        try:
            assert waiting.wait(WAIT)
            assert request(base, "GET", "/health")[0] == 200  # (its timeout is the gate's)
            assert not gate.is_set() and slow.is_alive()
        finally:
            gate.set()
            slow.join(WAIT)
        assert [status for status, _ in answers] == [200]


@contextmanager
def logged() -> Iterator[list[logging.LogRecord]]:
    """Every record of dikkat's and uvicorn's loggers (uvicorn's do not propagate to the root)
    and of any other logger, while the block runs."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.access")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def test_a_client_that_leaves_is_one_line_never_a_traceback(tiny_gpt):
    limits = Limits(max_body_bytes=1000, body_timeout=0.5)  # (connections: the default's)
    app = create_app(Engine(tiny_gpt), ByteTokenizer(), NAME, limits=limits)
    with serving(app, log_level="info") as base, logged() as records:
        for _ in range(3):  # mid-body
            with socket.create_connection(address(base), timeout=10) as s:
                s.sendall(head("POST", 200) + b'{"model": "tiny", "pro')
        with socket.create_connection(address(base), timeout=10) as s:  # mid-stream
            data = b'{"model": "tiny", "prompt": "a", "max_tokens": 60, "stream": true}'
            s.sendall(head("POST", len(data)) + data)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        # the abuse of the others: cross-site, too large, too slow
        raw(base, head("POST", 10, Host="evil.example", Origin="http://evil.example") + b"x" * 10)
        raw(base, head("POST", 2**30) + b"{")
        raw(base, head("POST", 100) + b"{")
        wait_for(lambda: sum("left" in r.getMessage() for r in records) >= 4, "four lines")
        time.sleep(0.2)  # (anything else it would log)
    left = [r for r in records if r.name == "dikkat.serving" and "left" in r.getMessage()]
    assert [r.levelno for r in left] == [logging.INFO] * 4, [r.getMessage() for r in left]
    assert sum("mid-stream" in r.getMessage() for r in left) == 1
    assert not [r for r in records if r.exc_info or "Traceback" in r.getMessage()]
    assert not [r for r in records if r.levelno >= logging.WARNING], records


def test_a_long_prompt_never_stalls_health_on_smollm2(smollm2):
    """A real tokenizer on a prompt just under the bound (it takes a second or more): /health
    keeps answering meanwhile. The tokenising thread must let the event loop's run, which
    ``tokenizers``' ``encode_batch`` does and its ``encode`` does not."""
    engine = Engine(smollm2.model, block_size=16, num_blocks=16, max_batch=1)
    with serving(create_app(engine, smollm2.tokenizer, "smollm2")) as base:
        request(base, "POST", "/tokenize", {"prompt": "warm up"})
        text = "hello world, this is text. " * 45_000  # under 8192 × 162 characters
        answers: list[Any] = []
        body = {"model": "smollm2", "prompt": text, "max_tokens": 1}
        slow = threading.Thread(
            target=lambda: answers.append(request(base, "POST", "/v1/completions", body))
        )
        started = time.perf_counter()
        slow.start()
        answered = []  # when each /health answer came, from the start
        while slow.is_alive() and len(answered) < 10_000:
            assert request(base, "GET", "/health")[0] == 200
            answered.append(time.perf_counter() - started)
        slow.join(WAIT)
        took = time.perf_counter() - started
    assert answers[0][1]["error"]["code"] == "context_length_exceeded"  # tokenised, then refused
    # a loop held by the tokenising answers nothing in the middle of it; one that is free
    # answers there however slowly a busy machine runs it (what it answers is counted, not timed)
    middle = [t for t in answered if took / 4 < t < 3 * took / 4]
    assert middle, (answered, took)
