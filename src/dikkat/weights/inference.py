"""Inference copies of a model: every :class:`~dikkat.layers.Linear` replaced by a layer that
holds its weight in one format (:data:`dikkat.weights.formats.FORMATS` names them and their
layers).

:func:`inference_model` returns such a copy. The model it is given is never touched: the copy
is a snapshot, with its own clones of the other parameters and buffers, so writes to the
model afterwards (an optimizer step, ``load_state_dict``) do not reach it, and nothing of one
copy reaches another (two generations in two formats, in two threads, on one model).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dikkat.layers.linear import Linear, LinearRows
from dikkat.validate import check_bool
from dikkat.weights.formats import FORMATS, WeightFormat, check_weights
from dikkat.weights.held import InferenceLinear

__all__ = ["inference_model"]


def inference_model(
    model: nn.Module, weights: WeightFormat | None = None, *, batched: bool | None = None
) -> nn.Module:
    """A copy of ``model`` for inference, its :class:`~dikkat.layers.Linear` layers holding
    their weights in the format ``weights``:

    - "fp32": the weights as they are, multiplied through copies reordered for oneDNN on the CPU
      (made on first use); a product of one or two rows (decoding) multiplies the weight itself,
      which is faster there (``plain_gemv_max_rows`` in :mod:`dikkat.core.tuning`);
    - "bf16": bf16 copies; the input is rounded to bf16 for the product, the output comes back
      in the input's dtype;
    - "int8": per-output-channel int8 weights with fp32 scales (weight-only; see
      :func:`dikkat.weights.int8.int8_linear`);
    - "w8a8": the same int8 weights times 8-bit inputs rounded on the fly, through FBGEMM, on
      x86 CPUs (see :func:`dikkat.weights.int8.w8a8_linear`).

    oneDNN lays a packed weight out for a number of input rows. By default every product uses a
    copy laid out for one row (decoding one sequence; a prompt's prefill makes do with it).
    ``batched=True`` (a server decoding many sequences at once) adds a second layout, for
    :data:`~dikkat.weights.held.BATCH_ROWS` rows, used by the products of more than two rows:
    more memory, faster batches.

    The copy is in eval mode, its parameters do not require gradients, and everything but the
    linear layers' weights (embeddings, norms, attention, a tied output embedding's input side)
    runs as in the model, in its dtype. It is a snapshot: the model is never changed, and writes
    to the model afterwards do not reach the copy. A weight tied to another parameter stays
    tied in an "fp32" copy; in the other formats the linear layer holds its own converted copy.
    Making it costs a pass over the weights and the memory of the copy; to serve many calls
    from one model, make it once and hand it to them (``generate(copy, ...)``).

    A model that is already an inference copy is returned as it is when ``weights`` and
    ``batched`` are None or its own (what ``generate(copy, ...)`` does with its defaults); a
    ValueError asks for another format of it, which needs the original model.

    >>> copy = inference_model(Linear(32, 8), "int8")
    >>> copy(torch.randn(2, 32)).shape, copy.weights_format
    (torch.Size([2, 8]), 'int8')
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if weights is not None:
        weights = check_weights("weights", weights)
    if batched is not None:
        check_bool("batched", batched)
    held = [m for m in model.modules() if isinstance(m, InferenceLinear)]
    if held:
        return _as_it_is(model, held, weights, batched)
    weights, batched = weights or "fp32", bool(batched)
    layer = FORMATS[weights].layer
    memo: dict[int, Any] = {}
    with torch.no_grad():
        for m in _linears(model):
            if id(m) not in memo:
                # the parameters through the memo: one tied to another stays tied in the copy
                bias = None if m.bias is None else copy.deepcopy(m.bias, memo)
                weight = copy.deepcopy(m.weight, memo) if weights == "fp32" else m.weight.detach()
                memo[id(m)] = layer(weight, bias, batched)
        # each Linear met, as a submodule or as a LinearRows' source, becomes its layer
        out = copy.deepcopy(model, memo)
    for p in out.parameters():
        p.requires_grad_(False)
    return out.eval()


def _linears(model: nn.Module) -> Iterator[Linear]:
    """The Linears of ``model``: its submodules, and the sources of its :class:`LinearRows`
    (registered where they are owned, which may be outside ``model``)."""
    for m in model.modules():
        if isinstance(m, Linear):
            yield m
        elif isinstance(m, LinearRows) and isinstance(m.source, Linear):
            yield m.source


def _as_it_is(
    model: nn.Module,
    held: list[InferenceLinear],
    weights: WeightFormat | None,
    batched: bool | None,
) -> nn.Module:
    """``model``, an inference copy already, if it is what ``weights`` and ``batched`` ask."""
    formats = {(m.weights_format, m.batched) for m in held}
    (have, was_batched), *others = sorted(formats)
    if others or weights not in (None, have) or batched not in (None, was_batched):
        asked = f"weights={weights!r}, batched={batched!r}"
        raise ValueError(
            f"model is already an inference copy (weights={have!r}, batched={was_batched}); "
            f"{asked} needs a copy of the original model"
        )
    return model
