"""Sliding windows, audited layer by layer: each layer of a decoder reads exactly the keys its
window allows — none further back, and every one inside (docs/audit.md).

Notation: ``T`` positions, ``C`` width, ``w`` a layer's window (keys i − w + 1 … i).

Through the whole model a sliding window proves little: one full-attention layer (Gemma 3 has
one in six) carries every earlier token to every position. So the audit feeds every attention
layer an input of its own — random hidden states (1, T, C), in place of what the layer below
would give — during one forward pass of the model, with the masks and positions the model itself
builds. Then it changes those inputs at positions 0 … p (a *cut* at p) and runs again. A layer
of window w must leave its outputs at positions p + w … T − 1 unchanged (their windows start
after p) and change every output at p + 1 … p + w − 1 (their windows hold position p); a full
layer must change every output after p. The cuts are drawn at random among the first
``queries`` positions, so that every window ends before the text does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dikkat.audit.probe import RTOL, dtype_name
from dikkat.validate import check_int

__all__ = ["LayerWindow", "WindowReport", "windows"]


@dataclass(frozen=True)
class LayerWindow:
    """One attention layer's verdict: ``window`` None for a full layer."""

    layer: int
    window: int | None
    leaked: tuple[int, ...]  # positions whose output changed, though their window starts later
    blind: tuple[int, ...]  # positions whose window holds the cut, whose output did not change


@dataclass(frozen=True)
class WindowReport:
    layers: tuple[LayerWindow, ...]
    seq_len: int
    cuts: tuple[int, ...]
    rtol: float
    precision: str
    name: str = "windows"

    @property
    def ok(self) -> bool:
        return all(not (lw.leaked or lw.blind) for lw in self.layers)

    def summary(self) -> str:
        bad = [lw for lw in self.layers if lw.leaked or lw.blind]
        if bad:
            lw = bad[0]
            what = (
                f"position {lw.leaked[0]} read a key before its window of {lw.window}"
                if lw.leaked
                else f"position {lw.blind[0]} did not read a key inside its window"
            )
            return f"LEAK in layer {lw.layer}: {what} ({len(bad)} layers wrong)"
        sliding = sorted({lw.window for lw in self.layers if lw.window is not None})
        n_sliding = sum(lw.window is not None for lw in self.layers)
        n_full = len(self.layers) - n_sliding
        return (
            f"{n_sliding} sliding layers read exactly their last {sliding} keys, "
            f"{n_full} full layers every key"
        )

    def coverage(self) -> str:
        return (
            f"{len(self.cuts)} cuts (at {list(self.cuts)}) of {self.seq_len} positions, random "
            f"hidden states into every attention layer, {self.precision}; an output counts as "
            f"changed above {self.rtol:g} × its own size"
        )

    def __str__(self) -> str:
        rows = [f"{self.name} audit: {'ok' if self.ok else 'FAILED'}", f"  {self.summary()}"]
        for lw in self.layers:
            kind = "full" if lw.window is None else f"window {lw.window}"
            verdict = "ok" if not (lw.leaked or lw.blind) else (
                f"read before its window at {list(lw.leaked[:4])}" if lw.leaked
                else f"blind inside it at {list(lw.blind[:4])}"
            )  # fmt: skip
            rows.append(f"  layer {lw.layer:>3}  {kind:<12} {verdict}")
        return "\n".join(rows)


