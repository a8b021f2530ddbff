"""What ``torch.compile`` buys with dikkat, against the same model compiled with PyTorch's SDPA.

    python benchmarks/compiled.py [--quick] [--cache 128,512] [--seq 256] [--runs 20]
                                  [--threads 2] [--parts gpt2,llama]

(a) **GPT-2-small decode step.** dikkat's own ``GPT`` with the ``gpt2-small`` preset (12 layers,
width 768, 12 heads, vocabulary 50257, learned positions; random weights, fp32), batch 1, its
preallocated KV cache (``model.new_cache``). A prompt of L tokens (``--cache``) is prefilled and
one step written at slot L; the step timed is then always the same: one token at slot L against
L + 1 cached keys, ``model(token, offset=L, cache=cache, last_only=True)`` (what
:func:`dikkat.generation.decode_step` calls). The slot is fixed because dikkat's generation
grows the cache by one slot a step, and a compiled step would recompile for each new length.
Attention: dikkat's layer with backend ``auto``, ``sdpa`` and ``reference``, and ``torch``: the
same model whose attention layers call ``torch.nn.functional.scaled_dot_product_attention``
directly (:class:`TorchAttention`: the same projections and cache, no dikkat dispatch; one query
at the last slot attends to every cached key, so no mask). dikkat's generation itself decodes
eagerly, on an inference copy of the weights (``dikkat.generation.inference_model``), not timed
here.

(b) **Hugging Face Llama forward.** ``transformers.LlamaForCausalLM`` from a config (4 layers,
hidden 512, 8 query heads and 2 key/value heads of 64, MLP 1536, vocabulary 32000; random
weights, fp32), batch 1, ``--seq`` tokens, ``use_cache=False``, ``torch.no_grad``, with
``attn_implementation="dikkat"`` (``dikkat.hf.register()``, backend auto) and ``"sdpa"``
(transformers' own call of PyTorch's SDPA).

Each is run eagerly and compiled (``torch.compile``, inductor, default mode), first with
``fullgraph=True``; where that fails, the error and where it was raised are printed and the
model is compiled with ``fullgraph=False`` (the graph breaks counted by
``torch._dynamo.explain``). "compile s" is the first call of the compiled function: tracing,
inductor's compile (cold: its on-disk caches are switched off, so no compile reuses another's)
and one run; inductor's one-time start-up is paid before, by a tiny compile. Then every function
is warmed up once more and timed in ``--runs`` interleaved rounds (one call of each per round, so
a change in the machine's load falls on all alike); the median is reported. Ratios: compiled /
eager of each attention, and dikkat / torch at equal compile state. max |Δ|: compiled against
eager logits of the same model.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from common import machine, save_json
from dikkat.layers.attention import MultiHeadAttention
from dikkat.models import GPT, GPTConfig

GPT_ATTENTION = ("auto", "sdpa", "reference", "torch")
LLAMA_ATTENTION = ("dikkat", "sdpa")
LLAMA_SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
}


class TorchAttention(MultiHeadAttention):
    """dikkat's attention layer for a one-token decode step, with the attention itself
    ``F.scaled_dot_product_attention`` called directly: the same fused projection, cache and
    output projection, none of :func:`dikkat.attention`'s checks and dispatch."""

    def forward(  # type: ignore[override]
        self,
        x: Tensor,
        context: Tensor | None = None,
        mask: object = None,
        *,
        offset: int = 0,
        positions: Tensor | None = None,
        cache: Any = None,
        return_weights: bool = False,
    ) -> Tensor:
        if x.shape[1] != 1 or cache is None or context is not None or return_weights:
            raise ValueError("TorchAttention times one-token decode steps with a cache only")
        q, k, v = self._project_self(x)  # (B, H, 1, D), (B, G, 1, D) × 2
        k, v = cache.update(offset, k, v)  # (B, G, offset + 1, D): every filled slot
        # the one query sits at the last filled slot: causal lets it see every key
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.n_kv_heads != self.n_heads)
        B, H, T, D = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, T, H * D))


@dataclass
class Case:
    """One model and attention, run eagerly and compiled."""

    name: str
    eager: Callable[[], Tensor]
    compiled: Callable[[], Tensor] | None = None
    compile_s: float = 0.0
    fullgraph: bool = True
    fullgraph_error: str | None = None
    graphs: int = 0
    breaks: int = 0
    max_diff: float = 0.0
    times: dict[str, list[float]] = field(default_factory=lambda: {"eager": [], "compiled": []})

    def median_ms(self, mode: str) -> float:
        return 1e3 * statistics.median(self.times[mode])


