"""The keyword arguments transformers' attention layers pass, and what dikkat does with each.

Notation: ``B`` batch, ``H`` query heads, ``T`` query length, ``S`` key length, ``k`` keys
chosen per query.

A layer calls ``attention_interface(module, query, key, value, attention_mask, dropout=...,
scaling=..., **kwargs)``, and its ``kwargs`` carry the layer's own extras (``sliding_window``,
``softcap``, ``s_aux``, ...) and whatever the model's forward passed down (``position_ids``,
``use_cache``, ``output_attentions``, ...). :data:`KEYWORDS` is the one list of those dikkat
knows: each is *honoured* (dikkat computes what it means), *accepted* (its meaning is already in
q, k, v and the mask, or it concerns the model's outputs and not attention: the entry says why),
or *refused* when set (a value other than None or False: a ``ValueError`` naming it and what it
is). A keyword not in the list is refused by name too, so none is ever dropped unread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dikkat.core.mask_base import DenseMask, Mask, as_mask

__all__ = ["KEYWORDS", "Keyword"]

HONOURED, ACCEPTED, REFUSED = "honoured", "accepted", "refused"
_INTEGER = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class Keyword:
    """What dikkat's HF attention does with one keyword argument."""

    does: str  # HONOURED, ACCEPTED or REFUSED (when set: a value other than None or False)
    what: str  # what transformers means by it, and where it goes in dikkat (or why not)


_PACKED = (
    "for flash-attention's variable-length kernels; dikkat reads packed sequences from "
    "position_ids (transformers' mask function turns position ids that restart into a document "
    "mask): pass position_ids alone"
)

KEYWORDS: dict[str, Keyword] = {
    # --- honoured: dikkat computes what they mean --------------------------------------------
    "dropout": Keyword(HONOURED, "attention dropout probability (0 at evaluation): dropout="),
    "scaling": Keyword(HONOURED, "the scores' scale (1/√D unless the model sets its own): scale="),
    "softcap": Keyword(HONOURED, "logit soft-capping (Gemma 2's attn_logit_softcapping): softcap="),
    "position_bias": Keyword(
        HONOURED, "an additive position bias (T5's relative attention bias, 1 or B, H, T, S): bias="
    ),
    "s_aux": Keyword(HONOURED, "attention sinks, one logit per query head (gpt-oss, (H,)): sinks="),
    "sinks": Keyword(
        HONOURED, "attention sinks, one logit per head and query ((B, H, T, 1)): sinks= (B, H, T)"
    ),
    "indices": Keyword(
        HONOURED,
        "sparse attention: the k keys each query may see, (B, T, k), shared by the heads, −1 for "
        "none (DeepSeek Sparse Attention's top-k): a dense mask and-ed with the attention mask",
    ),
    "output_attentions": Keyword(
        HONOURED, "return the weights (B, H, T, S): recomputed after the call (docs/hf.md)"
    ),
    "is_causal": Keyword(
        HONOURED,
        "whether the layer attends causally: read when no mask is passed (a causal layer without "
        "one is refused); a mask says it otherwise, as for eager attention",
    ),
    # --- accepted: their meaning is already in q, k, v and the mask, or is not attention's ----
    "sliding_window": Keyword(
        ACCEPTED,
        "the layer's window: in the mask the registered mask function built for the layer "
        "(sliding_window(w)) or the caller did; with no mask at all it is refused",
    ),
    "position_ids": Keyword(
        ACCEPTED,
        "the tokens' positions: RoPE has used them before the call, and the mask function has "
        "read packed sequences from them",
    ),
    "cache_position": Keyword(
        ACCEPTED, "the queries' positions in the cache (transformers 4): the mask's q_offset"
    ),
    "use_cache": Keyword(
        ACCEPTED, "whether the layer keeps a cache: it has updated it before the call (k, v)"
    ),
    "encoder_hidden_states": Keyword(
        ACCEPTED,
        "the encoder's states, already projected into k and v for cross-attention (BERT passes "
        "None for self-attention)",
    ),
    "output_hidden_states": Keyword(ACCEPTED, "what the model returns, not what attention does"),
    "output_router_logits": Keyword(ACCEPTED, "what a mixture of experts returns, not attention"),
    "num_items_in_batch": Keyword(ACCEPTED, "the loss's normaliser (Trainer), not attention's"),
    # --- refused when set ----------------------------------------------------------------------
    "cu_seq_lens_q": Keyword(REFUSED, "packed sequences' cumulative query lengths, " + _PACKED),
    "cu_seq_lens_k": Keyword(REFUSED, "packed sequences' cumulative key lengths, " + _PACKED),
    "max_length_q": Keyword(REFUSED, "the longest packed query sequence, " + _PACKED),
    "max_length_k": Keyword(REFUSED, "the longest packed key sequence, " + _PACKED),
    "seq_idx": Keyword(REFUSED, "each token's sequence in a packed batch (Mamba), " + _PACKED),
    "block_indices": Keyword(
        REFUSED,
        "block-sparse attention (MiniMax M3's indexer): the key blocks each query may see, "
        "which dikkat does not take; use attn_implementation='eager' or 'sdpa'",
    ),
    "deterministic": Keyword(
        REFUSED,
        "flash-attention's switch for a deterministic backward; dikkat's backends follow "
        "torch.use_deterministic_algorithms instead",
    ),
}