def windows(
    model: nn.Module,
    *,
    queries: int = 16,
    cuts: int = 2,
    seed: int = 0,
    dtype: torch.dtype | None = torch.float64,
) -> WindowReport:
    """Audit every attention layer of ``model`` (a :class:`~dikkat.models.Decoder`: its
    ``blocks`` each have ``.attn`` and ``.window``) against its own window.

    Args:
        queries: positions past the widest window; the text is ``widest + queries`` long.
        cuts: forward passes with a cut (plus two without, the second checking that the model
            repeats itself).
        dtype: the probes run a copy of the model in this dtype (None: the model as it is).
    """
    check_int("queries", queries, at_least=2)
    check_int("cuts", cuts)
    blocks = list(getattr(model, "blocks", ()))
    if not blocks or not all(hasattr(b, "attn") and hasattr(b, "window") for b in blocks):
        raise TypeError(f"windows audits a decoder whose blocks have .attn and .window, got "
                        f"{type(model).__name__}")  # fmt: skip
    widths = [b.window for b in blocks if b.window is not None]
    if not widths:
        raise ValueError(f"{type(model).__name__} has no sliding-window layer to audit")
    config = model.config
    T = max(widths) + queries
    if config.max_len < T:
        raise ValueError(f"the audit needs {T} positions, past the model's context")
    run = model if dtype is None else copy.deepcopy(model).to(dtype)
    weight = run.tok_emb.weight
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (1, T), generator=gen).to(weight.device)
    inputs = [torch.randn(1, T, config.d_model, generator=gen, dtype=weight.dtype).to(weight.device)
              for _ in blocks]  # fmt: skip
    outputs: list[Tensor | None] = [None] * len(blocks)
    hooks = []
    for i, block in enumerate(run.blocks):
        hooks.append(block.attn.register_forward_pre_hook(_feed(inputs, i), with_kwargs=True))
        hooks.append(block.attn.register_forward_hook(_keep(outputs, i)))
    was = run.training
    run.eval()
    try:
        with torch.no_grad():
            reference = _forward(run, ids, outputs)
            rtol = RTOL.get(weight.dtype, 1e-6)
            again = _forward(run, ids, outputs)
            _check_repeatable(reference, again, rtol)
            found = {i: ([], []) for i in range(len(blocks))}
            # a cut at p ≤ queries − 1 leaves the widest window's leak range p + w … T − 1
            drawn = torch.randint(0, queries, (cuts,), generator=gen).tolist()
            for p in drawn:
                for x in inputs:
                    x[:, : p + 1] += torch.randn(x[:, : p + 1].shape, generator=gen).to(x)
                changed = _forward(run, ids, outputs)
                for i, block in enumerate(blocks):
                    moved = _moved(reference[i], changed[i], rtol)  # (T,) bool
                    sees = p + (T if block.window is None else block.window)  # first blind
                    found[i][0].extend(t for t in range(max(sees, p + 1), T) if moved[t])
                    found[i][1].extend(t for t in range(p + 1, min(sees, T)) if not moved[t])
                reference = changed
    finally:
        for h in hooks:
            h.remove()
        run.train(was)
    layers = tuple(
        LayerWindow(i, b.window, tuple(sorted(set(found[i][0]))), tuple(sorted(set(found[i][1]))))
        for i, b in enumerate(blocks)
    )
    precision = dtype_name(weight.dtype) + (", as given" if dtype is None else ", a copy")
    return WindowReport(layers, T, tuple(drawn), rtol, precision)


def _feed(inputs: list[Tensor], i: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (inputs[i], *args[1:]), kwargs

    return hook


def _keep(outputs: list[Tensor | None], i: int):
    def hook(module: nn.Module, args: tuple, result: object) -> None:
        outputs[i] = (result[0] if isinstance(result, tuple) else result).detach().clone()

    return hook


def _forward(model: nn.Module, ids: Tensor, outputs: list[Tensor | None]) -> list[Tensor]:
    model(ids, return_hidden=True)  # the hooks keep each attention layer's output
    return [o for o in outputs if o is not None]


def _moved(before: Tensor, after: Tensor, rtol: float) -> Tensor:
    """(T,): positions whose output changed by more than ``rtol`` of its own size."""
    size = before[0].abs().amax(-1).clamp_min(torch.finfo(before.dtype).tiny)
    return ((after[0] - before[0]).abs().amax(-1) > rtol * size).cpu()


def _check_repeatable(first: list[Tensor], second: list[Tensor], rtol: float) -> None:
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        if bool(_moved(a, b, rtol).any()):
            raise ValueError(
                f"layer {i} gave different outputs for the same input twice: the audit cannot "
                "tell a leak from noise (a nondeterministic kernel?)"
            )
