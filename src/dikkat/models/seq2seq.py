"""The original encoder-decoder translator ("Attention Is All You Need", 2017) (docs/contract.md
§11, §14).

Notation: ``B`` batch, ``S`` source tokens, ``T`` target tokens, ``C`` width, ``V`` vocabulary.

The encoder reads the source bidirectionally (only padding is masked). The decoder attends
causally to the target so far, and through cross-attention to the encoded source: its queries
come from the target, its keys and values from the encoder's output. Positions are the fixed
sinusoids, embeddings are scaled by √C, blocks are post-norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from dikkat.core.masks import Mask, causal, padding
from dikkat.generation.generate import TOKEN_LEVEL, Step, check_room, sample_loop, token_rows
from dikkat.generation.prompts import Prompts, check_prompts, left_pad
from dikkat.generation.sampling import Sampling, SamplingParams, as_params
from dikkat.layers.block import Block, BlockConfig
from dikkat.layers.inputs import check_token_id, check_token_ids, check_valid
from dikkat.layers.kv_cache import KVCache
from dikkat.layers.linear import Linear
from dikkat.layers.mlp import Activation
from dikkat.layers.norm import LayerNorm
from dikkat.layers.positional import SinusoidalPositionalEncoding
from dikkat.models.io import SaveLoad
from dikkat.presets import pick_preset
from dikkat.validate import check_bool, check_sizes
from dikkat.weights.formats import WeightFormat
from dikkat.weights.inference import inference_model


def right_pad(src: Prompts, pad_id: int) -> tuple[Tensor, Tensor]:
    """Checked sources → ids (B, S) right-padded with ``pad_id`` and ``valid`` (B, S) (False =
    padding): the encoder is bidirectional, so the pads need only be masked, not moved left."""
    if isinstance(src, Tensor):
        return src, torch.ones_like(src, dtype=torch.bool)
    rows = [list(reversed(s.tolist() if isinstance(s, Tensor) else s)) for s in src]
    ids, valid = left_pad(rows, pad_id)
    return ids.flip(1), valid.flip(1)


@dataclass(frozen=True)
class Seq2SeqConfig:
    """Sizes and choices of an encoder-decoder Transformer."""

    src_vocab_size: int = 256  # source vocabulary
    tgt_vocab_size: int = 256  # target vocabulary
    max_len: int = 256  # longest source or target
    d_model: int = 128  # width C
    n_heads: int = 4  # heads H
    n_encoder_layers: int = 3
    n_decoder_layers: int = 3
    d_ff: int | None = None  # MLP hidden width; None = 4·d_model
    norm: Literal["pre", "post"] = "post"  # the 2017 paper is post-norm
    norm_eps: float = 1e-5
    activation: Activation = "relu"  # the 2017 paper's FFN
    dropout: float = 0.0
    share_embeddings: bool = False  # one embedding for source and target (needs equal vocabs)
    tie_output: bool = True  # output projection = target embedding

    def __post_init__(self) -> None:
        check_sizes(
            self, "src_vocab_size", "tgt_vocab_size", "max_len", "n_encoder_layers",
            "n_decoder_layers",
        )  # fmt: skip
        check_bool("share_embeddings", self.share_embeddings)
        check_bool("tie_output", self.tie_output)
        self.block()  # validates widths, heads, norm, norm_eps, activation, dropout
        if self.d_model % 2:
            raise ValueError(f"the sinusoidal positions need an even d_model, got {self.d_model}")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError("share_embeddings needs src_vocab_size == tgt_vocab_size")

    def block(self, *, cross_attention: bool = False) -> BlockConfig:
        return BlockConfig(
            d_model=self.d_model,
            n_heads=self.n_heads,
            d_ff=self.d_ff,
            norm=self.norm,
            norm_eps=self.norm_eps,
            activation=self.activation,
            dropout=self.dropout,
            cross_attention=cross_attention,
        )

    @classmethod
    def preset(cls, name: str, **overrides: object) -> Seq2SeqConfig:
        """A named configuration, optionally with some fields changed."""
        return pick_preset(SEQ2SEQ_PRESETS, name, "Seq2Seq", overrides)


SEQ2SEQ_PRESETS: dict[str, Seq2SeqConfig] = {
    "tiny": Seq2SeqConfig(),
    # The paper's base model: d 512, 8 heads of 64, 6 + 6 layers, MLP 2048, dropout 0.1, one
    # shared 37k BPE vocabulary for English–German.
    "original-base": Seq2SeqConfig(
        src_vocab_size=37000,
        tgt_vocab_size=37000,
        max_len=512,
        d_model=512,
        n_heads=8,
        n_encoder_layers=6,
        n_decoder_layers=6,
        d_ff=2048,
        dropout=0.1,
        share_embeddings=True,
    ),
}


class Seq2Seq(SaveLoad, nn.Module):
    """Encoder-decoder Transformer for translation.

    >>> model = Seq2Seq(Seq2SeqConfig.preset("tiny"))
    >>> src, tgt = torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 7))
    >>> model(src, tgt).shape                                   # logits for each target slot
    torch.Size([2, 7, 256])
    """

    config_class = Seq2SeqConfig

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.config = c = config
        self.src_emb = nn.Embedding(c.src_vocab_size, c.d_model)
        self.tgt_emb = (
            self.src_emb if c.share_embeddings else nn.Embedding(c.tgt_vocab_size, c.d_model)
        )
        self.pos = SinusoidalPositionalEncoding(c.d_model, c.max_len)
        self.drop = nn.Dropout(c.dropout)
        self.encoder = nn.ModuleList(Block(c.block()) for _ in range(c.n_encoder_layers))
        self.decoder = nn.ModuleList(
            Block(c.block(cross_attention=True)) for _ in range(c.n_decoder_layers)
        )
        # Pre-norm stacks end with a LayerNorm; post-norm blocks already end with one.
        self.enc_norm = LayerNorm(c.d_model, eps=c.norm_eps) if c.norm == "pre" else None
        self.dec_norm = LayerNorm(c.d_model, eps=c.norm_eps) if c.norm == "pre" else None
        self.out = Linear(c.d_model, c.tgt_vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        nn.init.normal_(self.src_emb.weight, std=c.d_model**-0.5)
        if not c.share_embeddings:
            nn.init.normal_(self.tgt_emb.weight, std=c.d_model**-0.5)
        if c.tie_output:
            self.out.weight = self.tgt_emb.weight

    def is_tied(self, name: str) -> bool:
        c = self.config
        return (c.tie_output and name == "out.weight") or (
            c.share_embeddings and name == "tgt_emb.weight"
        )

    def _embed(self, name: str, emb: nn.Embedding, ids: Tensor, offset: int = 0) -> Tensor:
        check_token_ids(name, ids, emb.num_embeddings, layout=("B", "L"), device=emb.weight.device)
        end, context = offset + ids.shape[1], self.config.max_len
        if end > context:
            raise ValueError(
                f"{name} has {ids.shape[1]} tokens from position {offset}: positions up to "
                f"{end - 1}, past the model's context of {context}"
            )
        # the paper multiplies embeddings by √C so they are not drowned by the sinusoids
        return self.drop(self.pos(emb(ids) * math.sqrt(self.config.d_model), offset))

    def encode(self, src: Tensor, src_valid: Tensor | None = None) -> Tensor:
        """Source ids (B, S) → memory (B, S, C); ``src_valid`` (B, S) bool is False at padding
        (HF's ``attention_mask`` as bool)."""
        x = self._embed("src", self.src_emb, src)
        mask = None
        if src_valid is not None:
            check_valid("src_valid", src_valid, src, "src")
            mask = padding(valid=src_valid)
        for block in self.encoder:
            x = block(x, mask)
        return x if self.enc_norm is None else self.enc_norm(x)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        src_valid: Tensor | None = None,
        *,
        tgt_mask: Mask | None = None,
        offset: int = 0,
        cache: list[KVCache] | None = None,
        cross_cache: list[KVCache] | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, list]:
        """Target ids (B, T) and memory (B, S, C) → logits (B, T, V).

        ``tgt_mask`` defaults to ``causal()``; caches make one-token decoding cheap (the cross
        caches hold the projected memory, computed on the first step only).
        """
        x = self._embed("tgt", self.tgt_emb, tgt, offset)
        ctx_mask = None
        if src_valid is not None:
            check_valid("src_valid", src_valid, memory[..., 0], "the memory's (B, S)")
            ctx_mask = padding(valid=src_valid)
        mask = causal() if tgt_mask is None else tgt_mask
        weights = []
        for i, block in enumerate(self.decoder):
            out = block(
                x,
                mask,
                context=memory,
                context_mask=ctx_mask,
                offset=offset,
                cache=None if cache is None else cache[i],
                cross_cache=None if cross_cache is None else cross_cache[i],
                return_weights=return_weights,
            )
            x, w = out if return_weights else (out, None)
            weights.append(w)
        if self.dec_norm is not None:
            x = self.dec_norm(x)
        logits = self.out(x)
        return (logits, weights) if return_weights else logits

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_valid: Tensor | None = None,
        tgt_valid: Tensor | None = None,
    ) -> Tensor:
        """Teacher forcing: logits (B, T, V) for every target slot given the ones before it.

        ``src_valid`` (B, S) and ``tgt_valid`` (B, T) are bool, False at padding.
        """
        memory = self.encode(src, src_valid)
        tgt_mask = causal()
        if tgt_valid is not None:
            check_valid("tgt_valid", tgt_valid, tgt, "tgt")
            tgt_mask = tgt_mask & padding(valid=tgt_valid)
        return self.decode(tgt, memory, src_valid, tgt_mask=tgt_mask)

    def new_caches(
        self, batch: int, max_len: int, src_len: int
    ) -> tuple[list[KVCache], list[KVCache]]:
        """Per decoder layer: self caches (B, H, max_len, D) and cross caches (B, H, src_len, D)."""
        c = self.config
        w = self.tgt_emb.weight
        make = lambda n: [  # noqa: E731
            KVCache(batch, c.n_heads, n, c.d_model // c.n_heads, dtype=w.dtype, device=w.device)
            for _ in range(c.n_decoder_layers)
        ]
        return make(max_len), make(src_len)

    @torch.no_grad()
    def generate(
        self,
        src: Prompts,
        params: SamplingParams | int | None = None,
        *,
        bos_id: int,
        pad_id: int = 0,
        weights: WeightFormat | None = None,
        **sampling: Unpack[Sampling],
    ) -> list[list[int]]:
        """Translate: encode the sources once, then decode token by token from ``bos_id``.

        ``src`` is a (B, S) tensor or a list of sources of any lengths (right-padded with
        ``pad_id``, a source id, and masked). Returns one list per source: its target tokens
        after ``bos_id`` (which is not included), cut after the first stop token. ``params``
        (a :class:`~dikkat.generation.SamplingParams`, or an int ``max_new_tokens`` and keywords:
        ``eos_id=2, temperature=0.8``) decodes as in :meth:`GPT.generate`, through the same
        loop (:func:`dikkat.generation.sample_loop`); one choice per source (``n = 1``). The
        cross-attention keys/values of the sources are projected on the first step and reused
        from the cross caches at every later step. ``bos_id`` and the new tokens must fit in
        the context: at most ``max_len − 1`` new tokens. ``weights`` is the format the linear
        layers multiply in (``"fp32"``, ``"bf16"``, ``"int8"``, ``"w8a8"``; see
        :meth:`GPT.generate`), the encoder's included: the translation runs on an inference copy
        of the model (:func:`dikkat.weights.inference_model`), whose parameters stay as they are.
        """
        c = self.config
        params = as_params(params, sampling)
        params.refuse("Seq2Seq.generate", "n", *TOKEN_LEVEL)
        params.check_vocab(c.tgt_vocab_size)
        max_new_tokens = params.max_new_tokens
        check_token_id("bos_id", bos_id, c.tgt_vocab_size)
        check_prompts(src, c.src_vocab_size)  # before the rows are reversed for padding
        check_token_id("pad_id", pad_id, c.src_vocab_size)
        check_room(1, max_new_tokens, c.max_len, prompt="the target (bos_id)")
        device = self.tgt_emb.weight.device
        ids, valid = (t.to(device) for t in right_pad(src, pad_id))
        src_valid = None if bool(valid.all()) else valid
        model: Seq2Seq = inference_model(self, weights)  # type: ignore[assignment]
        start, step = model._decoder_steps(ids, src_valid, max_new_tokens, bos_id)
        tokens = sample_loop(start, step, params)
        return token_rows(list(tokens), ids.shape[0], params.stop_ids)

    def _decoder_steps(
        self, ids: Tensor, src_valid: Tensor | None, max_new_tokens: int, bos_id: int
    ) -> tuple[Callable[[], Tensor], Step]:
        """``start`` and ``step`` of :func:`dikkat.generation.sample_loop` for sources ids (B, S):
        ``start`` encodes them once and feeds ``bos_id`` at target slot 0; ``step`` feeds new
        token i at slot i + 1. Both return the next token's logits (B, V)."""
        B, S = ids.shape
        memory = torch.empty(0)
        cache: list[KVCache] = []
        cross: list[KVCache] = []

        def feed(token: Tensor, slot: int) -> Tensor:  # token (B,) at target slot → logits (B, V)
            logits = self.decode(
                token.view(B, 1), memory, src_valid, offset=slot, cache=cache, cross_cache=cross
            )
            return logits[:, -1]  # type: ignore[index]

        def start() -> Tensor:
            nonlocal memory, cache, cross
            memory = self.encode(ids, src_valid)
            cache, cross = self.new_caches(B, max_new_tokens, S)
            return feed(torch.full((B,), bos_id, dtype=torch.long, device=ids.device), 0)

        return start, lambda token, i: feed(token, i + 1)
