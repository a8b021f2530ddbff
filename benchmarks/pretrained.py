"""Real pretrained models, side by side: dikkat's native decoder against transformers reading the
same GGUF file (both dequantised to fp32), batch 1.

    python benchmarks/pretrained.py [--models smollm2,gemma3-270m] [--new 128] [--prompt 16]
                                    [--prefill 512] [--rounds 3] [--threads 2]

For each model: prefill of ``--prefill`` tokens (the prompt's forward pass that fills the KV
cache, last position's logits only, as generation needs; dikkat's weights prepared once, as a
program holding the model has them), and greedy decoding of ``--new``
tokens after a ``--prompt``-token prompt, never stopping at an end token (transformers with
``min_new_tokens``). The engines run in turn, ``--rounds`` times, and each figure is the median
of its rounds, so that a machine shared with other work slows both alike. dikkat decodes in fp32,
bf16, int8, w8a8, q8 and q4 (the weights prepared once, as a server holding the model would), in
the file's own quantisation kept packed ("gguf", what ``dikkat.pretrained.load`` gives by
default), and in that with the compiled static decode step ("gguf+compile"; its compile is part
of the warm-up, not of the timing). The text is this Python's own standard-library source.

Quality beside speed: for each weight format, the fraction of fp32's greedy tokens it reproduces
and the mean log-likelihood (nats per token) of ``--quality-tokens`` held-out tokens. Bandwidth:
the read bandwidth of a 1 GiB sum, measured in the same run; each decode row gives the bytes one
token reads (every weight in its format, one embedding row when untied, the cached keys and
values at the mean length) and the share of that bandwidth it reaches.
"""

from __future__ import annotations

import argparse
import statistics
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn

from common import save_json
from dikkat.bench.bandwidth import weight_bytes
from dikkat.generation import generate
from dikkat.models import Decoder
from dikkat.pretrained import Pretrained, load
from dikkat.pretrained.sources import resolve
from dikkat.weights import inference_model, w8a8_available
from generation import read_bandwidth

FORMATS = ("fp32", "bf16", "int8", "w8a8", "q8", "q4", "gguf", "gguf+compile")


