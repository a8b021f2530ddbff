"""LoRA adapters in PEFT's format (https://huggingface.co/docs/peft): the
``adapter_model.safetensors`` keys and the ``adapter_config.json`` fields that
``peft.PeftModel.from_pretrained`` reads, for the adapters of :mod:`dikkat.training.lora`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from dikkat.training.lora import LoraConfig, Site

__all__ = ["PEFT_PREFIX", "load_peft_state", "lora_config_of", "peft_config", "peft_state"]

# the prefix PEFT's saved adapters give every key (peft.utils.save_and_load): the PeftModel's
# base_model (a LoraModel) wraps the transformers model as .model
PEFT_PREFIX = "base_model.model."


def peft_state(sites: list[Site]) -> dict[str, Tensor]:
    """The adapters as PEFT saves them (``adapter_model.safetensors``): ``<prefix><module>.lora_A
    .weight`` (r, K) and ``.lora_B.weight`` (N, r), fp32 and contiguous."""
    state = {}
    for s in sites:
        key = f"{PEFT_PREFIX}{s.hf}"
        state[f"{key}.lora_A.weight"] = s.layer.lora_A[s.name].detach().contiguous()
        state[f"{key}.lora_B.weight"] = s.layer.lora_B[s.name].detach().contiguous()
    return state


def load_peft_state(sites: list[Site], state: Mapping[str, Tensor], source: str) -> None:
    """Copy a PEFT adapter's weights (keys as :func:`peft_state` writes them) into ``sites``;
    a missing or extra key, or a shape that differs, is refused naming it."""
    wanted = peft_state(sites)
    missing = sorted(set(wanted) - set(state))
    extra = sorted(set(state) - set(wanted))
    if missing or extra:
        raise ValueError(
            f"{source} does not hold this model's adapters: missing {missing[:3]}"
            f"{' …' * (len(missing) > 3)}, unknown {extra[:3]}{' …' * (len(extra) > 3)}"
        )
    for key, want in wanted.items():
        if tuple(state[key].shape) != tuple(want.shape):
            raise ValueError(
                f"{source}: {key} has shape {tuple(state[key].shape)}, the model's adapter "
                f"{tuple(want.shape)}"
            )
    with torch.no_grad():
        for s in sites:
            key = f"{PEFT_PREFIX}{s.hf}"
            s.layer.lora_A[s.name].copy_(state[f"{key}.lora_A.weight"])
            s.layer.lora_B[s.name].copy_(state[f"{key}.lora_B.weight"])


def peft_config(config: LoraConfig, base_model: str) -> dict[str, Any]:
    """``adapter_config.json`` as PEFT reads it (``peft.LoraConfig``'s fields; the rest take
    PEFT's defaults): ``base_model`` is what ``PeftModel.from_pretrained`` is told to load."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": list(config.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def lora_config_of(peft: Mapping[str, Any], source: str) -> LoraConfig:
    """The :class:`LoraConfig` of a PEFT ``adapter_config.json``; what dikkat's adapters do
    not compute (DoRA, rsLoRA, trained biases, per-module ranks) is refused by name."""
    if peft.get("peft_type") != "LORA":
        raise ValueError(f"{source}: peft_type {peft.get('peft_type')!r} is not LORA")
    for key, plain in (("use_dora", False), ("use_rslora", False), ("bias", "none")):
        if peft.get(key, plain) != plain:
            raise ValueError(f"{source}: {key}={peft[key]!r} is not supported (only {plain!r})")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform"):
        if peft.get(key):
            raise ValueError(f"{source}: {key} is not supported")
    targets = peft.get("target_modules")
    if isinstance(targets, str):
        raise ValueError(f"{source}: target_modules {targets!r} (a pattern) is not supported")
    try:
        return LoraConfig(
            rank=peft["r"],
            alpha=float(peft["lora_alpha"]),
            dropout=float(peft.get("lora_dropout", 0.0)),
            targets=tuple(targets or ()),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{source} is not a LoRA adapter config dikkat reads: {e}") from None
