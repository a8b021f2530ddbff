"""Greedy generation speed: dikkat's GPT (fp32, bf16, int8 and w8a8 weights) against Hugging Face
``generate`` (fp32), identical weights, and how close each comes to the memory's bandwidth.

    python benchmarks/generation.py [--new 128] [--prompt 16] [--repeats 3]

GPT-2-small shape (12 layers, 12 heads, 768 wide, vocabulary 50257), randomly initialised (no
download), batch 1. Every model decodes greedily from the same prompt; dikkat fp32 must give HF's
tokens (asserted), bf16, int8 and w8a8 report the fraction of fp32's tokens they reproduce (on
random weights; benchmarks/quantized_quality.py measures a trained model).

Bandwidth: the same run measures this machine's read bandwidth (a sum over 1 GiB); each
configuration prints tokens/s, the bytes one token reads (the linear layers' weights in its
format, the norms, one row of each embedding, and the KV cache at the mean length), the achieved
GB/s (bytes × tokens/s) and achieved / measured. dikkat's runs generate with one inference copy
per format (``inference_model(model, weights)``: the weights are prepared once, as a server
holding the model would); "each call packs" times fp32 generating from the model itself, which
makes a copy per call. ``kernels`` times one product of the lm_head's shape and the
MLP's: oneDNN-packed fp32 and bf16, torch's int8 weight-only kernel, dequantise-then-matmul,
and FBGEMM's dynamic quantised product (w8a8).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common import save_json
from dikkat.interop import gpt_from_hf
from dikkat.layers import Linear
from dikkat.models import GPT, GPTConfig
from dikkat.weights import (
    dequantize_int8,
    inference_model,
    int8_linear,
    quantize_int8,
    quantize_w8a8,
    w8a8_linear,
)

FORMATS = ("fp32", "bf16", "int8", "w8a8")
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "int8": 1, "w8a8": 1}


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second read by a sum over one 1 GiB tensor (all threads), median of 7."""
    a = torch.ones(nbytes // 4, dtype=torch.float32)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def time_generate(fn: Callable[[], object], repeats: int) -> tuple[float, object, float]:
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


def bytes_per_token(model: GPT, weights: str, mean_len: float) -> int:
    """Bytes one decoding step reads: every Linear's weight in ``weights`` (with int8's fp32
    scales; biases in the weight's dtype for bf16), the other parameters (norms) whole, one row
    of each embedding, and the fp32 keys and values of ``mean_len`` cached tokens per layer."""
    c = model.config
    linear_params, total = set(), 0
    for m in model.modules():
        if isinstance(m, Linear):
            n, k = m.weight.shape
            total += n * k * WEIGHT_BYTES[weights] + (4 * n if weights in ("int8", "w8a8") else 0)
            if m.bias is not None:
                total += n * (2 if weights == "bf16" else 4)
            linear_params |= {id(m.weight)} | ({id(m.bias)} if m.bias is not None else set())
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if id(p) in linear_params:
                continue
            linear_params.add(id(p))
            rows = isinstance(m, nn.Embedding) or p.dim() == 2  # an embedding: one row read
            total += (p.shape[-1] if rows else p.numel()) * p.element_size()
    kv_heads, head_dim = c.block().kv_heads, c.d_model // c.n_heads
    total += int(2 * c.n_layers * kv_heads * head_dim * mean_len * 4)
    return total


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
    bw = read_bandwidth()
    mean_len = n_prompt + (n_new - 1) / 2  # cached tokens a decoding step reads, on average
    rows = {}
    outs = {}
    for weights in FORMATS:
        copy = inference_model(ours, weights)  # prepared once

        def run_copy(copy=copy):
            with torch.inference_mode():
                return copy.generate(ids, n_new)

        t, outs[weights], _ = time_generate(run_copy, repeats)
        del copy
        rows[weights] = _row(n_new / t, bytes_per_token(ours, weights, mean_len), bw)
    rows["hf_fp32"] = _row(n_new / t_hf, bytes_per_token(ours, "fp32", mean_len), bw)
    identical = out_hf.tolist() == outs["fp32"]
    assert identical, "dikkat fp32 greedy tokens differ from HF's"
    fp32_new = outs["fp32"][0][n_prompt:]
    for weights in FORMATS[1:]:
        new = outs[weights][0][n_prompt:]
        rows[weights]["same_tokens_as_fp32"] = sum(map(int.__eq__, new, fp32_new)) / n_new
    return {
        "rows": rows,
        "ours_each_call_packs_tok_s": n_new / t_alone,
        "identical_tokens": identical,
        "read_bandwidth_gb_s": bw / 1e9,
        "int8_vs_hf": rows["int8"]["tok_s"] / rows["hf_fp32"]["tok_s"],
        "w8a8_vs_hf": rows["w8a8"]["tok_s"] / rows["hf_fp32"]["tok_s"],
    }


def _row(tok_s: float, nbytes: int, bandwidth: float) -> dict:
    return {
        "tok_s": tok_s,
        "bytes_per_token": nbytes,
        "achieved_gb_s": tok_s * nbytes / 1e9,
        "fraction_of_bandwidth": tok_s * nbytes / bandwidth,
    }


def kernels(repeats: int = 20) -> dict:
    """Milliseconds for one row times a weight of each shape, per way of multiplying."""
    torch.manual_seed(0)
    results = {}
    with torch.inference_mode():
        for n, k in ((50257, 768), (3072, 768)):
            results[f"{n}x{k}"] = {
                name: 1e3 * _best(fn, repeats if "dequantise" not in name else 3)
                for name, fn in _products(torch.randn(n, k), torch.randn(1, k)).items()
            }
    return results


def _products(w: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    q, q8 = quantize_int8(w), quantize_w8a8(w)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    x16, w16 = x.bfloat16(), w.bfloat16()
    products: dict[str, Callable[[], object]] = {
        "fp32 plain": lambda: F.linear(x, w),
        "fp32 packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
    }
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX-512 BW/VL/DQ or AVX-NE-CONVERT
        packed16 = torch.ops.mkldnn._reorder_linear_weight(w16, 1)
        products["bf16 packed"] = lambda: torch.ops.mkldnn._linear_pointwise(
            x16, packed16, None, "none", [], ""
        )
    else:
        products["bf16 plain"] = lambda: F.linear(x16, w16)
    return products | {
        "int8 kernel": lambda: int8_linear(x, q),
        "int8 dequantise + matmul": lambda: F.linear(x, dequantize_int8(q)),
        "w8a8 (FBGEMM)": lambda: w8a8_linear(x, q8),
    }


def plain_vs_packed(rows: tuple[int, ...] = (1, 2, 8), repeats: int = 5) -> dict[int, float]:
    """oneDNN-packed / plain F.linear time over GPT-2-small's 49 weights, per number of input
    rows (the crossover ``plain_gemv_max_rows`` in dikkat.core.tuning rests on)."""
    torch.manual_seed(0)
    shapes = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12 + [(50257, 768)]
    ws = [torch.randn(n, k) for n, k in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws]
    ratios = {}
    with torch.inference_mode():
        for m in rows:
            xs = [torch.randn(m, w.shape[1]) for w in ws]
            plain = _best(
                lambda xs=xs: [F.linear(x, w) for x, w in zip(xs, ws, strict=True)], repeats
            )
            onednn = _best(
                lambda xs=xs: [
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                    for x, w in zip(xs, packed, strict=True)
                ],
                repeats,
            )
            ratios[m] = onednn / plain
    return ratios


def batch_layout(rows: int = 8, repeats: int = 5) -> dict[str, float]:
    """Seconds for GPT-2-small's 49 fp32 weights times one row (the one-row oneDNN layout) and
    times ``rows`` rows in the one-row layout and in the layout for ``rows`` rows
    (``inference_model(..., batched=True)``): what a batched decode step costs against one."""
    torch.manual_seed(0)
    shapes = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12 + [(50257, 768)]
    ws = [torch.randn(n, k) for n, k in shapes]
    one = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws]
    many = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws]
    del ws
    cases = (
        ("1 row", one, 1),
        (f"{rows} rows, 1-row layout", one, rows),
        (f"{rows} rows, {rows}-row layout", many, rows),
    )
    times = {}
    with torch.inference_mode():
        for name, packed, m in cases:
            xs = [torch.randn(m, k) for _, k in shapes]
            times[name] = _best(
                lambda xs=xs, packed=packed: [
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                    for x, w in zip(xs, packed, strict=True)
                ],
                repeats,
            )
    return times


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


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
    print(f"GPT-2 small, batch 1, {args.prompt}-token prompt, {args.new} greedy tokens")
    r = vs_hf(args.new, args.prompt, args.repeats)
    print(f"  read bandwidth (sum over 1 GiB): {r['read_bandwidth_gb_s']:.1f} GB/s")
    print(f"  {'':<18} {'tok/s':>7} {'MB/token':>9} {'GB/s':>6} {'of bw':>6}  tokens = fp32")
    for key in ("hf_fp32", *FORMATS):
        row = r["rows"][key]
        same = row.get("same_tokens_as_fp32")
        note = "" if same is None else f"{100 * same:.0f}%"
        if key == "fp32":
            note = f"identical to HF: {r['identical_tokens']}"
        print(
            f"  {'HF fp32' if key == 'hf_fp32' else 'dikkat ' + key:<18} {row['tok_s']:7.1f} "
            f"{row['bytes_per_token'] / 1e6:9.1f} {row['achieved_gb_s']:6.1f} "
            f"{100 * row['fraction_of_bandwidth']:5.0f}%  {note}"
        )
    print(f"  dikkat fp32, each call packs {r['ours_each_call_packs_tok_s']:.1f} tok/s")
    print(f"  int8 / HF fp32: ×{r['int8_vs_hf']:.2f}, w8a8 / HF fp32: ×{r['w8a8_vs_hf']:.2f}")
    k = kernels()
    for shape, ways in k.items():
        shown = ", ".join(f"{name} {ms:.2f}" for name, ms in ways.items())
        print(f"  one row × {shape} (ms): {shown}")
    g = plain_vs_packed()
    shown = ", ".join(f"{m} row{'s' if m > 1 else ''} {ratio:.2f}" for m, ratio in g.items())
    print(f"  GPT-2-small's weights, fp32, oneDNN packed / plain F.linear: {shown}")
    b = batch_layout()
    shown = ", ".join(f"{name} {1e3 * t:.1f}" for name, t in b.items())
    print(f"  GPT-2-small's weights, fp32 oneDNN (ms): {shown}")
    c = cache_vs_recompute(args.cache_new, 1)
    print(
        f"tiny preset, {args.cache_new} greedy tokens: KV cache {c['cached_tok_s']:.0f} tok/s, "
        f"recompute {c['recompute_tok_s']:.0f} tok/s, ×{c['speedup']:.1f}, "
        f"identical tokens: {c['identical_tokens']}"
    )
    result = {
        "args": vars(args),
        "vs_hf": r,
        "kernels": k,
        "packed_over_plain": g,
        "batch_layout_s": b,
        "cache": c,
    }
    path = save_json("generation", result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
