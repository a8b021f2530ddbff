"""Concurrent streams through ``dikkat serve``: aggregate tokens/s, time to first token and
inter-token latency at 1, 4, 8 and 16 streams at once, and one stream against ``generate``.

    python benchmarks/serving.py [--model smollm2] [--streams 1,4,8,16] [--tokens 64]
                                 [--prompt 16] [--pairs 3] [--threads 2] [--quick]

The server is ``python -m dikkat serve --model MODEL`` in its own process (the app that command
builds: the pretrained decoder, a GGUF file's quantised weights kept packed as the file holds
them, its engine and its tokenizer), answering
``/v1/completions``; the clients are the official ``openai`` async client, streaming, in this
process. Each stream sends a different slice of this Python's standard-library source as token
ids (no stream reuses another's cached prefix), greedy, with ``logit_bias`` −100 on the
tokenizer's end ids, so that every stream gets all its tokens (an OpenAI-level "ignore EOS": the
server would still stop at an end id, it never picks one). ``--quick`` serves a small random GPT
with a number tokenizer instead (a spawned server process, no end ids).

Per stream count: aggregate tokens/s = every stream's tokens / the wall time from the first
request to the last chunk; time to first token (TTFT) = a request to its first chunk;
inter-token latency (ITL) = the gaps between one stream's chunks (percentiles over all streams).

One stream against ``generate``: in this process, with the same torch threads, the same model
and the same sampling parameters, ``dikkat.iter_generate`` decodes a prompt of the same length
for the same number of tokens (the weights prepared once, as the server's engine holds them).
The two take turns ``--pairs`` times, while the other side is idle; decode ms/token = (last
token − first token) / (tokens − 1) on each side, so the ratio compares decoding alone (no
prefill, no connection set-up).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from common import save_json

SMALL = dict(vocab_size=512, max_len=256, d_model=128, n_layers=4, n_heads=4)
NAME = "bench"  # the model's name in the API
STDLIB = ("textwrap.py", "colorsys.py", "fnmatch.py", "shlex.py", "difflib.py")


class NumberTokenizer:
    """Each id is the word " <id>": every token shows as text (a random model's ids decode to
    nothing useful with a real tokenizer, and the benchmark times chunks of text)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [int(w) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return "".join(f" {i}" for i in ids)


def small_model() -> Any:
    import torch

    from dikkat.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**SMALL)).eval()


def serve_small(port: int, max_batch: int, threads: int) -> None:
    """The ``--quick`` server process: the small GPT, its engine and app, on ``port``."""
    import torch
    import uvicorn

    from dikkat.serving import Engine, create_app

    torch.set_num_threads(threads)
    engine = Engine(small_model(), max_batch=max_batch)
    app = create_app(engine, NumberTokenizer(SMALL["vocab_size"]), NAME, stop_ids=())
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The server process, started on a free port; :meth:`wait` until it answers ``/health``."""

    def __init__(
        self, model: str | None, max_batch: int, threads: int, extra: tuple[str, ...] = ()
    ) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(tempfile.mkdtemp()) / "server.log"
        self._process: subprocess.Popen | Any
        if model is None:
            process = mp.get_context("spawn").Process(
                target=serve_small, args=(port, max_batch, threads), daemon=True
            )
            process.start()
            self._process = process
        else:  # what `dikkat serve --model MODEL` runs; OMP_NUM_THREADS sets torch's threads
            command = [sys.executable, "-m", "dikkat", "serve", "--model", model, "--name", NAME,
                       "--port", str(port), "--max-batch", str(max_batch),
                       "--max-model-len", "1024", "--log-level", "warning", *extra]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            with open(self.log, "w") as out:
                self._process = subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, env=env
                )

    def alive(self) -> bool:
        p = self._process
        return p.poll() is None if isinstance(p, subprocess.Popen) else p.is_alive()

    def wait(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                tail = self.log.read_text()[-2000:] if self.log.exists() else ""
                raise SystemExit(f"the server ended before it served\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except OSError:
                time.sleep(0.5)
        raise SystemExit(f"the server did not answer /health within {timeout} s")

    def stop(self) -> None:
        """Terminate the process; kill it if it has not ended 30 s later."""
        p = self._process
        p.terminate()
        if isinstance(p, subprocess.Popen):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(30)
        else:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(30)


class Prompts:
    """Consecutive, non-overlapping slices of a text: no two prompts share a first block."""

    def __init__(self, text: list[int], length: int) -> None:
        self.text, self.length, self.next = text, length, 0

    def take(self, count: int) -> list[list[int]]:
        end = self.next + count * self.length
        if end > len(self.text):
            raise SystemExit(f"the text has {len(self.text)} tokens, fewer than the run needs")
        out = [self.text[i : i + self.length] for i in range(self.next, end, self.length)]
        self.next = end
        return out


# --- through the server --------------------------------------------------------------------------


async def one_stream(
    client: Any, prompt: list[int], tokens: int, bias: dict[str, float], extra: dict | None = None
) -> tuple[float, list[float], int]:
    """(the request's start, its chunks' arrival times, the tokens in its usage); ``extra``:
    fields the OpenAI API does not name, sent in the request's body as they are."""
    t0 = time.perf_counter()
    optional = {"logit_bias": bias} if bias else {}
    stream = await client.completions.create(
        model=NAME, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra, **optional,
    )  # fmt: skip
    arrivals, used = [], 0
    async for chunk in stream:
        closing = all(c.finish_reason is not None and not c.text for c in chunk.choices)
        if chunk.choices and not closing:  # (llama-server ends with a chunk holding no token)
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    return t0, arrivals, used