def where(error: BaseException) -> str:
    """The innermost frame of user code (dikkat, transformers) an exception was raised at."""
    stack = getattr(error, "real_stack", None) or traceback.extract_tb(error.__traceback__)
    frames = [f for f in stack if "/torch/" not in f.filename] or list(stack)
    if not frames:
        return "?"
    f = frames[-1]
    short = f.filename.split("/src/")[-1].split("/site-packages/")[-1]
    return f"{short}:{f.lineno}"


def compile_case(case: Case, fn: Callable[..., Tensor], args: tuple) -> None:
    """Compile ``fn`` (fullgraph first), time its first call, check it against eager."""
    torch._dynamo.reset()  # each case's compile alone: no guards or graphs of another
    reference = case.eager()
    start = time.perf_counter()
    try:
        compiled = torch.compile(fn, fullgraph=True)
        out = compiled(*args)
    except Exception as error:  # reported, then compiled with graph breaks
        first = str(error).strip().splitlines()[0][:160]
        case.fullgraph, case.fullgraph_error = (
            False,
            f"{type(error).__name__} at {where(error)}: {first}",
        )
        torch._dynamo.reset()
        start = time.perf_counter()
        compiled = torch.compile(fn, fullgraph=False)
        out = compiled(*args)
    case.compile_s = time.perf_counter() - start
    case.compiled = lambda: compiled(*args)
    case.max_diff = float((out - reference).abs().max())
    explained = torch._dynamo.explain(fn)(*args)
    case.graphs, case.breaks = explained.graph_count, explained.graph_break_count


def run_rounds(cases: list[Case], runs: int) -> None:
    """One warm-up call of each, then ``runs`` rounds of one timed call of each, interleaved."""
    calls = [(c, mode) for c in cases for mode in ("eager", "compiled")]
    for c, mode in calls:
        getattr(c, mode)()
    for _ in range(runs):
        for c, mode in calls:
            t0 = time.perf_counter()
            getattr(c, mode)()
            c.times[mode].append(time.perf_counter() - t0)


def gpt2_cases(L: int, attentions: tuple[str, ...]) -> list[Case]:
    """One GPT-2-small per attention (the same weights), each with its cache filled to L + 1."""
    torch.manual_seed(0)
    base = GPT(GPTConfig.preset("gpt2-small")).eval()
    ids = torch.randint(0, base.config.vocab_size, (1, L + 1))
    cases = []
    for name in attentions:
        model = copy.deepcopy(base)
        cache = model.new_cache(1, L + 1)
        token = ids[:, L:]

        def step(token: Tensor, model: GPT = model, cache: list = cache) -> Tensor:
            return model(token, offset=L, cache=cache, last_only=True)

        model(ids[:, :L], cache=cache)  # the prefill, then the step at slot L: through dikkat
        step(token)
        for block in model.blocks:
            if name == "torch":
                block.attn.__class__ = TorchAttention
            else:
                block.attn.backend = name
        case = Case(name, eager=lambda step=step, token=token: step(token))
        compile_case(case, step, (token,))
        cases.append(case)
    return cases


def llama_cases(seq: int, layers: int) -> tuple[list[Case], float]:
    """One Llama per attention implementation (the same weights); and the largest difference
    between their eager logits."""
    import transformers

    import dikkat.hf

    transformers.logging.set_verbosity_error()
    dikkat.hf.register()
    shape = LLAMA_SHAPE | {"num_hidden_layers": layers}
    config = transformers.LlamaConfig(**shape, max_position_embeddings=max(seq, 256))
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, seq))
    cases, eager_logits = [], []
    for name in LLAMA_ATTENTION:
        model = copy.deepcopy(base)
        model.set_attn_implementation(name)

        def forward(ids: Tensor, model: Any = model) -> Tensor:
            return model(input_ids=ids, use_cache=False).logits

        case = Case(name, eager=lambda forward=forward: forward(ids))
        eager_logits.append(case.eager())
        compile_case(case, forward, (ids,))
        cases.append(case)
    return cases, float((eager_logits[0] - eager_logits[1]).abs().max())


