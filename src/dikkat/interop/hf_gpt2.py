"""Hugging Face GPT-2 weights → :class:`dikkat.models.GPT`.

Facts of HF's ``GPT2LMHeadModel`` layout that the mapping handles:

- its ``Conv1D`` layers store the weight as (in, out), the transpose of ``nn.Linear``'s;
- ``attn.c_attn`` is one fused projection whose output columns are [q | k | v];
- the MLP uses the tanh GELU (``gelu_new``), LayerNorm eps is ``layer_norm_epsilon`` (1e-5);
- ``lm_head.weight`` is tied to ``transformer.wte.weight``.

Only ``transformers`` configs are read here; the library itself never imports ``transformers``
unless one of these functions is called with a model object.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from dikkat.interop.common import state_and_config
from dikkat.models.gpt import GPT, GPTConfig
from dikkat.models.io import load_checked

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def gpt2_config(hf_config: Any) -> GPTConfig:
    """A :class:`GPTConfig` equal to a ``transformers.GPT2Config``."""
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if getattr(hf_config, flag, False):
            raise ValueError(f"GPT-2 configs with {flag}=True have no dikkat equivalent")
    if not getattr(hf_config, "scale_attn_weights", True):
        raise ValueError("GPT-2 configs with scale_attn_weights=False have no dikkat equivalent")
    act = getattr(hf_config, "activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise ValueError(f"GPT-2 activation {act!r} is not one of {sorted(_ACTIVATIONS)}")
    return GPTConfig(
        vocab_size=hf_config.vocab_size,
        max_len=hf_config.n_positions,
        d_model=hf_config.n_embd,
        n_layers=hf_config.n_layer,
        n_heads=hf_config.n_head,
        d_ff=getattr(hf_config, "n_inner", None),
        position="learned",
        norm_eps=getattr(hf_config, "layer_norm_epsilon", 1e-5),
        activation=_ACTIVATIONS[act],
        tie_embeddings=True,
    )


def gpt2_state_dict(hf_state: Mapping[str, Tensor], n_layers: int) -> dict[str, Tensor]:
    """Rename and transpose an HF GPT-2 state dict into GPT's names."""
    sd = {k.removeprefix("transformer."): v for k, v in hf_state.items()}
    out = {
        "tok_emb.weight": sd["wte.weight"],
        "pos_emb.weight": sd["wpe.weight"],
        "norm_f.weight": sd["ln_f.weight"],
        "norm_f.bias": sd["ln_f.bias"],
    }
    for i in range(n_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
            out[b + ours + ".weight"] = sd[h + theirs + ".weight"]
            out[b + ours + ".bias"] = sd[h + theirs + ".bias"]
        # Conv1D stores (in, out): transpose to Linear's (out, in); c_attn's columns are [q|k|v].
        w_q, w_k, w_v = sd[h + "attn.c_attn.weight"].t().chunk(3, dim=0)
        b_q, b_k, b_v = sd[h + "attn.c_attn.bias"].chunk(3)
        for name, w, bias in (("q_proj", w_q, b_q), ("k_proj", w_k, b_k), ("v_proj", w_v, b_v)):
            out[b + f"attn.{name}.weight"] = w
            out[b + f"attn.{name}.bias"] = bias
        out[b + "attn.out_proj.weight"] = sd[h + "attn.c_proj.weight"].t()
        out[b + "attn.out_proj.bias"] = sd[h + "attn.c_proj.bias"]
        out[b + "mlp.up.weight"] = sd[h + "mlp.c_fc.weight"].t()
        out[b + "mlp.up.bias"] = sd[h + "mlp.c_fc.bias"]
        out[b + "mlp.down.weight"] = sd[h + "mlp.c_proj.weight"].t()
        out[b + "mlp.down.bias"] = sd[h + "mlp.c_proj.bias"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def gpt_from_hf(model_or_state_dict: Any, config: Any = None) -> GPT:
    """Build a :class:`GPT` from an HF ``GPT2LMHeadModel``/``GPT2Model`` or its state dict.

    With a state dict, pass its ``transformers.GPT2Config`` (or a :class:`GPTConfig`) as
    ``config``.
    """
    state, config = state_and_config(model_or_state_dict, config, "GPT-2")
    cfg = config if isinstance(config, GPTConfig) else gpt2_config(config)
    try:
        tensors = gpt2_state_dict(state, cfg.n_layers)
    except KeyError as e:
        raise ValueError(f"not a GPT-2 state dict: it has no {e.args[0]!r}") from None
    head = state.get("lm_head.weight")
    if head is not None and not torch.equal(head, tensors["tok_emb.weight"]):
        cfg = replace(cfg, tie_embeddings=False)  # an untied output embedding
        tensors["lm_head.weight"] = head.detach().clone()
    model = GPT(cfg)
    load_checked(model, tensors, "the GPT-2 weights")
    dtype = next(iter(tensors.values())).dtype
    return model.to(dtype if dtype.is_floating_point else torch.float32)


def load_hf_gpt2_dir(path: str | os.PathLike) -> GPT:
    """A GPT from a locally saved HF GPT-2 directory (``save_pretrained``): its ``config.json``
    and ``model.safetensors`` (or ``pytorch_model.bin``). Needs no ``transformers`` import."""
    d = Path(path)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d} has no config.json (expected an HF GPT-2 directory)")
    try:
        fields = json.loads((d / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{d / 'config.json'} is not valid JSON: {e}") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        hint = " (a dikkat model: use `dikkat generate DIR`)" if "dikkat_version" in fields else ""
        raise ValueError(
            f"{d} is not a Hugging Face model: its config.json has no model_type{hint}"
        )
    if fields["model_type"] != "gpt2":
        raise ValueError(f"{d} holds a {fields['model_type']!r} model, not GPT-2")
    hf_config = SimpleNamespace(**fields)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        if (d / "model.safetensors").is_file():
            state = load_file(d / "model.safetensors")
        elif (d / "pytorch_model.bin").is_file():
            state = torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
        else:
            raise FileNotFoundError(f"{d} has neither model.safetensors nor pytorch_model.bin")
    except FileNotFoundError:
        raise
    except (OSError, RuntimeError, ValueError, SafetensorError) as e:
        raise ValueError(f"{d}'s weights are truncated or corrupt: {e}") from None
    return gpt_from_hf(state, hf_config)
