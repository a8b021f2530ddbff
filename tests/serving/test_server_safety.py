"""The server as a local service that web pages and other users can reach: the Host header is
checked (DNS rebinding), a browser origin not allowed is refused and gets no CORS headers, a body
must be ``application/json`` (a "simple" cross-site POST is refused), and an API key is bytes a
client can send (docs/server.md, "Running it safely"). Real HTTP requests on a loopback port."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from live_server import address, body_of, metrics, raw, request, serving

from dikkat.serving import Engine, create_app
from dikkat.text import ByteTokenizer

NAME = "tiny"
GOOD = {"model": NAME, "prompt": "hi", "max_tokens": 2}
PROMPTS = "dikkat_prompt_tokens_total"


@pytest.fixture(scope="module")
def url(tiny_gpt):
    with serving(create_app(Engine(tiny_gpt), ByteTokenizer(), NAME)) as base:
        yield base


def error_of(answer: Any) -> dict[str, Any]:
    assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
    return answer["error"]


def test_a_simple_cross_site_post_is_refused_and_runs_nothing(url):
    """A page's form-like POST (text/plain, its own Origin and, through DNS rebinding, its own
    Host): refused on each count alone, and nothing reaches the engine."""
    port = address(url)[1]
    before = metrics(url)[PROMPTS]
    evil = {"Origin": "http://evil.example", "Host": f"evil.example:{port}"}
    cases = [
        ({"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
        ({"Content-Type": "multipart/form-data; boundary=x"}, 415, "unsupported_media_type"),
        ({"Origin": evil["Origin"]}, 403, "origin_not_allowed"),
        ({"Host": evil["Host"]}, 400, "host_not_allowed"),
        ({**evil, "Content-Type": "text/plain"}, 400, "host_not_allowed"),
    ]
    for headers, status, code in cases:
        got, answer = request(url, "POST", "/v1/completions", GOOD, headers)
        assert (got, error_of(answer)["code"]) == (status, code), (headers, answer)
    assert metrics(url)[PROMPTS] == before
    charset = {"Content-Type": "Application/JSON; charset=utf-8"}
    assert request(url, "POST", "/v1/completions", GOOD, charset)[0] == 200


def test_no_content_type_is_refused(url):
    data = b'{"model": "tiny", "prompt": "hi"}'
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    status, answer = raw(url, head.encode() + data)
    assert status == 415 and b"no Content-Type" in answer


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "LOCALHOST", "127.0.0.1"])
def test_the_loopback_names_are_this_server(url, host):
    port = address(url)[1]
    assert request(url, "GET", "/health", headers={"Host": f"{host}:{port}"})[0] == 200
    assert request(url, "GET", "/health", headers={"Host": host})[0] == 200  # (no port: any)


@pytest.mark.parametrize(
    "host", ["evil.example", "127.0.0.1.evil.example", "localhost.evil", "10.1.2.3", "x@127.0.0.1",
             "[::1", "127.0.0.1:80x", "evil.example:8000@127.0.0.1"],
)  # fmt: skip
def test_any_other_host_is_refused_as_dns_rebinding_would_send_it(url, host):
    status, answer = request(url, "GET", "/v1/models", headers={"Host": host})
    assert status == 400 and error_of(answer)["code"] == "host_not_allowed"
    assert "--allowed-hosts" in error_of(answer)["message"]


def test_a_request_without_host_is_refused(url):
    status, _ = raw(url, b"GET /health HTTP/1.0\r\n\r\n")
    assert status == 400


def test_allowed_hosts_open_it_by_name_or_to_all(tiny_gpt):
    app = create_app(Engine(tiny_gpt), ByteTokenizer(), NAME, allowed_hosts=["My.Box", "[fd00::1]"])
    with serving(app) as base:
        for host in ("my.box:8000", "MY.BOX", "[fd00::1]:80"):
            assert request(base, "GET", "/health", headers={"Host": host})[0] == 200, host
        assert request(base, "GET", "/health", headers={"Host": "other.box"})[0] == 400
    with serving(create_app(Engine(tiny_gpt), ByteTokenizer(), NAME, allowed_hosts=["*"])) as base:
        assert request(base, "GET", "/health", headers={"Host": "evil.example"})[0] == 200


@pytest.mark.parametrize("bad", ["http://x", "a/b", "host:8000", "", "a b"])
def test_a_malformed_allowed_host_is_refused_at_start(tiny_gpt, bad):
    with pytest.raises(ValueError, match="allowed host"):
        create_app(Engine(tiny_gpt), ByteTokenizer(), NAME, allowed_hosts=[bad])


def preflight(
    url: str, origin: str, asked: str = "authorization,content-type"
) -> tuple[int, bytes]:
    return raw(url, (
        "OPTIONS /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        f"Origin: {origin}\r\nAccess-Control-Request-Method: POST\r\n"
        f"Access-Control-Request-Headers: {asked}\r\n\r\n"
    ).encode())  # fmt: skip


def test_no_origin_is_allowed_by_default(url):
    status, answer = preflight(url, "http://localhost:3000")
    assert status == 403 and b"access-control-allow-origin" not in answer.lower()
    status, answer = request(url, "GET", "/v1/models", headers={"Origin": "null"})
    assert status == 403 and error_of(answer)["code"] == "origin_not_allowed"


def test_cors_headers_for_the_allowed_origins_only(tiny_gpt):
    allowed = "http://localhost:3000"
    app = create_app(
        Engine(tiny_gpt), ByteTokenizer(), NAME, api_key="sesame", allowed_origins=[allowed + "/"]
    )
    with serving(app) as base:
        status, answer = preflight(base, allowed)  # no key: a preflight never carries one
        head = answer.partition(b"\r\n\r\n")[0].decode().lower()
        assert status == 204, answer
        assert f"access-control-allow-origin: {allowed}" in head
        assert "access-control-allow-methods: get, post, options" in head
        assert "access-control-allow-headers: authorization,content-type" in head
        data = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
        status, answer = raw(base, (
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            f"Authorization: Bearer sesame\r\nOrigin: {allowed}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        ).encode() + data)  # fmt: skip
        assert status == 200
        assert f"access-control-allow-origin: {allowed}\r\n".encode() in answer.lower()
        key = {"Authorization": "Bearer sesame"}
        for other in ("http://localhost:3001", "https://localhost:3000", "http://evil.example"):
            status, answer = preflight(base, other)
            assert status == 403 and b"access-control-allow-origin" not in answer.lower(), other
            status, _ = request(base, "POST", "/v1/completions", GOOD, {**key, "Origin": other})
            assert status == 403
    app = create_app(Engine(tiny_gpt), ByteTokenizer(), NAME, allowed_origins=["*"])
    with serving(app) as base:
        status, answer = preflight(base, "http://evil.example")
        assert status == 204 and b"http://evil.example" in answer


@pytest.mark.parametrize("bad", ["localhost:3000", "http://", "http://a/b", "ftp//x"])
def test_a_malformed_allowed_origin_is_refused_at_start(tiny_gpt, bad):
    with pytest.raises(ValueError, match="allowed origin"):
        create_app(Engine(tiny_gpt), ByteTokenizer(), NAME, allowed_origins=[bad])


def test_a_non_ascii_authorization_header_is_401_not_500(tiny_gpt):
    with serving(create_app(Engine(tiny_gpt), ByteTokenizer(), NAME, api_key="sesame")) as base:
        for token in ("Bearer s\u00e9same", "Bearer \u00ff\u00fe", "\u00e9", "Bearer  sesame x"):
            status, answer = request(base, "GET", "/v1/models", headers={"Authorization": token})
            assert status == 401 and error_of(answer)["code"] == "invalid_api_key", token
        head = (
            b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xf0\x9f\x94\x91"
        )
        assert raw(base, head + b"\r\n\r\n")[0] == 401
        ok = request(base, "GET", "/v1/models", headers={"Authorization": "Bearer sesame"})
        assert ok[0] == 200


@pytest.mark.parametrize("key", ["s\u00e9same", "two words", "tab\tbed", "new\nline", "\u200b", ""])
def test_an_api_key_no_client_can_send_is_refused_at_start(tiny_gpt, key):
    with pytest.raises(ValueError) as e:
        create_app(Engine(tiny_gpt), ByteTokenizer(), NAME, api_key=key)
    assert "\n" not in str(e.value) and (key == "" or key not in str(e.value))  # never echoed


def test_a_refusal_closes_the_connection_without_reading_the_body(url):
    """A refused request's body is never read: the answer says ``Connection: close`` and the
    server closes, even while the client still claims a gigabyte to come."""
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {2**30}\r\n\r\n"
    )
    status, answer = raw(url, head.encode() + b"x" * 1000, timeout=10)
    assert status == 415 and b"connection: close" in answer.lower()
    assert body_of(answer)["error"]["code"] == "unsupported_media_type"
