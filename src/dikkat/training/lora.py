"""Low-rank adapters on a pretrained decoder whose weights stay as its file holds them.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685) learns, beside a frozen weight W (N, K), two small matrices A (r, K) and
B (N, r): the layer computes ``W x + (α / r) · B A dropout(x)``. B starts at zero, so training
starts from the base model exactly; A starts as PEFT's does (Kaiming-uniform, like an
``nn.Linear``'s weight).

The frozen products go through :func:`dikkat.weights.frozen_linear`, so a GGUF file's packed
blocks (or 16-bit tables) are multiplied as they are, forward and backward, and no fp32 copy of
the base model is made (QLoRA, arXiv:2305.14314). Every frozen layer on the gradient's path is
wrapped so (:class:`FrozenLinear`), adapted or not: the output layer, an un-adapted ``down``.

dikkat's self-attention multiplies by one fused q/k/v weight (and the MLP by one gate/up
weight), where PEFT adapts ``q_proj``, ``k_proj`` and ``v_proj`` one by one. A
:class:`LoraLinear` therefore holds one adapter per *row span* of its base: adapter i adds
``(α / r) · B_i A_i x`` to output features [start_i, stop_i) — the same sums as PEFT's separate
layers. Adapters are named as PEFT and transformers name the modules (``q_proj``, ``o_proj``,
``gate_proj``, …): the family's tensor table (:mod:`dikkat.pretrained.families`) maps each to
dikkat's module and to its GGUF tensor.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from dikkat.layers.linear import LinearRows
from dikkat.models.decoder import Decoder
from dikkat.pretrained.families import Family
from dikkat.validate import check_float, check_int
from dikkat.weights.frozen import frozen_linear, half_backward, input_gradient
from dikkat.weights.half import HalfLinear
from dikkat.weights.held import InferenceLinear
from dikkat.weights.packed_layers import PackedExperts, PackedLinear

__all__ = [
    "DEFAULT_TARGETS",
    "FrozenLinear",
    "LoraConfig",
    "LoraLinear",
    "Site",
    "adapter_sites",
    "add_lora",
    "target_names",
]

# PEFT's default for Llama-family models (peft.utils.constants,
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING): the queries and the values
DEFAULT_TARGETS = ("q_proj", "v_proj")


@dataclass(frozen=True)
class LoraConfig:
    """Which layers get adapters and how big: rank r, α (the update is scaled by α / r),
    dropout on the adapters' input, and the target modules by their transformers names."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    seed: int = 0  # A's initialisation

    def __post_init__(self) -> None:
        check_int("rank", self.rank, at_least=1)
        check_float("alpha", self.alpha, low=0.0, low_open=True)
        check_float("dropout", self.dropout, low=0.0, high=1.0, high_open=True)
        check_int("seed", self.seed, at_least=0)
        targets = self.targets
        if isinstance(targets, str) or not all(isinstance(t, str) and t for t in targets):
            raise TypeError(f"targets must be a tuple of module names, got {targets!r}")
        if not targets or len(set(targets)) != len(targets):
            raise ValueError(f"targets must name distinct modules, got {list(targets)}")
        object.__setattr__(self, "targets", tuple(sorted(targets)))  # a set, kept in one order

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


_FROZEN = (PackedLinear, HalfLinear, nn.Linear)


class FrozenLinear(nn.Module):
    """A frozen linear layer (packed, 16-bit or plain) that gradients flow back through to its
    input: ``base(x)`` forward, ``∂L/∂x`` from the weight dequantised a block of rows at a
    time (:func:`~dikkat.weights.frozen_linear`). The base gets no gradient."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        if not isinstance(base, _FROZEN):
            raise TypeError(
                f"base must be a PackedLinear, HalfLinear or nn.Linear, got {type(base).__name__}"
            )
        base.requires_grad_(False)
        self.base = base

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> Any:
        return self.base.weight

    @property
    def bias(self) -> Tensor | None:
        return self.base.bias

    def frozen(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return frozen_linear(x, self.base)
        return self.base(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.frozen(x)

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Output features [start, stop) (a :class:`~dikkat.layers.linear.LinearRows` view:
        cross-attention's queries); computed whole and sliced."""
        return self.forward(x)[..., start:stop]


