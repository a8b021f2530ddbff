"""The server over a real model, SmolLM2-135M-Instruct (a Llama-family ``dikkat.models.Decoder``
with a ChatML template), through the official ``openai`` client: its chat answers are
``Pretrained.chat``'s, its log-probabilities the model's own ``log_softmax`` (fp32, the whole
sequence in one forward), and 16 concurrent streams, 4 of them left mid-way, each get what the
request alone gets and give back every cache block. Small ``max_tokens`` keep it quick."""

from __future__ import annotations

import threading
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import torch  # noqa: E402
from live_server import WAIT, serving, settled  # noqa: E402

from dikkat.serving import Engine, create_app  # noqa: E402

NAME = "smollm2"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def client(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def engine_for(lm: Any, max_batch: int = 16) -> Engine:
    return Engine(lm.model, block_size=16, num_blocks=160, max_batch=max_batch)


@pytest.fixture(scope="module")
def url(smollm2):
    app = create_app(engine_for(smollm2), smollm2.tokenizer, NAME, chat_ids=smollm2.chat_ids)
    with serving(app) as base:
        yield base


def reference_logprobs(lm: Any, ids: list[int]) -> torch.Tensor:
    """(T, V): row t is log_softmax of the model's fp32 logits after ids[: t + 1]."""
    with torch.no_grad():
        return torch.log_softmax(lm.model(torch.tensor([ids]))[0].float(), dim=-1)


def greedy(lm: Any, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The n greedy tokens after ids, each from a whole forward of the sequence so far, and the
    log-probabilities (n, V) each was picked from."""
    new: list[int] = []
    for _ in range(n):
        new.append(int(reference_logprobs(lm, ids + new)[-1].argmax()))
    return new, reference_logprobs(lm, ids + new)[len(ids) - 1 : -1]


def test_a_chat_answer_is_pretrained_chat_s(url, smollm2):
    asks = [ASK, [{"role": "system", "content": "Answer with one word."},
                  {"role": "user", "content": "Is water wet? Yes or no."}]]  # fmt: skip
    for messages in asks:
        expected = smollm2.chat(messages, 8)
        r = client(url).chat.completions.create(
            model=NAME, messages=messages, max_tokens=8, temperature=0
        )
        assert r.choices[0].message.content == expected
        stream = client(url).chat.completions.create(
            model=NAME, messages=messages, max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream) == expected
    assert r.choices[0].finish_reason == "stop"  # the one-word answer ended at <|im_end|>
    assert "<|im_end|>" not in r.choices[0].message.content


def test_greedy_logprobs_are_the_model_s_log_softmax(url, smollm2):
    prompt = "The capital of France is"
    r = client(url).completions.create(
        model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    decode = smollm2.tokenizer.decode
    new, reference = greedy(smollm2, smollm2.tokenizer.encode(prompt), 6)
    assert lp.tokens == [decode([t]) for t in new] and r.choices[0].text == decode(new)
    for k, token in enumerate(new):
        assert abs(lp.token_logprobs[k] - reference[k, token].item()) < 1e-4
        top = reference[k].topk(3)
        assert list(lp.top_logprobs[k]) == [decode([i]) for i in top.indices.tolist()]
        assert list(lp.top_logprobs[k].values()) == pytest.approx(top.values.tolist(), abs=1e-4)
    # the chat format carries the same numbers
    r = client(url).chat.completions.create(
        model=NAME, messages=ASK, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    ids = smollm2.tokenizer.encode(smollm2.chat_prompt(ASK), add_special=False)
    new, reference = greedy(smollm2, ids, 4)
    assert [bytes(e.bytes) for e in content] == [decode([t]).encode() for t in new]
    for k, token in enumerate(new):
        assert abs(content[k].logprob - reference[k, token].item()) < 1e-4
        top = reference[k].topk(2)
        assert [e.logprob for e in content[k].top_logprobs] == pytest.approx(
            top.values.tolist(), abs=1e-4
        )


def test_echo_scores_a_text_as_the_model_does_teacher_forced(url, smollm2):
    text = "Paris is the capital of France."
    ids = smollm2.tokenizer.encode(text)
    reference = reference_logprobs(smollm2, ids)
    expected = [reference[k - 1, ids[k]].item() for k in range(1, len(ids))]
    for max_tokens in (0, 1):
        r = client(url).completions.create(
            model=NAME, prompt=ids, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1
        )
        lp = r.choices[0].logprobs
        assert r.choices[0].text.startswith(text)
        assert lp.token_logprobs[0] is None
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
        assert len(lp.tokens) == len(ids) + max_tokens
        assert r.usage.completion_tokens == max_tokens
    assert lp.token_logprobs[-1] == pytest.approx(reference[-1].max().item(), abs=1e-4)


def test_n_seeded_choices_repeat_and_choice_0_is_n_1(url):
    args = dict(model=NAME, messages=ASK, max_tokens=6, temperature=1.0, seed=42)
    first = client(url).chat.completions.create(n=3, **args)
    texts = [c.message.content for c in first.choices]
    assert len(texts) == 3 and len(set(texts)) > 1
    again = client(url).chat.completions.create(n=3, **args)
    assert [c.message.content for c in again.choices] == texts
    alone = client(url).chat.completions.create(n=1, **args)
    assert alone.choices[0].message.content == texts[0]
    settled(url)


def test_16_streams_4_left_each_answer_is_the_request_alone_no_block_leaked(url):
    topics = ["cats", "the sea", "Paris", "bread", "rain", "music", "chess", "tea"]
    asks = [  # 8 requests of mixed lengths, each sent twice
        dict(messages=[{"role": "user", "content": f"About {topic}." + " Be brief." * (i % 3)}],
             max_tokens=3 + (5 * i) % 7)
        for i, topic in enumerate(topics)
    ]  # fmt: skip
    requests = [asks[i % 8] for i in range(16)]
    leave = {1, 6, 11, 15}  # these close their stream after 2 chunks (their twins finish)
    c = client(url)
    alone = [
        c.chat.completions.create(model=NAME, temperature=0, **r).choices[0].message.content
        for r in asks
    ]
    before = settled(url)
    results: dict[int, Any] = {}

    def one(i: int) -> None:
        stream = c.chat.completions.create(model=NAME, temperature=0, stream=True, **requests[i])
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
        t.join(WAIT * 6)
    assert not any(t.is_alive() for t in threads)
    seen = settled(url)  # every block is free again
    assert sorted(results) == list(range(16))
    for i in sorted(set(range(16)) - leave):
        assert "".join(ch.delta.content or "" for ch in results[i]) == alone[i % 8], i
        assert results[i][-1].finish_reason in ("stop", "length")
    for i in leave:
        assert len(results[i]) == 2
    aborted = seen["dikkat_requests_aborted_total"] - before["dikkat_requests_aborted_total"]
    finished = seen["dikkat_requests_finished_total"] - before["dikkat_requests_finished_total"]
    assert finished + aborted == 16 and aborted <= len(leave)


def test_dikkat_serve_model_serves_a_pretrained_decoder(smollm2, monkeypatch, capsys):
    from dikkat.cli import main, serve

    served: dict[str, Any] = {}
    monkeypatch.setattr(
        "dikkat.pretrained.load", lambda source, device, weights=None: smollm2
    )  # as loaded

    def run_server(app: Any, sockets: Any, log_level: str) -> None:
        with serving(app) as base:  # (served here: the engine's thread ends with the command)
            r = client(base).chat.completions.create(
                model="smollm2", messages=ASK, max_tokens=5, temperature=0
            )
            served["answer"] = r.choices[0].message.content
            served["max_model_len"] = (
                client(base).models.list().data[0].model_extra["max_model_len"]
            )

    monkeypatch.setattr(serve, "run_server", run_server)
    argv = ["serve", "--model", "smollm2", "--num-blocks", "32", "--max-batch", "2", "--port", "0"]
    assert main(argv) == 0
    assert "chat and completions" in capsys.readouterr().out
    assert served["answer"] == smollm2.chat(ASK, 5)
    assert served["max_model_len"] == smollm2.model.config.max_len
