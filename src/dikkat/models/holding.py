"""How a decoder takes the weights a file stores: :class:`HoldsWeights`, whose :meth:`~HoldsWeights.
hold` a loader hands every tensor it read, named as the model names them, and which decides
what becomes of each — as gpt-fast's ``Attention.load_hook`` joins ``wq``/``wk``/``wv`` into
``wqkv`` (pytorch-labs/gpt-fast, ``model.py``), not the loader.

What the model knows and the loader does not: q/k/v rows fuse into ``attn.qkv_proj`` (all three
or none: ``q_proj``/``k_proj``/``v_proj`` are views of its rows) and a gated MLP's gate and up
into ``mlp.gate_up``; a matrix kept as the file holds it — packed blocks
(:class:`~dikkat.weights.packed.PackedWeight`, a file's quantised matrices) or a 16-bit tensor
(fp16, bf16: :mod:`dikkat.weights.half`) — is held by a layer that multiplies it so
(:class:`~dikkat.weights.packed_layers.PackedLinear`, :class:`~dikkat.weights.half.HalfLinear`)
in place of a linear layer, or by an embedding that looks its rows up
(:class:`~dikkat.weights.packed_layers.PackedEmbedding`, :class:`~dikkat.weights.half.
HalfEmbedding`) in place of the token table (a table that is added, as learned positions, is
expanded to fp32); a tied output layer is the token table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dikkat.layers.attention import MultiHeadAttention
from dikkat.layers.mlp import GatedMLP
from dikkat.layers.moe import SparseMoE
from dikkat.models.io import load_checked
from dikkat.weights.half import HALF_DTYPES, HalfEmbedding, HalfLinear, is_half
from dikkat.weights.packed import PackedWeight, dequantize
from dikkat.weights.packed_layers import PackedEmbedding, PackedExperts, PackedLinear

__all__ = ["HoldsWeights", "Stored"]

Stored = Tensor | PackedWeight  # a tensor as read (fp32, or a 16-bit matrix), or packed blocks


def kept(w: object) -> bool:
    """Whether ``w`` is a matrix kept as the file holds it: packed blocks or a 16-bit tensor."""
    return isinstance(w, PackedWeight) or is_half(w)


def _expanded(w: Stored) -> Tensor:
    """``w`` in fp32 (for a model that multiplies it as a plain parameter)."""
    return dequantize(w) if isinstance(w, PackedWeight) else w.float()


def _kept_layer(parts: Sequence[Stored], bias: nn.Parameter | None) -> nn.Module | None:
    """The layer multiplying ``parts`` stacked by rows as they are kept: packed blocks (of any
    kinds), or 16-bit tensors of one dtype (each where it is, not joined: a file's map); None
    for parts kept in neither one way."""
    if all(isinstance(p, PackedWeight) for p in parts):
        return PackedLinear(list(parts), bias, False)  # type: ignore[arg-type]
    if all(is_half(p) for p in parts) and len({p.dtype for p in parts}) == 1:
        return HalfLinear(list(parts), bias)  # type: ignore[arg-type]  # each where it lies
    return None


class HoldsWeights:
    """Mixin for a decoder (``nn.Module`` with ``config.tie_embeddings``, ``tok_emb`` and
    ``lm_head``) built on the meta device, which then takes its weights by :meth:`hold`."""

    config: Any
    tok_emb: Any
    lm_head: Any

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every name :meth:`hold` takes → its shape: the state dict's names, and each fused
        layer's own (``attn.qkv_proj``, which a GPT-2 GGUF file stores whole; ``mlp.gate_up``,
        gate's rows then up's, which Phi-3's files store whole)."""
        module: nn.Module = self  # type: ignore[assignment]
        shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        for prefix, m in module.named_modules():
            if isinstance(m, GatedMLP) and m.gate_up is None:
                shapes[f"{prefix}.gate_up.weight"] = (2 * m.up.out_features, m.up.in_features)
            elif isinstance(m, SparseMoE):  # a GGUF file's experts, stacked
                E, H, C = m.n_experts, m.hidden, m.d_model
                for name, shape in (("gate", (E, H, C)), ("up", (E, H, C)), ("down", (E, C, H))):
                    shapes[f"{prefix}.experts.{name}.weight"] = shape
        return shapes | {k: tuple(p.shape) for k, p in module.named_parameters()}

    def hold(self, weights: dict[str, Stored], source: str) -> None:
        """Take ``weights`` (every name of the state dict, untied output layer included, or a fused
        layer's own name for its parts) as the model's: a tensor becomes the parameter itself
        (``assign=True``: its memory is kept, not copied), a matrix kept as the file holds it
        (packed blocks, 16 bits) the layer that multiplies it. ``weights`` is consumed: a kept
        entry leaves it once a layer holds it (or its fused, regrouped copy), so that what was
        read is let go layer by layer and a load peaks near the model's size, not twice it.
        Raises ``ValueError`` naming ``source`` where a name or shape does not fit."""
        if not isinstance(weights, dict):
            raise TypeError(f"weights must be a dict (consumed), not {type(weights).__name__}")
        module: nn.Module = self  # type: ignore[assignment]
        left = weights
        for prefix, m in module.named_modules():
            at = f"{prefix}." if prefix else ""
            if isinstance(m, MultiHeadAttention) and m.qkv_proj is not None:
                _hold_qkv(m, at, left)
            elif isinstance(m, SparseMoE):  # before its experts (named_modules: parents first)
                _hold_experts(m, at, left)
            elif isinstance(m, GatedMLP):
                _hold_gate_up(m, at, left)
        for name in [n for n, w in left.items() if kept(w)]:
            layer = self._layer_for(name, left[name])
            if layer is None:  # not multiplied: expanded, as the file's reader would
                left[name] = _expanded(left[name])
                continue
            parent, _, leaf = name.removesuffix(".weight").rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, leaf, layer)
            del left[name]
        if self.config.tie_embeddings and isinstance(self.tok_emb, PackedEmbedding):
            self.lm_head = PackedLinear(self.tok_emb.packed, None, False)  # the same table
        elif self.config.tie_embeddings and isinstance(self.tok_emb, HalfEmbedding):
            self.lm_head = HalfLinear(self.tok_emb.table, None)  # the same table
        for name in [n for n, w in left.items() if w.dtype in HALF_DTYPES]:
            left[name] = left[name].float()  # a 16-bit vector: read as the fp32 parameter
        load_checked(module, left, source, assign=True)
        if self.config.tie_embeddings and not isinstance(
            self.tok_emb, (PackedEmbedding, HalfEmbedding)
        ):
            self.lm_head.weight = self.tok_emb.weight  # assign=True replaced the shared one

    def _layer_for(self, name: str, w: Stored) -> nn.Module | None:
        """The layer that holds ``w`` (kept as the file holds it) in place of the module
        ``name`` is the weight of: a linear layer for a linear one (its bias, still to load,
        kept), an embedding for the token table; None for any other."""
        module: nn.Module = self  # type: ignore[assignment]
        path = name.removesuffix(".weight")
        old = module.get_submodule(path)
        if path == "tok_emb" and isinstance(old, nn.Embedding):
            return PackedEmbedding(w) if isinstance(w, PackedWeight) else HalfEmbedding(w)
        if isinstance(old, nn.Linear):
            return _kept_layer([w], old.bias)  # type: ignore[arg-type]
        return None