class LoraLinear(FrozenLinear):
    """A frozen base layer plus one adapter per named row span of its output (see the module
    doc): ``lora_A[name]`` (r, K) and ``lora_B[name]`` (stop − start, r), PEFT's layout."""

    def __init__(
        self,
        base: nn.Module,
        spans: Mapping[str, tuple[int, int]],
        config: LoraConfig,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(base)
        N, K = self.out_features, self.in_features
        taken = sorted(spans.values())
        for (_, b), (c, _) in itertools.pairwise(taken):
            if b > c:
                raise ValueError(f"adapter spans overlap: {dict(spans)}")
        if not spans or taken[0][0] < 0 or taken[-1][1] > N or any(a >= b for a, b in taken):
            raise ValueError(f"adapter spans must lie in [0, {N}) and not be empty: {dict(spans)}")
        self.spans = dict(spans)
        self.scale, self.rank = config.scale, config.rank
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        like = {"dtype": torch.float32}
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for name, (a, b) in self.spans.items():
            A = torch.empty(config.rank, K, **like)  # type: ignore[arg-type]
            # nn.Linear's (and PEFT's) initialisation: Kaiming-uniform with a = √5
            bound = 1 / math.sqrt(K)
            A.uniform_(-bound, bound, generator=generator)
            self.lora_A[name] = nn.Parameter(A)
            self.lora_B[name] = nn.Parameter(torch.zeros(b - a, config.rank, **like))  # type: ignore[arg-type]

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.dropout, nn.Dropout) and self.training:
            return self._unfused(x)
        ordered = self._ordered()
        weights = [w for name, _, _ in ordered for w in (self.lora_A[name], self.lora_B[name])]
        return _LoraProduct.apply(x, self, *weights)

    def _ordered(self) -> list[tuple[str, int, int]]:
        return sorted(((n, a, b) for n, (a, b) in self.spans.items()), key=lambda s: s[1])

    def _unfused(self, x: Tensor) -> Tensor:
        """The adapters as plain operations, each with its own dropout mask (as PEFT's separate
        layers draw theirs): training with dropout."""
        y = self.frozen(x)
        pieces, at = [], 0
        for name, a, b in self._ordered():
            if a > at:
                pieces.append(y[..., at:a])
            h = self.dropout(x) @ self.lora_A[name].T.to(x.dtype)
            pieces.append(y[..., a:b] + (h @ self.lora_B[name].T.to(x.dtype)) * self.scale)
            at = b
        if at < y.shape[-1]:
            pieces.append(y[..., at:])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)

    def delta(self, name: str) -> Tensor:
        """The update this adapter adds to its rows of the weight: (α / r) · B A, fp32."""
        return (self.lora_B[name] @ self.lora_A[name]).detach() * self.scale

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scale={self.scale:g}, spans={self.spans}"


class _LoraProduct(torch.autograd.Function):
    """A :class:`LoraLinear`'s product in one step: the frozen product, each adapter's update
    added into its columns in place (no copies of the output to join), and a backward that
    gives the input's gradient (the frozen weight's, :func:`~dikkat.weights.frozen.
    input_gradient`, plus each adapter's) and the adapters' own; the rank-r products ``x Aᵀ``
    are kept for it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, layer: LoraLinear, *weights: Tensor) -> Tensor:  # type: ignore[override]
        ctx.layer, ctx.half, ctx.dtype = layer, half_backward(), x.dtype
        # fp32 throughout, under autocast too (whose bf16 the frozen backward takes: ctx.half)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            x = x.to(torch.promote_types(x.dtype, torch.float32))
            y = layer.base(x).contiguous()
            x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
            hs = []
            for (_, a, b), A, B in zip(layer._ordered(), weights[0::2], weights[1::2], strict=True):
                h = x2 @ A.T.to(x.dtype)  # (M, r)
                y2[:, a:b].addmm_(h, B.T.to(x.dtype), alpha=layer.scale)
                hs.append(h)
        ctx.save_for_backward(x, *weights, *hs)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        layer: LoraLinear = ctx.layer
        x, *rest = ctx.saved_tensors
        n = len(rest) // 3
        weights, hs = rest[: 2 * n], rest[2 * n :]
        x2, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1]).to(x.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = input_gradient(g, layer.base, half=ctx.half).to(x.dtype)
        grads: list[Tensor] = []
        spans = layer._ordered()
        for (_, a, b), A, B, h in zip(spans, weights[0::2], weights[1::2], hs, strict=True):
            gs = g[:, a:b]
            gh = (gs @ B.to(g.dtype)).mul_(layer.scale)  # (M, r)
            grads += [(gh.T @ x2).to(A.dtype), (gs.T @ h).mul_(layer.scale).to(B.dtype)]
            if grad_x is not None:
                grad_x.addmm_(gh, A.to(g.dtype))
        shown = None if grad_x is None else grad_x.view(x.shape).to(ctx.dtype)
        return (shown, None, *grads)


@dataclass(frozen=True)
class Site:
    """One adapter as the formats name it: block ``block``'s ``name`` (transformers' module
    name, ``q_proj``), dikkat's module path ``ours`` (``blocks.3.attn.q_proj``), its
    transformers module path ``hf`` and its GGUF tensor ``gguf`` (``blk.3.attn_q.weight``)."""

    block: int
    name: str
    ours: str
    hf: str
    gguf: str | None
    layer: LoraLinear = field(compare=False, repr=False)


def target_names(family: Family) -> dict[str, str]:
    """transformers' module name → dikkat's path within a block, for every linear layer of a
    block the family's table holds (attention and MLP projections; norms are not targets)."""
    names = {}
    for row in family.tensors.layer:
        if row.hf is None or "{e}" in row.ours or not row.ours.startswith(("attn.", "mlp.")):
            continue
        if row.ours.endswith("norm"):
            continue
        names[row.hf.rsplit(".", 1)[-1]] = row.ours
    return names