async def _streams(
    url: str, prompts: list[list[int]], tokens: int, bias: dict, extra: dict | None
) -> list[tuple]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=600)
    try:
        return await asyncio.gather(*(one_stream(client, p, tokens, bias, extra) for p in prompts))
    finally:
        await client.close()


def streams_round(
    url: str, prompts: list[list[int]], tokens: int, bias: dict, extra: dict | None = None
) -> dict:
    """Every prompt streamed at once; the round's figures (``extra``: see :func:`one_stream`)."""
    results = asyncio.run(_streams(url, prompts, tokens, bias, extra))
    total = sum(used for _, _, used in results)
    if total != len(prompts) * tokens:  # an end id got through: the figures would mislead
        raise SystemExit(f"{len(prompts)} streams got {total} tokens, not {tokens} each")
    start = min(t0 for t0, _, _ in results)
    wall = max(times[-1] for _, times, _ in results) - start
    first = sorted(times[0] - t0 for t0, times, _ in results)
    gaps = sorted(b - a for _, times, _ in results for a, b in itertools.pairwise(times))
    decode = [(times[-1] - times[0]) / (tokens - 1) for _, times, _ in results]
    return {
        "streams": len(prompts),
        "tokens": total,
        "chunks": sum(len(times) for _, times, _ in results),  # < tokens: some held no text
        "seconds": wall,
        "tokens_per_s": total / wall,
        "ttft_ms": {q: 1e3 * _pct(first, q) for q in (50, 90)},
        "itl_ms": {q: 1e3 * _pct(gaps, q) for q in (50, 90, 99)},
        "decode_ms_per_token": 1e3 * statistics.mean(decode),
    }


def _pct(xs: list[float], q: int) -> float:
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] if xs else float("nan")


# --- generate alone -----------------------------------------------------------------------------


def generate_once(model: Any, prompt: list[int], params: Any) -> dict:
    """One prompt through ``iter_generate``: its first token's time and its decode rate."""
    from dikkat.generation import iter_generate

    t0 = time.perf_counter()
    times = [time.perf_counter() for _ in iter_generate(model, [prompt], params)]
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    return {
        "ttft_ms": 1e3 * (times[0] - t0),
        "itl_ms": {q: 1e3 * _pct(gaps, q) for q in (50, 90, 99)},
        "decode_ms_per_token": 1e3 * (times[-1] - times[0]) / (len(times) - 1),
    }


# --- the run -------------------------------------------------------------------------------------


def load(args: argparse.Namespace) -> tuple[Any, list[int], tuple[int, ...]]:
    """The model for ``generate``, the text the prompts are cut from, the end ids to bias."""
    if args.quick:
        text = [(7 * i) % (SMALL["vocab_size"] - 1) + 1 for i in range(20_000)]
        return small_model(), text, ()
    import dikkat.pretrained

    lm = dikkat.pretrained.load(args.model)
    root = Path(sysconfig.get_paths()["stdlib"])
    text = lm.tokenizer.encode("".join((root / name).read_text() for name in STDLIB))
    return lm.model.eval(), text, tuple(sorted(lm.tokenizer.eos_ids))


