"""Concurrent streams through ``dikkat serve``: aggregate tokens/s, first-token and per-token
latency, for 1, 4, 8 and 16 streams at once.

    python benchmarks/serving.py [--streams 1,4,8,16] [--tokens 64] [--prompt 16] [--quick]

The server runs in its own process (an Engine over a randomly initialised GPT-2-small-shaped
model, fp32, greedy, no end-of-text stop, so every stream gets all its tokens); the clients are
the official ``openai`` async client, streaming, in this process. ``--quick`` uses a small model.
Aggregate tokens/s = every stream's tokens / the wall time from the first request to the last
token; first-token latency from a request to its first chunk; per-token latency = the gaps
between a stream's chunks (percentiles over all streams).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing as mp
import socket
import time

from common import save_json

GPT2_SMALL = dict(vocab_size=50257, max_len=1024, d_model=768, n_layers=12, n_heads=12)
SMALL = dict(vocab_size=512, max_len=256, d_model=128, n_layers=4, n_heads=4)


class NumberTokenizer:
    """Each id is the word " <id>": every token shows as text (a random model's ids decode to
    nothing useful with a real tokenizer, and the benchmark times chunks of text)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [int(w) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return "".join(f" {i}" for i in ids)


def serve(shape: dict, port: int, max_batch: int) -> None:
    """The server process: build the model, the engine and the app; serve on ``port``."""
    import torch
    import uvicorn

    from dikkat.models import GPT, GPTConfig
    from dikkat.serving import Engine, create_app

    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape)).eval()
    engine = Engine(model, max_batch=max_batch)
    app = create_app(engine, NumberTokenizer(shape["vocab_size"]), "bench", stop_ids=())
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def one_stream(client, prompt: list[int], tokens: int) -> tuple[float, list[float], int]:
    """(seconds to the first chunk, the chunks' arrival times, the tokens in usage)."""
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model="bench", prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    arrivals, used = [], 0
    async for chunk in stream:
        if chunk.choices:
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    return arrivals[0] - t0, arrivals, used


async def round_of(url: str, streams: int, tokens: int, prompt_len: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=600)
    # different prompts, so that no stream reuses another's cached prefix
    prompts = [[(7 * s + 13 * i) % 50000 + 1 for i in range(prompt_len)] for s in range(streams)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_stream(client, p, tokens) for p in prompts))
    wall = time.perf_counter() - t0
    await client.close()
    first = sorted(r[0] for r in results)
    gaps = sorted(b - a for _, times, _ in results for a, b in itertools.pairwise(times))
    total = sum(r[2] for r in results)
    assert total == streams * tokens, (total, streams, tokens)
    return {
        "streams": streams,
        "tokens": total,
        "seconds": wall,
        "tokens_per_s": total / wall,
        "first_token_ms": {q: 1e3 * _pct(first, q) for q in (50, 90, 99)},
        "per_token_ms": {q: 1e3 * _pct(gaps, q) for q in (50, 90, 99)},
    }


def _pct(xs: list[float], q: int) -> float:
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] if xs else float("nan")


def _wait_until_up(url: str, process: mp.Process, timeout: float = 600) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.is_alive():
            raise SystemExit("the server process ended before it served")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the server did not answer within {timeout} s")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,4,8,16", help="concurrent streams, a list")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per stream")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per stream")
    parser.add_argument("--quick", action="store_true", help="a small model instead")
    args = parser.parse_args(argv)
    counts = [int(s) for s in args.streams.split(",")]
    shape = SMALL if args.quick else GPT2_SMALL
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    process = mp.get_context("spawn").Process(target=serve, args=(shape, port, max(counts)))
    process.start()
    rows = []
    try:
        _wait_until_up(url, process)
        asyncio.run(round_of(url, 1, 4, args.prompt))  # warm-up: packed weights, first calls
        for n in counts:
            rows.append(asyncio.run(round_of(url, n, args.tokens, args.prompt)))
    finally:
        process.terminate()
        process.join(30)
    one = next((r["tokens_per_s"] for r in rows if r["streams"] == 1), None)
    print("streams    tok/s  × one   first p50 / p90 ms   token p50 / p90 / p99 ms")
    for r in rows:
        speedup = r["tokens_per_s"] / one if one else float("nan")
        f, g = r["first_token_ms"], r["per_token_ms"]
        print(
            f"{r['streams']:>7} {r['tokens_per_s']:>8.1f} {speedup:>6.2f} "
            f"{f[50]:>8.0f} /{f[90]:>7.0f}  {g[50]:>6.1f} /{g[90]:>6.1f} /{g[99]:>6.1f}"
        )
    payload = {"shape": shape, "tokens": args.tokens, "prompt": args.prompt, "rows": rows}
    save_json("serving-quick" if args.quick else "serving", payload)
    return payload


if __name__ == "__main__":
    main()