def table(cases: list[Case], torch_name: str, label: str) -> list[dict[str, Any]]:
    """Print one row per case and return the rows."""
    ref = next(c for c in cases if c.name == torch_name)
    print(
        f"  {label:<10}{'eager ms':>10}{'compiled ms':>13}{'comp/eager':>11}{'compile s':>11}"
        f"{'/torch eager':>13}{'/torch comp':>12}{'graphs':>8}{'max |Δ|':>10}"
    )
    rows = []
    for c in cases:
        e, k = c.median_ms("eager"), c.median_ms("compiled")
        row = {
            "attention": c.name,
            "eager_ms": e,
            "compiled_ms": k,
            "compiled_over_eager": k / e,
            "compile_s": c.compile_s,
            "over_torch_eager": e / ref.median_ms("eager"),
            "over_torch_compiled": k / ref.median_ms("compiled"),
            "fullgraph": c.fullgraph,
            "fullgraph_error": c.fullgraph_error,
            "graphs": c.graphs,
            "graph_breaks": c.breaks,
            "max_abs_diff": c.max_diff,
        }
        rows.append(row)
        graphs = f"{c.graphs}" + ("" if c.fullgraph else "*")
        print(
            f"  {c.name:<10}{e:>10.2f}{k:>13.2f}{k / e:>11.2f}{c.compile_s:>11.1f}"
            f"{row['over_torch_eager']:>13.2f}{row['over_torch_compiled']:>12.2f}{graphs:>8}"
            f"{c.max_diff:>10.1e}"
        )
    for c in cases:
        if c.fullgraph_error:
            print(f"  * {c.name}: fullgraph=True failed, compiled with graph breaks ({c.breaks}):")
            print(f"      {c.fullgraph_error}")
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", default="128,512", help="cached tokens L of the decode step")
    parser.add_argument("--seq", type=int, default=256, help="tokens of the Llama forward")
    parser.add_argument("--layers", type=int, default=4, help="layers of the Llama")
    parser.add_argument("--runs", type=int, default=20, help="timed rounds after the warm-up")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parts", default="gpt2,llama", help="gpt2, llama or both")
    parser.add_argument(
        "--attention", default=",".join(GPT_ATTENTION), help="the GPT-2's attentions (torch last)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="cache 128, attention auto and torch, a 2-layer Llama at 64 tokens, 5 rounds",
    )
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := set(parts) - {"gpt2", "llama"}:
        parser.error(f"unknown part {sorted(unknown)[0]!r}: choose gpt2, llama")
    lengths = [int(n) for n in args.cache.split(",")]
    attentions = tuple(args.attention.split(","))
    if not set(attentions) <= set(GPT_ATTENTION) or "torch" not in attentions:
        parser.error(f"--attention: any of {', '.join(GPT_ATTENTION)}, with torch")
    if args.quick:
        lengths, attentions, args.seq, args.layers, args.runs = [128], ("auto", "torch"), 64, 2, 5
    torch.set_num_threads(args.threads)
    # the graph breaks are counted in the table, not logged as they happen
    torch._logging.set_logs(dynamo=logging.ERROR)
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
    torch._inductor.config.force_disable_caches = True  # every compile cold: none reuses another
    torch.compile(lambda x: x.sin() + 1)(torch.ones(4))  # inductor's one-time start-up, apart
    m = machine()
    print(
        f"{m['cpu']}, {m['cores']} cores, torch {m['torch']} with {m['torch_threads']} threads, "
        f"Python {m['python']}; inductor, caches off; median of {args.runs} interleaved rounds"
    )
    result: dict[str, Any] = {"args": vars(args)}
    with torch.no_grad():
        if "gpt2" in parts:
            result["gpt2"] = {}
            for L in lengths:
                print(
                    f"\n(a) GPT-2 small (dikkat GPT, gpt2-small preset, random weights, fp32), "
                    f"batch 1: one decode step at cache slot {L} ({L + 1} keys); torch = the "
                    "same model, attention layers calling torch's SDPA directly"
                )
                cases = gpt2_cases(L, attentions)
                run_rounds(cases, args.runs)
                result["gpt2"][str(L)] = table(cases, "torch", "attention")
        if "llama" in parts:
            import transformers

            print(
                f"\n(b) transformers {transformers.__version__} LlamaForCausalLM ({args.layers} "
                f"layers, hidden 512, 8 heads, 2 kv heads, vocab 32000, random weights, fp32), "
                f"batch 1, {args.seq} tokens, no cache: one forward"
            )
            cases, between = llama_cases(args.seq, args.layers)
            run_rounds(cases, args.runs)
            result["llama"] = table(cases, "sdpa", "attn_impl")
            result["llama_eager_dikkat_vs_sdpa_max_abs_diff"] = between
            print(f"  eager logits, dikkat against sdpa: max |Δ| {between:.1e}")
            result["transformers"] = transformers.__version__
    path = save_json("compiled-quick" if args.quick else "compiled", result)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
