"""Attention weights of a Hugging Face Llama at long context: eager's ``output_attentions``
against ``dikkat.capture`` of one layer, one head, a few rows — peak memory and time.

    python benchmarks/hf_weights.py [--tokens 16384] [--rows 64] [--layers 2] [--heads 2]

A randomly initialised tiny ``LlamaForCausalLM`` (hidden 64, grouped-query heads), one forward
of one sequence, fp32, no grad. ``eager output_attentions`` is transformers' own way to get
weights: every layer's (B, H, T, T) softmax, kept. ``dikkat capture`` runs the model through
``dikkat.hf`` (backend auto) inside ``dikkat.capture(model, layers=[0], heads=[0],
rows=last --rows)``. ``dikkat, no weights`` is the same model without the capture. Each runs in
a fresh process, so that one's peak is not another's; the peak is what the first forward adds to
the process's resident memory (benchmarks/common.peak_memory), the time the best of ``--repeat``
forwards after it. The captured rows are compared with
the same rows of eager's weights.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import peak_memory, save_json

MODES = ("eager output_attentions", "dikkat capture", "dikkat, no weights")


def _model(tokens: int, layers: int, heads: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=tokens,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _one(mode: str, args: argparse.Namespace, out: Path) -> dict:
    """Run one mode in this process; the selected rows go to ``out`` (a .pt file)."""
    import dikkat
    import dikkat.hf

    torch.set_num_threads(args.threads)
    model = _model(args.tokens, args.layers, args.heads)
    ids = torch.randint(0, 256, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    rows = list(range(args.tokens - args.rows, args.tokens))
    kept: dict[str, torch.Tensor] = {}
    if mode == "eager output_attentions":
        model.set_attn_implementation("eager")

        def run() -> object:
            result = model(ids, output_attentions=True)
            kept["rows"] = result.attentions[0][:, [0]][:, :, rows].clone()
            return result
    else:
        model.set_attn_implementation(dikkat.hf.register("dikkat-bench"))

        def run() -> object:
            if mode == "dikkat, no weights":
                return model(ids)
            with dikkat.capture(model, layers=[0], heads=[0], rows=rows) as cap:
                result = model(ids)
            kept["rows"] = cap[0]
            return result

    with torch.no_grad():
        peak = peak_memory(run)  # the first call, cold: what it needs at most
        seconds = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
    if "rows" in kept:
        torch.save(kept["rows"], out)
    return {"mode": mode, "seconds": min(seconds), "peak_bytes": peak}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=64, help="query rows captured (the last)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2, help="timed calls after the first")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(_one(args.one, args, args.out)))
        return {}
    full = args.layers * args.heads * args.tokens**2 * 4
    print(
        f"tiny Llama: {args.layers} layers, {args.heads} heads, T = {args.tokens}, fp32; eager "
        f"keeps {args.layers} × {args.heads} × T² × 4 B = {full / 2**30:.1f} GiB of weights\n"
    )
    print(f"{'mode':<26}{'s':>8}{'peak MiB':>11}")
    results, kept = [], {}
    with tempfile.TemporaryDirectory() as folder:
        for mode in args.modes:
            out = Path(folder) / f"{len(results)}.pt"
            child = [sys.executable, __file__, "--one", mode, "--out", str(out)]
            child += [f"--{k}={getattr(args, k)}" for k in ("tokens", "rows", "layers", "heads")]
            child += [f"--threads={args.threads}", f"--repeat={args.repeat}"]
            done = subprocess.run(child, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{done.stderr[-2000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(row)
            if out.exists():
                kept[mode] = torch.load(out)
            print(f"{mode:<26}{row['seconds']:>8.2f}{row['peak_bytes'] / 2**20:>11.1f}")
    if {"eager output_attentions", "dikkat capture"} <= kept.keys():
        diff = (kept["dikkat capture"] - kept["eager output_attentions"]).abs().max()
        print(f"\ncaptured rows vs eager's: max |difference| {float(diff):.2e}")
        results.append({"max_abs_difference": float(diff)})
    payload = {"args": {k: v for k, v in vars(args).items() if k not in ("one", "out")}}
    save_json("hf_weights", {**payload, "results": results})
    return {"results": results}


if __name__ == "__main__":
    main()
