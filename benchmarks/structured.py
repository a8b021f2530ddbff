"""Constrained decoding against free decoding of the same requests, in the serving engine.

    python benchmarks/structured.py [--model smollm2] [--streams 1,8] [--tokens 128]
                                    [--rounds 3] [--eager]

The engine ``dikkat serve --model`` runs (its batch step compiled unless ``--eager``), the
same prompts taking turns: free, then held to a JSON Schema (an array of 40 small objects, so
that no answer is complete before ``--tokens``: both make exactly that many tokens), greedy, the
end-of-generation ids banned in the free requests (``logit_bias``) so that they run as long.
Tokens/s is all the round's tokens over its wall time; the ratio is constrained over free,
paired by round. Also: the time to compile the schema the first time (the vocabulary's
tokenizer, then the grammar) and again (the cache).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dikkat.generation import SamplingParams
from dikkat.generation.constraint import Grammars
from dikkat.serving import Engine

SCHEMA = {
    "type": "array",
    "minItems": 40,
    "maxItems": 40,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "score": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "score"],
        "additionalProperties": False,
    },
}
PROMPT = "List forty players with their scores, as JSON:"


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float]:
    """All requests at once, stepped to the end: (tokens made, seconds)."""
    start = time.perf_counter()
    for p in prompts:
        engine.submit(p, params)
    made = 0
    while engine.has_work():
        for event in engine.step():
            if event.error is not None:
                raise RuntimeError(event.error)
            made += event.token is not None
    return made, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="the eager batch step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import dikkat.pretrained

    lm = dikkat.pretrained.load(args.model)
    tok, vocab = lm.tokenizer, lm.model.config.vocab_size
    t0 = time.perf_counter()
    grammars = Grammars(tok, vocab, tok.eos_ids)
    t1 = time.perf_counter()
    free = SamplingParams(
        max_new_tokens=args.tokens, logit_bias={i: -100.0 for i in tok.eos_ids},
        stop_ids=tuple(tok.eos_ids),
    )  # fmt: skip
    held = SamplingParams(
        max_new_tokens=args.tokens, stop_ids=tuple(tok.eos_ids), json_schema=SCHEMA
    )
    grammars.compile(held.constraint)
    t2 = time.perf_counter()
    grammars.compile(held.constraint)
    t3 = time.perf_counter()
    print(
        f"compile: the vocabulary's tokenizer {t1 - t0:.2f} s, the schema {1e3 * (t2 - t1):.1f} "
        f"ms, again (cached) {1e6 * (t3 - t2):.1f} µs"
    )
    streams = [int(s) for s in args.streams.split(",")]
    engine = Engine(
        lm.model, max_batch=max(streams), compile=not args.eager, grammars=grammars,
        num_blocks=max(streams) * (args.tokens // 16 + 4),
    )  # fmt: skip
    ids = lm.chat_ids([{"role": "user", "content": PROMPT}])
    run(engine, [ids], SamplingParams(max_new_tokens=4))  # warm: the step, the kernels
    print(f"{args.model}, {args.threads} threads, {args.tokens} tokens a request, greedy")
    print("| streams | free tok/s | constrained tok/s | constrained / free |")
    print("|---:|---:|---:|---:|")
    for n in streams:
        prompts = [ids + [ids[-1]] * i for i in range(n)]  # distinct prompts: no shared tail
        ratios, rates = [], {"free": [], "held": []}
        for _ in range(args.rounds):
            made_f, secs_f = run(engine, prompts, free)
            made_h, secs_h = run(engine, prompts, held)
            assert made_f == made_h == n * args.tokens, (made_f, made_h)
            rates["free"].append(made_f / secs_f)
            rates["held"].append(made_h / secs_h)
            ratios.append(secs_f / secs_h)
        f, h = statistics.median(rates["free"]), statistics.median(rates["held"])
        print(f"| {n} | {f:.1f} | {h:.1f} | {statistics.median(ratios):.2f} |")


if __name__ == "__main__":
    main()
