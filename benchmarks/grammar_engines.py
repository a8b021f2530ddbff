"""The two grammar engines vLLM offers, side by side on one vocabulary: llguidance (what
dikkat's constrained decoding uses, :mod:`dikkat.generation.constraint`) and xgrammar.

    python benchmarks/grammar_engines.py [--model smollm2] [--rounds 5]

xgrammar is not a dependency of dikkat: the script installs it into this environment with pip
when it is missing. For each of three JSON Schemas (a flat object, the nested one of
``benchmarks/structured.py``, an object of many typed fields) and each engine: the time to
build the engine's view of the vocabulary (once per tokenizer), to compile the schema, and the
time per token to compute the next-token bitmask along a valid answer of the schema (medians
over ``--rounds`` passes), with the compact JSON layout in both (no free whitespace).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

FLAT = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ITEM = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "score": {"type": "integer"}},
    "required": ["name", "score"],
    "additionalProperties": False,
}
NESTED = {"type": "array", "items": ITEM, "minItems": 1}
WIDE = {
    "type": "object",
    "properties": {
        f"field_{i}": [
            {"type": "string"},
            {"type": "number"},
            {"type": "boolean"},
            {"enum": ["red", "green", "blue"]},
        ][i % 4]
        for i in range(24)
    },
    "additionalProperties": False,
}
WIDE["required"] = list(WIDE["properties"])
ANSWERS = {
    "flat": (FLAT, {"name": "Ayşe Yılmaz", "age": 31}),
    "nested": (NESTED, [{"name": f"player{i}", "score": 10 * i} for i in range(12)]),
    "wide": (
        WIDE,
        {f"field_{i}": ["text", 2.5, True, "green"][i % 4] for i in range(24)},
    ),
}


def timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def llguidance_engine(tokenizer: Any, vocab: int, eos: list[int]) -> dict[str, Any]:
    import llguidance

    from dikkat.generation.constraint import JSON_LAYOUT

    lltok, build = timed(
        lambda: llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=eos)
    )
    words = (vocab + 31) // 32

    def compile(schema: dict) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides=JSON_LAYOUT
        )
        return llguidance.LLMatcher(lltok, grammar)

    def masks(matcher: Any, ids: list[int]) -> list[float]:
        bits = torch.full((words,), -1, dtype=torch.int32)
        out = []
        for t in ids:
            _, dt = timed(lambda: matcher.unsafe_compute_mask_ptr(bits.data_ptr(), words * 4))
            out.append(dt)
            assert (int(bits[t // 32]) >> (t % 32)) & 1, "llguidance forbade the answer"
            assert matcher.consume_token(t)
        return out

    return {"build": build, "compile": compile, "masks": masks}


def xgrammar_engine(tokenizer: Any, vocab: int, eos: list[int]) -> dict[str, Any]:
    import transformers
    import xgrammar

    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    info, build = timed(
        lambda: xgrammar.TokenizerInfo.from_huggingface(fast, vocab_size=vocab, stop_token_ids=eos)
    )
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(schema: dict) -> Any:
        compiled = compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )
        return xgrammar.GrammarMatcher(compiled)

    def masks(matcher: Any, ids: list[int]) -> list[float]:
        bits = xgrammar.allocate_token_bitmask(1, vocab)
        out = []
        for t in ids:
            _, dt = timed(lambda: matcher.fill_next_token_bitmask(bits))
            out.append(dt)
            assert (int(bits[0, t // 32]) >> (t % 32)) & 1, "xgrammar forbade the answer"
            assert matcher.accept_token(t)
        return out

    return {"build": build, "compile": compile, "masks": masks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if importlib.util.find_spec("xgrammar") is None:
        print("installing xgrammar (for this comparison only) …", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "xgrammar"], check=True)
    torch.set_num_threads(1)
    import dikkat.pretrained

    lm = dikkat.pretrained.load(args.model)
    tok, vocab = lm.tokenizer, lm.model.config.vocab_size
    eos = sorted(tok.eos_ids)
    engines = {"llguidance": llguidance_engine(tok, vocab, eos),
               "xgrammar": xgrammar_engine(tok, vocab, eos)}  # fmt: skip
    print(f"{args.model}: {vocab} tokens; one thread; medians of {args.rounds} rounds\n")
    print(
        "| schema | engine | vocabulary (s, once) | compile (ms) | mask p50 (µs) | mask mean (µs) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for name, (schema, answer) in ANSWERS.items():
        text = json.dumps(answer, ensure_ascii=False)
        ids = [*tok.encode(text, add_special=False), eos[0]]
        for engine_name, engine in engines.items():
            compiles, p50s, means = [], [], []
            for _ in range(args.rounds):
                matcher, dt = timed(lambda e=engine, s=schema: e["compile"](s))
                compiles.append(dt)
                per_token = engine["masks"](matcher, ids)
                p50s.append(statistics.median(per_token))
                means.append(statistics.mean(per_token))
            print(
                f"| {name} | {engine_name} | {engine['build']:.2f} | "
                f"{1e3 * statistics.median(compiles):.1f} | {1e6 * statistics.median(p50s):.0f} | "
                f"{1e6 * statistics.median(means):.0f} |"
            )


if __name__ == "__main__":
    main()
