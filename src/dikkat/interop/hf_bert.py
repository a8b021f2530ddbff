"""Hugging Face BERT weights → :class:`dikkat.models.BERT`.

HF's ``BertModel`` keeps q, k, v as separate ``nn.Linear`` layers (no transposes needed), is
post-norm (``attention.output.LayerNorm`` after the attention residual, ``output.LayerNorm`` after
the MLP residual), uses the exact GELU and LayerNorm eps 1e-12. Checkpoints may also store
``embeddings.position_ids`` (a constant buffer) and a pooler; both are ignored here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from dikkat.interop.common import state_and_config
from dikkat.models.bert import BERT, BERTConfig
from dikkat.models.io import load_checked

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def bert_config(hf_config: Any, *, mlm_head: bool = False) -> BERTConfig:
    """A :class:`BERTConfig` equal to a ``transformers.BertConfig``."""
    if getattr(hf_config, "position_embedding_type", "absolute") != "absolute":
        raise ValueError("only BERT with absolute position embeddings is supported")
    act = hf_config.hidden_act
    if act not in _ACTIVATIONS:
        raise ValueError(f"BERT activation {act!r} is not one of {sorted(_ACTIVATIONS)}")
    return BERTConfig(
        vocab_size=hf_config.vocab_size,
        max_len=hf_config.max_position_embeddings,
        d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=hf_config.num_attention_heads,
        d_ff=hf_config.intermediate_size,
        type_vocab_size=hf_config.type_vocab_size,
        norm_eps=hf_config.layer_norm_eps,
        activation=_ACTIVATIONS[act],
        mlm_head=mlm_head,
    )


def bert_state_dict(hf_state: Mapping[str, Tensor], n_layers: int) -> dict[str, Tensor]:
    """Rename an HF BERT state dict (``bert.`` prefix optional) into BERT's names."""
    sd = {k.removeprefix("bert."): v for k, v in hf_state.items()}
    out = {
        "tok_emb.weight": sd["embeddings.word_embeddings.weight"],
        "pos_emb.weight": sd["embeddings.position_embeddings.weight"],
        "type_emb.weight": sd["embeddings.token_type_embeddings.weight"],
        "emb_norm.weight": sd["embeddings.LayerNorm.weight"],
        "emb_norm.bias": sd["embeddings.LayerNorm.bias"],
    }
    names = {
        "attn.q_proj": "attention.self.query",
        "attn.k_proj": "attention.self.key",
        "attn.v_proj": "attention.self.value",
        "attn.out_proj": "attention.output.dense",
        "norm1": "attention.output.LayerNorm",
        "mlp.up": "intermediate.dense",
        "mlp.down": "output.dense",
        "norm2": "output.LayerNorm",
    }
    for i in range(n_layers):
        for ours, theirs in names.items():
            for p in ("weight", "bias"):
                out[f"blocks.{i}.{ours}.{p}"] = sd[f"encoder.layer.{i}.{theirs}.{p}"]
    if "cls.predictions.bias" in sd:
        head = {
            "mlm.dense": "cls.predictions.transform.dense",
            "mlm.norm": "cls.predictions.transform.LayerNorm",
        }
        for ours, theirs in head.items():
            for p in ("weight", "bias"):
                out[f"{ours}.{p}"] = sd[f"{theirs}.{p}"]
        out["mlm.bias"] = sd["cls.predictions.bias"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def bert_from_hf(model_or_state_dict: Any, config: Any = None) -> BERT:
    """Build a :class:`BERT` from an HF ``BertModel``/``BertForMaskedLM`` or a state dict + config.

    The MLM head is included when the weights have one (``cls.predictions.*``).
    """
    state, config = state_and_config(model_or_state_dict, config, "BERT")
    has_head = any(k.startswith("cls.predictions.") for k in state)
    cfg = config if isinstance(config, BERTConfig) else bert_config(config, mlm_head=has_head)
    try:
        tensors = bert_state_dict(state, cfg.n_layers)
    except KeyError as e:
        raise ValueError(f"not a BERT state dict: it has no {e.args[0]!r}") from None
    model = BERT(cfg)
    own = model.state_dict()
    tensors = {k: v for k, v in tensors.items() if k in own}  # e.g. no MLM head in the config
    load_checked(model, tensors, "the BERT weights")
    return model
