"""A local Hugging Face model folder as a :class:`~dikkat.maps.text.TextModel`.

The model is loaded from the folder alone (``local_files_only``: nothing is downloaded) with
its attention switched to dikkat (:func:`dikkat.hf.register`), which is what lets
:func:`dikkat.capture` see its weights; the tokenizer is the folder's own
(:func:`dikkat.text.load_tokenizer`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dikkat.hf.attention import register
from dikkat.maps.text import TextModel, mask_id_of
from dikkat.text import load_tokenizer

__all__ = ["hf_model"]

CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # architectures that predict the next token


def hf_model(path: str | Path, *, device: str | torch.device = "cpu") -> TextModel:
    """The encoder (``AutoModel``: its last hidden states) or causal LM
    (``AutoModelForCausalLM``, when the folder's ``architectures`` name one: its logits) saved
    in ``path``. Encoder-decoders are refused."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
    try:  # transformers is an optional dependency
        import transformers
    except ImportError as error:
        raise ImportError("--hf needs transformers: pip install 'dikkat[hf]'") from error
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{path} holds an encoder-decoder ({config.model_type}); show reads "
                         "encoders and causal models")  # fmt: skip
    causal = any(a.endswith(CAUSAL_SUFFIXES) for a in (config.architectures or ()))
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    name = register()
    model = auto.from_pretrained(path, local_files_only=True, attn_implementation=name)
    model.to(device).eval()
    tokenizer = load_tokenizer(path, verify=False)
    field = "logits" if causal else "last_hidden_state"
    return TextModel(
        model,
        tokenizer,
        lambda ids: getattr(model(input_ids=ids), field),
        causal=causal,
        embedding=model.get_input_embeddings(),
        mask_id=None if causal else mask_id_of(tokenizer, config.vocab_size),
        name=f"{config.model_type} ({path.name})",
    )