def measure(args: argparse.Namespace, server: Server, counts: list[int]) -> dict:
    import torch

    from dikkat.generation import SamplingParams
    from dikkat.layers import packed_for_inference

    model, text, ends = load(args)  # while the server loads its own
    server.wait()
    load_before = os.getloadavg()
    prompts = Prompts(text, args.prompt)
    bias = {str(i): -100.0 for i in ends}
    params = SamplingParams(
        max_new_tokens=args.tokens, stop_ids=ends, logit_bias={i: -100.0 for i in ends}
    )
    warm = SamplingParams(max_new_tokens=4, stop_ids=ends, logit_bias=params.logit_bias)
    with torch.no_grad(), packed_for_inference(model, "fp32"):  # packed once, as the engine's
        generate_once(model, prompts.take(1)[0], warm)
        streams_round(server.url, prompts.take(1), 4, bias)
        pairs = []
        for _ in range(args.pairs):
            g = generate_once(model, prompts.take(1)[0], params)
            s = streams_round(server.url, prompts.take(1), args.tokens, bias)
            pairs.append({"generate": g, "server": s})
    rows = [streams_round(server.url, prompts.take(n), args.tokens, bias) for n in counts]
    return {
        "model": "small random GPT" if args.quick else args.model,
        "tokens": args.tokens,
        "prompt": args.prompt,
        "threads": args.threads,
        "load_average": {"start": load_before, "end": os.getloadavg()},  # 1, 5, 15 minutes
        "rows": rows,
        "pairs": pairs,
    }


def report(result: dict) -> None:
    rows = result["rows"]
    one = next((r["tokens_per_s"] for r in rows if r["streams"] == 1), float("nan"))
    start, end = result["load_average"]["start"][0], result["load_average"]["end"][0]
    print(f"{result['model']}: {result['prompt']}-token prompts, {result['tokens']} tokens a "
          f"stream, {result['threads']} threads, load average {start:.2f} → {end:.2f}")  # fmt: skip
    print("streams    tok/s  × one   TTFT p50 / p90 ms   ITL p50 / p90 / p99 ms")
    for r in rows:
        f, g = r["ttft_ms"], r["itl_ms"]
        print(
            f"{r['streams']:>7} {r['tokens_per_s']:>8.1f} {r['tokens_per_s'] / one:>6.2f} "
            f"{f[50]:>8.0f} /{f[90]:>7.0f}  {g[50]:>6.1f} /{g[90]:>6.1f} /{g[99]:>6.1f}"
        )
    print("one stream against generate (taking turns): decode ms/token, first token ms")
    ratios = []
    for i, p in enumerate(result["pairs"]):
        g, s = p["generate"]["decode_ms_per_token"], p["server"]["decode_ms_per_token"]
        ratios.append(s / g)
        first = p["generate"]["ttft_ms"], p["server"]["ttft_ms"][50]
        print(f"  turn {i + 1}: generate {g:.1f}, server {s:.1f}, server / generate {s / g:.3f}; "
              f"first token {first[0]:.0f} against {first[1]:.0f}")  # fmt: skip
    if ratios:
        result["server_over_generate"] = statistics.median(ratios)
        print(f"  median server / generate: {result['server_over_generate']:.3f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="what dikkat serve --model serves")
    parser.add_argument("--streams", default="1,4,8,16", help="concurrent streams, a list")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per stream")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per stream")
    parser.add_argument("--pairs", type=int, default=3, help="turns of one stream vs generate")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both processes")
    parser.add_argument("--quick", action="store_true", help="a small random GPT instead")
    args = parser.parse_args(argv)
    if args.tokens < 2:
        parser.error("--tokens must be at least 2 (a decode rate needs two tokens)")
    counts = [int(s) for s in args.streams.split(",")]

    import torch

    torch.set_num_threads(args.threads)
    server = Server(None if args.quick else args.model, max(counts), args.threads)
    try:
        result = measure(args, server, counts)
    finally:
        server.stop()
    report(result)
    save_json("serving-quick" if args.quick else f"serving-{args.model}", result)
    return result


if __name__ == "__main__":
    main()
