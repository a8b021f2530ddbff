"""dikkat's OpenAI-compatible server, over HTTP on a loopback port, through the official
``openai`` client (and raw requests where the client would refuse to send the input)."""

from __future__ import annotations

import re
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import torch  # noqa: E402
from live_server import WAIT, metrics, request, serving, settled, wait_for  # noqa: E402

from conftest import chatml_ids  # noqa: E402
from dikkat.generation import generate  # noqa: E402
from dikkat.models import GPT, GPTConfig  # noqa: E402
from dikkat.serving import Engine, create_app  # noqa: E402
from dikkat.text import ByteTokenizer  # noqa: E402

NAME = "tiny"
TOKENIZER = ByteTokenizer()
PROMPT = "héllo wörld"  # 13 bytes: multi-byte characters in the prompt too
COMPLETIONS = 'dikkat_http_requests_total{route="/v1/completions",code="200"}'


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, max_len=64, d_model=32, n_layers=2, n_heads=2)).eval()


def new_tokens(model: GPT, prompt: list[int], n: int, **sampling: Any) -> list[int]:
    return generate(model, [prompt], n, **sampling)[0][len(prompt) :]


class Throttled:
    """An engine whose step waits for :attr:`gate` and then :attr:`delay` seconds: requests
    stay queued (gate closed) or linger (delay) as long as a test needs."""

    def __init__(self, engine: Any, delay: float = 0.0) -> None:
        self.inner, self.delay = engine, delay
        self.gate = threading.Event()
        self.gate.set()

    def step(self) -> Any:
        self.gate.wait(WAIT)
        if self.delay:
            threading.Event().wait(self.delay)
        return self.inner.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def engine_for(model: GPT, **kwargs: Any) -> Any:
    return Engine(model, **kwargs)


def client(url: str, key: str = "unused") -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=WAIT)


@pytest.fixture(scope="module")
def url(model):
    with serving(create_app(engine_for(model), TOKENIZER, NAME)) as base:
        yield base


def test_models_and_health(url):
    assert [m.id for m in client(url).models.list().data] == [NAME]
    assert request(url, "GET", "/health") == (200, {"status": "ok", "model": NAME})


def test_greedy_completion_is_generate_s_with_real_usage(url, model):
    prompt = TOKENIZER.encode(PROMPT)
    expected = TOKENIZER.decode(new_tokens(model, prompt, 12))
    for given in (PROMPT, prompt):  # text, or token ids
        r = client(url).completions.create(model=NAME, prompt=given, max_tokens=12, temperature=0)
        assert r.choices[0].text == expected
        assert r.choices[0].finish_reason == "length"
        assert r.object == "text_completion" and r.model == NAME
        u = r.usage
        assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (13, 12, 25)


def test_stream_is_the_whole_text_in_pieces_then_usage_then_done(url, model):
    prompt = TOKENIZER.encode(PROMPT)
    expected = TOKENIZER.decode(new_tokens(model, prompt, 10))
    chunks = list(
        client(url).completions.create(
            model=NAME, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    *text_chunks, last = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == expected
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert all(c.usage is None for c in text_chunks)
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == 13 and last.usage.total_tokens == 23

    # without include_usage no chunk has usage; the raw stream is server-sent events
    status, raw = request(url, "POST", "/v1/completions", dict(
        model=NAME, prompt=PROMPT, max_tokens=3, temperature=0, stream=True))  # fmt: skip
    events = [line for line in raw.split("\n") if line]
    assert status == 200 and all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and '"usage"' not in raw


def test_seeded_sampling_is_generate_s(url, model):
    prompt = TOKENIZER.encode(PROMPT)
    sampling = dict(temperature=0.9, top_p=0.8, seed=1234)
    expected = TOKENIZER.decode(new_tokens(model, prompt, 20, **sampling))
    assert expected != TOKENIZER.decode(new_tokens(model, prompt, 20))  # not just greedy
    args = dict(model=NAME, prompt=PROMPT, max_tokens=20, **sampling)
    assert client(url).completions.create(**args).choices[0].text == expected
    stream = client(url).completions.create(**args, stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected


def test_streamed_text_never_breaks_a_multibyte_character(url, model):
    prompt = TOKENIZER.encode(PROMPT)
    expected = TOKENIZER.decode(new_tokens(model, prompt, 40, temperature=1.0, seed=1))
    wide = [c for c in expected if ord(c) > 127 and c != "\ufffd"]
    assert len(wide) >= 2  # the sample holds characters of two or more bytes
    stream = client(url).completions.create(
        model=NAME, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=1, stream=True
    )
    pieces = [c.choices[0].text for c in stream]
    assert "".join(pieces) == expected  # a premature U+FFFD would differ here
    assert len(pieces) > 10


def test_stop_strings_cut_the_text(url, model):
    prompt = TOKENIZER.encode(PROMPT)
    text = TOKENIZER.decode(new_tokens(model, prompt, 20))
    assert text.startswith("d++g")  # what this model continues with
    c = client(url)
    before = settled(url)
    for stream in (False, True):
        r = c.completions.create(
            model=NAME, prompt=PROMPT, max_tokens=20, temperature=0, stop=["zz", "+g"],
            stream=stream,
        )  # fmt: skip
        chunks = list(r) if stream else [r]
        assert "".join(x.choices[0].text for x in chunks) == "d+"
        assert chunks[-1].choices[0].finish_reason == "stop"
    r = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0, stop="Q")
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text, "length")
    after = settled(url)  # a request ended by a stop string gave its blocks back
    counts = ("dikkat_requests_finished_total", "dikkat_requests_aborted_total")
    assert [after[k] - before[k] for k in counts] == [3, 0]  # ended by its text: finished


def test_the_end_of_text_token_stops_and_is_not_shown(model):
    prompt = TOKENIZER.encode(PROMPT)
    tokens = new_tokens(model, prompt, 20)
    eos = tokens[3]
    first = tokens.index(eos)
    with serving(create_app(engine_for(model), TOKENIZER, NAME, stop_ids=(eos,))) as base:
        r = client(base).completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0)
        assert r.choices[0].text == TOKENIZER.decode(tokens[:first])
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == first + 1  # the end-of-text token counts


