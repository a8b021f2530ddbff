"""Greedy generation speed: dikkat's GPT against Hugging Face ``generate``, identical weights.

    python benchmarks/generation.py [--new 128] [--prompt 16] [--repeats 3]

GPT-2-small shape (12 layers, 12 heads, 768 wide, vocabulary 50257), randomly initialised (no
download), fp32, batch 1. Both models decode greedily from the same prompt; the tokens must be
identical. Also: the KV cache against recomputing the whole prefix, on the tiny preset.
The memory-bandwidth limit is (read bandwidth of a 1 GiB sum) / (bytes of weights per token).
Each ``generate`` call packs the weights for oneDNN and frees them at its end; "held" times the
calls inside one ``packed_for_inference`` block, which packs once (as a server holding the model
would), "each call packs" without it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import save_json
from dikkat.interop import gpt_from_hf
from dikkat.layers import packed_for_inference
from dikkat.models import GPT, GPTConfig


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second read by a sum over one 1 GiB tensor (all threads), median of 7."""
    a = torch.ones(nbytes // 4, dtype=torch.float32)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def time_generate(fn, repeats: int) -> tuple[float, object, float]:
    """(best seconds over ``repeats`` after a warm-up, the output, the warm-up's seconds)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out, first


def vs_hf(n_new: int, n_prompt: int, repeats: int) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=50256, eos_token_id=50256
    )
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    ours = gpt_from_hf(hf).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, n_prompt))

    def run_hf():
        with torch.inference_mode():
            return hf.generate(
                ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=0
            )

    def run_ours():
        with torch.inference_mode():
            return ours.generate(ids, n_new)

    t_hf, out_hf, _ = time_generate(run_hf, repeats)
    t_alone, _, _ = time_generate(run_ours, repeats)  # each call packs the weights
    with packed_for_inference(ours):
        t_ours, out_ours, _ = time_generate(run_ours, repeats)  # packed once
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    bw = read_bandwidth()
    limit = bw / weight_bytes  # tokens/s if each token only had to read the weights once
    return {
        "hf_tok_s": n_new / t_hf,
        "ours_tok_s": n_new / t_ours,
        "ours_each_call_packs_tok_s": n_new / t_alone,
        "speedup": t_hf / t_ours,
        "identical_tokens": out_hf.tolist() == out_ours,
        "weight_bytes": weight_bytes,
        "read_bandwidth_gb_s": bw / 1e9,
        "bandwidth_limit_tok_s": limit,
        "fraction_of_limit": (n_new / t_ours) / limit,
    }


def cache_vs_recompute(n_new: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", max_len=n_new + 16)).eval()
    ids = torch.randint(0, 256, (1, 16))

    def recompute():
        seq = ids
        with torch.inference_mode():
            for _ in range(n_new):
                nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, nxt], dim=1)
        return seq

    def cached():
        with torch.inference_mode():
            return model.generate(ids, n_new)

    t_re, a, _ = time_generate(recompute, repeats)
    t_kv, b, _ = time_generate(cached, repeats)
    return {
        "recompute_tok_s": n_new / t_re,
        "cached_tok_s": n_new / t_kv,
        "speedup": t_re / t_kv,
        "identical_tokens": a.tolist() == b,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=128, help="tokens to generate")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-new", type=int, default=512, help="tokens for the cache bench")
    args = parser.parse_args(argv)
    print(f"GPT-2 small, fp32, batch 1, {args.prompt}-token prompt, {args.new} greedy tokens")
    r = vs_hf(args.new, args.prompt, args.repeats)
    print(f"  HF generate     {r['hf_tok_s']:7.1f} tok/s")
    print(
        f"  dikkat, held    {r['ours_tok_s']:7.1f} tok/s   ×{r['speedup']:.2f} HF, "
        f"identical tokens: {r['identical_tokens']}"
    )
    each = r["ours_each_call_packs_tok_s"]
    print(f"  dikkat, each call packs {each:7.1f} tok/s")
    print(
        f"  bandwidth limit {r['bandwidth_limit_tok_s']:7.1f} tok/s   "
        f"({r['weight_bytes'] / 1e6:.0f} MB of weights at {r['read_bandwidth_gb_s']:.1f} GB/s); "
        f"dikkat reaches {100 * r['fraction_of_limit']:.0f}%"
    )
    c = cache_vs_recompute(args.cache_new, 1)
    print(
        f"tiny preset, {args.cache_new} greedy tokens: KV cache {c['cached_tok_s']:.0f} tok/s, "
        f"recompute {c['recompute_tok_s']:.0f} tok/s, ×{c['speedup']:.1f}, "
        f"identical tokens: {c['identical_tokens']}"
    )
    path = save_json("generation", {"args": vars(args), "vs_hf": r, "cache": c})
    print(f"wrote {path}")
    return {"vs_hf": r, "cache": c}


if __name__ == "__main__":
    main()