def stdlib_ids(lm: Pretrained, n: int, skip: int = 0) -> list[int]:
    """Tokens ``skip … skip + n`` of some standard-library sources of this Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = ("textwrap.py", "colorsys.py", "fnmatch.py", "shlex.py", "difflib.py")
    ids = lm.tokenizer.encode("".join((root / name).read_text() for name in names))
    if len(ids) < skip + n:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {skip + n}")
    return ids[skip : skip + n]


def bytes_per_token(model: nn.Module, mean_len: float) -> int:
    """Bytes one decoding step reads: every weight in its format (``dikkat bench decode``'s
    count: one embedding row, a tied table once), and the fp32 keys and values of ``mean_len``
    cached tokens in every layer."""
    c = model.config
    return weight_bytes(model) + int(2 * c.n_layers * c.kv_heads * c.dim * mean_len * 4)


def median_time(fn, rounds: list[float]) -> None:
    t0 = time.perf_counter()
    fn()
    rounds.append(time.perf_counter() - t0)


def mean_loglik(model: nn.Module, ids: list[int]) -> float:
    """The mean log-likelihood of ``ids`` in one forward pass (a packed model's prefill path:
    the dequantised weights; its decode steps' rounding shows in the greedy agreement)."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        logp = torch.log_softmax(model(x)[0, :-1].double(), -1)
    return logp.gather(-1, x[0, 1:, None]).mean().item()


def bench_model(name: str, args: argparse.Namespace, bandwidth: float) -> dict:
    from transformers import AutoModelForCausalLM

    path = resolve(name).path
    lm = load(name, weights="fp32")
    packed = load(name).model  # the file's blocks
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompt = torch.tensor([stdlib_ids(lm, args.prompt)])
    prefill_ids = torch.tensor([stdlib_ids(lm, args.prefill)])
    formats = [f for f in FORMATS if f != "w8a8" or w8a8_available()]

    def model_for(weights: str) -> Decoder:
        if weights.startswith("gguf"):
            return packed
        return inference_model(lm.model, weights)  # type: ignore[return-value]

    def hf_decode():
        with torch.inference_mode():
            return hf.generate(
                prompt, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False
            )[0, args.prompt :].tolist()

    def hf_prefill():
        with torch.inference_mode():
            hf(prefill_ids, use_cache=True, logits_to_keep=1)

    held = inference_model(lm.model, "fp32")  # as a program holding the model would

    def ours_prefill():  # on the fp32 copy held for the whole run: the weights packed once
        with torch.inference_mode():
            held(prefill_ids, cache=held.new_cache(1, args.prefill), last_only=True)

    def packed_prefill():
        with torch.inference_mode():
            packed(prefill_ids, cache=packed.new_cache(1, args.prefill), last_only=True)

    keys = ("hf_prefill", "ours_prefill", "gguf_prefill", "hf", *formats)
    times: dict[str, list[float]] = {k: [] for k in keys}
    tokens: dict[str, list[int]] = {}
    hf_decode(), ours_prefill(), hf_prefill(), packed_prefill()  # warm-up
    # the compiled step's compile, outside the timing, for the cache length the timing uses
    generate(packed, prompt, args.new, compile=True)
    for _ in range(args.rounds):
        median_time(hf_prefill, times["hf_prefill"])
        median_time(ours_prefill, times["ours_prefill"])
        median_time(packed_prefill, times["gguf_prefill"])
        t0 = time.perf_counter()
        tokens["hf"] = hf_decode()
        times["hf"].append(time.perf_counter() - t0)
        for weights in formats:
            copy = model_for(weights)  # outside the timing, one at a time
            compiled = weights.endswith("+compile")
            with torch.inference_mode():
                # packs outside the timing too (a compiled step: the timed cache length)
                generate(copy, prompt, args.new if compiled else 2, compile=compiled)
                t0 = time.perf_counter()
                out = generate(copy, prompt, args.new, compile=compiled)[0][args.prompt :]
                times[weights].append(time.perf_counter() - t0)
            tokens[weights] = out
            del copy
    mean_len = args.prompt + (args.new - 1) / 2
    held_out = stdlib_ids(lm, args.quality_tokens, skip=args.prefill)
    rows = {}
    for key in ("hf", *formats):
        tok_s = args.new / statistics.median(times[key])
        nbytes = bytes_per_token(lm.model if key == "hf" else model_for(key), mean_len)
        rows[key] = {
            "decode_tok_s": tok_s,
            "rounds_tok_s": [args.new / t for t in times[key]],
            "bytes_per_token": nbytes,
            "share_of_bandwidth": tok_s * nbytes / bandwidth,
            "same_tokens_as_fp32": sum(map(int.__eq__, tokens[key], tokens["fp32"])) / args.new,
        }
        if key != "hf":
            rows[key]["mean_loglik"] = mean_loglik(model_for(key), held_out)
            rows[key]["vs_transformers"] = tok_s / (args.new / statistics.median(times["hf"]))
    prefill = {
        k: args.prefill / statistics.median(times[f"{k}_prefill"]) for k in ("hf", "ours", "gguf")
    }
    return {
        "model": repr(lm),
        "decode": rows,
        "prefill_tok_s": prefill,
        "prefill_vs_transformers": prefill["ours"] / prefill["hf"],
        "identical_tokens": tokens["fp32"] == tokens["hf"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3-270m")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--quality-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    bandwidth = read_bandwidth()
    results = {"read_bandwidth_gb_s": bandwidth / 1e9, "threads": args.threads, "models": {}}
    for name in args.models.split(","):
        r = bench_model(name, args, bandwidth)
        results["models"][name] = r
        print(f"\n{r['model']}: prefill {args.prefill} tokens, tok/s: dikkat "
              f"{r['prefill_tok_s']['ours']:.0f} (packed {r['prefill_tok_s']['gguf']:.0f}), "
              f"transformers {r['prefill_tok_s']['hf']:.0f} "
              f"({r['prefill_vs_transformers']:.2f}x); fp32 tokens identical: "
              f"{r['identical_tokens']}")  # fmt: skip
        print(f"{'decode':>14} {'tok/s':>7} {'x HF':>6} {'MB/tok':>7} {'BW share':>8} "
              f"{'same tok':>8} {'loglik':>7}")  # fmt: skip
        for key, row in r["decode"].items():
            print(f"{'transformers' if key == 'hf' else key:>14} {row['decode_tok_s']:7.1f} "
                  f"{row.get('vs_transformers', 1.0):6.2f} {row['bytes_per_token'] / 1e6:7.0f} "
                  f"{row['share_of_bandwidth']:8.0%} {row['same_tokens_as_fp32']:8.0%} "
                  f"{row.get('mean_loglik', float('nan')):7.3f}")  # fmt: skip
    print(f"\nread bandwidth (1 GiB sum): {bandwidth / 1e9:.1f} GB/s, {args.threads} threads")
    save_json("pretrained", results)
    return results


if __name__ == "__main__":
    main()