GOOD = {"model": NAME, "prompt": "hi", "max_tokens": 4}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b'{"model": "tiny", "prompt": ', None, "not valid JSON"),
        (b"[1, 2]", None, "JSON object"),
        ({**GOOD, "max_tokens": "4"}, "max_tokens", "integer"),
        ({**GOOD, "max_tokens": True}, "max_tokens", "integer"),
        ({**GOOD, "temperature": "hot"}, "temperature", "number"),
        ({**GOOD, "prompt": 5}, "prompt", "wrong type"),
        ({**GOOD, "stream": "yes"}, "stream", "boolean"),
        ({**GOOD, "colour": "blue"}, "colour", "unknown field"),
        ({**GOOD, "max_tokens": 63}, "max_tokens", "context of 64"),
        ({**GOOD, "prompt": "x" * 64}, "prompt", "context is 64"),
        ({**GOOD, "prompt": []}, "prompt", "no tokens"),
        ({**GOOD, "prompt": [1, 256]}, "prompt", "vocabulary of 256"),
        ({**GOOD, "n": 0}, "n", "greater than or equal to 1"),
        ({**GOOD, "stop": list("abcdefghijklmnopq")}, "stop", "at most 16"),
        ({**GOOD, "temperature": 3.0}, "temperature", "less than or equal to 2"),
    ],
)
def test_bad_requests_get_400_with_an_openai_error(url, body, param, words):
    status, answer = request(url, "POST", "/v1/completions", body)
    assert status == 400, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == param
    assert words in answer["error"]["message"], answer


def test_an_unknown_model_or_route_gets_404(url):
    status, answer = request(url, "POST", "/v1/completions", {**GOOD, "model": "gpt-9"})
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    status, answer = request(url, "GET", "/v2/anything")
    assert status == 404 and set(answer["error"]) == {"message", "type", "param", "code"}


def test_metrics_count_requests_and_tokens(url):
    before = metrics(url)
    client(url).completions.create(model=NAME, prompt="ab", max_tokens=5, temperature=0)
    after = settled(url)
    assert after[COMPLETIONS] == before.get(COMPLETIONS, 0) + 1
    assert after["dikkat_generation_tokens_total"] == before["dikkat_generation_tokens_total"] + 5
    assert after["dikkat_prompt_tokens_total"] == before["dikkat_prompt_tokens_total"] + 2
    _, text = request(url, "GET", "/metrics")
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert {n.split("{")[0] for n in metrics(url)} <= names  # every sample is declared


def test_a_full_queue_answers_503_until_it_drains(model):
    engine = Throttled(engine_for(model, max_batch=1, max_queue=2))
    engine.gate.clear()  # nothing is admitted: the requests wait in the queue
    with serving(create_app(engine, TOKENIZER, NAME)) as base:
        answers: list[Any] = []

        def ask() -> None:
            answers.append(request(base, "POST", "/v1/completions", GOOD))

        waiting = [threading.Thread(target=ask) for _ in range(2)]
        for t in waiting:
            t.start()
        wait_for(lambda: metrics(base)["dikkat_requests_waiting"] == 2, "two waiting requests")
        with pytest.raises(openai.InternalServerError) as e:
            client(base).completions.create(**GOOD)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "engine_overloaded"
        engine.gate.set()
        for t in waiting:
            t.join(WAIT)
        assert [status for status, _ in answers] == [200, 200]
        settled(base)


def test_an_api_key_is_needed_on_every_route(model):
    with serving(create_app(engine_for(model), TOKENIZER, NAME, api_key="sesame")) as base:
        for path in ("/health", "/metrics", "/v1/models"):
            status, answer = request(base, "GET", path)
            assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(base, key="sesame!").completions.create(**GOOD)
        r = client(base, key="sesame").completions.create(**GOOD)
        assert r.usage.completion_tokens == 4
        assert request(base, "GET", "/health", headers={"Authorization": "Bearer sesame"})[0] == 200


