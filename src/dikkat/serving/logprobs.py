"""Log-probabilities in OpenAI's two formats (docs/server.md, "Log-probabilities").

The numbers are the engine's: ``log_softmax`` of the model's fp32 logits at each position, the
model's own distribution before penalties, ``logit_bias``, temperature and top-k / top-p
(:class:`~dikkat.generation.TokenLogprob`, vLLM's default "raw" log-probabilities).

* completions (``logprobs: k``): four parallel lists, ``tokens`` (each token's text),
  ``token_logprobs``, ``top_logprobs`` (a dict token text → log-probability of the k most likely
  tokens and the chosen one, so up to k + 1 entries, as OpenAI documents) and ``text_offset``
  (where each token's text begins in the prompt followed by the completion). With ``echo`` the
  prompt's tokens come first; the first has ``None`` for its log-probability and alternatives.
* chat (``logprobs: true, top_logprobs: k``): a list ``content`` of ``{"token", "logprob",
  "bytes", "top_logprobs": [{"token", "logprob", "bytes"} × k]}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dikkat.generation import TokenLogprob
from dikkat.serving.params import finite
from dikkat.serving.tokens import Offsets, Vocabulary


class CompletionLogprobs:
    """The completions format, built a piece at a time (a stream sends each piece's tokens
    with its chunk); offsets continue from one piece to the next."""

    def __init__(self, vocab: Vocabulary, top: int, start: int = 0) -> None:
        self.vocab, self.top = vocab, top
        self.offsets = Offsets(vocab.decode, start)

    def part(self, entries: Sequence[TokenLogprob | None], tokens: Sequence[int]) -> dict[str, Any]:
        """The four lists for ``tokens`` (an entry None: a prompt's first token)."""
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token, entry in zip(tokens, entries, strict=True):
            out["tokens"].append(self.vocab.token_text(token))
            out["text_offset"].append(self.offsets.push(token))
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(finite(entry.logprob))
            alternatives = {self.vocab.token_text(t): finite(lp) for t, lp in entry.top[: self.top]}
            alternatives.setdefault(self.vocab.token_text(entry.token), finite(entry.logprob))
            out["top_logprobs"].append(alternatives)
        return out

    @staticmethod
    def join(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return {key: [x for part in parts for x in part[key]] for key in parts[0]}


def _chat_entry(vocab: Vocabulary, token: int, logprob: float) -> dict[str, Any]:
    return {
        "token": vocab.token_text(token),
        "logprob": finite(logprob),
        "bytes": list(vocab.token_bytes(token)),
    }


def chat_logprobs(vocab: Vocabulary, entries: Sequence[TokenLogprob], top: int) -> dict[str, Any]:
    """The chat format of ``entries``: ``{"content": [...], "refusal": None}``."""
    content = []
    for e in entries:
        item = _chat_entry(vocab, e.token, e.logprob)
        item["top_logprobs"] = [_chat_entry(vocab, t, lp) for t, lp in e.top[:top]]
        content.append(item)
    return {"content": content, "refusal": None}