def _hold_qkv(attn: MultiHeadAttention, at: str, left: dict[str, Stored]) -> None:
    """The fused q/k/v projection from its stored rows: given whole (``qkv_proj``), or as q, k
    and v, kept together when all three are kept alike (else the kept ones are expanded)."""
    whole = left.get(f"{at}qkv_proj.weight")
    if whole is not None and kept(whole):
        del left[f"{at}qkv_proj.weight"]
        attn.hold_qkv(_kept_layer([whole], attn.qkv_proj.bias))  # type: ignore[arg-type,union-attr]
        return
    if whole is not None:  # a tensor: under the state dict's three names
        for kind in ("weight", "bias"):
            fused = left.pop(f"{at}qkv_proj.{kind}", None)
            if fused is not None:
                for n, part in zip("qkv", fused.split(attn.qkv_sizes), strict=True):  # type: ignore[union-attr]
                    left[f"{at}{n}_proj.{kind}"] = part
        return
    names = [f"{at}{n}_proj.weight" for n in "qkv"]
    parts = [left.get(n) for n in names]
    layer = _kept_layer(parts, attn.qkv_proj.bias) if all(map(kept, parts)) else None  # type: ignore[union-attr]
    if layer is None:
        for n, p in zip(names, parts, strict=True):
            if p is not None and kept(p):
                left[n] = _expanded(p)
        return
    for n in names:
        del left[n]
    biases = [n.replace(".weight", ".bias") for n in names]
    if all(b in left for b in biases):  # one bias for the fused rows, loaded with the rest
        left[f"{at}qkv_proj.bias"] = torch.cat([left.pop(b) for b in biases])  # type: ignore[misc]
    attn.hold_qkv(layer)


