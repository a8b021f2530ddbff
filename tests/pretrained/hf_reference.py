"""transformers' own Llama / Gemma 3 code as an exact fp64 reference.

``model.double()`` is not enough: transformers computes three things in fp32 whatever the model's
dtype — the RoPE angles (``position_ids.float() * inv_freq.float()``, with ``inv_freq`` built in
fp32), the RMSNorm (``x.float()``), and the eager softmax (``dtype=torch.float32``). At position
1 300 an fp32 angle is off by up to ~1e-4 rad, which moves Gemma 3's logits by ~4e-3: more than
every other rounding of its fp32 forward together. :func:`exact_fp64` lifts those three to fp64
(the angles from fp64 frequencies, the norms in fp64, SDPA instead of eager), so what is left
is the model's math.
"""

from __future__ import annotations

import copy
import types

import torch
from torch import nn


def exact_fp64(model: nn.Module) -> nn.Module:
    """An fp64 copy of an HF Llama-family or Gemma 3 causal LM, computed in fp64 throughout."""
    ref = copy.deepcopy(model).double().eval()
    ref.set_attn_implementation("sdpa")  # eager's softmax runs in fp32
    config = ref.config
    patched = {"norm": 0, "rope": 0}
    for module in ref.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            gemma = name.startswith("Gemma")
            module.forward = types.MethodType(_gemma_norm if gemma else _llama_norm, module)
            patched["norm"] += 1
        elif name.endswith("RotaryEmbedding"):
            _fp64_rope(module, config)
            patched["rope"] += 1
    if not patched["norm"] or patched["rope"] != 1:  # transformers renamed something: say so
        raise RuntimeError(f"exact_fp64 found {patched} RMSNorm / rotary modules in {name}")
    return ref


def _llama_norm(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h


def _gemma_norm(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    return h * (1.0 + self.weight)


def _fp64_rope(module: nn.Module, config) -> None:
    """Replace each ``*inv_freq`` buffer by the fp64 frequencies of its RoPE base, and compute
    the angles in fp64."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = config.rope_parameters
    per_kind = params if "rope_theta" not in params else {"": params}
    for kind, p in per_kind.items():
        if p.get("rope_type", "default") != "default":
            raise RuntimeError(f"exact_fp64 knows only the default RoPE, got {p}")
        name = f"{kind}_inv_freq" if kind else "inv_freq"
        steps = torch.arange(0, dim, 2, dtype=torch.float64)
        setattr(module, name, 1.0 / (p["rope_theta"] ** (steps / dim)))

    def forward(self, x, position_ids, layer_type=None):
        inv = getattr(self, f"{layer_type}_inv_freq" if layer_type else "inv_freq")
        angles = position_ids[..., None].to(torch.float64) * inv  # (B, T, D/2)
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    module.forward = types.MethodType(forward, module)
