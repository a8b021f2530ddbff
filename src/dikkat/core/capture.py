"""Attention weights on demand: the rows, heads and layers asked for, never the rest.

Notation: ``B`` batch, ``H`` query heads, ``T`` query length, ``S`` key length; ``h`` and ``r``
the number of heads and query rows selected.

Fused attention never holds the (B, H, T, S) weights (PyTorch's SDPA does not return them,
pytorch/pytorch#119811), so a model that shows its weights usually runs the slow formula in
every layer and keeps every layer's full matrix. :func:`capture` instead marks the selected
attention layers of a model; each :func:`dikkat.attention` call made inside one of them keeps
its log-sum-exp and recomputes the weights of the selected heads and rows from q, k and it
(:func:`dikkat.attention_weights`) — (B, h, r, S) per call, nothing for the other layers::

    with dikkat.capture(model, layers=[-1], heads=[0], rows=[-1]) as cap:
        model(ids)
    w = cap[-1]  # (B, 1, 1, S): what the last token of the last layer's head 0 looked at

Attention layers are the model's modules whose class name ends in ``Attention`` and that hold
no such module themselves (:func:`attention_layers`): dikkat's ``MultiHeadAttention``, and the
attention modules of Hugging Face models run through :mod:`dikkat.hf`. A selected layer that
runs without calling ``dikkat.attention`` (a Hugging Face model on its eager attention) is an
error at the end of its forward, never a silently empty capture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from dikkat.core.masks import Mask
from dikkat.core.weights import attention_weights

__all__ = ["Capture", "CapturedCall", "attention_layers", "capture"]


def attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention layers of ``model`` as ``(name, module)`` in ``model.named_modules()``
    order: modules whose class name ends in ``Attention`` holding no such module (so BERT's
    ``BertSelfAttention`` counts, not the ``BertAttention`` that wraps it). :func:`capture`'s
    ``layers`` index this list."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found = []
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("Attention"):
            continue
        inner = (m for m in module.modules() if m is not module)
        if not any(type(m).__name__.endswith("Attention") for m in inner):
            found.append((name, module))
    return found


@dataclass(frozen=True)
class CapturedCall:
    """The weights one attention call of a selected layer recomputed."""

    layer: str  # the module's name in the model
    heads: tuple[int, ...]  # the query heads kept, in the order of ``weights``' dim 1
    rows: tuple[int, ...]  # the query rows kept (0 … T − 1 of this call), dim 2
    weights: Tensor  # (B, len(heads), len(rows), S)


@dataclass
class Capture:
    """What :func:`capture` yields: the calls recorded so far, in the order they ran."""

    layers: tuple[str, ...]  # the names of the selected layers
    calls: list[CapturedCall] = field(default_factory=list)

    def of(self, layer: int | str) -> list[Tensor]:
        """The weights of every call of ``layer`` (an index into :attr:`layers` or a name),
        e.g. one per step of ``generate``."""
        name = self._name(layer)
        return [c.weights for c in self.calls if c.layer == name]

    def __getitem__(self, layer: int | str) -> Tensor:
        """The weights of ``layer``'s one call; an error if it ran more than once (use
        :meth:`of`) or not at all."""
        found = self.of(layer)
        if len(found) != 1:
            raise ValueError(
                f"layer {self._name(layer)!r} was called {len(found)} times within the capture; "
                "Capture.of(layer) lists the weights of every call"
            )
        return found[0]

    def _name(self, layer: int | str) -> str:
        if isinstance(layer, str):
            if layer not in self.layers:
                raise ValueError(f"layer {layer!r} was not captured; captured: {self.layers}")
            return layer
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int or a str, got {type(layer).__name__}")
        if not -len(self.layers) <= layer < len(self.layers):
            raise ValueError(
                f"layer index {layer} is out of range for the {len(self.layers)} captured layers"
            )
        return self.layers[layer]


@dataclass
class _Target:
    """The selected layer whose forward is running, and what to keep of its calls."""

    capture: Capture
    layer: str
    heads: tuple[int, ...] | None
    rows: tuple[int, ...] | None
    calls: int = 0


_target: ContextVar[_Target | None] = ContextVar("dikkat_capture_target", default=None)
# capture blocks open in this process, any thread: while there are none, an attention call does
# not read the ContextVar, which torch.compile cannot trace (a plain int it can guard on)
_open = 0


def capture_target() -> _Target | None:
    """The capture an attention call made now belongs to (None outside selected layers)."""
    if not _open:
        return None
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "dikkat.capture cannot record inside torch.compile: run the captured forward "
            "eagerly (outside the compiled model, or under torch.compiler.disable)"
        )
    return _target.get()


def record(
    target: _Target,
    q: Tensor,
    k: Tensor,
    lse: Tensor | None,
    *,
    mask: Mask | None,
    scale: float,
    bias: Tensor | None,
    q_offset: int,
    softcap: float | None,
    sinks: Tensor | None = None,
) -> None:
    """Recompute and keep the selected heads and rows of one call (lse None: the backend did
    not return it, so the rows' log-sum-exp is computed from their scores)."""
    H, T = q.shape[1], q.shape[2]
    heads = tuple(range(H)) if target.heads is None else _resolve("heads", target.heads, H)
    rows = tuple(range(T)) if target.rows is None else _resolve("rows", target.rows, T)
    with torch.no_grad():
        weights = attention_weights(
            q.detach(),
            k.detach(),
            None if lse is None else lse.detach(),
            rows=list(rows),
            heads=list(heads),
            mask=mask,
            scale=scale,
            bias=None if bias is None else bias.detach(),
            q_offset=q_offset,
            softcap=softcap,
            sinks=None if sinks is None else sinks.detach(),
        )
    target.calls += 1
    target.capture.calls.append(CapturedCall(target.layer, heads, rows, weights))


def _resolve(name: str, chosen: tuple[int, ...], n: int) -> tuple[int, ...]:
    """Indices of this call, negatives counted from the end as in Python."""
    bad = [i for i in chosen if not -n <= i < n]
    if bad:
        raise ValueError(
            f"capture {name} {list(chosen)} do not all exist in a call with {n} {name}: {bad}"
        )
    return tuple(i % n for i in chosen)


def _indices(name: str, value: Sequence[int] | int | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    values = [value] if isinstance(value, int) else value
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence | range):
        raise TypeError(f"{name} must be an int, a sequence of ints or None, got {value!r}")
    if not values or any(isinstance(i, bool) or not isinstance(i, int) for i in values):
        raise ValueError(f"{name} must be a non-empty sequence of ints, got {value!r}")
    return tuple(values)


def _select(
    model: nn.Module, layers: Sequence[int | str] | int | str | None
) -> list[tuple[str, nn.Module]]:
    found = attention_layers(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no attention layers (modules whose class name ends in "
            "'Attention'); capture has nothing to select"
        )
    if layers is None:
        return found
    chosen = [layers] if isinstance(layers, int | str) else list(layers)
    names = [name for name, _ in found]
    picked = []
    for layer in chosen:
        if isinstance(layer, str):
            if layer not in names:
                raise ValueError(f"layers: no attention layer named {layer!r}; there are {names}")
            picked.append(names.index(layer))
        elif isinstance(layer, int) and not isinstance(layer, bool):
            if not -len(found) <= layer < len(found):
                raise ValueError(
                    f"layers: index {layer} is out of range for the {len(found)} attention "
                    f"layers of {type(model).__name__}"
                )
            picked.append(layer % len(found))
        else:
            raise TypeError(f"layers must hold ints or names, got {layer!r}")
    return [found[i] for i in sorted(set(picked))]


@contextmanager
def capture(
    model: nn.Module,
    *,
    layers: Sequence[int | str] | int | str | None = None,
    heads: Sequence[int] | int | None = None,
    rows: Sequence[int] | int | None = None,
) -> Iterator[Capture]:
    """Within the block, the selected attention layers of ``model`` record their weights.

    Args:
        model: a dikkat model, or a Hugging Face model registered with :mod:`dikkat.hf`.
        layers: indices into :func:`attention_layers` (negative from the end) or module names;
            None: every attention layer.
        heads: query heads to keep (negative from the end); None: all.
        rows: query rows of each call to keep (negative from the end, so ``-1`` is the newest
            token of every decoding step); None: all.

    Yields a :class:`Capture`; ``cap[layer]`` is the (B, h, r, S) weights of that layer's one
    call, ``cap.of(layer)`` those of every call. The weights are the softmax's (before any
    dropout), recomputed without gradient.
    """
    selected = _select(model, layers)
    heads_t, rows_t = _indices("heads", heads), _indices("rows", rows)
    cap = Capture(tuple(name for name, _ in selected))
    handles = []
    for name, module in selected:
        target = _Target(cap, name, heads_t, rows_t)
        handles.append(module.register_forward_pre_hook(_enter(target)))
        handles.append(module.register_forward_hook(_leave(target)))
    global _open
    token = _target.set(None)  # a forward that raised inside the block leaves nothing after it
    _open += 1
    try:
        yield cap
    finally:
        _open -= 1
        _target.reset(token)
        for handle in handles:
            handle.remove()


def _enter(target: _Target) -> Callable[[nn.Module, object], None]:
    def hook(module: nn.Module, args: object) -> None:
        target.calls = 0
        _target.set(target)

    return hook


def _leave(target: _Target) -> Callable[[nn.Module, object, object], None]:
    def hook(module: nn.Module, args: object, output: object) -> None:
        _target.set(None)
        if target.calls == 0:
            implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
            hint = (
                f" (it runs attn_implementation={implementation!r}; register dikkat with "
                "dikkat.hf.register and select it)"
                if implementation is not None
                else ""
            )
            raise ValueError(
                f"capture: layer {target.layer!r} ({type(module).__name__}) ran without calling "
                f"dikkat.attention, so there are no weights to capture{hint}"
            )

    return hook