def _hold_gate_up(mlp: GatedMLP, at: str, left: dict[str, Stored]) -> None:
    """gate and up in one layer when both are kept alike (else each is held alone); stored
    whole (``gate_up``), kept as it is, or a tensor split into the two."""
    whole = left.pop(f"{at}gate_up.weight", None)
    if whole is not None and kept(whole):
        mlp.hold_gate_up(_kept_layer([whole], None))  # type: ignore[arg-type]
        return
    if whole is not None:
        left[f"{at}gate.weight"], left[f"{at}up.weight"] = whole.chunk(2)  # type: ignore[union-attr]
        return
    names = [f"{at}gate.weight", f"{at}up.weight"]
    parts = [left.get(n) for n in names]
    layer = _kept_layer(parts, None) if all(map(kept, parts)) else None  # type: ignore[arg-type]
    if layer is not None:
        for n in names:
            del left[n]
        mlp.hold_gate_up(layer)


def _hold_experts(moe: SparseMoE, at: str, left: dict[str, Stored]) -> None:
    """A mixture's experts stored stacked (a GGUF file's ``ffn_*_exps``: a tensor (E, …), or
    packed blocks of its E·rows rows) split into each expert's weights — views of the stack's
    rows — which each expert then holds as any gated MLP; and the router, which picks the
    experts, in fp32 (it is small, and its picks should not hang on a rounding). Three packed
    stacks whose experts are whole groups of the kernel are also kept whole
    (:class:`~dikkat.weights.packed_layers.PackedExperts`): a step multiplies every token by its
    experts in one product each, and each expert's own layers are views of them."""
    stacks = {n: left.pop(f"{at}experts.{n}.weight", None) for n in ("gate", "up", "down")}
    router = f"{at}router.weight"
    if router in left and kept(left[router]):
        left[router] = _expanded(left[router])
    stacked = _stacked(moe, stacks)
    if stacked is not None:
        moe.stacked = stacked
        for e, expert in enumerate(moe.experts):
            *gate_up, down = stacked.expert(e)
            expert.down = PackedLinear(down, None, False)
            if len(gate_up) == 1:
                expert.hold_gate_up(PackedLinear(gate_up[0], None, False))
            else:
                expert.gate, expert.up = (PackedLinear(p, None, False) for p in gate_up)
        return
    for name, whole in stacks.items():
        if whole is None:
            continue
        rows = whole.shape[0] // moe.n_experts
        for e in range(moe.n_experts):
            part = (
                whole.rows(e * rows, (e + 1) * rows)
                if isinstance(whole, PackedWeight)
                else whole[e]
            )
            left[f"{at}experts.{e}.{name}.weight"] = part


def _stacked(moe: SparseMoE, stacks: dict[str, Stored | None]) -> PackedExperts | None:
    """The three stacks held whole, where all are packed and each expert is whole groups of the
    kernel; else None (the experts are then held one by one)."""
    if not all(isinstance(w, PackedWeight) for w in stacks.values()):
        return None
    try:
        return PackedExperts(*stacks.values(), moe.n_experts, moe.experts[0].act)  # type: ignore[arg-type]
    except ValueError:
        return None
