"""Build Qwen3-MoE-shaped GGUF files (a mixture of experts) with llama.cpp's own tools.

    python benchmarks/qwen3moe.py [--out DIR] [--types F16,Q8_0,Q4_0] [--layers 4] [--seed 0]

A Hugging Face ``qwen3_moe`` folder with the layer shape of Qwen3-30B-A3B — width 2048, 32 query
heads of 128 over 4 key/value heads, q/k norms, 128 experts of 768 in each block, 8 of them a
token, renormalised — and ``--layers`` of its 48 layers (default 4: about 2.4 B weights, 0.23 B
of them read per token), random weights (normal, std 0.02, ``--seed``) in bf16, and SmolLM2's
tokenizer (see ``llama1b.py``, whose conversion and quantisation this shares). About 4.6, 2.4
and 1.3 GiB as F16, Q8_0 and Q4_0: many times a CPU's caches, and a decode step reads 8 / 128
of the experts. Then, for example:

    python benchmarks/llamacpp.py --models DIR/qwen3moe-Q4_0.gguf --skip quality
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from llama1b import gguf_files
from llamacpp_build import cache_dir


def hf_folder(folder: Path, args: argparse.Namespace) -> Path:
    """The random Qwen3-MoE folder (config, bf16 weights, SmolLM2's tokenizer) in ``folder``."""
    from safetensors.torch import save_file

    import dikkat.pretrained

    folder.mkdir(parents=True, exist_ok=True)
    smol = dikkat.pretrained.load("smollm2").tokenizer
    smol.backend.save(str(folder / "tokenizer.json"))
    vocab = smol.vocab_size
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    config = special | {"tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    C, D, H, KV, E, F = args.width, 128, args.heads, args.kv_heads, args.experts, args.expert_ffn
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab,
        "hidden_size": C, "intermediate_size": 6144, "moe_intermediate_size": F,
        "num_hidden_layers": args.layers, "num_attention_heads": H, "num_key_value_heads": KV,
        "head_dim": D, "hidden_act": "silu", "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
        "num_experts": E, "num_experts_per_tok": args.experts_used, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": smol.bos_id, "eos_token_id": smol.eos_id,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(args.seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, C), "lm_head.weight": rand(vocab, C),
               "model.norm.weight": ones(C)}  # fmt: skip
    for i in range(args.layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(H * D, C),
            p + "self_attn.k_proj.weight": rand(KV * D, C),
            p + "self_attn.v_proj.weight": rand(KV * D, C),
            p + "self_attn.o_proj.weight": rand(C, H * D),
            p + "self_attn.q_norm.weight": ones(D),
            p + "self_attn.k_norm.weight": ones(D),
            p + "mlp.gate.weight": rand(E, C),
            p + "input_layernorm.weight": ones(C),
            p + "post_attention_layernorm.weight": ones(C),
        }
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            tensors |= {q + "gate_proj.weight": rand(F, C), q + "up_proj.weight": rand(F, C),
                        q + "down_proj.weight": rand(C, F)}  # fmt: skip
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def main(argv: list[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", type=Path, default=None, help="folder for the HF model and the GGUF files")
    add("--types", default="F16,Q8_0,Q4_0", help="GGUF types (F16 converted, others quantised)")
    add("--layers", type=int, default=4)
    add("--width", type=int, default=2048)
    add("--heads", type=int, default=32)
    add("--kv-heads", type=int, default=4)
    add("--experts", type=int, default=128)
    add("--experts-used", type=int, default=8)
    add("--expert-ffn", type=int, default=768)
    add("--seed", type=int, default=0)
    add("--cache", type=Path, default=cache_dir(), help="where llama.cpp is built")
    args = parser.parse_args(argv)
    from dikkat.files import cache_dir as dikkat_cache

    out = args.out or dikkat_cache() / "qwen3moe"
    folder = out / "hf"
    if not (folder / "model.safetensors").is_file():
        print(f"writing the random model into {folder} …", flush=True)
        hf_folder(folder, args)
    return gguf_files(folder, out, "qwen3moe", args.types, args.cache)


if __name__ == "__main__":
    main()