def test_a_client_that_leaves_frees_its_cache_blocks(model):
    engine = Throttled(engine_for(model), delay=0.02)
    with serving(create_app(engine, TOKENIZER, NAME)) as base:
        stream = client(base).completions.create(
            model=NAME, prompt="ab", max_tokens=60, temperature=1.0, seed=0, stream=True
        )
        for _, _chunk in zip(range(3), stream, strict=False):
            pass
        stream.close()  # mid-stream: 57 tokens still to come
        # a non-streaming request whose client hangs up before the answer
        host, port = base.removeprefix("http://").split(":")
        body = b'{"model": "tiny", "prompt": "ab", "max_tokens": 60}'
        with socket.create_connection((host, int(port)), timeout=WAIT) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            wait_for(lambda: metrics(base)["dikkat_requests_running"] >= 1, "it to run")
        seen = settled(base)
        assert seen["dikkat_requests_aborted_total"] == 2
        assert seen["dikkat_generation_tokens_total"] < 2 * 60  # both stopped early


def test_load_16_streams_some_aborted_nothing_lost_no_block_leaked(model):
    prompts = [TOKENIZER.encode("ab" * (1 + i % 5)) for i in range(16)]
    lengths = [4 + (7 * i) % 37 for i in range(16)]
    leave = {i for i in range(16) if i % 4 == 3}  # these close their stream after 2 chunks
    pairs = zip(prompts, lengths, strict=True)
    expected = [TOKENIZER.decode(new_tokens(model, p, n)) for p, n in pairs]
    results: dict[int, Any] = {}
    with serving(create_app(engine_for(model, max_batch=8), TOKENIZER, NAME)) as base:
        c = client(base)

        def one(i: int) -> None:
            stream = c.completions.create(
                model=NAME, prompt=prompts[i], max_tokens=lengths[i], temperature=0, stream=True
            )
            chunks = []
            for chunk in stream:
                chunks.append(chunk.choices[0])
                if i in leave and len(chunks) == 2:
                    stream.close()
                    break
            results[i] = chunks

        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert not any(t.is_alive() for t in threads)
        seen = settled(base)
    assert sorted(results) == list(range(16))  # every stream answered
    for i in sorted(set(range(16)) - leave):  # complete, and each equal to generate() alone
        assert "".join(ch.text for ch in results[i]) == expected[i], i
        assert results[i][-1].finish_reason == "length"
    for i in leave:  # cleanly cut: a prefix of the answer
        assert expected[i].startswith("".join(ch.text for ch in results[i]))
    assert seen[COMPLETIONS] == 16
    assert seen["dikkat_requests_finished_total"] + seen["dikkat_requests_aborted_total"] == 16


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", ["README.md", "docs/server.md"])
def test_the_documented_client_example_runs(model, page, capsys):
    (block,) = [
        b for b in re.findall(r"```py\n(.*?)```", (ROOT / page).read_text(), flags=re.S)
        if "openai.OpenAI" in b
    ]  # fmt: skip
    key = re.search(r'api_key="([^"]+)"', block).group(1)
    name = re.search(r'model="([^"]+)"', block).group(1)
    app = create_app(engine_for(model), TOKENIZER, name, api_key=key, chat_ids=chatml_ids)
    with serving(app) as base:
        exec(compile(block.replace("http://127.0.0.1:8000", base), page, "exec"), {})
    assert capsys.readouterr().out.strip()


def test_dikkat_serve_serves_a_saved_model(model, tmp_path, monkeypatch):
    from dikkat.cli import main, serve

    model.save(tmp_path / "tiny-gpt")
    served: dict[str, Any] = {}

    def run_server(app: Any, sockets: list[socket.socket], log_level: str) -> None:
        served["address"] = sockets[0].getsockname()  # bound by dikkat serve: port 0 chose one
        with serving(app) as base:  # (served here: the engine's thread ends with the command)
            c = client(base, key="k")
            assert [m.id for m in c.models.list().data] == ["tiny-gpt"]
            r = c.completions.create(model="tiny-gpt", prompt=PROMPT, max_tokens=6, temperature=0)
            served["text"] = r.choices[0].text

    monkeypatch.setattr(serve, "run_server", run_server)
    argv = [str(tmp_path / "tiny-gpt"), "--port", "0", "--max-batch", "2", "--api-key", "k"]
    assert main(["serve", *argv]) == 0
    assert served["address"][0] == "127.0.0.1" and served["address"][1] > 0
    assert served["text"] == TOKENIZER.decode(new_tokens(model, TOKENIZER.encode(PROMPT), 6))


def test_dikkat_serve_refuses_two_models_or_none(capsys):
    from dikkat.cli import main

    assert main(["serve"]) == 2
    assert "--hf-gpt2" in capsys.readouterr().err
