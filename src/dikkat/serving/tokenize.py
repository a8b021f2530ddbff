"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes (docs/server.md).

``/tokenize`` takes ``{"prompt": text}`` (BOS / EOS added where the model's tokenizer adds them,
unless ``add_special_tokens: false``) or ``{"messages": [...]}`` (the conversation in the chat
template, as ``/v1/chat/completions`` would feed it) and answers ``{"tokens", "count",
"max_model_len"}`` (and ``"token_strs"`` with ``return_token_strs: true``); ``/detokenize``
takes ``{"tokens": [...]}`` and answers ``{"prompt": text}`` (control tokens written out). A
text that cannot fit the context is refused before it is tokenised, as the other routes refuse
it (:func:`~dikkat.serving.params.check_text`).
"""

from __future__ import annotations

from typing import Any

from dikkat.serving.choices import Served
from dikkat.serving.params import check_ids, check_text, conversation_ids
from dikkat.serving.protocol import DetokenizeRequest, RequestError, TokenizeRequest


def _check_model(model: str | None, served: Served) -> None:
    if model is not None and model != served.name:
        raise RequestError(
            f"the model {model!r} does not exist; this server has {served.name!r}",
            param="model", status=404, code="model_not_found",
        )  # fmt: skip


def tokenize(body: TokenizeRequest, served: Served) -> dict[str, Any]:
    _check_model(body.model, served)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("give either prompt (a string) or messages", param="prompt")
    vocab = served.vocab
    if body.messages is not None:
        if not body.add_generation_prompt:
            raise RequestError(
                "add_generation_prompt: false is not supported: the server renders a "
                "conversation with the assistant's turn opened",
                param="add_generation_prompt",
            )
        ids = conversation_ids(body.messages, served.chat_ids, vocab, served.max_len, served.name)
        if body.add_special_tokens:  # what the tokenizer adds around a text (BOS), as a text
            front, back = vocab.specials
            ids = front + ids + back
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        prompt = body.prompt or ""
        check_text(len(prompt), vocab, served.max_len, "the prompt", "prompt")
        ids = vocab.encode(prompt, special=special)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": served.max_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [vocab.token_text(t) for t in ids]
    return out


def detokenize(body: DetokenizeRequest, served: Served) -> dict[str, Any]:
    _check_model(body.model, served)
    if body.tokens:
        check_ids(body.tokens, served.vocab.vocab_size, "tokens", "tokens")
    return {"prompt": served.vocab.decode_all(body.tokens)}
