"""The fused q/k/v projection of :class:`~dikkat.layers.MultiHeadAttention` and its state dict.

One ``Linear`` holds the rows [q | k | v]; state dicts keep three entries, ``q_proj``, ``k_proj``
and ``v_proj``, as three separate ``nn.Linear`` would (gpt-fast fuses ``wqkv`` at load the same
way, with a state-dict hook), so checkpoints and ported weights load unchanged.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor, nn

from dikkat.layers.linear import Linear


def fused_linear(in_features: int, sizes: tuple[int, ...], bias: bool) -> Linear:
    """One Linear whose row blocks hold what ``nn.Linear(in_features, n)`` for each n of
    ``sizes``, built in turn, would hold: the same random draws, so a seeded layer starts from
    the same weights as with three separate projections."""
    parts = [nn.Linear(in_features, n, bias=bias) for n in sizes]
    fused = Linear(in_features, sum(sizes), bias=bias, device="meta", dtype=parts[0].weight.dtype)
    if parts[0].weight.is_meta:  # built to be given its weights (dikkat.models.io.meta_modules)
        return fused  # (copying meta tensors would import torch's symbolic shapes and sympy)
    fused = fused.to_empty(device=parts[0].weight.device)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if bias:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


_QKV = ("q_proj", "k_proj", "v_proj")


def split_qkv_state(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """State-dict post-hook: ``qkv_proj.weight`` ((H + 2G)·D, C) → ``q_proj.weight`` (H·D, C),
    ``k_proj.weight`` and ``v_proj.weight`` (G·D, C), biases alike, in the order that three
    separate Linears would give them. Views of the fused tensors, as a state dict's entries are
    of the parameters."""
    fused = prefix + "qkv_proj."
    if fused + "weight" not in state_dict:
        return
    keys = list(state_dict)
    own = keys[keys.index(fused + "weight") :]  # this layer's entries from qkv_proj on
    entries = {k: state_dict.pop(k) for k in own}
    sizes = module.qkv_sizes
    for key, value in entries.items():
        if key == fused + "bias":
            continue  # written together with the weight
        if key != fused + "weight":
            state_dict[key] = value
            continue
        bias = entries.get(fused + "bias")
        biases = bias.split(sizes) if bias is not None else (None,) * len(sizes)
        for name, w, b in zip(_QKV, value.split(sizes), biases, strict=True):
            state_dict[f"{prefix}{name}.weight"] = w
            if b is not None:
                state_dict[f"{prefix}{name}.bias"] = b


def fuse_qkv_state(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load pre-hook: ``q_proj``/``k_proj``/``v_proj`` weights (and biases) → ``qkv_proj``.

    A block that is absent keeps its current value and is reported missing (an error when
    ``strict``), a block of the wrong shape is reported by its own name, as ``load_state_dict``
    reports a separate Linear's. A state dict that already holds ``qkv_proj`` loads as it is.
    """
    qkv = module.qkv_proj
    for kind in ("weight", "bias"):
        names = [f"{prefix}{name}.{kind}" for name in _QKV]
        current = getattr(qkv, kind)
        given = {n: state_dict.pop(n) for n in names if n in state_dict}
        if current is None or not given:
            state_dict |= given  # no such parameter here: load_state_dict reports them unexpected
            continue
        blocks = current.detach().split(module.qkv_sizes)
        for name, block in zip(names, blocks, strict=True):
            t = given.get(name)
            if t is None:
                missing_keys.append(name)
            elif not isinstance(t, Tensor) or t.shape != block.shape:
                shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                error_msgs.append(
                    f"size mismatch for {name}: copying a param with shape {shape} from "
                    f"checkpoint, the shape in current model is {tuple(block.shape)}."
                )
                del given[name]
        if not given:
            continue  # nothing loadable: the errors above say why
        # in the given tensors' dtype and device (a model on "meta" may load with assign=True)
        like = next(iter(given.values()))
        parts = []
        for name, block in zip(names, blocks, strict=True):
            if name in given:
                parts.append(given[name].to(like))
            elif block.is_meta:
                parts.append(torch.empty(block.shape, dtype=like.dtype, device=like.device))
            else:
                parts.append(block.to(like))
        state_dict[f"{prefix}qkv_proj.{kind}"] = _joined(parts)


def _joined(parts: list[Tensor]) -> Tensor:
    """``parts`` stacked by rows: where they lie one after another in one storage (the blocks of
    one fused tensor, as a file that stores q/k/v whole is read) the view of them all, which
    copies nothing; else their concatenation."""
    first = parts[0]
    adjacent = all(p.is_contiguous() and not p.is_meta for p in parts) and all(
        b.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and b.dtype == first.dtype
        and b.shape[1:] == first.shape[1:]
        and a.data_ptr() + a.nbytes == b.data_ptr()
        for a, b in itertools.pairwise(parts)
    )
    if not adjacent:
        return torch.cat(parts)
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())