def add_lora(model: nn.Module, family: Family, config: LoraConfig) -> list[Site]:
    """Freeze ``model`` (a pretrained :class:`~dikkat.models.Decoder`) and give it ``config``'s
    adapters, in place; returns where they are. Every frozen linear layer a gradient passes is
    wrapped in :class:`FrozenLinear`. Unknown targets, a model of experts and a model holding
    its weights in a format without a backward (int8, w8a8) are refused by name."""
    if not isinstance(model, Decoder):
        raise TypeError(f"model must be a pretrained Decoder, got {type(model).__name__}")
    if not isinstance(config, LoraConfig):
        raise TypeError(f"config must be a LoraConfig, got {type(config).__name__}")
    if any(isinstance(m, LoraLinear) for m in model.modules()):
        raise ValueError("the model has adapters already")
    if any(isinstance(m, PackedExperts) for m in model.modules()):
        raise ValueError(
            "adapters on a mixture of experts are not supported: its experts' product has no "
            "backward pass here"
        )
    known = target_names(family)
    unknown = [t for t in config.targets if t not in known]
    if unknown:
        raise ValueError(
            f"targets {unknown} are not modules of a {family.name} block: {sorted(known)}"
        )
    _check_trainable_path(model)
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(config.seed)
    for block in model.blocks:  # type: ignore[attr-defined]
        # the layer each target multiplies by, and its rows there
        by_layer: dict[int, tuple[nn.Module, dict[str, tuple[int, int]]]] = {}
        for name in config.targets:
            module = block.get_submodule(known[name])
            layer, rows = (
                (module.source, (module.start, module.stop))
                if isinstance(module, LinearRows)
                else (module, (0, module.out_features))
            )
            by_layer.setdefault(id(layer), (layer, {}))[1][name] = rows
        for layer, spans in by_layer.values():
            _put(*_owner(block, layer), LoraLinear(layer, spans, config, generator))
    for parent in list(model.modules()):  # the rest, frozen and differentiable in their input
        for attr, child in list(parent.named_children()):
            if isinstance(child, _FROZEN) and not isinstance(parent, FrozenLinear):
                _put(parent, attr, FrozenLinear(child))
    return list(adapter_sites(model, family))


def adapter_sites(model: nn.Module, family: Family) -> Iterator[Site]:
    """Every adapter of ``model`` with its names in each format, by block then target."""
    known = target_names(family)
    tables = family.tensors
    for i, block in enumerate(model.blocks):  # type: ignore[attr-defined]
        for name, ours in known.items():
            module = block.get_submodule(ours)
            layer = module.source if isinstance(module, LinearRows) else module
            if isinstance(layer, LoraLinear) and name in layer.lora_A:
                row = next(r for r in tables.layer if r.ours == ours)
                gguf = None if row.gguf is None else tables.gguf_name(ours, i)
                hf = f"{tables.hf_block.format(i=i)}{row.hf}"
                yield Site(i, name, f"blocks.{i}.{ours}", hf, gguf, layer)


def _put(owner: nn.Module, attr: str, new: nn.Module) -> None:
    """Make ``new`` ``owner.attr``: a fused q/k/v or gate/up layer through the owner's own
    ``hold_*``, which also rebuilds the views of its rows (``q_proj``, ``gate``, …)."""
    if attr == "qkv_proj" and hasattr(owner, "hold_qkv"):
        owner.hold_qkv(new)
    elif attr == "gate_up" and hasattr(owner, "hold_gate_up"):
        owner.hold_gate_up(new)
    else:
        setattr(owner, attr, new)


def _owner(root: nn.Module, layer: nn.Module) -> tuple[nn.Module, str]:
    """The module that holds ``layer`` as an attribute, and that attribute's name."""
    for path, child in root.named_modules():
        if child is layer and path:
            parent, _, attr = path.rpartition(".")
            return root.get_submodule(parent), attr
    raise ValueError(f"{type(layer).__name__} is not a submodule of this block")


def _check_trainable_path(model: nn.Module) -> None:
    """Refuse a model one of whose linear layers has no backward (an int8 or w8a8 inference
    copy): the gradient would stop there without a word."""
    for name, m in model.named_modules():
        if isinstance(m, InferenceLinear) and not isinstance(m, (PackedLinear, HalfLinear)):
            raise ValueError(
                f"{name} holds its weight as {m.weights_format!r}, which has no backward pass: "
                "load the model with weights=None (as its file holds them) or 'fp32'"
            )
