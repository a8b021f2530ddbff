"""Build Llama-3.2-1B-shaped GGUF files larger than a CPU's caches, with llama.cpp's own tools.

    python benchmarks/llama1b.py [--out DIR] [--types F16,Q8_0,Q4_0] [--layers 16] [--width 2048]
                                 [--heads 32] [--kv-heads 8] [--ffn 8192] [--seed 0] [--llama3]

A Hugging Face Llama folder of the shape of Llama 3.2 1B (16 layers, width 2048, 32 query heads
over 8 key/value heads, MLP 8192, tied embeddings; with ``--llama3`` its RoPE scaling — Llama 3.2's
``llama3`` with factor 32 over 8192 positions, which the converter writes as a ``rope_freqs``
tensor —, else none) with random weights (normal,
std 0.02, ``--seed``), in bf16 safetensors, and a byte-level BPE tokenizer: SmolLM2's (its
49 152 tokens, rebuilt from the ``smollm2`` GGUF file by dikkat and saved as ``tokenizer.json``,
which llama.cpp's converter knows by its hash). llama.cpp's ``convert_hf_to_gguf.py`` (from the
llama-cpp-python sdist that benchmarks/llamacpp_build.py builds) writes it as F16, and its
``llama-quantize`` makes the other ``--types`` from that; the converter's one requirement that
dikkat does not have (``sentencepiece``, which it imports before it looks for a SentencePiece
model) is installed beside llama.cpp's build, not into this environment. About 2.0, 1.1 and 0.6
GB; the folder and the files go to ``--out`` (default: ``llama1b`` in dikkat's cache). Then, for
example:

    python benchmarks/llamacpp.py --models DIR/llama1b-Q4_0.gguf --skip quality
    python benchmarks/load_memory.py --models DIR/llama1b-Q4_0.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from llamacpp_build import VERSION, build_llamacpp, cache_dir, run

# Llama 3.2 1B's config.json
LLAMA32_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip


def hf_folder(folder: Path, args: argparse.Namespace) -> Path:
    """The random Llama folder (config, bf16 weights, SmolLM2's tokenizer) in ``folder``."""
    from safetensors.torch import save_file

    import dikkat.pretrained

    folder.mkdir(parents=True, exist_ok=True)
    smol = dikkat.pretrained.load("smollm2").tokenizer
    smol.backend.save(str(folder / "tokenizer.json"))
    vocab = smol.vocab_size
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    config = special | {"tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    head = args.width // args.heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": args.width, "intermediate_size": args.ffn,
        "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads, "head_dim": head, "hidden_act": "silu",
        "max_position_embeddings": 131072 if args.llama3 else 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": LLAMA32_ROPE if args.llama3 else None,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "bos_token_id": smol.bos_id, "eos_token_id": smol.eos_id,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(args.seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    kv = args.kv_heads * head
    tensors = {"model.embed_tokens.weight": rand(vocab, args.width),
               "model.norm.weight": torch.ones(args.width, dtype=torch.bfloat16)}  # fmt: skip
    for i in range(args.layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(args.width, args.width),
            p + "self_attn.k_proj.weight": rand(kv, args.width),
            p + "self_attn.v_proj.weight": rand(kv, args.width),
            p + "self_attn.o_proj.weight": rand(args.width, args.width),
            p + "mlp.gate_proj.weight": rand(args.ffn, args.width),
            p + "mlp.up_proj.weight": rand(args.ffn, args.width),
            p + "mlp.down_proj.weight": rand(args.width, args.ffn),
            p + "input_layernorm.weight": torch.ones(args.width, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(args.width, dtype=torch.bfloat16),
        }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def main(argv: list[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", type=Path, default=None, help="folder for the HF model and the GGUF files")
    add("--types", default="F16,Q8_0,Q4_0", help="GGUF types (F16 converted, others quantised)")
    add("--layers", type=int, default=16)
    add("--width", type=int, default=2048)
    add("--heads", type=int, default=32)
    add("--kv-heads", type=int, default=8)
    add("--ffn", type=int, default=8192)
    add("--seed", type=int, default=0)
    add("--llama3", action="store_true", help="Llama 3.2's llama3 RoPE scaling")
    add("--cache", type=Path, default=cache_dir(), help="where llama.cpp is built")
    args = parser.parse_args(argv)
    from dikkat.files import cache_dir as dikkat_cache

    stem = "llama32-1b" if args.llama3 else "llama1b"
    out = args.out or dikkat_cache() / stem
    folder = out / "hf"
    if not (folder / "model.safetensors").is_file():
        print(f"writing the random model into {folder} …", flush=True)
        hf_folder(folder, args)
    return gguf_files(folder, out, stem, args.types, args.cache)


def gguf_files(folder: Path, out: Path, stem: str, types: str, cache: Path) -> dict[str, Path]:
    """The HF ``folder`` written by llama.cpp's converter as ``out/{stem}-F16.gguf``, and the
    other ``types`` quantised from it by ``llama-quantize`` (each kept once made)."""
    bins = build_llamacpp(cache, VERSION)
    source = cache / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    files: dict[str, Path] = {}
    f16 = out / f"{stem}-F16.gguf"
    if not f16.is_file():
        print(f"converting to {f16} with llama.cpp's convert_hf_to_gguf.py …", flush=True)
        tmp = f16.with_suffix(".part")
        deps = cache / "converter-deps"
        if not (deps / "sentencepiece").is_dir():
            pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(deps)]
            run([*pip, "sentencepiece"], "pip install of the converter's sentencepiece")
        env = {**os.environ, "PYTHONPATH": f"{source / 'gguf-py'}{os.pathsep}{deps}"}
        cmd = [sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder),
               "--outtype", "f16", "--outfile", str(tmp)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"the conversion failed: {done.stderr[-2000:]}")
        tmp.replace(f16)
    files["F16"] = f16
    for kind in [t for t in types.split(",") if t != "F16"]:
        path = out / f"{stem}-{kind}.gguf"
        if not path.is_file():
            print(f"quantising to {path} …", flush=True)
            tmp = path.with_suffix(".part")
            run([str(bins / "llama-quantize"), str(f16), str(tmp), kind], f"llama-quantize {kind}")
            tmp.replace(path)
        files[kind] = path
    for kind, path in files.items():
        print(f"{kind}: {path} ({path.stat().st_size / 2**30:.2f} GiB)")
    return files


if __name__ == "__main__":
    main()