def check_keywords(layer: str, kwargs: dict[str, Any], has_mask: bool) -> None:
    """Raise ``ValueError`` for a keyword not in :data:`KEYWORDS`, for a refused one that is set,
    and for a window with no mask to carry it."""
    for name, value in kwargs.items():
        entry = KEYWORDS.get(name)
        if entry is None:
            raise ValueError(
                f"{layer} passed {name}={_short(value)} to dikkat's attention, which does not "
                "know that keyword and refuses it rather than ignore it (dikkat.hf.KEYWORDS "
                "lists the ones it knows, and what it does with each)"
            )
        if entry.does == REFUSED and value is not None and value is not False:
            raise ValueError(
                f"{layer} passed {name}={_short(value)} ({entry.what}); dikkat's attention does "
                "not support it"
            )
    window = kwargs.get("sliding_window")
    if window is not None and not has_mask:
        raise ValueError(
            f"{layer} passed sliding_window={window} but no attention mask to carry it: dikkat "
            "takes the window from the mask, and without one every query would see every key"
        )


def _short(value: object) -> str:
    if isinstance(value, Tensor):
        return f"<tensor of shape {tuple(value.shape)}>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def hf_sinks(kwargs: dict[str, Any]) -> Tensor | None:
    """The call's attention sinks for ``dikkat.attention``: ``s_aux`` (H,) or ``sinks`` (B, H, T,
    1) → (B, H, T); dikkat checks their shape, dtype and values."""
    s_aux, sinks = kwargs.get("s_aux"), kwargs.get("sinks")
    if s_aux is not None and sinks is not None:
        raise ValueError("the layer passed both s_aux= and sinks= (attention sinks): pass one")
    if isinstance(sinks, Tensor) and sinks.dim() == 4 and sinks.shape[-1] == 1:
        return sinks.squeeze(-1)  # (B, H, T, 1) → (B, H, T)
    return s_aux if sinks is None else sinks


def with_indices(
    layer: str, mask: Mask | Tensor | None, indices: Tensor | None, shape: tuple[int, int, int],
    q_offset: int,
) -> Mask | Tensor | None:  # fmt: skip
    """The call's mask and-ed with the keys ``indices`` (B|1, T, k) selects for each query
    (−1: none), as transformers' eager path scatters them into its mask."""
    if indices is None:
        return mask
    B, T, S = shape
    if not isinstance(indices, Tensor) or indices.dtype not in _INTEGER:
        raise TypeError(
            f"{layer} passed indices= (sparse attention's key indices) that are not an integer "
            f"tensor: {type(indices).__name__} {getattr(indices, 'dtype', '')}".rstrip()
        )
    if indices.dim() != 3 or indices.shape[0] not in (1, B) or indices.shape[1] != T:
        raise ValueError(
            f"{layer} passed indices= of shape {tuple(indices.shape)}; dikkat takes (B, T, k) = "
            f"({B}, {T}, k): the k keys each of the T queries may see, shared by the heads"
        )
    if indices.numel() and (int(indices.min()) < -1 or int(indices.max()) >= S):
        raise ValueError(
            f"{layer} passed indices= from {int(indices.min())} to {int(indices.max())}, but "
            f"there are {S} keys (0 … {S - 1}; −1 for none)"
        )
    idx = indices.long()
    columns = torch.where(idx < 0, S, idx)  # −1 lands in a column dropped after the scatter
    chosen = torch.zeros(indices.shape[0], T, S + 1, dtype=torch.bool, device=indices.device)
    chosen = chosen.scatter_(-1, columns, True)[..., :S].unsqueeze(1)  # (B|1, 1, T, S)
    selected = DenseMask(chosen, q_offset)
    return selected if mask is None else as_mask(mask, q_offset) & selected
